"""Faults a new user hit on a fresh clone, each kept as a case: bad input fails at once, clearly, before any model
is loaded, and nothing is silently fixed or lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.config import ConfigError, build_config, parse_override

REPO = Path(__file__).resolve().parents[2]


def test_an_override_that_is_not_yaml_names_itself_and_suggests_quoting():
    with pytest.raises(ConfigError, match=r"override 'rewards=\[\{name:': the value is not valid YAML.*quote"):
        parse_override("rewards=[{name:")


@pytest.mark.parametrize("overrides, needle", [
    (["sampling.sde_kind=fow_sde"], "unknown SDE kind 'fow_sde'"),
    (["algo.advantage=grpoo"], "unknown advantage estimator 'grpoo'"),
    (["chunker.name=chunk", "chunker.chunk_sizes=[2,3]"], "must be positive and sum to the 8"),
    (["chunker.name=window", "chunker.window_size=20"], "exceeds sampling.num_steps=8"),
    (["chunker.name=entropy_merge", "chunker.entropy_threshold=0.9", "sampling.sde_kind=cps"], "cannot use"),
])
def test_strategy_errors_come_before_any_model_loads(overrides, needle):
    from flowgrpo.preflight import check_strategies

    with pytest.raises((KeyError, ValueError), match=needle):
        check_strategies(build_config({"sampling": {"num_steps": 8}}, overrides))


def test_the_script_prints_one_error_line_for_a_setup_mistake(tmp_path):
    proc = subprocess.run(
        [sys.executable, "flowgrpo/train.py", "sampling.sde_kind=fow_sde", f"output_dir={tmp_path / 'r'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "error: sampling.sde_kind: unknown SDE kind 'fow_sde'" in proc.stderr and "Traceback" not in proc.stderr


def _run_folder(tmp_path, **train):
    from flowgrpo.training.run_folder import RunFolder

    return RunFolder(build_config({"output_dir": str(tmp_path), "train": train}))


def test_an_output_dir_holding_a_run_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(FileExistsError, match="already holds a run"):
        _run_folder(tmp_path).claim(3)


def test_resuming_into_the_folder_drops_records_after_the_checkpoint(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    lines = [json.dumps({"epoch": e}) for e in (0, 1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _run_folder(tmp_path, resume_from=str(tmp_path / "checkpoints")).claim(3)
    kept = [json.loads(x)["epoch"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]  # the stub resumes at epoch 3


def test_a_run_that_stopped_before_its_first_checkpoint_says_how_to_start_it_again(tmp_path):
    """Before: the refusal suggested train.resume_from=<run>/checkpoints, a folder that did not exist, and
    train.resume_from=auto said 'starting a new run' and then hit the same refusal."""
    from flowgrpo.preflight import check_output_dir, resolve_auto_resume

    (tmp_path / "config.yaml").write_text("{}\n")
    cfg = build_config({"output_dir": str(tmp_path)})
    with pytest.raises(FileExistsError, match="stopped before its first checkpoint; start it again with "
                                              "logging.overwrite=true") as info:
        check_output_dir(cfg)
    assert "resume_from=" + str(tmp_path / "checkpoints") not in str(info.value)
    again = resolve_auto_resume(build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}}))
    assert again.train.resume_from is None and again.logging.overwrite  # README: such a folder starts afresh
    check_output_dir(again)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("epoch_0\n")
    with pytest.raises(FileExistsError, match=f"resume it with train.resume_from={tmp_path / 'checkpoints'}"):
        check_output_dir(cfg)
