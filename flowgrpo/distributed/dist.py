"""Every collective in one place, each with a single-process fallback so CPU tests cover the callers.

Callers pass tensors on any device and get results on that device. Inside, each collective runs on the device its
backend needs (:func:`backend_device`): NCCL only takes CUDA tensors (a CPU tensor raises "No backend type
associated with device type cpu"), gloo and MPI take CPU tensors. This module is the one place that converts.

Data ranks. With context parallelism (``parallel.context_degree`` C > 1) the C consecutive global ranks
``d·C … d·C + C − 1`` form one context group (the innermost dimension of the device mesh, ``"context"``): they
split each transformer call's tokens and hold the same samples. The samples are split over the W / C data ranks
(:func:`data_rank`, :func:`data_world_size`, :func:`local_slice`, :func:`padded_share`), and :func:`gather_cat` and
:func:`all_reduce_sum` take each data rank's value once (a context group's C copies are equal); with C = 1 they
are the plain collectives over all ranks. :func:`rank` and :func:`world_size` stay global (the main process,
the gradient's mean over every rank that FSDP2 reduces over).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

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


_CONTEXT = 1  # the context-parallel degree C (set_context_degree)


def set_context_degree(degree: int) -> None:
    """Make the next collectives and splits treat each ``degree`` consecutive ranks as one data rank (module
    docstring); 1 restores plain data parallelism.

    Raises:
        ValueError: ``degree`` < 1, or a world size it does not divide (naming both).
    """
    global _CONTEXT
    if degree < 1 or world_size() % degree:
        raise ValueError(f"parallel.context_degree={degree} must be >= 1 and divide the world size {world_size()}")
    _CONTEXT = degree


def context_degree() -> int:
    """The context-parallel degree C set by :func:`set_context_degree` (1 by default)."""
    return _CONTEXT


def data_world_size() -> int:
    """The number of data ranks, W / C: how many ways the samples are split."""
    return world_size() // _CONTEXT


def data_rank() -> int:
    """This process's data rank, global rank // C (the ranks of one context group share it)."""
    return rank() // _CONTEXT


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


def _gather_data(t: torch.Tensor) -> list[torch.Tensor]:
    """Every data rank's ``t`` (equal shapes), in data-rank order, on the backend's device: one all-gather over
    all ranks, keeping the first rank of each context group."""
    x = _on_backend(t)
    parts = [torch.empty_like(x) for _ in range(world_size())]
    torch_dist.all_gather(parts, x)
    return parts[::_CONTEXT]


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from all data ranks along dim 0 (data-rank order; a context group's copy
    once), on ``t``'s device; identity on one process."""
    if not is_distributed():
        return t
    return torch.cat(_gather_data(t)).to(t.device)


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if not is_distributed():
        return t
    out = _on_backend(t).clone()
    torch_dist.all_reduce(out, op=op)
    return out.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over data ranks, a context group's copy once (a new tensor on ``t``'s device); identity on one
    process."""
    if is_distributed() and _CONTEXT > 1:
        return torch.stack(_gather_data(t)).sum(0).to(t.device)
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


def local_main_first(fn):
    """``fn()`` on the first process of each node (``LOCAL_RANK`` 0) and, after every process has reached a
    barrier, on the others: a download made once per node, which the rest then read from the cache. Returns
    ``fn()``'s value on every process; a plain call on one process. A collective."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    out = fn() if first else None
    barrier()
    return out if first else fn()


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
    """Destroy the one-process group :func:`ensure_process_group` made (a launcher's group is left alone), and
    return to a context degree of 1."""
    global _OWN_GROUP, _CONTEXT
    if _OWN_GROUP and is_distributed():
        torch_dist.destroy_process_group()
    _OWN_GROUP = False
    _CONTEXT = 1


def end_worker(code: int = 0) -> NoReturn:
    """End a torchrun worker script: destroy the process groups, flush stdout and stderr, and leave with ``code``
    without the interpreter's teardown (``os._exit``).

    Gloo subgroups that a device mesh or a context-parallel plan still references outlive
    ``destroy_process_group``; their worker threads are then torn down during interpreter finalisation, where a
    thread that touches a Python object aborts the process (``terminate called without an active exception``,
    SIGABRT; seen in CI on a loaded 2-core machine after the results were written; pytorch/pytorch#179291 describes
    the mechanism). For scripts whose results are already on disk; a library caller's process is never ended here.
    """
    if is_distributed():
        torch_dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def context_leader() -> bool:
    """Whether this process is the first of its context group (global rank % C = 0): the one that decodes and
    scores the group's samples where one copy serves (the others hold the same samples); True with C = 1."""
    return rank() % _CONTEXT == 0


def padded_share(total: int) -> tuple[list[int], int]:
    """This data rank's contiguous share of ``total`` items for work every rank must do in lockstep (under FSDP2
    each transformer call is a collective), ``total`` need not divide evenly: with k = ceil(``total`` / data
    ranks), the indices ``d·k … min(d·k + k, total) − 1`` of data rank d, padded to k entries by repeating its last
    one (index 0 for a rank that has none), and the count of real ones (they come first). Every data rank then
    makes k results; :func:`gather_cat` of them, cut to the first ``total``, is the items in order (the padding
    sits at positions ≥ ``total``). The ranks of one context group get the same share.

    Raises:
        ValueError: ``total`` < 1.
    """
    if total < 1:
        raise ValueError(f"padded_share needs at least one item, got total={total}")
    k = -(-total // data_world_size())
    start = data_rank() * k
    real = list(range(start, min(start + k, total)))
    return real + [real[-1] if real else 0] * (k - len(real)), len(real)


def local_slice(total: int) -> slice:
    """This data rank's contiguous share of ``total`` items (``total`` must divide evenly over the data ranks;
    the ranks of one context group get the same share)."""
    n = data_world_size()
    if total % n:
        raise ValueError(f"{total} items cannot be split evenly over {n} data ranks")
    per = total // n
    return slice(data_rank() * per, (data_rank() + 1) * per)


def _launcher_store(timeout_s: float):
    """A client of the store torchrun's agent serves for its workers (``TORCHELASTIC_USE_AGENT_STORE=True`` at
    ``MASTER_ADDR:MASTER_PORT``, torch's ``rendezvous._agent_store_serves``): there before any process group, so
    processes can tell each other things while setting up. None elsewhere (one process, ``accelerate launch``'s
    single child, a launcher without an agent store) or when it cannot be reached."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("WORLD_SIZE", "1")) < 2:
        return None
    import datetime

    try:
        return torch_dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
    except (KeyError, ValueError, RuntimeError):
        return None


def share_refusal(main_process: bool, wait_s: float, code: int, line: str) -> None:
    """Every process of a torchrun launch that refuses to run (a bad config found while setting up: each process
    finds the same fault) ends together with the refusal's exit status ``code``, ``line`` said once (by the main
    process), through the launcher's store (:func:`_launcher_store`; keys of this launch and restart); no process
    is left running for torchrun to end with SIGTERM when it sees the first one end.

    The main process waits (at most ``wait_s`` seconds) until every other process has counted itself in, says
    ``line`` on stderr, gives the cue and ends (:func:`end_worker`); another counts itself in, waits at most
    ``wait_s`` for the cue and ends quietly. Returns (to say the line itself) only where there is no launcher's
    store (another process after waiting ``wait_s``: the launcher ends it meanwhile when the main one refused) or
    for another process whose cue did not come (the fault is its own).
    """
    import time

    env = os.environ
    key = f"flowgrpo/refusal/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = _launcher_store(wait_s)
    if store is None:
        if not main_process:
            time.sleep(wait_s)
        return
    try:
        if not main_process:
            store.add(f"{key}/others", 1)
            store.wait([key])  # the store's timeout: wait_s
            end_worker(code)
        others, deadline = int(env["WORLD_SIZE"]) - 1, time.monotonic() + wait_s
        while store.add(f"{key}/others", 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, KeyError, ValueError):  # the cue never came (DistStoreError is a RuntimeError)
        return
    sys.stderr.write(line)
    sys.stderr.flush()
    store.set(key, "refused")
    end_worker(code)
