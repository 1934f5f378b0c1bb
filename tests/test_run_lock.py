"""A run owns its output_dir while it runs (flowgrpo.writing.run_lock): a second run on the folder, started as a fresh
run, with ``logging.overwrite=true`` or with ``train.resume_from=auto``, is refused naming the live run, before anything
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
    from flowgrpo.writing.run_lock import hold_run_folder
    with hold_run_folder(sys.argv[1], command="flowgrpo train (run A)"):
        print("held", flush=True)
        sys.stdin.readline()  # until the test closes stdin (or kills this process)
""")


def _fake_run(folder, with_checkpoint: bool) -> dict:
    """A's files: its config, metrics and (optionally) a complete checkpoint; returns their bytes."""
    import torch

    from flowgrpo.checkpoints.save_load import save_checkpoint
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
        proc.wait(timeout=600)


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
    from flowgrpo.writing.run_lock import RunFolderBusy, hold_run_folder

    folder, proc = run_a
    with pytest.raises(RunFolderBusy, match=f"PID {proc.pid}"), hold_run_folder(folder):
        pass
    os.kill(proc.pid, signal.SIGKILL)  # a crash: no clean-up code runs
    proc.wait(timeout=600)
    with hold_run_folder(folder, command="run B"):  # free at once
        with hold_run_folder(folder):  # re-entrant within the holding process
            pass
        assert "run B" in (folder / ".flowgrpo.lock").read_text()


def test_a_lock_held_by_another_program_is_not_blamed_on_the_last_recorded_run(tmp_path):
    """Fresh-user trial 7: the lock file keeps the record of the last run that took it (a refused one too); held by
    another program (``flock`` from a shell) the busy line named that long-ended run as "still running"."""
    from flowgrpo.writing.run_lock import RunFolderBusy, hold_run_folder, lock_holder

    folder = tmp_path / "run"
    ended = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from flowgrpo.writing.run_lock import hold_run_folder
        with hold_run_folder(sys.argv[1], command="run X (ended)"):
            open(sys.argv[1] + "/config.yaml", "w").close()  # a run was written: its lock file stays
    """), str(folder)], check=True, timeout=600)
    assert ended.returncode == 0 and "run X (ended)" in (folder / ".flowgrpo.lock").read_text()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import fcntl, sys
        fh = open(sys.argv[1] + "/.flowgrpo.lock")
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.readline()
    """), str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy) as info, hold_run_folder(folder):
            pass
        line = str(info.value)
        assert "still running" not in line and "is in use (held by another process; the last run recorded" in line
        assert "run X (ended)" in line and line.count("has ended") == 1
        assert lock_holder(folder).startswith("held by another process")
    finally:
        holder.kill()
        holder.wait(timeout=600)


# ---------------------------------------------------------------- shared file systems (NFS, Lustre, ...)
@pytest.fixture
def on_nfs(tmp_path, monkeypatch):
    """``tmp_path`` as an NFS mount in a fake ``/proc/mounts`` (below a local root), and ``flock`` unusable."""
    from flowgrpo.writing import run_lock

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp_path.resolve()} nfs4 rw,vers=4.2 0 0\n")
    monkeypatch.setattr(run_lock, "MOUNTS", str(mounts))

    def no_flock(*args):
        raise AssertionError("flock used on a shared file system")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    return tmp_path / "run"


def test_the_file_system_type_is_the_longest_mount_above_the_path(tmp_path):
    from flowgrpo.writing.run_lock import file_system_type

    mounts = tmp_path / "mounts"
    (tmp_path / "a b" / "c").mkdir(parents=True)
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nsrv:/x {tmp_path}/a\\040b lustre rw 0 0\n")
    assert file_system_type(tmp_path / "a b" / "c", mounts) == "lustre"  # \040: a space in /proc/mounts
    assert file_system_type(tmp_path, mounts) == "ext4"
    assert file_system_type(tmp_path, tmp_path / "missing") is None


def test_on_a_shared_file_system_the_lock_is_an_exclusive_file_removed_at_the_end(on_nfs):
    import json

    from flowgrpo.writing.run_lock import RunFolderBusy, _acquire, hold_run_folder

    folder = on_nfs
    folder.mkdir()
    with hold_run_folder(folder, command="run A"):
        info = json.loads((folder / ".flowgrpo.lock").read_text())
        assert info["pid"] == os.getpid() and info["command"] == "run A"
        with pytest.raises(RunFolderBusy, match=r"in use by .*run A.* the lock is the file .*: if that run is gone"):
            _acquire(folder.resolve(), "run B")  # a second holder (the same live process here)
    assert not (folder / ".flowgrpo.lock").exists() and folder.is_dir()


def test_a_stale_lock_on_a_shared_file_system_is_replaced_only_when_its_process_is_gone_here(on_nfs):
    import json
    import socket

    from flowgrpo.writing.run_lock import RunFolderBusy, hold_run_folder

    folder = on_nfs
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = folder / ".flowgrpo.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "command": "killed run",
                                "started": "2026-01-01T00:00:00+00:00"}))
    with hold_run_folder(folder, command="run B"):  # a kill -9'd run on this machine: replaced
        assert json.loads(lock.read_text())["command"] == "run B"
    # a run on another machine cannot be checked from here: refused, naming the file to delete
    lock.write_text(json.dumps({"pid": os.getpid(), "host": "node-7", "command": "run on node 7",
                                "started": "2026-01-01T00:00:00+00:00"}))
    with pytest.raises(RunFolderBusy, match=r"PID \d+ on node-7.*delete it"):
        with hold_run_folder(folder, command="run C"):
            pass
    # this machine's PID reused by a process started after the lock: the lock's run is gone
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": "old run",
                                "started": "2000-01-01T00:00:00+00:00"}))
    with hold_run_folder(folder, command="run D"):
        assert json.loads(lock.read_text())["command"] == "run D"


# ----------------------------------------------------------------- the lock file never writes into a file of yours
def _held(folder):
    from flowgrpo.writing.run_lock import hold_run_folder

    with hold_run_folder(folder, command="flowgrpo train"):
        pass


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_file_linked_to_a_users_file_is_refused_and_the_file_kept(tmp_path, link):
    """Fresh-user trial 5: ``.flowgrpo.lock`` made a link to the user's file (a copied run folder, a tidy-up by hand)
    took the lock's JSON, opened with ``open(…, "a+")`` (which follows a symbolic link and writes into a hard
    link), and the refusal then said "nothing was changed"."""
    from flowgrpo.writing.outputs import OutputRefused

    mine = tmp_path / "precious.txt"
    mine.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".flowgrpo.lock").symlink_to(mine) if link == "symbolic" else os.link(mine, run / ".flowgrpo.lock")
    with pytest.raises(OutputRefused, match=r"its lock file '\.flowgrpo\.lock' is a (symbolic link|hard link).*"
                                            r"nothing was changed"):
        _held(run)
    assert mine.read_text() == "precious\n" and sorted(os.listdir(run)) == [".flowgrpo.lock"]


def test_a_users_own_file_named_as_the_lock_is_refused_and_kept(tmp_path):
    """Trial 5: a user's ``.flowgrpo.lock`` in their folder was overwritten, and the run's marker was left there."""
    from flowgrpo.writing.outputs import OutputRefused

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".flowgrpo.lock").write_text("my lock notes\n")
    with pytest.raises(OutputRefused, match="is not flowgrpo's lock .*nothing was changed"):
        _held(mine)
    assert os.listdir(mine) == [".flowgrpo.lock"] and (mine / ".flowgrpo.lock").read_text() == "my lock notes\n"


def test_a_refused_run_leaves_an_empty_folder_of_the_users_empty(tmp_path):
    """A folder that was there and empty: a run refused at set-up (inside the hold) takes back the lock file and
    the marker it wrote, and leaves a marker that was there (a link: trial 5 found the lock file left behind with
    "nothing was changed"). A run that wrote its files keeps its lock and marker."""
    from flowgrpo.writing.run_lock import hold_run_folder

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="a bad prompt file"), hold_run_folder(empty):
        assert sorted(os.listdir(empty)) == [".flowgrpo-output", ".flowgrpo.lock"]
        raise ValueError("a bad prompt file")
    assert os.listdir(empty) == []
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "precious.txt").write_text("precious\n")
    (linked / ".flowgrpo-output").symlink_to(tmp_path / "precious.txt")
    with pytest.raises(ValueError, match="a link"), hold_run_folder(linked):  # the run's check of its files' links
        raise ValueError("a link among the run's files")
    assert os.listdir(linked) == [".flowgrpo-output"] and (tmp_path / "precious.txt").read_text() == "precious\n"
    with hold_run_folder(empty):
        (empty / "config.yaml").write_text("{}\n")
    assert sorted(os.listdir(empty)) == [".flowgrpo-output", ".flowgrpo.lock", "config.yaml"]
