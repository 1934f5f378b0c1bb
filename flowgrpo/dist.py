"""Every collective in one place, each with a single-process fallback so CPU tests cover the callers."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def world_size() -> int:
    return torch_dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return torch_dist.get_rank() if is_distributed() else 0


def is_main_process() -> bool:
    return rank() == 0


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from all ranks along dim 0 (rank order); identity on one process."""
    if not is_distributed():
        return t
    parts = [torch.empty_like(t) for _ in range(world_size())]
    torch_dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a new tensor); identity on one process."""
    if not is_distributed():
        return t
    out = t.clone()
    torch_dist.all_reduce(out)
    return out


def local_slice(total: int) -> slice:
    """This rank's contiguous share of ``total`` items (``total`` must divide evenly)."""
    n = world_size()
    if total % n:
        raise ValueError(f"{total} items cannot be split evenly over {n} processes")
    per = total // n
    return slice(rank() * per, (rank() + 1) * per)
