"""The update's schedule: micro-batches, the optimizer steps' shares of them, and the packs of chunks that share
one transformer call.

Semantics (``train.*``): the B local samples are cut into micro-batches of ``train_batch_size`` consecutive
samples; ``optimizer_steps_per_epoch`` optimizer steps each take an equal, consecutive share of the micro-batches
(gradients accumulate over that share and all its chunks). A micro-batch's chunks share transformer calls of at
most ``train_batch_size`` rows (:func:`schedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowgrpo.distributed import dist
from flowgrpo.records import Advantages, ChunkPlan, Trajectory
from flowgrpo.sampling.packed_forward import transformer_rows


@dataclass(frozen=True)
class StepWork:
    """The work of one optimizer step.

    Attributes:
        work: its forwards, each a pack of (rows (n,) long host, chunk index) items forwarded in one transformer
            call.
        global_pairs: the (sample, chunk) pairs it trains, summed over all processes.
        micro_batches: the micro-batches of its share (for the progress bar).
        padding: the last ``padding`` packs of ``work`` are fillers (:func:`pad_packs`): forwarded and
            back-propagated with weight 0, never recorded.
    """

    work: list[list[tuple[torch.Tensor, int]]]
    global_pairs: float
    micro_batches: int
    padding: int

    def is_filler(self, i: int) -> bool:
        """Whether pack ``i`` of ``work`` is a filler."""
        return i >= len(self.work) - self.padding


def micro_batches(b: int, size: int) -> list[torch.Tensor]:
    """Consecutive (size,) long index tensors covering ``b`` samples. Raises ``ValueError`` unless size divides b."""
    if b % size:
        raise ValueError(f"train_batch_size={size} must divide the {b} trajectories this process sampled")
    return [torch.arange(s, s + size) for s in range(0, b, size)]


def step_shares(mbs: list[torch.Tensor], steps: int) -> list[list[torch.Tensor]]:
    """The micro-batches of each of ``steps`` optimizer steps: equal consecutive shares (``tensor_split``).

    Raises ``ValueError`` when there are fewer micro-batches than steps."""
    if len(mbs) < steps:
        raise ValueError(f"optimizer_steps_per_epoch={steps} exceeds the {len(mbs)} training micro-batches of this "
                         "epoch")
    return [[mbs[i] for i in ix] for ix in torch.arange(len(mbs)).tensor_split(steps)]


def pack(items: list, cost, limit: int) -> list[list]:
    """Consecutive ``items`` in packs whose summed ``cost(*item)`` stays within ``limit``; an item over the limit
    is a pack alone."""
    packs: list[list] = []
    total = limit + 1
    for item in items:
        c = cost(*item)
        if total + c > limit:
            packs.append([])
            total = 0
        packs[-1].append(item)
        total += c
    return packs


def pair_mask(plan: ChunkPlan, adv: Advantages) -> torch.Tensor:
    """(B_local, K) bool host: the (sample, chunk) pairs the update trains (planned, and kept by the advantage)."""
    return plan.selected & adv.train_mask[dist.local_slice(len(adv.values))].unsqueeze(1)


def _packs(share: list[torch.Tensor], plan: ChunkPlan, mask: torch.Tensor, limit: int,
           shared_inputs: Callable[[torch.Tensor], torch.Tensor | None]) -> list[list[tuple[torch.Tensor, int]]]:
    """The packed forwards of one optimizer step's micro-batches (see :func:`schedule`)."""
    packs = []
    for rows in share:
        # host lists, read once a micro-batch: no tensor op per chunk
        row_list, trained = rows.tolist(), mask[rows].any(dim=0).tolist()  # (n,), (K,)
        selected = plan.selected[rows].T.tolist()  # (K, n)
        items = [(torch.tensor([r for r, s in zip(row_list, selected[k], strict=True) if s], dtype=torch.long), k)
                 for k in range(plan.num_chunks) if trained[k]]
        packs += pack(items, lambda r, k: transformer_rows(r, plan.chunks[k], shared_inputs(r)), limit)
    return packs


def pad_packs(work: list[list[list]], shares: list[list[torch.Tensor]]) -> tuple[list[list[list]], list[int]]:
    """Each optimizer step's packs padded to the most any process has, and the fillers added per step.

    Every process must make the same transformer calls in the same order: a sharded (FSDP2) transformer gathers
    its weights in each forward and reduces gradients in each back-propagation, and DDP reduces in the step's
    last one. A filler repeats one row of the step (its first trained item's, else the share's first sample)."""
    if dist.world_size() == 1:
        return work, [0] * len(work)
    most = dist.all_reduce_max(torch.tensor([float(len(w)) for w in work], dtype=torch.float64)).tolist()
    pads = [int(n) - len(w) for n, w in zip(most, work, strict=True)]
    padded = [w + [[(w[0][0][0][:1], w[0][0][1]) if w else (share[0][:1], 0)]] * p
              for w, share, p in zip(work, shares, pads, strict=True)]
    return padded, pads


def schedule(traj: Trajectory, plan: ChunkPlan, mask: torch.Tensor, *, batch_size: int, steps: int,
             shared_inputs: Callable[[torch.Tensor], torch.Tensor | None]) -> list[StepWork]:
    """Each optimizer step's packed forwards and its pair count summed over all processes (one collective).

    The B local samples are cut into micro-batches of ``batch_size`` and the micro-batches into ``steps`` equal
    consecutive shares. A micro-batch forwards each chunk that has a trained pair in ``mask`` (B, K) for the
    rows the plan selects (samples left out by their advantage, NaN reward or dropped group, are forwarded and
    masked); consecutive chunks of one micro-batch share a transformer call while it holds at most
    ``batch_size`` transformer rows (identical inputs, ``shared_inputs(rows)`` keys, counted once; a chunk of k
    steps counts k rows per sample). A chunk over that limit is forwarded alone, so a per-step micro-batch still
    forwards one step at a time, while E-GRPO's shared-anchor chunks (one transformer row a group) share one call.
    With several processes every step's packs are padded to the most any process has (:func:`pad_packs`).

    Raises ``ValueError`` when ``batch_size`` does not divide B or there are fewer micro-batches than steps.
    """
    shares = step_shares(micro_batches(traj.batch_size, batch_size), steps)
    work = [_packs(share, plan, mask, batch_size, shared_inputs) for share in shares]
    local_pairs = torch.stack([mask[torch.cat(share)].sum() for share in shares]).double()
    global_pairs = dist.all_reduce_sum(local_pairs).tolist()
    work, pads = pad_packs(work, shares)
    return [StepWork(w, n, len(share), p) for w, n, share, p in zip(work, global_pairs, shares, pads, strict=True)]
