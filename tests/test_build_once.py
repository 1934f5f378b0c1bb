"""``flowgrpo.builds.cache_folder.build_once``: concurrent builders of one artefact build it once (the others wait on
the lock)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flowgrpo.builds.cache_folder import build_once


def _slow_build(tmp: Path, log: Path) -> None:
    with log.open("a") as fh:  # one line per build actually run
        fh.write("built\n")
    time.sleep(1.0)
    (tmp / "model_index.json").write_text("{}")


def _builder(target: str, log: str) -> None:
    build_once(Path(target), lambda tmp: _slow_build(tmp, Path(log)))


def test_concurrent_builders_build_once(tmp_path):
    target, log = tmp_path / "model", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_builder, args=(str(target), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert log.read_text().splitlines() == ["built"]  # without the lock each of the three builds its own copy
    assert (target / "model_index.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.tmp-")]  # no leftover copy


CHILD = ("import os, pathlib, sys, time; out = pathlib.Path(sys.argv[2]); (out / 'partial').write_text('x'); "
         "pid = pathlib.Path(sys.argv[1]); (pid.parent / 'pid.tmp').write_text(str(os.getpid())); "
         "os.replace(pid.parent / 'pid.tmp', pid); time.sleep(120)")

#: a parent process that builds the digits base model on first use, as training does (ensure_digits_model ->
#: build_once -> pretrain_pinned -> run_pinned), with the child's 4-minute pretraining replaced by CHILD (same spawn)
PARENT = """
import sys
from flowgrpo.builds import repeatable
from flowgrpo.tasks.digits.model import ensure_digits_model
real = repeatable.run_pinned
def fake(argv, what):
    real(["-c", sys.argv[2], sys.argv[1], argv[argv.index("--pinned-child") + 1]], what)
repeatable.run_pinned = fake
ensure_digits_model(0, progress=False)
"""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child's end with its parent is Linux's prctl")
def test_a_killed_build_leaves_no_child_running_and_its_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    """Before: SIGTERM to a run building the digits base model left the build's child running as an orphan (each
    kill one more, building in parallel), and its ``.digits-v3-seed0.tmp-*`` folder in the cache for ever."""
    from flowgrpo.tasks.digits import model as digits

    cache, pid_file = tmp_path / "cache", tmp_path / "child.pid"
    env = {**os.environ, "FLOWGRPO_CACHE": str(cache)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), CHILD], env=env)
    child = None
    try:
        deadline = time.monotonic() + 240
        while not pid_file.exists():
            assert parent.poll() is None and time.monotonic() < deadline, "the build's child never started"
            time.sleep(0.2)
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGTERM)  # what `kill`, `timeout` and job schedulers send
        assert parent.wait(30) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the build's child outlived its killed parent"
    finally:
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    target = digits.default_model_dir(0).relative_to(digits.cache_root())
    left = [p for p in cache.iterdir() if p.name.startswith(f".{target}.tmp-")]
    assert len(left) == 1 and (left[0] / "partial").is_file()  # the killed build's folder
    monkeypatch.setenv("FLOWGRPO_CACHE", str(cache))
    built = build_once(digits.default_model_dir(0), lambda tmp: (tmp / "model_index.json").write_text("{}"))
    assert (built / "model_index.json").is_file() and not (built / "partial").exists()
    assert sorted(p.name for p in cache.iterdir()) == [str(target)]  # the dead build's folder is gone


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="watches the open files in /proc/self/fd")
def test_a_waiter_on_an_unlinked_lock_file_locks_the_path_afresh(tmp_path):
    """The holder unlinks the lock file when done; a process that waited on it must not enter beside one that
    locked the new file at the same path (else both build, and one removes the other's folder as dead)."""
    import fcntl

    from flowgrpo.builds.cache_folder import _locked

    path = tmp_path / ".m.lock"
    first = open(path, "a")  # noqa: SIM115
    fcntl.flock(first, fcntl.LOCK_EX)
    entered = threading.Event()

    def waiter():
        with _locked(path):
            entered.set()
            time.sleep(0.5)

    thread = threading.Thread(target=waiter)
    thread.start()
    deadline = time.monotonic() + 30
    while sum(os.path.realpath(f"/proc/self/fd/{fd}") == str(path) for fd in os.listdir("/proc/self/fd")) < 2:
        assert time.monotonic() < deadline, "the waiter never opened the lock file"
        time.sleep(0.05)  # until the waiter has opened the file (beside `first`) and waits on its lock
    path.unlink()
    newcomer = open(path, "a")  # noqa: SIM115 - a third process's lock on the new file at the path
    fcntl.flock(newcomer, fcntl.LOCK_EX)
    fcntl.flock(first, fcntl.LOCK_UN)
    first.close()
    assert not entered.wait(1.0), "the waiter entered while another held the lock of the file at the path"
    fcntl.flock(newcomer, fcntl.LOCK_UN)
    newcomer.close()
    assert entered.wait(5.0)
    thread.join(5)
