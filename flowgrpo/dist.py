"""Every collective in one place, each with a single-process fallback so CPU tests cover the callers.

Callers pass tensors on any device and get results on that device. Inside, each collective runs on the device its
backend needs (:func:`backend_device`): NCCL only takes CUDA tensors (a CPU tensor raises "No backend type
associated with device type cpu"), gloo and MPI take CPU tensors. This module is the one place that converts.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

# the device type each process-group backend reduces on (a backend string such as "cpu:gloo,cuda:nccl" takes both)
_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cpu", "xccl": "xpu", "hccl": "npu"}


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def world_size() -> int:
    return torch_dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return torch_dist.get_rank() if is_distributed() else 0


def backend_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` must be on to reach the default process group's collectives: its own device when the
    backend takes it, else the backend's device (CUDA: this process's current device).

    Raises:
        ValueError: a backend this module does not know, naming it.
    """
    backend = str(torch_dist.get_backend())
    types = set()
    for part in backend.split(","):
        dev, _, name = part.rpartition(":")
        if dev:
            types.add(dev)
        elif name in _BACKEND_DEVICE:
            types.add(_BACKEND_DEVICE[name])
        else:
            raise ValueError(f"unknown process-group backend {name!r}; known: {sorted(_BACKEND_DEVICE)}")
    if t.device.type in types:
        return t.device
    kind = "cuda" if "cuda" in types else sorted(types)[0]
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _on_backend(t: torch.Tensor) -> torch.Tensor:
    return t.to(backend_device(t)).contiguous()


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from all ranks along dim 0 (rank order), on ``t``'s device; identity on
    one process."""
    if not is_distributed():
        return t
    x = _on_backend(t)
    parts = [torch.empty_like(x) for _ in range(world_size())]
    torch_dist.all_gather(parts, x)
    return torch.cat(parts).to(t.device)


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if not is_distributed():
        return t
    out = _on_backend(t).clone()
    torch_dist.all_reduce(out, op=op)
    return out.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a new tensor on ``t``'s device); identity on one process."""
    return _all_reduce(t, torch_dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks (a new tensor on ``t``'s device); identity on one process."""
    return _all_reduce(t, torch_dist.ReduceOp.MAX)


def broadcast_from_main(t: torch.Tensor) -> torch.Tensor:
    """The main process's ``t`` on every process (a new tensor on ``t``'s device); ``t`` on one process."""
    if not is_distributed():
        return t
    out = _on_backend(t).clone()
    torch_dist.broadcast(out, src=0)
    return out.to(t.device)


def broadcast_object(obj):
    """The main process's (global rank 0) ``obj`` on every process (a picklable object of plain data: an error
    message, names and dtypes, an optimizer's parameter groups); ``obj`` itself on one process."""
    if not is_distributed():
        return obj
    box = [obj if rank() == 0 else None]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait until every rank arrives (after the main process has written a shared file); no-op on one process."""
    if is_distributed():
        torch_dist.barrier()


_OWN_GROUP = False  # whether this module made the process group (one process, for torch's sharding)


def ensure_process_group(device: torch.device) -> None:
    """A default process group for torch's sharding: the launcher's (torchrun, accelerate) when there is one, else
    a one-process group in memory (``HashStore``; NCCL for a CUDA device with gloo for CPU tensors, such as the
    shards of ``parallel.offload=cpu``; gloo otherwise), so that a sharded model runs the same code on one process
    as on many."""
    global _OWN_GROUP
    if is_distributed():
        return
    backend = "cuda:nccl,cpu:gloo" if torch.device(device).type == "cuda" else "gloo"
    torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1)
    _OWN_GROUP = True


def release_own_group() -> None:
    """Destroy the one-process group :func:`ensure_process_group` made (a launcher's group is left alone)."""
    global _OWN_GROUP
    if _OWN_GROUP and is_distributed():
        torch_dist.destroy_process_group()
    _OWN_GROUP = False


def local_slice(total: int) -> slice:
    """This rank's contiguous share of ``total`` items (``total`` must divide evenly)."""
    n = world_size()
    if total % n:
        raise ValueError(f"{total} items cannot be split evenly over {n} processes")
    per = total // n
    return slice(rank() * per, (rank() + 1) * per)
