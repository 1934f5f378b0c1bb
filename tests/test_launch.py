"""Specification of flowgrpo.distributed.launch: the launch a stopped run prints to resume it is the one it was started
with
(torchrun, accelerate launch), read from the launcher's command line or rebuilt from torchrun's variables; and the
first SIGINT or SIGTERM stops the run through KeyboardInterrupt, the ones after it ignored (issue 54)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowgrpo.distributed.launch import (
    launch_environment,
    launcher_words,
    restore_signals,
    stop_on_signals,
    stopping_signal,
    wait_for_launcher,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "flowgrpo" / "train.py")
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}


def test_a_torchrun_launch_is_read_from_the_launcher_command_line():
    """What the kernel shows for ``torchrun --nproc_per_node 2 flowgrpo/train.py cfg.yaml``: the interpreter running
    the torchrun script; the launch shown as typed, up to the script as given (relative to the launcher's folder)."""
    parent = (["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc_per_node", "2", "flowgrpo/train.py", "cfg.yaml",
               "train.resume_from=old"], REPO)
    assert launcher_words(SCRIPT, parent=parent, env=TORCHRUN) == ["torchrun", "--nproc_per_node", "2",
                                                                    "flowgrpo/train.py"]


def test_an_accelerate_launch_is_read_from_the_launcher_command_line():
    parent = (["/opt/venv/bin/python", "/opt/venv/bin/accelerate", "launch", "--num_processes", "2", SCRIPT, "x=1"],
              Path("/"))
    env = {"ACCELERATE_USE_CPU": "False"}
    assert launcher_words(SCRIPT, parent=parent, env=env) == ["accelerate", "launch", "--num_processes", "2", SCRIPT]
    # a shell (or anything that does not hold the script as one of its words) is not the launcher
    shell = (["bash", "-c", f"python {SCRIPT}"], REPO)
    assert launcher_words(SCRIPT, parent=shell, env=env) == []


def test_a_torchrun_launch_is_rebuilt_from_its_variables_when_the_launcher_cannot_be_read():
    unreadable = (["/usr/bin/python3", "-m", "something_else"], REPO)
    assert launcher_words(SCRIPT, parent=unreadable, env=TORCHRUN) == ["torchrun", "--nnodes", "2",
                                                                       "--nproc_per_node", "2", SCRIPT]


def test_an_accelerate_launch_repeats_the_launchers_variables_not_the_ones_it_sets():
    """accelerate launch --cpu gives its processes ACCELERATE_USE_CPU=True itself (its flag is in the launch
    words): the variables are the launcher's own environment's, the ones the user set."""
    mine = {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "no", "CUDA_VISIBLE_DEVICES": "1"}
    users = {"CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin", "ACCELERATE_LOG_LEVEL": "info"}
    assert launch_environment(mine, parent_env=users) == ["ACCELERATE_LOG_LEVEL=info", "CUDA_VISIBLE_DEVICES=1"]
    assert launch_environment({**TORCHRUN, "ACCELERATE_USE_CPU": "true", "PATH": "/bin"}) == ["ACCELERATE_USE_CPU=true"]


def test_a_single_process_has_no_launcher():
    assert launcher_words(SCRIPT, parent=(["/usr/bin/python3", SCRIPT], REPO), env={}) == []


def test_the_interrupted_line_under_torchrun_resumes_with_the_same_launch(tmp_path, monkeypatch):
    """The resume command under torchrun was ``<python> flowgrpo/train.py …``, one process: it is the launch."""
    import flowgrpo.distributed.launch as launch
    import flowgrpo.runner as runner
    from flowgrpo.config import build_config

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("epoch_1\n")
    cfg = build_config({"output_dir": str(tmp_path), "train": {"num_epochs": 2}})
    args = SimpleNamespace(config="cfg.yaml", overrides=["train.resume_from=old", "x=1"])
    monkeypatch.setattr(runner, "_TRAINER", SimpleNamespace(out=tmp_path, cfg=cfg, epoch=0, stage="epochs"))
    monkeypatch.setattr(runner.sys, "argv", [SCRIPT, "cfg.yaml", "x=1"])
    for key in [k for k in os.environ if k.startswith("ACCELERATE_") or k.endswith("_VISIBLE_DEVICES")]:
        monkeypatch.delenv(key)
    for key, value in {**TORCHRUN, "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": "2,3", "HOME": "/h"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "_parent_command", lambda pid: (["/usr/local/bin/torchrun", "--nproc_per_node", "2",
                                                                 "flowgrpo/train.py", "cfg.yaml", "x=1"], REPO))
    line = runner._interrupted_line(args, None)
    # the variables the launch needed come first, as typed: without ACCELERATE_USE_CPU=true a CPU machine fails
    assert line.rstrip().endswith(f"resume: ACCELERATE_USE_CPU=true CUDA_VISIBLE_DEVICES=2,3 torchrun "
                                  f"--nproc_per_node 2 flowgrpo/train.py cfg.yaml x=1 "
                                  f"train.resume_from={tmp_path / 'checkpoints'}")


def test_one_process_resumes_without_the_launch_variables(tmp_path, monkeypatch):
    """Without a launcher the command is the script's; no variable of the environment is put before it."""
    import flowgrpo.runner as runner
    from flowgrpo.config import build_config

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("epoch_1\n")
    cfg = build_config({"output_dir": str(tmp_path), "train": {"num_epochs": 2}})
    monkeypatch.setattr(runner, "_TRAINER", SimpleNamespace(out=tmp_path, cfg=cfg, epoch=0, stage="epochs"))
    monkeypatch.setattr(runner.sys, "argv", [SCRIPT, "x=1"])
    for key in [k for k in os.environ if k.startswith("ACCELERATE_") or k == "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    line = runner._interrupted_line(SimpleNamespace(config=None, overrides=["x=1"]), "flowgrpo train")
    assert "resume: flowgrpo train x=1 train.resume_from=" in line, line


@pytest.fixture
def ctrl_c_delivered():
    """SIGINT handled as in a terminal's foreground job for the test: a suite started in the background (``… &``)
    has SIGINT ignored, which stop_on_signals rightly keeps ignored (a background job ignores Ctrl-C)."""
    kept = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, kept)


def test_a_stop_signal_ignored_by_the_job_stays_ignored(ctrl_c_delivered):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's SIGINT
    replaced = stop_on_signals()
    try:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.SIGINT not in replaced
        os.kill(os.getpid(), signal.SIGINT)  # nothing happens
    finally:
        restore_signals(replaced)


def test_the_first_stop_signal_interrupts_and_the_next_is_ignored(ctrl_c_delivered):
    replaced = stop_on_signals()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM after a Ctrl-C: ignored
        os.kill(os.getpid(), signal.SIGINT)
        assert stopping_signal() == signal.SIGTERM
    finally:
        restore_signals(replaced)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_ctrl_c_under_accelerate_waits_for_the_launchers_sigterm_before_its_line(ctrl_c_delivered):
    """accelerate's launcher drops the chunk of its child's output it has read when its own Ctrl-C is raised (on a
    loaded machine: the resume line, CI of stop 59); it sends its SIGTERM after it started copying again, so a run
    stopped by SIGINT says its line once that SIGTERM came. A stop by SIGTERM, or a SIGTERM already come, waits for
    nothing; with none coming the wait ends at its bound."""
    import threading

    replaced = stop_on_signals()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert not wait_for_launcher(0.05)  # no SIGTERM: the bound
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()  # the launcher, a moment later
        assert wait_for_launcher(600.0)  # returns when it comes (never a deadline: the bound is generous)
        assert stopping_signal() == signal.SIGINT  # the first signal still names the stop (exit status 130)
        stop_on_signals()  # a new command
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM first: nothing to wait for
        assert wait_for_launcher(600.0)
    finally:
        restore_signals(replaced)
