"""Checkpoints: everything needed to resume a run bit for bit, written atomically.

A checkpoint is a folder ``<output_dir>/checkpoints/epoch_<N>`` holding

* ``trainable.safetensors``: the trained parameters (LoRA or the whole transformer), by parameter name;
* ``ema.safetensors``: the EMA shadow weights (when EMA is on);
* ``optimizer.pt``, ``rng.pt``: optimizer state and the torch RNG state, loaded with ``weights_only=True``
  (tensors and plain containers only: a pickled object is refused);
* ``state.json``: epoch, LR-scheduler and prompt-sampler state.

The folder is written under a temporary name and renamed into place, and ``latest`` (a text file naming the
folder) is replaced atomically after it: a crash mid-write leaves the previous checkpoint intact and ``latest``
pointing at it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or holds something other than tensors and plain data."""


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(root: str | Path, epoch: int, *, model: torch.nn.Module, optimizer, lr_scheduler, sampler,
                    ema=None, keep: int = 2) -> Path:
    """Write ``root/epoch_<epoch>`` atomically and point ``root/latest`` at it; keep the newest ``keep``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"epoch_{epoch}"
    tmp = root / f".epoch_{epoch}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_trainable_state(model), tmp / "trainable.safetensors")
    if ema is not None:
        save_file({k: v.contiguous() for k, v in ema.state_dict().items()}, tmp / "ema.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    state = {"epoch": epoch, "lr_scheduler": lr_scheduler.state_dict(), "sampler": sampler.state_dict()}
    (tmp / "state.json").write_text(json.dumps(state))
    for f in tmp.iterdir():  # make the bytes durable before the rename publishes them
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    done = sorted((p for p in root.glob("epoch_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a folder, or from a checkpoints root holding ``latest``."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist (train.resume_from: a checkpoint folder such as "
                              "OUTPUT_DIR/checkpoints/epoch_N, N 0-based, or OUTPUT_DIR/checkpoints for the latest)")
    if (p / "latest").is_file():
        p = p / (p / "latest").read_text().strip()
    if not (p / "state.json").is_file():
        raise CheckpointError(f"{str(p)!r} is not a complete checkpoint (no state.json)")
    return p


def _safe_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any refusal is reported the same way
        raise CheckpointError(
            f"refusing {str(path)!r}: checkpoints may hold only tensors and plain data ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from err


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer, lr_scheduler, sampler,
                    ema=None) -> int:
    """Restore every part from a checkpoint; returns the epoch it was written after.

    Raises:
        CheckpointError: incomplete folder, parameter names or shapes that do not match the model (naming the
            first mismatched parameter and both shapes), or a non-tensor pickle.
    """
    p = resolve_checkpoint(path)
    weights = load_file(p / "trainable.safetensors")
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
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)
    optimizer.load_state_dict(_safe_load(p / "optimizer.pt"))
    torch.set_rng_state(_safe_load(p / "rng.pt")["torch"])
    if ema is not None:
        if not (p / "ema.safetensors").is_file():
            raise CheckpointError(f"checkpoint {str(p)!r} has no EMA weights but this run uses EMA")
        ema.load_state_dict(load_file(p / "ema.safetensors"))
    state = json.loads((p / "state.json").read_text())
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    sampler.load_state_dict(state["sampler"])
    return int(state["epoch"])
