"""The command line (``flowgrpo/train.py``, the ``flowgrpo`` command, ``flowgrpo-reward-server``): a setup
mistake is one error line, not a traceback, before any model loads; numbers out of range are usage errors naming
what is allowed; ``--out`` of the wrong kind is refused before any work; ``flowgrpo sample --run`` rebuilds the model
as training did and names a folder that is not a run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowgrpo.cli import main as cli_main
from tests.tiny_runs import _cfg

REPO = Path(__file__).resolve().parents[2]


def test_the_script_prints_one_error_line_for_a_setup_mistake(tmp_path):
    proc = subprocess.run(
        [sys.executable, "flowgrpo/train.py", "sampling.sde_kind=fow_sde", f"output_dir={tmp_path / 'r'}"],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 2
    assert "error: sampling.sde_kind: unknown SDE kind 'fow_sde'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_script_reports_a_config_error_in_one_line_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "flowgrpo/train.py", "train.learning_rate=1e-4",
                           f"output_dir={tmp_path / 'r'}"], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: unknown config key 'train.learning_rate'; did you mean "
                                                   "'train.lr'?")


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_reward_server_refuses_a_port_out_of_range_in_one_line(port):
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.rewards.server", "--reward", "jpeg_compressibility",
                           "--port", port], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --port" in proc.stderr
    assert "allowed: an integer from 0 to 65535 (0: pick a free one)" in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["prompts", "geneval", "--out", "o.jsonl", "--per-task", "-1"], "argument --per-task: -1 is out of range"),
    (["sample", "--model", "tiny", "--num-steps", "0", "--out", "s"], "argument --num-steps: 0 is out of range"),
    (["sample", "--model", "tiny", "--num-images", "-2", "--out", "s"], "argument --num-images: -2 is out of range"),
    (["sample", "--model", "tiny", "--batch-size", "0", "--out", "s"], "argument --batch-size: 0 is out of range"),
    (["sample", "--model", "tiny", "--height", "-64", "--out", "s"], "argument --height: -64 is out of range"),
    (["sample", "--model", "tiny", "--guidance-scale", "-3", "--out", "s"],
     "argument --guidance-scale: -3.0 is out of range; allowed: a number >= 0.0"),
    (["sample", "--model", "tiny", "--guidance-scale", "nan", "--out", "s"],
     "argument --guidance-scale: nan is out of range; allowed: a number >= 0.0"),
    (["sample", "--model", "tiny", "--guidance-scale", "x", "--out", "s"],
     "argument --guidance-scale: 'x' is not a number; allowed: a number >= 0.0"),
])
def test_cli_numbers_out_of_range_are_usage_errors(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "allowed: a" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_out_of_the_wrong_kind_is_one_line_before_any_work(tmp_path, capsys):
    """Before: ``flowgrpo sample --out FILE`` loaded the model, sampled, then FileExistsError; ``flowgrpo prompts
    --out FOLDER`` read the sources, then IsADirectoryError."""
    a_file = tmp_path / "taken.txt"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--model", "/nonexistent/model", "--prompts", "digits_eval", "--out", str(a_file)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--out {str(a_file)!r} is a file; give a folder" in err
    src = tmp_path / "p.txt"
    src.write_text('draw "hi"\n')
    with pytest.raises(SystemExit) as info:
        cli_main(["prompts", "ocr", str(src), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"error: --out {str(tmp_path)!r} is a folder; give the prompt file" in err


@pytest.mark.slow
def test_sample_run_rebuilds_the_model_as_training_did(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    run(_cfg(tmp_path, tiny_flux_dir, model={"scheduler_shift": 3.0}, train={"num_epochs": 1}))
    out = tmp_path / "sampled"
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "sample", "--run", str(tmp_path / "run"), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(out / "images.pt"), torch.load(tmp_path / "run" / "eval_images_after.pt"),
                               rtol=0, atol=1e-5)
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "sample", "--run", str(tmp_path), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"flowgrpo sample: error: {str(tmp_path)!r} is not a run folder (no "
                                                "config.yaml in it)"]


def _no_such(tmp_path):
    """A path whose folder cannot be made: under ``/proc`` (a virtual file system: no such file or directory)."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc on this platform")
    return Path("/proc/flowgrpo-no-such-folder")


def test_sample_out_that_cannot_be_made_is_one_line_before_the_model(tmp_path, capsys):
    """Before: the model was built and sampled, then a FileNotFoundError / PermissionError traceback from mkdir."""
    out = _no_such(tmp_path) / "s7"
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--model", "/nonexistent/model", "--prompts", "digits_eval", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert err == [f"flowgrpo sample: error: --out {str(out)!r} cannot be made: No such file or directory "
                   f"({out.parent}); choose a folder you can write to"]


@pytest.mark.parametrize("prompt_set", ["ocr", "geneval"])
def test_prompts_out_that_cannot_be_written_is_one_line(tmp_path, capsys, prompt_set):
    """Before: a FileNotFoundError / PermissionError traceback from writing the prompt file."""
    pytest.importorskip("flowgrpo_rewards") if prompt_set == "geneval" else None
    out = _no_such(tmp_path) / ("x.jsonl" if prompt_set == "geneval" else "x.txt")
    src = tmp_path / "p.txt"
    src.write_text('draw "hi"\n')
    with pytest.raises(SystemExit) as info:
        cli_main(["prompts", prompt_set, *([str(src)] if prompt_set == "ocr" else []), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert err[-1] == (f"flowgrpo prompts: error: --out {str(out)!r} cannot be written: No such file or directory "
                       f"({out.parent}); choose a file in a folder you can write to")


def test_sample_of_a_folder_that_is_not_a_run_is_an_error_line(tmp_path, capsys):
    """Before: ``flowgrpo sample: '…' is not a run folder``, without the ``error:`` the other lines have."""
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--run", str(tmp_path), "--out", str(tmp_path / "s")])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"flowgrpo sample: error: {str(tmp_path)!r} is not a run folder (no config.yaml in it)"]
