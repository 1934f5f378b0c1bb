"""The cache folder of built-once artefacts (embedded models, reward stand-ins) and the atomic build routine."""

from __future__ import annotations

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
    a crash never leaves a half-written model, and of concurrent builders the first rename wins.

    Raises:
        FileExistsError: ``target`` exists but is not complete (remove it to rebuild).
    """
    if is_complete(target):
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists but is not a finished model folder; remove it to rebuild")
    target.parent.mkdir(parents=True, exist_ok=True)
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
    return target
