"""``chunk``: contiguous transitions share one importance ratio (Chunk-GRPO / GCPO, arXiv 2510.21583)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowgrpo.algo.chunkers.base import (
    CHUNKERS,
    BaseChunker,
    DropLastConfig,
    check_trainable,
    make_plan,
    release_count,
    trainable_steps,
)
from flowgrpo.records import ChunkPlan, Trajectory


class ChunkConfig(DropLastConfig):
    """Settings of ``chunk`` (Chunk-GRPO / GCPO, arXiv 2510.21583)."""

    name: Literal["chunk"] = "chunk"
    chunk_sizes: list[int] | None = Field(
        None, description="fixed chunk sizes summing to the trainable transitions (else adaptive, Sec. 4.2)"
    )
    min_chunk_size: int = Field(2, ge=1, description="adaptive chunks: the smallest chunk the recursion produces")
    chunk_fraction: float = Field(
        1.0, gt=0, le=1, description="int(K*fraction) of the K chunks trained per trajectory (GCPO's "
        "int(num_chunks * timestep_fraction))"
    )
    chunk_selection: Literal["uniform", "weighted"] = Field(
        "uniform", description="which chunks a trajectory trains when chunk_fraction < 1: uniformly at random "
        "(GCPO's script: randperm) or without replacement with probability proportional to the chunk's mean "
        "L1_rel (--sample_weight, Sec. 4.3)"
    )
    weight_reference: Literal["x_t", "x_next_batch"] = Field(
        "x_t", description="weighted selection's L1_rel(t): mean|x_{t+1}-x_t| / (mean|x_t| + 1e-8) per sample "
        "(x_t, GCPO's code) or ||x_{t+1}-x_t||_1 / ||x_{t+1}||_1 averaged over the batch (x_next_batch)"
    )


def _check_sizes(sizes, trainable: int, where: str) -> None:
    if min(sizes) < 1 or sum(sizes) != trainable:
        raise ValueError(f"objective.chunker.chunk_sizes {list(sizes)} must be positive and sum to the {trainable} "
                         f"trainable transitions {where}")


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


def chunk_weights(latents: torch.Tensor, steps: list[int], bounds: list[tuple[int, int]],
                  reference: str = "x_t") -> torch.Tensor:
    """Selection probabilities (B, K) float32 of each sample's K chunks for weighted chunk sampling.

    GCPO (arXiv 2510.21583, Sec. 4.3; xingzhejun/GCPO ``train_grpo_flux_hpsv3.py``, ``--sample_weight``):
    ``L1(t) = mean|x_{t+1} − x_t| / (mean|x_t| + 1e-8)`` per sample (``reference="x_t"``); a chunk's weight is
    the mean of L1 over its transitions plus 1e-8; weights are normalised to sum 1 per sample. With
    ``reference="x_next_batch"`` L1 is :func:`relative_l1` (‖x_{t+1} − x_t‖₁/‖x_{t+1}‖₁, batch mean), the same
    for every sample.

    Args:
        latents: (B, T+1, …) trajectory latents.
        steps: the trainable transitions (positions of the L1 curve); bounds: chunks as ``[lo, hi)`` into steps.

    Raises:
        ValueError: an unknown ``reference``.
    """
    x = latents.float().flatten(2)
    if reference == "x_t":
        l1 = (x[:, 1:] - x[:, :-1]).abs().mean(-1) / (x[:, :-1].abs().mean(-1) + 1e-8)  # (B, T)
    elif reference == "x_next_batch":
        l1 = relative_l1(latents).expand(x.shape[0], -1)
    else:
        raise ValueError(f"weight_reference must be 'x_t' or 'x_next_batch', got {reference!r}")
    l1 = l1[:, steps]
    w = torch.stack([l1[:, lo:hi].mean(1) for lo, hi in bounds], dim=1) + 1e-8  # (B, K)
    return w / w.sum(1, keepdim=True)


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


@CHUNKERS.register("chunk")
class Chunk(BaseChunker):
    """Contiguous chunks of transitions share one ratio (Chunk-GRPO / GCPO, Luo et al., arXiv 2510.21583, eq. 6:
    ``r_chunk = exp(mean_{t∈chunk}(log p_θ − log p_old))``, the geometric mean of the step ratios).

    Sizes are fixed (``chunk_sizes``, summing to the number of trainable transitions) or adaptive from the
    batch's L1_rel curve (:func:`adaptive_chunks`). With ``chunk_fraction`` < 1, each trajectory trains
    int(fraction·K) chunks (GCPO's count), chosen uniformly at random per trajectory (``chunk_selection:
    uniform``, GCPO's script) or drawn without replacement with the probabilities of :func:`chunk_weights`
    (``weighted``, the paper's Sec. 4.3). A chunk's transitions go through the transformer as one batch, a
    different layout from the rollout's, so old log-probs are recomputed first.
    """

    Config = ChunkConfig
    needs_recompute = True

    def validate(self, num_steps: int, sde_kind: str) -> None:
        trainable = check_trainable(self.cfg, num_steps, sde_kind)
        if self.cfg.chunk_sizes is not None:
            _check_sizes(self.cfg.chunk_sizes, trainable, f"of {num_steps} steps (sde_kind {sde_kind!r}, "
                         f"drop_last_step {self.cfg.drop_last_step})")
            release_count(self.cfg.chunk_fraction, len(self.cfg.chunk_sizes), "objective.chunker.chunk_fraction")

    def chunk_bounds(self, traj: Trajectory) -> tuple[list[tuple[int, ...]], list[int], list[tuple[int, int]]]:
        """(chunks as tuples of transitions, the trainable transitions, chunks as ``[lo, hi)`` into them)."""
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        if self.cfg.chunk_sizes is not None:
            sizes = list(self.cfg.chunk_sizes)
            _check_sizes(sizes, len(steps), "(num_steps minus deterministic/dropped ones)")
            edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]
            bounds = list(zip(edges[:-1], edges[1:], strict=True))
        else:
            bounds = adaptive_chunks(relative_l1(traj.latents)[steps], self.cfg.min_chunk_size)
        return [tuple(steps[i] for i in range(lo, hi)) for lo, hi in bounds], steps, bounds

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        chunks, steps, bounds = self.chunk_bounds(traj)
        k = len(chunks)
        b = traj.batch_size
        n = release_count(self.cfg.chunk_fraction, k, "objective.chunker.chunk_fraction")
        if n == k:
            return make_plan(chunks, torch.ones(b, k, dtype=torch.bool))
        selected = torch.zeros(b, k, dtype=torch.bool)
        if self.cfg.chunk_selection == "uniform":
            for i in range(b):
                selected[i, torch.randperm(k, generator=generator)[:n]] = True
        else:
            w = chunk_weights(traj.latents, steps, bounds, self.cfg.weight_reference).cpu()
            for i in range(b):
                selected[i, torch.multinomial(w[i], n, replacement=False, generator=generator)] = True
        return make_plan(chunks, selected)


