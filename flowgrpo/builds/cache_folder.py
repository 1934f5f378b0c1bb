"""The cache folder of built-once artefacts (embedded models, reward stand-ins) and the atomic build routine."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``$FLOWGRPO_CACHE``, else ``$XDG_CACHE_HOME/flowgrpo``, else ``~/.cache/flowgrpo``."""
    if os.environ.get("FLOWGRPO_CACHE"):
        return Path(os.environ["FLOWGRPO_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "flowgrpo"


def build_once(target: Path, build, is_complete=lambda p: (p / "model_index.json").exists()) -> Path:
    """``target``, built by ``build(tmp_folder)`` into a temporary sibling and renamed into place when absent:
    a crash never leaves a half-written model. Concurrent builders (the processes of a launch, the workers of a
    test run) take turns on a lock file beside ``target`` (``fcntl.flock``, where the platform has it): the first
    builds, the others wait and use its copy; without the lock the first rename wins. A builder under the lock first
    removes the temporary folders of builds that were killed (:func:`_remove_dead_builds`).

    Raises:
        FileExistsError: ``target`` exists but is not complete (remove it to rebuild).
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    try:
        with _locked(lock) as locked:
            if is_complete(target):  # built by the builder this one waited for
                logger.info("another process built %s; using it", target)
                return target
            if target.exists():
                raise FileExistsError(f"{target} exists but is not a finished model folder; remove it to rebuild")
            if locked:
                _remove_dead_builds(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                build(tmp)
                try:
                    os.rename(tmp, target)
                except OSError:
                    if not is_complete(target):
                        raise
                    logger.info("another process finished %s first; using its copy", target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    finally:
        # the lock's file is not left in the cache: a builder still waiting on it rechecks the target under it,
        # and a later one checks completeness before it locks
        with contextlib.suppress(OSError):
            lock.unlink()
    return target


def _remove_dead_builds(target: Path) -> None:
    """Remove the temporary folders (``.{target.name}.tmp-*``) that builds of ``target`` left behind when their
    process was killed (SIGTERM or SIGKILL end a process without its cleanup). Called only under the build lock:
    a live build holds that lock for its whole life, so no folder found then belongs to one."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        if stale.is_dir():
            logger.info("removing %s, left by a build that was killed", stale)
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` while open; yields whether it is held (False where ``fcntl`` is missing:
    Windows). A holder unlinks the file when it is done (:func:`build_once`), so a waiter that then gets the lock of
    the unlinked file locks ``path`` afresh: two processes never both hold the lock of the file at ``path``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no POSIX locks: concurrent builders race, the first rename wins
        yield False
        return
    while True:
        with open(path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the file was unlinked (and perhaps made again) while this process waited: lock anew
                continue
            try:
                yield True
                return
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
