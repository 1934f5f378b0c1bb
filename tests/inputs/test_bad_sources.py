"""A strategy section that is neither a name nor a mapping, and a model path that is a local path that does not
exist, are refused in one line naming the value (found by a fresh-eyes run: ``chunker=null``, now
``objective.chunker=null``, raised a TypeError traceback, and ``model.pretrained=/tmp/nomodel`` advised
``hf download /tmp/nomodel``)."""

from __future__ import annotations

import pytest

from flowgrpo.config import build_config
from flowgrpo.runner import DEFAULT_CONFIG


@pytest.mark.parametrize("value", ["null", "3", "[per_step]"])
def test_a_strategy_section_that_is_not_a_name_or_mapping_is_refused_in_one_line(value):
    import yaml

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    with pytest.raises(ValueError) as err:
        build_config(data, [f"objective.chunker={value}"])
    text = str(err.value)
    assert "chunker=" in text and "a chunker section is a name or a mapping" in text and "entropy_merge" in text


@pytest.mark.parametrize("path", ["/tmp/flowgrpo-no-such-model", "./no-such-model", "~/no-such", "a/b/c"])
def test_a_local_path_that_does_not_exist_is_named_not_sent_to_the_hub(path):
    from flowgrpo.models import pipeline_class_name

    with pytest.raises(ValueError, match="no such folder") as err:
        pipeline_class_name(path)
    assert "hf download" not in str(err.value)
