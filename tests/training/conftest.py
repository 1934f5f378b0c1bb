"""Fixtures of the training tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny random SD3.5 pipeline folder whose tokenizers know the test prompts' words (built once a module)."""
    from flowgrpo.models.sd3 import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"), seed=0, words="a red cube blue ball".split())
