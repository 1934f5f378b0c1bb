"""Checkpoints: everything needed to resume a run bit for bit, written atomically.

A checkpoint is a folder ``<output_dir>/checkpoints/epoch_<N>``. Its tensors come in one of two forms, chosen by
the layout of the trained weights:

**Sharded** (the trained parameters are DTensors: ``parallel.sharding=fsdp2``, on any process count, one
included). Every process writes and reads only its own shards, so no process ever holds a whole tensor:

* ``sharded/``: torch's distributed checkpoint (``torch.distributed.checkpoint``, DCP): one file per process,
  ``__<rank>_0.distcp``, with that process's shards of the trained parameters (``model.<name>``), of the
  optimizer's moments and step counts (``optim.<name>.<key>``), of the EMA (``ema.ema.<i>``) and of the
  objective's own state (``objective.<key>``), and ``.metadata`` naming each tensor's whole shape and which file
  holds which part (written by the main process). Loading reshards: a run with another process count or layout
  reads the parts of the files it needs, in place into its own shards; an unsharded run (one process, or DDP)
  reads them into whole tensors. ``.metadata`` is a pickle: it is read by an unpickler that admits only DCP's
  own metadata classes (and torch's sizes and dtypes), so, as below, a checkpoint never runs code;
* ``optimizer_groups.json``: the optimizer's parameter groups (settings and parameter names).

**Whole** (every other run: one process, or DDP over several), each tensor whole, the main process writes:

* ``trainable.safetensors``: the trained parameters (LoRA or the whole transformer), by parameter name;
* ``ema.safetensors``: the EMA shadow weights (when EMA is on);
* ``objective.safetensors``: the objective's own state (when it keeps any: the old copy of the weights of the
  forward-process objectives);
* ``optimizer.pt``: optimizer state keyed by parameter name, loaded with ``weights_only=True`` (tensors and
  plain containers only: a pickled object is refused).

Both hold ``rng.pt`` (the torch RNG state, ``weights_only=True``) and ``state.json`` (epoch, LR-scheduler and
prompt-sampler state, and ``files``: every other file's size in bytes, so a file truncated or lost after the write —
a full disk, a cut copy — is found before a resume picks the checkpoint:
:func:`~flowgrpo.checkpoints.health.incomplete`). Either form loads into either kind of run (a run resumes with
another process count or sharding); a sharded run loading a whole checkpoint (one written before the sharded form
existed, or by an unsharded run) has the main process alone read the files and send each process its shards, one
tensor at a time (:mod:`flowgrpo.checkpoints.state_dicts`). Saving and loading are collectives: every process calls
them. The sharded form needs a file system every process sees (as a multi-node run's output folder is).

The folder is written under a temporary name, made durable (every file fsynced, the sharded ones by the process
that wrote them and again by the main process) and renamed into place by the main process, and ``latest`` (a text
file naming the folder) is replaced atomically after it: a crash mid-write leaves the previous checkpoint intact
and ``latest`` pointing at it. Re-saving an existing epoch (a resumed run) replaces it without a moment in which
``latest`` names a missing or incomplete folder (:func:`publish_checkpoint`), and a checkpoint is removed (the
``keep`` rotation) by renaming it to a hidden name before deleting it, so no half-deleted folder keeps a
checkpoint's name.

Which checkpoints a save keeps and a resume picks (health, the file-size check, ``latest``, the rotation) is
:mod:`flowgrpo.checkpoints.health`."""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowgrpo.checkpoints.health import (
    HEALTH_FILE,
    MANIFEST,
    CheckpointError,
    checkpoint_folders,
    error_cause,
    fsync_dir,
    latest_name,
    point_latest,
    resolve_checkpoint,
    rotation_victims,
)
from flowgrpo.checkpoints.state_dicts import (
    full_tensor,
    is_sharded,
    load_optimizer_state,
    load_sharded_optimizer_state,
    load_sharded_trainable_state,
    load_trainable_state,
    optimizer_state,
    optimizer_target,
    scatter_from_rank0,
    sharded_optimizer_state,
    sharded_trainable_state,
    trainable_names,
    trainable_state,
)
from flowgrpo.distributed import dist
from flowgrpo.strategies.settings import flat_dict
from flowgrpo.writing.outputs import save_tensors

#: the folder of a sharded checkpoint's tensors (torch's distributed checkpoint) and its optimizer groups' file
SHARDED = "sharded"
GROUPS = "optimizer_groups.json"


def save_checkpoint(root: str | Path, epoch: int, *, model: torch.nn.Module, optimizer, lr_scheduler, sampler,
                    ema=None, keep: int = 2, objective=None, health: dict | None = None) -> Path:
    """Write ``root/epoch_<epoch>`` atomically and point ``root/latest`` at it; keep the newest ``keep`` healthy
    ones and the best evaluated one (:func:`~flowgrpo.checkpoints.health.rotation_victims`).
    ``objective``: the run's objective, whose ``state_dict()`` (empty: none) is saved.
    ``health``: the health record written as the folder's ``health.json``
    (:func:`~flowgrpo.checkpoints.health.health_record`).

    Every process calls it. A sharded model (DTensor parameters): each process writes its own shards into the
    temporary folder, then the main process writes the rest and publishes it. Otherwise the main process writes
    whole tensors (gathered from DDP's identical copies: nothing to gather), and the others wait until it has."""
    root = Path(root)
    final = root / f"epoch_{epoch}"
    sharded = is_sharded(model)
    if sharded:
        tmp = root / f".epoch_{epoch}.tmp"
        if dist.rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        groups = _save_shards(tmp / SHARDED, model, optimizer, ema, objective)
        parts = functools.partial(_write_groups, groups=groups)
    else:
        parts = functools.partial(
            _write_whole, weights=trainable_state(model), opt_state=optimizer_state(model, optimizer),
            ema_state=ema.state_dict() if ema is not None else None,
            objective_state=objective.state_dict() if objective is not None else {})
    if dist.rank() == 0:
        _write(root, epoch, parts, lr_scheduler, sampler, keep, fresh=not sharded, health=health)
    dist.barrier()
    return final


def _save_shards(folder: Path, model, optimizer, ema, objective) -> list[dict]:
    """Every process writes its shards of the trained parameters, optimizer state, EMA and objective state into
    ``folder`` (torch's distributed checkpoint; the main process also writes ``.metadata``); returns the
    optimizer's parameter groups (plain data, for :func:`_write_groups`). A collective."""
    import torch.distributed.checkpoint as dcp

    opt_state, groups = sharded_optimizer_state(model, optimizer)
    state = {"model": sharded_trainable_state(model)}
    if opt_state:  # an optimizer that has not stepped has only its groups
        state["optim"] = opt_state
    if ema is not None:
        state["ema"] = ema.state_dict()
    extra = objective.state_dict() if objective is not None else {}
    if extra:
        state["objective"] = extra
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
    return groups


def _write_groups(tmp: Path, *, groups: list[dict]) -> None:
    """The optimizer's parameter groups of a sharded checkpoint, as JSON."""
    (tmp / GROUPS).write_text(json.dumps(groups))


def _write_whole(tmp: Path, *, weights: dict, opt_state: dict, ema_state: dict | None,
                 objective_state: dict | None) -> None:
    """The whole-tensor files of an unsharded run's checkpoint."""
    save_tensors(weights, tmp / "trainable.safetensors")
    if ema_state is not None:
        save_tensors({k: full_tensor(v).cpu().contiguous() for k, v in ema_state.items()}, tmp / "ema.safetensors")
    if objective_state:
        save_tensors({k: full_tensor(v).cpu().contiguous() for k, v in objective_state.items()},
                  tmp / "objective.safetensors")
    torch.save(opt_state, tmp / "optimizer.pt")


def _write(root: Path, epoch: int, parts, lr_scheduler, sampler, keep: int, *, fresh: bool = True,
           health: dict | None = None) -> None:
    """Write the checkpoint's files into a temporary folder (made here when ``fresh``; a sharded save's processes
    have already written theirs into it), with ``parts(tmp)`` writing the tensors, make it durable and publish
    it; then rotate to the newest ``keep``. Main process only."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"epoch_{epoch}"
    tmp = root / f".epoch_{epoch}.tmp"
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    parts(tmp)
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    state = {"epoch": epoch, "lr_scheduler": lr_scheduler.state_dict(), "sampler": sampler.state_dict(),
             MANIFEST: {f.relative_to(tmp).as_posix(): f.stat().st_size for f in sorted(tmp.rglob("*"))
                        if f.is_file()}}
    (tmp / "state.json").write_text(json.dumps(state))
    if health is not None:
        (tmp / HEALTH_FILE).write_text(json.dumps(health))
    for f in sorted(f for f in tmp.rglob("*") if f.is_file()):  # make the bytes durable before the rename
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    for sub in (d for d in tmp.rglob("*") if d.is_dir()):
        fsync_dir(sub)
    publish_checkpoint(root, tmp, final)
    for old in rotation_victims(checkpoint_folders(root), keep, final):
        _remove(old)


def _remove(folder: Path) -> None:
    """Delete ``folder`` by renaming it to a hidden name first (atomic), so no half-deleted checkpoint ever shows
    under its own name; a leftover hidden folder is deleted by the next save."""
    gone = folder.parent / f".{folder.name}.removing"
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _clone(src: Path, dst: Path) -> None:
    """``dst``: a complete copy of checkpoint folder ``src`` by hard links (no bytes copied; a copy where the file
    system has none), its sub-folders (a sharded checkpoint's ``sharded/``) first and ``state.json`` last, so it
    is complete once that exists."""
    dst.mkdir()
    for sub in sorted(d for d in src.iterdir() if d.is_dir()):
        shutil.copytree(sub, dst / sub.name, copy_function=_link)
    files = sorted((f for f in src.iterdir() if f.is_file()), key=lambda f: f.name == "state.json")
    for f in files:
        _link(f, dst / f.name)


def _link(src, dst) -> None:
    """``dst`` a hard link to file ``src``, or a copy where the file system has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
        if aside.exists() and latest_name(root) != aside.name:
            shutil.rmtree(aside)
        if not aside.exists():
            _clone(final, aside)
        if latest_name(root) == final.name:
            point_latest(root, aside.name)
        _remove(final)
    os.replace(tmp, final)
    fsync_dir(root)
    point_latest(root, final.name)
    for old in root.glob(".epoch_*.old"):  # this one's clone, and any an earlier crash left
        shutil.rmtree(old, ignore_errors=True)


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


def read_checkpoint_state(path: str | Path) -> dict:
    """The ``state.json`` of the checkpoint ``path`` names (a folder or its ``checkpoints/``: the newest healthy
    one), read without any tensor: ``epoch``, ``lr_scheduler``, ``sampler`` (what a resume's preflight compares
    before the model loads). Raises :class:`CheckpointError` as :func:`load_checkpoint`."""
    return _read(resolve_checkpoint(path) / "state.json", _read_state)


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
            f"something else or is corrupt ({error_cause(err)})"
        ) from err
    except Exception as err:  # noqa: BLE001 - safetensors, torch, json and the OS each raise their own types
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is corrupt or unreadable ({error_cause(err)}); was it truncated (full "
            "disk, interrupted copy)? Resume from another checkpoint"
        ) from err


def _load_objective(p: Path, objective) -> None:
    """Hand ``objective`` the state of ``p/objective.safetensors`` (a whole checkpoint). Raises
    :class:`CheckpointError` when the objective keeps state (``state_dict()`` non-empty) and the file is missing,
    or the file's state does not fit the objective (another objective's, or another model's). Under a sharded
    model the main process alone reads the file and sends each process its shards."""
    if objective is None:
        return
    f = p / "objective.safetensors"
    held = objective.state_dict()
    if not f.is_file():
        if held:
            _no_objective_state(p, objective)
        return
    def unfit(err) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(p)!r}: objective.safetensors does not fit objective "
                               f"{_objective_name(objective)!r} ({err})")

    if any(_is_dtensor(v) for v in held.values()):  # the main process reads and checks, each process gets its shards
        def read_checked() -> dict:
            whole = _read(f, load_file)
            if {k: tuple(v.shape) for k, v in whole.items()} != {k: tuple(v.shape) for k, v in held.items()}:
                raise unfit(f"the checkpoint holds {sorted(whole)[:3]}, the objective keeps {sorted(held)[:3]} "
                            "(or their shapes differ)")
            return whole

        whole = _on_main(read_checked)
        state = {k: scatter_from_rank0(whole[k] if whole is not None else None, held[k]) for k in sorted(held)}
    else:
        state = _read(f, load_file)
    try:
        objective.load_state_dict(state)
    except ValueError as err:
        raise unfit(err) from err


def _objective_name(objective) -> str:
    return objective.cfg.objective.name if hasattr(objective, "cfg") else type(objective).__name__


def _no_objective_state(p: Path, objective) -> None:
    name = _objective_name(objective)
    raise CheckpointError(f"checkpoint {str(p)!r} has no objective state (objective.safetensors), but "
                          f"objective {name!r} keeps some (the old copy of the weights); resume from a "
                          f"checkpoint of a {name!r} run")


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _on_main(read):
    """``read()`` on the main process alone (a whole checkpoint's file under a sharded model), its
    :class:`CheckpointError` raised on every process; returns its value on the main process, None elsewhere."""
    value, error = None, None
    if dist.rank() == 0:
        try:
            value = read()
        except CheckpointError as err:
            error = str(err)
    error = dist.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    return value


# the classes a DCP ``.metadata`` pickle may name: DCP's own metadata records, torch's sizes, dtypes and layouts,
# and the path the checkpoint was written to
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file admitting only classes of :data:`_METADATA_MODULES`, ``torch.Size``,
    torch's dtypes and layouts and ``pathlib`` paths: anything else is a ``pickle.UnpicklingError``."""

    def find_class(self, module: str, name: str):
        import importlib

        obj = getattr(importlib.import_module(module), name, None) if module.split(".")[0] in (
            "torch", "pathlib") else None
        allowed = (
            (module in _METADATA_MODULES and isinstance(obj, type))
            or (module == "torch" and (obj is torch.Size or isinstance(obj, torch.dtype | torch.layout)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is forbidden")
        return obj


def _read_metadata(path: Path):
    """A DCP ``.metadata`` file through :class:`_MetadataUnpickler`; raises ``ValueError`` when it is not DCP
    metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    with path.open("rb") as fh:
        meta = _MetadataUnpickler(fh).load()
    if not isinstance(meta, Metadata):
        raise ValueError(f"not DCP metadata but a {type(meta).__name__}")
    return meta


def _reader(folder: Path, meta):
    """A ``FileSystemReader`` of ``folder`` that hands DCP the checked ``meta`` (never unpickling the file again)
    and refuses pickled (non-tensor) entries."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return Reader(folder)


def _dcp_load(target: dict, folder: Path, meta, *, no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` of ``folder`` into ``target`` (in place), its failure (a
    ``CheckpointException``, which is no ``Exception``: it gathers every process's) raised as a ``RuntimeError``
    naming the first failing process and its error, for :func:`_read` to report."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(target, storage_reader=_reader(folder, meta), no_dist=no_dist)
    except CheckpointException as err:
        rank, (cause, _) = sorted(err.failures.items())[0]
        raise RuntimeError(f"process {rank}: {error_cause(cause)}") from None


def _load_sharded(p: Path, *, model, optimizer, ema, objective) -> None:
    """Load the tensors of sharded checkpoint ``p`` (``p/sharded``, ``p/optimizer_groups.json``) into the
    model's trained parameters, the optimizer, the EMA and the objective, every process reading the parts of
    the files its own shards need (the whole tensors, for an unsharded model). A collective.

    Raises:
        CheckpointError: as :func:`load_checkpoint`: a missing file, names or shapes that do not match the model,
            the EMA or the objective, a forbidden global in the metadata, or a corrupt file (naming it).
    """
    folder = p / SHARDED
    meta = _read(folder / ".metadata", _read_metadata)
    for info in {i.relative_path for i in meta.storage_data.values()}:
        if not (folder / info).is_file():
            raise CheckpointError(f"checkpoint {str(p)!r} is incomplete: {SHARDED}/{info} is missing")
    stored = meta.state_dict_metadata
    groups = _read(p / GROUPS, lambda f: json.loads(f.read_text(encoding="utf-8")))
    _check_sharded_model(p, _section(stored, "model"), model)
    target = _sharded_target(p, stored, model=model, optimizer=optimizer, ema=ema, objective=objective)
    _check_stored_tensors(p, stored, target)
    _read(folder, lambda f: _dcp_load(target, f, meta, no_dist=not dist.is_distributed()))
    load_sharded_trainable_state(model, target["model"])
    try:
        load_sharded_optimizer_state(model, optimizer, target.get("optim", {}), groups)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(p)!r}: {GROUPS} does not match the model ({error_cause(err)})") from err
    if ema is not None:
        ema.load_state_dict(target["ema"])
    if "objective" in target:
        objective.load_state_dict(target["objective"])


def _section(stored: dict, prefix: str) -> dict:
    """The entries of the sharded metadata ``stored`` (flat key → storage metadata) under ``prefix.``, keyed
    without it."""
    return {k[len(prefix) + 1:]: v for k, v in stored.items() if k.startswith(prefix + ".")}


def _check_sharded_model(p: Path, weights: dict, model) -> None:
    """Check that the checkpoint's ``model`` section ``weights`` (name → storage metadata) holds exactly the
    model's trained parameters with their whole shapes.

    Raises:
        CheckpointError: unknown or missing names (the first three of each), or the first shape that differs, in
            the model's parameter order.
    """
    names, params = trainable_names(model), dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    missing = sorted(k for k in names if k not in weights)
    if unknown or missing:
        raise CheckpointError(f"checkpoint {str(p)!r} does not match the model: unknown {unknown[:3]}, "
                              f"missing {missing[:3]}")
    for k in names:  # in the model's parameter order: the first mismatch
        _check_shape(p, k, tuple(weights[k].size), tuple(params[k].shape))


def _sharded_target(p: Path, stored: dict, *, model, optimizer, ema, objective) -> dict:
    """The nested state dict that ``torch.distributed.checkpoint.load`` fills in place: ``model`` (this process's
    shards), ``optim`` when the checkpoint holds optimizer state, ``ema`` when the run uses EMA and ``objective``
    when the objective keeps state.

    Raises:
        CheckpointError: a run with EMA and a checkpoint without, or objective state that does not fit
            ``objective``.
    """
    target = {"model": sharded_trainable_state(model)}
    if _section(stored, "optim"):
        target["optim"] = optimizer_target(model, optimizer)
    if ema is not None:
        if not _section(stored, "ema"):
            raise CheckpointError(f"checkpoint {str(p)!r} has no EMA weights but this run uses EMA")
        target["ema"] = ema.state_dict()
    if objective is not None:
        held, extra = objective.state_dict(), _section(stored, "objective")
        if held and not extra:
            _no_objective_state(p, objective)
        if sorted(extra) != sorted(held):
            raise CheckpointError(f"checkpoint {str(p)!r}: its objective state does not fit objective "
                                  f"{_objective_name(objective)!r} (the checkpoint holds {sorted(extra)[:3]}, the "
                                  f"objective keeps {sorted(held)[:3]})")
        if held:
            target["objective"] = held
    return target


def _check_stored_tensors(p: Path, stored: dict, target: dict) -> None:
    """Check that every tensor of ``target`` is a tensor of that shape in the sharded metadata ``stored``.

    Raises:
        CheckpointError: the first key that is missing, not a tensor, or of another shape.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, t in flat_dict(target).items():
        info = stored.get(key)
        if not isinstance(info, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {str(p)!r} does not match this run: {key!r} is "
                                  f"{'missing' if info is None else 'not a tensor'} in {SHARDED}/.metadata")
        if tuple(info.size) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {str(p)!r} does not match this run: {key!r} has shape "
                                  f"{tuple(info.size)} in the checkpoint but {tuple(t.shape)} here")


def whole_tensors(path: str | Path) -> dict[str, dict]:
    """Every tensor of a checkpoint (sharded or whole), whole, in this process's host memory, by part:
    ``trainable`` {name: tensor}, ``ema`` {``ema.<i>``: tensor}, ``objective`` {key: tensor} (empty dicts when
    absent) and ``optimizer`` {``state``: {name: {key: tensor}}}. For inspecting a checkpoint in one process (it
    holds the whole state: not for a large model's training processes); no process group is needed.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, for a missing, corrupt or refused file.
    """
    p = resolve_checkpoint(path)
    if not (p / SHARDED).is_dir():
        out = {"trainable": _read(p / "trainable.safetensors", load_file),
               "optimizer": _read(p / "optimizer.pt", _torch_load)}
        for part in ("ema", "objective"):
            f = p / f"{part}.safetensors"
            out[part] = _read(f, load_file) if f.is_file() else {}
        return out
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = p / SHARDED
    meta = _read(folder / ".metadata", _read_metadata)
    target = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    _read(folder, lambda f: _dcp_load(target, f, meta, no_dist=True))
    out = {"trainable": {}, "ema": {}, "objective": {}, "optimizer": {"state": {}}}
    for key, t in target.items():
        part, _, rest = key.partition(".")
        if part == "optim":
            name, _, slot = rest.rpartition(".")
            out["optimizer"]["state"].setdefault(name, {})[slot] = t
        else:
            out[{"model": "trainable"}.get(part, part)][rest] = t
    return out


def _check_shape(p: Path, k: str, stored: tuple, model: tuple) -> None:
    if stored != model:
        raise CheckpointError(
            f"checkpoint {str(p)!r} does not match the model: parameter {k!r} has shape {stored} in "
            f"the checkpoint but {model} in the model (was it written with other model "
            "settings, e.g. model.lora_rank or model.finetune?)"
        )


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer, lr_scheduler, sampler,
                    ema=None, objective=None) -> int:
    """Restore every part from a checkpoint, sharded or whole (module docstring); returns the epoch it was
    written after. Every process calls it. A sharded checkpoint: each process reads the parts its shards need. A
    whole one: an unsharded model's processes each read the files; a sharded model's main process alone reads them
    and sends each process its shards. ``objective``: the run's objective, given back its state
    (:func:`_load_objective`).

    Raises:
        CheckpointError: incomplete folder, parameter names or shapes that do not match the model (naming the
            first mismatched parameter and both shapes), a non-tensor pickle, or a file that is corrupt or
            unreadable (naming it; every file is read through :func:`_read`).
        ValueError: the prompt sampler's state does not match this run (``GroupSampler.load_state_dict``).
    """
    p = resolve_checkpoint(path, warn=True)
    if (p / SHARDED).is_dir():
        _load_sharded(p, model=model, optimizer=optimizer, ema=ema, objective=objective)
    else:
        _load_whole(p, model=model, optimizer=optimizer, ema=ema, objective=objective)
    torch.set_rng_state(_read(p / "rng.pt", lambda f: _torch_load(f)["torch"]))
    state = _read(p / "state.json", _read_state)
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    sampler.load_state_dict(state["sampler"])
    return int(state["epoch"])


def _load_whole(p: Path, *, model, optimizer, ema, objective) -> None:
    """The tensors of whole checkpoint ``p`` (``trainable.safetensors``, ``optimizer.pt``, ``ema.safetensors``,
    ``objective.safetensors``) into the model, optimizer, EMA and objective; under a sharded model the main
    process alone reads the files (:func:`_on_main`) and each process receives its shards."""
    from_rank0 = is_sharded(model) and dist.world_size() > 1
    _load_objective(p, objective)
    params = dict(model.named_parameters())

    def weights_checked() -> dict:
        weights = _read(p / "trainable.safetensors", load_file)
        unknown = sorted(set(weights) - set(params))
        missing = sorted(k for k, v in params.items() if v.requires_grad and k not in weights)
        if unknown or missing:
            raise CheckpointError(f"checkpoint {str(p)!r} does not match the model: unknown {unknown[:3]}, "
                                  f"missing {missing[:3]}")
        for k in (k for k in params if k in weights):  # in the model's parameter order: the first mismatch
            _check_shape(p, k, tuple(weights[k].shape), tuple(params[k].shape))
        return weights

    if from_rank0:
        load_trainable_state(model, _on_main(weights_checked), from_rank0=True)
    else:
        load_trainable_state(model, weights_checked())
    try:
        opt_state = (_on_main if from_rank0 else _call)(lambda: _read(p / "optimizer.pt", _torch_load))
        load_optimizer_state(model, optimizer, opt_state, from_rank0=from_rank0)
    except (ValueError, KeyError) as err:
        raise CheckpointError(
            f"checkpoint {str(p)!r}: optimizer.pt does not match the model ({error_cause(err)})") from err
    if ema is not None:
        if not (p / "ema.safetensors").is_file():
            raise CheckpointError(f"checkpoint {str(p)!r} has no EMA weights but this run uses EMA")
        if from_rank0:
            whole = _on_main(lambda: _read(p / "ema.safetensors", load_file))
            held = ema.state_dict()
            shapes = dist.broadcast_object({k: tuple(v.shape) for k, v in whole.items()} if whole is not None else None)
            if shapes != {k: tuple(v.shape) for k, v in held.items()}:
                raise CheckpointError(f"checkpoint {str(p)!r}: ema.safetensors holds other tensors than this "
                                      f"run's EMA ({len(held)} tensors of the trained parameters' shapes)")
            ema.load_state_dict({k: scatter_from_rank0(whole[k] if whole is not None else None, held[k])
                                 for k in sorted(held)})
        else:
            ema.load_state_dict(_read(p / "ema.safetensors", load_file))


def _call(read):
    return read()
