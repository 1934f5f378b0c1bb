"""Step groupers: which transitions are stochastic, which are trained, and which share one importance ratio.

A grouper is a registered strategy with two questions to answer:

* ``sde_steps(T, epoch) -> (T,) bool``: which transitions the rollout samples with the SDE (the others are ODE
  steps; only SDE transitions have a log-probability and can be trained);
* ``plan(trajectory, epoch, generator) -> ChunkPlan``: chunks of transitions that share one importance ratio
  ``r = exp(mean over the chunk of (log p_new − log p_old))`` and which samples train which chunk.

``per_step`` (Flow-GRPO, DanceGRPO) makes each transition its own chunk; ``chunk`` (Chunk-GRPO/GCPO) groups
contiguous transitions; ``trajectory`` is one chunk for the whole trajectory (GSPO-style sequence ratio);
``window`` (MixGRPO) confines the SDE and training to a sliding window.
"""

from __future__ import annotations

import math

import torch

from flowgrpo.records import ChunkPlan, Trajectory
from flowgrpo.registry import Registry

GROUPERS: Registry = Registry("grouper")


def trainable_steps(traj: Trajectory, drop_last_step: bool = False) -> list[int]:
    """Transitions stochastic for every sample (the grid positions a shared chunk plan can use)."""
    steps = [t for t in range(traj.num_steps) if bool(traj.stochastic[:, t].all())]
    if drop_last_step and steps and steps[-1] == traj.num_steps - 1:
        steps = steps[:-1]
    return steps


def _plan(chunks: list[tuple[int, ...]], selected: torch.Tensor) -> ChunkPlan:
    if not chunks:
        raise ValueError("the grouper found no stochastic transition to train (check sde_kind and noise_level)")
    return ChunkPlan(chunks=tuple(chunks), selected=selected)


class _Grouper:
    """Shared defaults: SDE at every step; the training layout equals the rollout's (no recompute needed)."""

    #: whether the training forward batches transitions differently from the rollout, so old log-probs must be
    #: recomputed with the training layout for the first ratio to be exactly 1 (DESIGN.md, "Exactness").
    needs_recompute = False

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        return torch.ones(num_steps, dtype=torch.bool)


@GROUPERS.register("per_step")
class PerStep(_Grouper):
    """Every stochastic transition is its own chunk (Flow-GRPO, arXiv 2505.05470, eq. 7; DanceGRPO).

    ``timestep_fraction`` < 1 trains ⌈fraction·K⌉ of the K stochastic transitions per sample: the first ones
    (``step_selection='first'``, Flow-GRPO's default) or a uniformly random subset per sample (``'random'``,
    DanceGRPO's ``timestep_fraction``).
    """

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        k = len(steps)
        n = max(1, math.ceil(self.cfg.timestep_fraction * k))
        b = traj.batch_size
        selected = torch.zeros(b, k, dtype=torch.bool)
        if self.cfg.step_selection == "first":
            selected[:, :n] = True
        else:
            for i in range(b):
                selected[i, torch.randperm(k, generator=generator)[:n]] = True
        return _plan([(t,) for t in steps], selected)


def relative_l1(latents: torch.Tensor) -> torch.Tensor:
    """L1_rel(t) = ‖x_{t+1} − x_t‖₁ / ‖x_{t+1}‖₁ for each transition t, averaged over the batch; (T,) float32.

    Chunk-GRPO (Luo et al., arXiv 2510.21583, Sec. 4.2) computes it on the latents of a trajectory and finds the
    curve nearly prompt-invariant, so one curve per batch gives every sample the same chunk boundaries.
    ``latents``: (B, T+1, …).
    """
    x = latents.float().flatten(2)
    num = (x[:, 1:] - x[:, :-1]).abs().sum(-1)
    den = x[:, 1:].abs().sum(-1).clamp(min=1e-12)
    return (num / den).mean(0)


def adaptive_chunks(l1: torch.Tensor, min_size: int) -> list[tuple[int, int]]:
    """Split positions 0..n−1 of a curve into contiguous chunks ``[start, end)``.

    The rule (our reading of Chunk-GRPO, arXiv 2510.21583, Sec. 4.2; the paper leaves details open):

    1. A segment shorter than ``2·min_size`` is a chunk.
    2. Otherwise take the k-th order difference d of the curve on the segment (k = 1 at the top level). Where
       sign(d[i]) ≠ sign(d[i+1]) the curve turns; a boundary goes at segment position i + 1 + k // 2 (for k = 1,
       the turning point opens the next chunk). Boundaries are accepted left to right when both sides keep at
       least ``min_size`` positions.
    3. If no boundary is accepted (all signs agree, or every turn is too close to an edge), split at the
       midpoint ``n // 2``.
    4. Recurse on every piece with order k + 1.

    Every chunk has between ``min_size`` and ``2·min_size − 1`` positions (unless the curve is shorter).
    """
    if min_size < 1:
        raise ValueError(f"min_chunk_size must be >= 1, got {min_size}")
    curve = l1.double()

    def split(a: int, b: int, order: int) -> list[tuple[int, int]]:
        n = b - a
        if n < 2 * min_size:
            return [(a, b)]
        cuts: list[int] = []
        if n > order + 1:
            d = torch.diff(curve[a:b], n=order)
            s = torch.sign(d)
            last = a
            for i in range(len(s) - 1):
                if s[i] != s[i + 1]:
                    pos = a + i + 1 + order // 2
                    if pos - last >= min_size and b - pos >= min_size:
                        cuts.append(pos)
                        last = pos
        if not cuts:
            cuts = [a + n // 2]
        edges = [a, *cuts, b]
        out: list[tuple[int, int]] = []
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            out += split(lo, hi, order + 1)
        return out

    return split(0, len(curve), 1)


@GROUPERS.register("chunk")
class Chunk(_Grouper):
    """Contiguous chunks of transitions share one ratio (Chunk-GRPO / GCPO, Luo et al., arXiv 2510.21583, eq. 6:
    ``r_chunk = exp(mean_{t∈chunk}(log p_θ − log p_old))``, the geometric mean of the step ratios).

    Sizes are fixed (``chunk_sizes``, summing to the number of trainable transitions) or adaptive from the
    batch's L1_rel curve (:func:`adaptive_chunks`). With ``chunk_fraction`` < 1, each trajectory trains
    ⌈fraction·K⌉ chunks drawn without replacement with probability ∝ the chunk's mean L1_rel (the paper's
    weighted sampling, Sec. 4.3). A chunk's transitions go through the transformer as one batch, a different
    layout from the rollout's, so old log-probs are recomputed first.
    """

    needs_recompute = True

    def chunk_bounds(self, traj: Trajectory) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        l1 = relative_l1(traj.latents)[steps]
        if self.cfg.chunk_sizes is not None:
            sizes = list(self.cfg.chunk_sizes)
            if sum(sizes) != len(steps) or min(sizes) < 1:
                raise ValueError(
                    f"grouper.chunk_sizes {sizes} must be positive and sum to the {len(steps)} trainable "
                    f"transitions (num_steps minus deterministic/dropped ones)"
                )
            edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]
            bounds = list(zip(edges[:-1], edges[1:], strict=True))
        else:
            bounds = adaptive_chunks(l1, self.cfg.min_chunk_size)
        chunks = [tuple(steps[i] for i in range(lo, hi)) for lo, hi in bounds]
        weights = torch.stack([l1[lo:hi].mean() for lo, hi in bounds]).float()
        return chunks, weights

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        chunks, weights = self.chunk_bounds(traj)
        k = len(chunks)
        b = traj.batch_size
        n = max(1, math.ceil(self.cfg.chunk_fraction * k))
        if n == k:
            return _plan(chunks, torch.ones(b, k, dtype=torch.bool))
        selected = torch.zeros(b, k, dtype=torch.bool)
        w = weights.clamp(min=1e-12)
        for i in range(b):
            selected[i, torch.multinomial(w, n, replacement=False, generator=generator)] = True
        return _plan(chunks, selected)


@GROUPERS.register("trajectory")
class WholeTrajectory(_Grouper):
    """One ratio for the whole trajectory: ``exp(mean over all trained steps of the log-ratio)``, the
    sequence-level ratio of GSPO (Zheng et al., arXiv 2507.18071, eq. 7) — ``chunk`` with a single chunk."""

    needs_recompute = True

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return _plan([tuple(steps)] if steps else [], torch.ones(traj.batch_size, 1, dtype=torch.bool))


@GROUPERS.register("window")
class SlidingWindow(_Grouper):
    """MixGRPO's sliding window (Li et al., arXiv 2507.21802, Sec. 3.2): SDE only on ``window_size``
    transitions starting at ``l = min(stride·⌊epoch / shift_every⌋, T − w)``, ODE elsewhere; only the window
    is trained, one ratio per step. The window moves from high noise (t = 0) toward low noise and stays at the
    end once it arrives.
    """

    def window_start(self, num_steps: int, epoch: int) -> int:
        w = self.cfg.window_size
        if w > num_steps:
            raise ValueError(f"grouper.window_size={w} exceeds sampling.num_steps={num_steps}")
        return min(self.cfg.window_stride * (epoch // self.cfg.window_shift_every), num_steps - w)

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        start = self.window_start(num_steps, epoch)
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[start : start + self.cfg.window_size] = True
        return mask

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return _plan([(t,) for t in steps], torch.ones(traj.batch_size, len(steps), dtype=torch.bool))


def build_grouper(cfg):
    """The grouper named by ``cfg.name`` (a :class:`~flowgrpo.config.GrouperConfig`)."""
    return GROUPERS.get(cfg.name)(cfg)
