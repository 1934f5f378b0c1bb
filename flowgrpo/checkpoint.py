"""Checkpoints: everything needed to resume a run bit for bit, written atomically.

A checkpoint is a folder ``<output_dir>/checkpoints/epoch_<N>`` holding

* ``trainable.safetensors``: the trained parameters (LoRA or the whole transformer), by parameter name;
* ``ema.safetensors``: the EMA shadow weights (when EMA is on);
* ``objective.safetensors``: the objective's own state (when it keeps any: the old copy of the weights of the
  forward-process objectives);
* ``optimizer.pt``, ``rng.pt``: optimizer state (keyed by parameter name) and the torch RNG state, loaded with
  ``weights_only=True`` (tensors and plain containers only: a pickled object is refused);
* ``state.json``: epoch, LR-scheduler and prompt-sampler state.

Every tensor is whole, whatever the process count or sharding of the run that wrote it, so a run resumes with
another process count (:mod:`flowgrpo.state_dicts` gathers a sharded model's tensors and hands them back). Saving
and loading are collectives: every process calls them; the main process (global rank 0) alone writes.

The folder is written under a temporary name, made durable and renamed into place, and ``latest`` (a text file
naming the folder) is replaced atomically after it: a crash mid-write leaves the previous checkpoint intact and
``latest`` pointing at it. Re-saving an existing epoch (a resumed run) replaces it without a moment in which
``latest`` names a missing or incomplete folder (:func:`publish_checkpoint`), and a checkpoint is removed (the
``keep`` rotation) by renaming it to a hidden name before deleting it, so no half-deleted folder keeps a
checkpoint's name.

The trainer writes a checkpoint only from healthy weights (:mod:`flowgrpo.divergence`): every trained parameter
finite, the epoch's own update figures not flagged (a NaN or infinite figure, or a KL figure beyond both its
floor and 1000 times its largest earlier value) and the new weights' own figures sound (their norm's growth, a
probe forward); ``health.json`` records them. A diverging run stops instead, naming the figure and the epoch.
A checkpoint whose weights later make non-finite images is marked unhealthy (:func:`mark_unhealthy`); a resume
never picks one (:func:`newest_healthy`, :func:`resolve_checkpoint`), and the rotation keeps the newest ``keep``
checkpoints not marked unhealthy plus the best evaluated one (:func:`rotation_victims`), so a healthy checkpoint
is never rotated out by one that is not.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flowgrpo import dist
from flowgrpo.state_dicts import load_optimizer_state, load_trainable_state, optimizer_state, trainable_state


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or holds something other than tensors and plain data."""


def save_checkpoint(root: str | Path, epoch: int, *, model: torch.nn.Module, optimizer, lr_scheduler, sampler,
                    ema=None, keep: int = 2, objective=None, health: dict | None = None) -> Path:
    """Write ``root/epoch_<epoch>`` atomically and point ``root/latest`` at it; keep the newest ``keep`` healthy
    ones and the best evaluated one (:func:`rotation_victims`).
    ``objective``: the run's objective, whose ``state_dict()`` (whole tensors; empty: no file) is saved.
    ``health``: the health record written as the folder's ``health.json`` (:func:`health_record`).

    Every process calls it (a sharded model's tensors are gathered); the main process writes, and the others
    wait until it has."""
    root = Path(root)
    weights, opt_state = trainable_state(model), optimizer_state(model, optimizer)
    ema_state = ema.state_dict() if ema is not None else None
    extra = objective.state_dict() if objective is not None else {}
    final = root / f"epoch_{epoch}"
    if dist.rank() == 0:
        _write(root, epoch, weights, opt_state, ema_state, lr_scheduler, sampler, keep, extra, health)
    dist.barrier()
    return final


def _write(root: Path, epoch: int, weights: dict, opt_state: dict, ema_state: dict | None, lr_scheduler, sampler,
           keep: int, objective_state: dict | None = None, health: dict | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"epoch_{epoch}"
    tmp = root / f".epoch_{epoch}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(weights, tmp / "trainable.safetensors")
    if ema_state is not None:
        save_file({k: v.contiguous() for k, v in ema_state.items()}, tmp / "ema.safetensors")
    if objective_state:
        save_file({k: v.contiguous() for k, v in objective_state.items()}, tmp / "objective.safetensors")
    torch.save(opt_state, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    state = {"epoch": epoch, "lr_scheduler": lr_scheduler.state_dict(), "sampler": sampler.state_dict()}
    (tmp / "state.json").write_text(json.dumps(state))
    if health is not None:
        (tmp / HEALTH_FILE).write_text(json.dumps(health))
    for f in tmp.iterdir():  # make the bytes durable before the rename publishes them
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    publish_checkpoint(root, tmp, final)
    for old in rotation_victims(checkpoint_folders(root), keep, final):
        _remove(old)


def _latest_name(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def _point_latest(root: Path, name: str) -> None:
    """``root/latest`` names ``name``, replaced atomically (written beside it, then renamed over it)."""
    pointer = root / ".latest.tmp"
    pointer.write_text(name)
    with pointer.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(pointer, root / "latest")
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
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


def _remove(folder: Path) -> None:
    """Delete ``folder`` by renaming it to a hidden name first (atomic), so no half-deleted checkpoint ever shows
    under its own name; a leftover hidden folder is deleted by the next save."""
    gone = folder.parent / f".{folder.name}.removing"
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _clone(src: Path, dst: Path) -> None:
    """``dst``: a complete copy of checkpoint folder ``src`` by hard links (no bytes copied; a copy where the file
    system has none), ``state.json`` last, so it is complete once that exists."""
    dst.mkdir()
    files = sorted((f for f in src.iterdir() if f.is_file()), key=lambda f: f.name == "state.json")
    for f in files:
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def publish_checkpoint(root: str | Path, tmp: str | Path, final: str | Path) -> None:
    """Move the complete, durable checkpoint folder ``tmp`` to ``final`` (both in ``root``) and point
    ``root/latest`` at it, such that a crash between any two steps leaves ``latest`` naming a complete checkpoint
    (the old one or the new one) and no half-written or half-deleted folder under a checkpoint's name.

    A folder cannot be renamed over a non-empty one, so replacing an existing ``final`` (a resumed run re-saving an
    epoch) goes: clone ``final`` by hard links to ``.<name>.old``; point ``latest`` at the clone if it named
    ``final``; remove ``final``; rename ``tmp`` to ``final``; point ``latest`` at it; remove the clone. A clone left
    by an earlier crash is kept while ``latest`` names it, else rebuilt.
    """
    root, tmp, final = Path(root), Path(tmp), Path(final)
    for stale in root.glob(".*.removing"):  # deletions an earlier crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    aside = root / f".{final.name}.old"
    if final.exists():
        if aside.exists() and _latest_name(root) != aside.name:
            shutil.rmtree(aside)
        if not aside.exists():
            _clone(final, aside)
        if _latest_name(root) == final.name:
            _point_latest(root, aside.name)
        _remove(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _point_latest(root, final.name)
    for old in root.glob(".epoch_*.old"):  # this one's clone, and any an earlier crash left
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- health, rotation and the resume choice
HEALTH_FILE = "health.json"


def health_record(figures: dict[str, float], best_metric: str | None = None) -> dict:
    """What ``health.json`` holds for a checkpoint written from weights the trainer found healthy: ``healthy``
    true, the ``health/*`` figures that showed it (:class:`~flowgrpo.divergence.WeightHealth`) and, when the epoch
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


def is_healthy(folder: str | Path) -> bool:
    """False only for a checkpoint marked unhealthy (``"healthy": false`` in its ``health.json``)."""
    return read_health(folder).get("healthy") is not False


def checkpoint_folders(root: str | Path) -> list[Path]:
    """The complete checkpoint folders ``root/epoch_<N>`` (with ``state.json``), oldest epoch first."""
    found = [p for p in Path(root).glob("epoch_*") if p.is_dir() and p.name[6:].isdigit()
             and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[6:]))


def newest_healthy(root: str | Path) -> Path | None:
    """The checkpoint a resume of ``root`` continues from: the one ``latest`` names unless it is marked unhealthy,
    else the newest checkpoint not marked unhealthy; None when there is none."""
    root = Path(root)
    name = _latest_name(root) if root.is_dir() else None
    if name and (root / name / "state.json").is_file() and is_healthy(root / name):
        return root / name
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
    _fsync_dir(folder)
    healthy = [p for p in checkpoint_folders(root) if is_healthy(p)]
    if healthy:
        _point_latest(root, healthy[-1].name)
        return healthy[-1]
    (root / "latest").unlink(missing_ok=True)
    _fsync_dir(root)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a folder, or from a checkpoints root holding ``latest``."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist (train.resume_from: a checkpoint folder such as "
                              "OUTPUT_DIR/checkpoints/epoch_N, N 0-based, or OUTPUT_DIR/checkpoints for the latest)")
    if (p / "latest").is_file():
        p = newest_healthy(p) or p / (p / "latest").read_text().strip()
    if not (p / "state.json").is_file():
        raise CheckpointError(f"{str(p)!r} is not a complete checkpoint (no state.json)")
    if not is_healthy(p):
        other = newest_healthy(p.parent)
        raise CheckpointError(f"checkpoint {str(p)!r} is marked unhealthy ({read_health(p).get('why', 'no reason')}"
                              f"); resume from {'a healthy one, ' + str(other) if other else 'the start'}")
    return p


def _torch_load(path: Path):
    """``torch.load`` with ``weights_only=True``: tensors and plain containers only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_state(path: Path) -> dict:
    """``state.json`` as a dict holding ``epoch`` (an integer), ``lr_scheduler`` and ``sampler`` (dicts).

    Raises ``ValueError`` (JSON or shape) or ``UnicodeDecodeError``, which :func:`_read` reports as corruption."""
    state = json.loads(path.read_text(encoding="utf-8"))
    kinds = {"epoch": int, "lr_scheduler": dict, "sampler": dict}
    if not isinstance(state, dict) or not all(isinstance(state.get(k), t) for k, t in kinds.items()):
        raise ValueError("not a mapping with an integer 'epoch' and the 'lr_scheduler' and 'sampler' states")
    return state


def _read(path: Path, read):
    """``read(path)``, every failure to read a checkpoint file reported the same way.

    Raises:
        CheckpointError: the file is missing (an incomplete checkpoint), holds a pickled object or cannot be
            unpickled (``pickle.UnpicklingError`` from ``weights_only=True``), or is otherwise corrupt or unreadable
            (a truncated safetensors or torch file, bad JSON, an OS error); each names the file and the cause.
    """
    try:
        return read(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path.parent)!r} is incomplete: {path.name} is missing") from None
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing {str(path)!r}: checkpoints may hold only tensors and plain data, and this file holds "
            f"something else or is corrupt ({_cause(err)})"
        ) from err
    except Exception as err:  # noqa: BLE001 - safetensors, torch, json and the OS each raise their own types
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is corrupt or unreadable ({_cause(err)}); was it truncated (full disk, "
            "interrupted copy)? Resume from another checkpoint"
        ) from err


def _load_objective(p: Path, objective) -> None:
    """Hand ``objective`` the state of ``p/objective.safetensors``. Raises :class:`CheckpointError` when the
    objective keeps state (``state_dict()`` non-empty) and the file is missing, or the file's state does not fit
    the objective (another objective's, or another model's)."""
    if objective is None:
        return
    f = p / "objective.safetensors"
    name = objective.cfg.objective.name if hasattr(objective, "cfg") else type(objective).__name__
    if not f.is_file():
        if objective.state_dict():
            raise CheckpointError(f"checkpoint {str(p)!r} has no objective state (objective.safetensors), but "
                                  f"objective {name!r} keeps some (the old copy of the weights); resume from a "
                                  f"checkpoint of a {name!r} run")
        return
    try:
        objective.load_state_dict(_read(f, load_file))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(p)!r}: objective.safetensors does not fit objective {name!r} "
                              f"({err})") from err


def _cause(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer, lr_scheduler, sampler,
                    ema=None, objective=None) -> int:
    """Restore every part from a checkpoint; returns the epoch it was written after. Every process calls it and
    reads the files (a sharded model keeps its shard of each whole tensor). ``objective``: the run's objective,
    given back its ``objective.safetensors`` (:func:`_load_objective`).

    Raises:
        CheckpointError: incomplete folder, parameter names or shapes that do not match the model (naming the
            first mismatched parameter and both shapes), a non-tensor pickle, or a file that is corrupt or
            unreadable (naming it; every file is read through :func:`_read`).
        ValueError: the prompt sampler's state does not match this run (``GroupSampler.load_state_dict``).
    """
    p = resolve_checkpoint(path)
    _load_objective(p, objective)
    weights = _read(p / "trainable.safetensors", load_file)
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    missing = sorted(k for k, v in params.items() if v.requires_grad and k not in weights)
    if unknown or missing:
        raise CheckpointError(f"checkpoint {str(p)!r} does not match the model: unknown {unknown[:3]}, "
                              f"missing {missing[:3]}")
    for k in (k for k in params if k in weights):  # in the model's parameter order: the first mismatch
        v = weights[k]
        if tuple(v.shape) != tuple(params[k].shape):
            raise CheckpointError(
                f"checkpoint {str(p)!r} does not match the model: parameter {k!r} has shape {tuple(v.shape)} in "
                f"the checkpoint but {tuple(params[k].shape)} in the model (was it written with other model "
                "settings, e.g. model.lora_rank or model.finetune?)"
            )
    load_trainable_state(model, weights)
    try:
        load_optimizer_state(model, optimizer, _read(p / "optimizer.pt", _torch_load))
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {str(p)!r}: optimizer.pt does not match the model ({_cause(err)})") from err
    torch.set_rng_state(_read(p / "rng.pt", lambda f: _torch_load(f)["torch"]))
    if ema is not None:
        if not (p / "ema.safetensors").is_file():
            raise CheckpointError(f"checkpoint {str(p)!r} has no EMA weights but this run uses EMA")
        ema.load_state_dict(_read(p / "ema.safetensors", load_file))
    state = _read(p / "state.json", _read_state)
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    sampler.load_state_dict(state["sampler"])
    return int(state["epoch"])
