"""Specification (issue #54, a fresh user's trial): each refusal says what is wrong with the value given: a folder
that is not a run (not a stopped run to resume), a folder given as a prompt source, a run without final weights
pushed (the same finish-it hint ``sample`` gives), a source file not of the prompt set's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main


def _refusal(capsys, argv: list[str]) -> str:
    """The one stderr line of ``flowgrpo ARGV``, which must exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        cli_main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1, err
    return err.strip()


def _stopped_run(folder: Path) -> Path:
    """A run folder as ``flowgrpo train`` leaves it when stopped after its first checkpoint: its marker
    (``.flowgrpo-output`` of kind run) and ``checkpoints/epoch_0``, no final weights."""
    (folder / "checkpoints" / "epoch_0").mkdir(parents=True)
    (folder / "checkpoints" / "epoch_0" / "state.json").write_text(json.dumps({"epoch": 0}))
    (folder / "checkpoints" / "latest").write_text("epoch_0")
    (folder / ".flowgrpo-output").write_text(json.dumps({"kind": "run"}))
    return folder


def test_sample_run_on_a_user_folder_says_it_is_not_a_run(tmp_path, capsys):
    """Before: "finish it with flowgrpo train … resume_from=auto", which train refuses (not made by flowgrpo)."""
    (tmp_path / "config.yaml").write_text("output_dir: elsewhere\ntrain:\n  lr: 0.0001\n")
    err = _refusal(capsys, ["sample", "--run", str(tmp_path), "--out", str(tmp_path / "out")])
    assert err.startswith("flowgrpo sample: error: ") and f"{str(tmp_path)!r} is not a flowgrpo run folder" in err
    assert "resume_from" not in err


def test_push_of_a_stopped_run_gives_the_finish_hint(tmp_path, capsys):
    run = _stopped_run(tmp_path / "run")
    err = _refusal(capsys, ["push", str(run), "me/x"])
    assert "is it a run folder" not in err
    assert f"finish it with `flowgrpo train output_dir={run} train.resume_from=auto`, then push it" in err
    assert "its checkpoints: epoch_0" in err


def test_push_of_a_user_folder_says_it_is_not_a_run(tmp_path, capsys):
    err = _refusal(capsys, ["push", str(tmp_path), "me/x"])
    assert "is not a flowgrpo run folder" in err and "resume_from" not in err


@pytest.mark.parametrize("name", ["ocr", "hpd", "pickapic"])
def test_prompt_source_that_is_a_folder(tmp_path, capsys, name):
    """Before: "no such file ['/some/folder']" for a folder that exists."""
    (tmp_path / "src").mkdir()
    err = _refusal(capsys, ["prompts", name, str(tmp_path / "src"), "--out", str(tmp_path / "x.txt")])
    assert f"{str(tmp_path / 'src')!r} is a folder, not a file" in err and "no such file" not in err


@pytest.mark.parametrize(("name", "allowed"), [("hpd", [".json"]), ("pickapic", [".parquet", ".jsonl", ".csv"])])
def test_prompt_source_not_of_the_sets_format(tmp_path, capsys, name, allowed):
    """Before: a plain text file was read as HPDv2 JSON / Pick-a-Pic without a word (one prompt a line)."""
    src = tmp_path / "some.txt"
    src.write_text("a cat\na dog\n")
    out = tmp_path / "out.txt"
    err = _refusal(capsys, ["prompts", name, str(src), "--out", str(out)])
    assert err.startswith("flowgrpo prompts: error: ") and str(src) in err
    assert all(suffix in err for suffix in allowed)
    assert not out.exists()


def test_ocr_still_reads_a_text_file(tmp_path):
    src = tmp_path / "some.txt"
    src.write_text('a sign that says "open"\n')
    cli_main(["prompts", "ocr", str(src), "--out", str(tmp_path / "out.txt")])
    assert (tmp_path / "out.txt").read_text() == 'a sign that says "open"\n'


def test_reward_server_kwarg_typo_is_named_as_train_names_it(capsys):
    """Before: the raw TypeError; now the line ``flowgrpo train`` gives for the same typo in rewards[].kwargs."""
    from flowgrpo.config import RewardSpec
    from flowgrpo.preflight import check_rewards
    from flowgrpo.rewards.registry import RewardLoadError
    from flowgrpo.rewards.server import main as server_main

    with pytest.raises(RewardLoadError) as train_err:
        check_rewards([RewardSpec(name="jpeg_compressibility", kwargs={"qualty": 5})])
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        server_main(["--reward", "jpeg_compressibility", "--kwargs", '{"qualty": 5}'])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1, err
    assert "did you mean 'quality'?" in err and "unexpected keyword" not in err
    assert str(train_err.value).replace("rewards[].kwargs", "--kwargs") in err


def test_overwrite_with_resume_auto_is_refused_first_quoting_auto(tmp_path, caplog):
    """Before: two INFO lines (the run continued, its saved config) and then the refusal naming the resolved
    ``RUN/checkpoints`` instead of the ``auto`` typed."""
    from flowgrpo.config import ConfigError, load_config
    from flowgrpo.preflight import resolve_auto_resume

    run = _stopped_run(tmp_path / "run")
    cfg_file = Path(__file__).resolve().parents[2] / "configs" / "tiny_jpeg.yaml"
    overrides = [f"output_dir={run}", "logging.overwrite=true", "train.resume_from=auto"]
    (run / "config.yaml").write_text(cfg_file.read_text())
    config = load_config(cfg_file, overrides)
    with caplog.at_level("INFO"), pytest.raises(ConfigError) as err:
        resolve_auto_resume(config, overrides, config_file=str(cfg_file))
    assert "logging.overwrite=true and train.resume_from=auto contradict" in str(err.value)
    assert str(run / "checkpoints") not in str(err.value)
    assert caplog.records == []


def test_a_recorded_file_replaced_by_a_link_is_called_a_link(tmp_path):
    """Before: a grid.png replaced by a symbolic link was refused as "changed since, so it is yours"."""
    from flowgrpo.writing.outputs import OutputRefused, check_written, claim_folder, record_written

    out = tmp_path / "out"
    claim_folder(out, "sample", "--out")
    (out / "grid.png").write_bytes(b"grid")
    record_written(out, "sample", ["grid.png"])
    (out / "grid.png").unlink()
    (out / "grid.png").symlink_to(tmp_path / "elsewhere.png")
    with pytest.raises(OutputRefused) as err:
        check_written(out, "--out", r"grid\.png")
    assert "'grid.png'" in str(err.value) and "symbolic link" in str(err.value)
    assert "so it is yours" not in str(err.value)
