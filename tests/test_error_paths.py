"""Rough error paths of issue 42, case 5: each is one line naming the file or value and the way out; under two
processes one rank speaks for the run; the digits build's progress bars obey ``logging.progress``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main
from flowgrpo.watch.divergence import DivergenceWatch, TrainingDiverged
from tests.tiny_runs import _cfg, _tiny_overrides

REPO = Path(__file__).resolve().parents[1]


def _exit(capsys, argv) -> tuple[int, list[str]]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    return info.value.code, capsys.readouterr().err.strip().splitlines()


def test_sampling_a_tiny_wan_without_a_size_names_the_size_and_the_options(tmp_path, capsys):
    """The pipeline's default 480x832 is beyond the tiny Wan's rotary tables (32 patches of 16 px: 512 px); main
    crashed inside diffusers with ``RuntimeError: shape '[1, 1, 52, -1]' is invalid``."""
    from flowgrpo.models.wan import build_tiny_wan

    model = build_tiny_wan(tmp_path / "wan")
    (tmp_path / "p.txt").write_text("a red cube\n")
    code, err = _exit(capsys, ["sample", "--model", str(model), "--prompts", str(tmp_path / "p.txt"), "--out",
                               str(tmp_path / "out"), "--num-steps", "1"])
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"flowgrpo sample: error: {model}: Wan frame size 480x832 is too large for this model: "
                             "its rotary position tables (rope_max_seq_len=32) cover 32 patches per side, i.e. at "
                             "most 512 pixels")
    assert "give --height and --width and --num-frames" in err[0]
    assert not (tmp_path / "out").exists()


def test_yaml_with_a_tab_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "tabbed.yaml"
    path.write_text("train:\n  lr: 1.0e-4\n\tnum_epochs: 3\n")
    code, err = _exit(capsys, ["train", str(path), f"output_dir={tmp_path / 'r'}"])
    assert code == 2
    assert err == [f"error: {path}:3:1: not valid YAML: found character '\\t' that cannot start any token (while "
                   "scanning for the next token); YAML indents with spaces only: replace the tab with spaces"]


def test_the_divergence_stop_advises_a_resume_only_when_a_checkpoint_was_written(tmp_path):
    watch = DivergenceWatch()
    with pytest.raises(TrainingDiverged) as none:
        watch.check({"policy/grad_norm": float("nan")}, 0, 3, tmp_path / "checkpoints")
    assert "no checkpoint was written yet. Start it again with a lower train.lr" in str(none.value)
    assert "Resume" not in str(none.value)
    ckpt = tmp_path / "checkpoints" / "epoch_0"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("epoch_0")
    with pytest.raises(TrainingDiverged) as one:
        watch.check({"policy/grad_norm": float("nan")}, 1, 3, tmp_path / "checkpoints")
    assert f"the last checkpoint, {ckpt}, is intact. Resume from it (train.resume_from=auto)" in str(one.value)


def test_sample_run_on_an_unfinished_run_names_its_checkpoints(tmp_path, tiny_flux_dir, capsys):
    from flowgrpo.strategies.settings import save_config

    cfg = _cfg(tmp_path, tiny_flux_dir)
    run = Path(cfg.output_dir)
    for e in (0, 1):
        (run / "checkpoints" / f"epoch_{e}").mkdir(parents=True)
        (run / "checkpoints" / f"epoch_{e}" / "state.json").write_text(json.dumps({"epoch": e}))
    (run / "checkpoints" / "latest").write_text("epoch_1")
    save_config(cfg, run / "config.yaml")
    code, err = _exit(capsys, ["sample", "--run", str(run), "--out", str(tmp_path / "out"), "--num-images", "1"])
    assert code == 2 and err == [  # every command's refusal: "PROG: error: …", exit status 2
        f"flowgrpo sample: error: no LoRA or transformer weights in '{run / 'lora'}': the run stopped before "
                       "writing its final weights; its checkpoints: epoch_1, epoch_0 (a resume continues from "
                       f"epoch_1); finish it with `flowgrpo train output_dir={run} train.resume_from=auto`, then "
                       "sample it"]


def test_sample_run_on_a_run_still_training_says_it_is_running(tmp_path, tiny_flux_dir, capsys):
    """A run that holds its folder's lock is training, not stopped: the line says so (and who holds it) and
    does not send the user to resume a live run."""
    import fcntl

    from flowgrpo.strategies.settings import save_config
    from flowgrpo.writing.outputs import LOCK_FILE

    cfg = _cfg(tmp_path, tiny_flux_dir)
    run = Path(cfg.output_dir)
    (run / "checkpoints" / "epoch_0").mkdir(parents=True)
    (run / "checkpoints" / "epoch_0" / "state.json").write_text(json.dumps({"epoch": 0}))
    (run / "checkpoints" / "latest").write_text("epoch_0")
    save_config(cfg, run / "config.yaml")
    with open(run / LOCK_FILE, "w") as held:  # what a live run holds: an exclusive flock, its record inside
        held.write(json.dumps({"pid": 4242, "host": "node7"}))
        held.flush()
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        code, err = _exit(capsys, ["sample", "--run", str(run), "--out", str(tmp_path / "out"), "--num-images", "1"])
    assert code == 2 and len(err) == 1
    assert "the run is still training (it holds the run folder's lock: PID 4242 on node7)" in err[0]
    assert "wait for it to finish, then sample it (checkpoints so far: epoch_0)" in err[0]
    assert "resume_from" not in err[0] and "stopped" not in err[0]
    code, err = _exit(capsys, ["sample", "--run", str(run), "--out", str(tmp_path / "out"), "--num-images", "1"])
    assert "the run stopped before writing its final weights" in err[0]  # the lock released: a stopped run


@pytest.mark.parametrize(("argv", "line"), [
    (["sample", "--out", "OUT"], "flowgrpo sample: error: give --run RUN_DIR or --model"),
    (["sample", "--model", "tiny", "--out", "OUT"], "flowgrpo sample: error: no prompts (give --prompts FILE)"),
])
def test_sample_refusals_are_one_error_line_with_exit_status_2(tmp_path, capsys, argv, line):
    """These two once exited 1 with their line but without the ``error:`` every other refusal has (a bare
    ``SystemExit(message)``); nothing is written."""
    code, err = _exit(capsys, [str(tmp_path / "o") if a == "OUT" else a for a in argv])
    assert (code, err) == (2, [line])
    assert not (tmp_path / "o").exists()


def test_the_digits_build_obeys_logging_progress(tmp_path, monkeypatch, capsys):
    """A first run of the digits default builds its model (minutes); with ``logging.progress=false`` the build's
    progress bars are off. The build itself is replaced here by one that records what it was asked."""
    import flowgrpo.tasks.digits.model as digits

    asked = []

    def build(out_dir, seed=0, *, progress=True, **recipe):
        asked.append(progress)
        raise ValueError("stop here: the test only checks what the build was asked")

    monkeypatch.setenv("FLOWGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digits, "pretrain_pinned", build)
    code, err = _exit(capsys, ["train", f"output_dir={tmp_path / 'r'}", "logging.progress=false"])
    assert asked == [False] and code == 2 and err[-1].startswith("error: stop here")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_under_two_processes_one_rank_speaks_for_the_run(tmp_path, tiny_flux_dir):
    """A run resumed under torchrun with changed settings and a learning rate that diverges: the resume messages,
    the changed-settings warning and the one-line stop are each printed once (main: once per process)."""
    common = [*_tiny_overrides(tmp_path, tiny_flux_dir), "model.finetune=full", "logging.save_every=1",
              "train.lr_schedule=cosine",
              f"output_dir={tmp_path / 'run'}", "train.rollout_batch_size=2", "train.train_batch_size=2"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    from flowgrpo.runner import main as train_main

    train_main([*common, "train.num_epochs=1", "train.lr=1e-4"])  # one process, a checkpoint to resume
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          _free_port(), "flowgrpo/train.py", *common, "train.num_epochs=3", "train.lr=1000",
                          "train.resume_from=auto"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = two.stdout + two.stderr
    assert two.returncode != 0, out[-2000:]
    assert out.count("resuming with settings that differ") == 1, out[-3000:]
    assert out.count("resumed from") == 1, out[-3000:]
    assert out.count("the cosine learning rate follows the run's length") == 1, out[-3000:]
    assert out.count("error: epoch 2/3: the run diverged") == 1, out[-3000:]


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_one_line_and_every_rank_exits_with_its_status(tmp_path):
    """Issue 54, F6: a bad override under ``torchrun --nproc_per_node 2`` (gloo): the line once (rank 0), no
    traceback of ours (rank 1 once got torchrun's SIGTERM while it slept in ``runner._refuse`` and printed a
    KeyboardInterrupt traceback), and each rank ends by itself with the refusal's status 2 (torchrun's summary
    lists every rank's exit code; a rank it had to end shows -15, SIGTERM). torchrun's own summary of a failed
    launch (its ChildFailedError) remains: torch prints it for any non-zero exit."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           "flowgrpo/train.py", "configs/tiny_jpeg.yaml", f"output_dir={tmp_path / 'x'}", "algo.clip_rnage=1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    line = ("error: unknown config key 'algo.clip_rnage': the algo section's keys moved (docs"
            "/configs.md: where each setting lives); did you mean 'objective.clip_range'?")
    assert proc.returncode != 0 and out.count(line) == 1 and out.count("error: ") == 1, out[-3000:]
    assert not re.search(r'File ".*/flowgrpo/', out) and "KeyboardInterrupt" not in out, out[-3000:]
    codes = re.findall(r"exitcode\s+:\s*(-?\d+)", out)  # the summary's rows, "exitcode  : 2"
    assert sorted(codes) == ["2", "2"], out[-3000:]  # both ranks, each by itself


def test_a_checkpoint_of_another_model_is_named_first(tmp_path):
    """Issue 54, F11: a tiny-model checkpoint resumed onto the digits model was refused about its evaluation
    settings, then its prompts; the other model is the fault, and is said first."""
    from flowgrpo.config import build_config
    from flowgrpo.preflight import preflight
    from flowgrpo.strategies.settings import ConfigError, save_config

    old = build_config({"output_dir": str(tmp_path / "tiny_run"), "model": {"pretrained": "tiny"},
                        "train": {"num_epochs": 2}, "data": {"eval_num_prompts": 4}})
    run = Path(old.output_dir)
    (run / "checkpoints" / "epoch_0").mkdir(parents=True)
    (run / "checkpoints" / "epoch_0" / "state.json").write_text(json.dumps({"epoch": 0}))
    (run / "checkpoints" / "latest").write_text("epoch_0")
    save_config(old, run / "config.yaml")
    new = build_config({"output_dir": str(tmp_path / "digits_run"), "model": {"pretrained": "digits"},
                        "train": {"num_epochs": 2, "resume_from": str(run / "checkpoints")},
                        "data": {"eval_num_prompts": 8}})
    with pytest.raises(ConfigError) as err:
        preflight(new)
    assert str(err.value).startswith(f"train.resume_from={str(run / 'checkpoints' / 'epoch_0')!r} is a checkpoint of "
                                     "another model: its run trained model.pretrained=tiny, this run gives "
                                     "model.pretrained=digits; set model.pretrained=tiny"), str(err.value)
