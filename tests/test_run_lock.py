"""A run owns its output_dir while it runs (flowgrpo.run_lock): a second run on the folder, started as a fresh run,
with ``logging.overwrite=true`` or with ``train.resume_from=auto``, is refused naming the live run, before anything
in the folder is read or removed; the lock dies with its process, so a crashed run leaves nothing stale.

Run A is a real second process that holds the folder as the training command does; run B is the training command
line (``flowgrpo.runner.main``) in this process, with model loading forbidden (everything must be decided first).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

HOLDER = textwrap.dedent("""
    import sys
    from flowgrpo.run_lock import hold_run_folder
    with hold_run_folder(sys.argv[1], command="flowgrpo train (run A)"):
        print("held", flush=True)
        sys.stdin.readline()  # until the test closes stdin (or kills this process)
""")


def _fake_run(folder, with_checkpoint: bool) -> dict:
    """A's files: its config, metrics and (optionally) a complete checkpoint; returns their bytes."""
    import torch

    from flowgrpo.checkpoint import save_checkpoint
    from flowgrpo.config import build_config, save_config
    from flowgrpo.data.prompts import GroupSampler

    folder.mkdir(parents=True, exist_ok=True)
    save_config(build_config({"output_dir": str(folder)}), folder / "config.yaml")
    (folder / "metrics.jsonl").write_text('{"epoch": 0}\n')
    if with_checkpoint:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.AdamW(model.parameters())
        save_checkpoint(folder / "checkpoints", 0, model=model, optimizer=opt,
                        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                        sampler=GroupSampler(10, 2, 0))
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
            and p.name != ".flowgrpo.lock"}


@pytest.fixture
def run_a(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield folder, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("checkpoint", [True, False], ids=["with_checkpoint", "before_first_checkpoint"])
@pytest.mark.parametrize("how", [[], ["logging.overwrite=true"], ["train.resume_from=auto"]],
                         ids=["fresh", "overwrite", "resume_auto"])
def test_a_second_run_on_a_live_runs_folder_is_refused_naming_it(run_a, monkeypatch, capsys, how, checkpoint):
    import flowgrpo.models as models
    from flowgrpo.runner import main

    folder, proc = run_a
    files = _fake_run(folder, checkpoint)
    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("run B loaded a model"))
    with pytest.raises(SystemExit) as exit_info:
        main([f"output_dir={folder}", *how])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"is in use by a run that is still running (PID {proc.pid}" in err
    assert "flowgrpo train (run A)" in err and "started " in err
    assert "overwrite" not in err and "resume_from" not in err  # nothing that would remove A's files
    after = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
             and p.name != ".flowgrpo.lock"}
    assert after == files  # A's files untouched, nothing added


def test_a_killed_run_leaves_no_stale_lock(run_a):
    from flowgrpo.run_lock import RunFolderBusy, hold_run_folder

    folder, proc = run_a
    with pytest.raises(RunFolderBusy, match=f"PID {proc.pid}"), hold_run_folder(folder):
        pass
    os.kill(proc.pid, signal.SIGKILL)  # a crash: no clean-up code runs
    proc.wait(timeout=30)
    with hold_run_folder(folder, command="run B"):  # free at once
        with hold_run_folder(folder):  # re-entrant within the holding process
            pass
        assert "run B" in (folder / ".flowgrpo.lock").read_text()
