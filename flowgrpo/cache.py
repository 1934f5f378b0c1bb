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
    builds, the others wait and use its copy; without the lock the first rename wins.

    Raises:
        FileExistsError: ``target`` exists but is not complete (remove it to rebuild).
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    try:
        with _locked(lock):
            if is_complete(target):  # built by the builder this one waited for
                logger.info("another process built %s; using it", target)
                return target
            if target.exists():
                raise FileExistsError(f"{target} exists but is not a finished model folder; remove it to rebuild")
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


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` while open (none where ``fcntl`` is missing: Windows)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no POSIX locks: concurrent builders race, the first rename wins
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
