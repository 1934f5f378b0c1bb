"""Checkpoint health, rotation and the resume choice: what a checkpoints root (``<output_dir>/checkpoints``) holds
as seen from outside its folders, and which of them a save keeps and a resume picks. Writing and reading a
checkpoint's tensors is :mod:`flowgrpo.checkpoints.save_load`.

Owns: ``health.json`` (:func:`health_record`, :func:`read_health`, :func:`mark_unhealthy`); the check that a
folder's files are as written, by the sizes its ``state.json`` lists under :data:`MANIFEST` (:func:`incomplete`);
the ``latest`` pointer (:func:`latest_name`, :func:`point_latest`, made durable by :func:`fsync_dir`); the
complete folders (:func:`checkpoint_folders`); the rotation (:func:`best_checkpoint`, :func:`rotation_victims`);
the resume choice (:func:`newest_healthy`, :func:`resolve_checkpoint`); and :class:`CheckpointError`, raised here
and by the loader.

The trainer writes a checkpoint only from healthy weights (:mod:`flowgrpo.watch.divergence`): every trained parameter
finite, the epoch's own update figures not flagged (a NaN or infinite figure, or a KL figure beyond both its floor
and 1000 times its largest earlier value) and the new weights' own figures sound (their norm's growth, a probe
forward); ``health.json`` records them. A diverging run stops instead, naming the figure and the epoch. A checkpoint
whose weights later make non-finite images is marked unhealthy (:func:`mark_unhealthy`); a resume never picks one,
nor one whose files are not as written (:func:`newest_healthy`, :func:`resolve_checkpoint`), and the rotation keeps
the newest ``keep`` checkpoints not marked unhealthy plus the best evaluated one (:func:`rotation_victims`), so a
healthy checkpoint is never rotated out by one that is not."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

#: the key of ``state.json`` listing every other file of the checkpoint with its size in bytes
MANIFEST = "files"

#: the checkpoint family's logger (its warnings keep the name they carried before the split)
logger = logging.getLogger("flowgrpo.checkpoints.save_load")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or holds something other than tensors and plain data."""


def latest_name(root: Path) -> str | None:
    """The folder name ``root/latest`` holds, or None when there is no ``latest``."""
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def point_latest(root: Path, name: str) -> None:
    """``root/latest`` names ``name``, replaced atomically (written beside it, then renamed over it)."""
    tmp = root / ".latest.tmp"
    tmp.write_text(name)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, root / "latest")
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    """Make the renames in folder ``path`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def error_cause(err: BaseException) -> str:
    """``err`` in one line for a message: its type and the first line of its text."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# ---------------------------------------------------------------------- health, rotation and the resume choice
HEALTH_FILE = "health.json"


def health_record(figures: dict[str, float], best_metric: str | None = None) -> dict:
    """What ``health.json`` holds for a checkpoint written from weights the trainer found healthy: ``healthy``
    true, the ``health/*`` figures that showed it (:class:`~flowgrpo.watch.divergence.WeightHealth`) and, when the epoch
    was evaluated, the evaluation figure ``best_metric`` and its value (``eval``; higher is better), which
    :func:`rotation_victims` keeps the best of."""
    record: dict = {"healthy": True, "checks": {k: v for k, v in figures.items() if k.startswith("health/")}}
    value = figures.get(best_metric) if best_metric else None
    if isinstance(value, int | float) and value == value:  # a figure, not NaN
        record["eval"] = {"metric": best_metric, "value": float(value)}
    return record


def read_health(folder: str | Path) -> dict:
    """A checkpoint's ``health.json`` as a dict; ``{}`` when it has none (written before health records) or it
    cannot be read (a checkpoint not marked is not unhealthy)."""
    try:
        record = json.loads((Path(folder) / HEALTH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def incomplete(folder: str | Path) -> str | None:
    """Why checkpoint ``folder`` is not as it was written, or None: a file its ``state.json`` lists (``files``:
    {relative path: bytes}, every file written before ``state.json``) is missing or has another size (a file
    truncated by a full disk or a cut copy). ``state.json`` itself unreadable, or its ``files`` not a mapping of
    names to integer sizes, is a reason too. A checkpoint written
    before the list existed has none to check (None). Sizes only: nothing is hashed, so a file of the right size
    with other bytes is found when it is read."""
    folder = Path(folder)
    try:
        files = json.loads((folder / "state.json").read_text(encoding="utf-8")).get(MANIFEST, {})
    except (OSError, ValueError, AttributeError) as err:
        return f"its state.json is unreadable ({error_cause(err)})"
    if not isinstance(files, dict) or not all(isinstance(n, str) and type(s) is int for n, s in files.items()):
        return f"its state.json's {MANIFEST!r} is not a mapping of file names to sizes in bytes"
    for name, size in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} of its {size} bytes (truncated?)"
    return None


def is_healthy(folder: str | Path) -> bool:
    """False for a checkpoint marked unhealthy (``"healthy": false`` in its ``health.json``) and for one whose
    files are not as they were written (:func:`incomplete`): a resume never picks either and neither counts
    towards the rotation's ``keep``."""
    return read_health(folder).get("healthy") is not False and incomplete(folder) is None


def checkpoint_folders(root: str | Path) -> list[Path]:
    """The complete checkpoint folders ``root/epoch_<N>`` (with ``state.json``), oldest epoch first."""
    found = [p for p in Path(root).glob("epoch_*") if p.is_dir() and p.name[6:].isdigit()
             and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[6:]))


def newest_healthy(root: str | Path, *, warn: bool = False) -> Path | None:
    """The checkpoint a resume of ``root`` continues from: the one ``latest`` names unless it is marked unhealthy,
    else the newest checkpoint not marked unhealthy; None when there is none. ``warn``: log that the one ``latest``
    names is passed over because its files are not as they were written (the load of a resume asks, so a
    resume says it once, not once per look)."""
    root = Path(root)
    name = latest_name(root) if root.is_dir() else None
    if name and (root / name / "state.json").is_file():
        if is_healthy(root / name):
            return root / name
        why = incomplete(root / name)
        if why is not None and warn:
            logger.warning("checkpoint %s is not as it was written (%s): a resume passes it over", root / name, why)
    healthy = [p for p in checkpoint_folders(root) if is_healthy(p)] if root.is_dir() else []
    return healthy[-1] if healthy else None


def best_checkpoint(folders: list[Path]) -> Path | None:
    """Of ``folders``, the healthy checkpoint with the highest evaluation figure in its ``health.json`` (the
    newest on a tie), or None when none was evaluated. Only figures of one metric are compared: that of the
    newest evaluated checkpoint."""
    rated = [(p, read_health(p).get("eval")) for p in folders if is_healthy(p)]
    rated = [(p, e) for p, e in rated if isinstance(e, dict) and isinstance(e.get("value"), int | float)]
    if not rated:
        return None
    metric = rated[-1][1].get("metric")
    same = [(p, float(e["value"])) for p, e in rated if e.get("metric") == metric]
    return max(reversed(same), key=lambda pe: pe[1])[0]


def rotation_victims(folders: list[Path], keep: int, written: Path) -> list[Path]:
    """The checkpoints of ``folders`` (oldest first) a save of ``written`` removes: all but the newest ``keep``
    not marked unhealthy, the best evaluated one (:func:`best_checkpoint`) and ``written`` itself. A checkpoint
    marked unhealthy never counts towards ``keep``, so it never pushes a healthy one out."""
    healthy = [p for p in folders if is_healthy(p)]
    kept = set(healthy[-keep:] if keep > 0 else healthy) | {Path(written)}
    best = best_checkpoint(folders)
    if best is not None:
        kept.add(best)
    return [p for p in folders if p not in kept]


def mark_unhealthy(root: str | Path, folder: str | Path, why: str) -> Path | None:
    """Mark checkpoint ``folder`` unhealthy (its ``health.json`` replaced atomically, ``healthy`` false and
    ``why``) and point ``root/latest`` at the newest healthy checkpoint, or remove ``latest`` when none is left
    (a resume then starts the run again). Main process only. Returns the checkpoint ``latest`` now names."""
    root, folder = Path(root), Path(folder)
    record = {**read_health(folder), "healthy": False, "why": why}
    tmp = folder / f".{HEALTH_FILE}.tmp"
    tmp.write_text(json.dumps(record))
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, folder / HEALTH_FILE)
    fsync_dir(folder)
    healthy = [p for p in checkpoint_folders(root) if is_healthy(p)]
    if healthy:
        point_latest(root, healthy[-1].name)
        return healthy[-1]
    (root / "latest").unlink(missing_ok=True)
    fsync_dir(root)
    return None


def resolve_checkpoint(path: str | Path, *, warn: bool = False) -> Path:
    """A checkpoint folder from a folder, or from a checkpoints root holding ``latest`` (``warn``: as
    :func:`newest_healthy`'s)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist (train.resume_from: a checkpoint folder such as "
                              "OUTPUT_DIR/checkpoints/epoch_N, N 0-based, or OUTPUT_DIR/checkpoints for the latest)")
    if (p / "latest").is_file():
        p = newest_healthy(p, warn=warn) or p / (p / "latest").read_text().strip()
    if not (p / "state.json").is_file():
        raise CheckpointError(f"{str(p)!r} is not a complete checkpoint (no state.json)")
    why = incomplete(p)
    if why is not None:
        other = newest_healthy(p.parent)
        raise CheckpointError(f"checkpoint {str(p)!r} is not as it was written: {why}; resume from "
                              f"{'an intact one, ' + str(other) if other else 'the start'}")
    if not is_healthy(p):
        other = newest_healthy(p.parent)
        raise CheckpointError(f"checkpoint {str(p)!r} is marked unhealthy ({read_health(p).get('why', 'no reason')}"
                              f"); resume from {'a healthy one, ' + str(other) if other else 'the start'}")
    return p
