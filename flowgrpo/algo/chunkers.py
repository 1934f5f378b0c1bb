"""Step chunkers: which transitions are stochastic, which are trained, and which share one importance ratio.

A chunker is a registered strategy with two questions to answer:

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

CHUNKERS: Registry = Registry("chunker")


def trainable_steps(traj: Trajectory, drop_last_step: bool = False) -> list[int]:
    """Transitions stochastic for every sample (the grid positions a shared chunk plan can use)."""
    steps = [t for t in range(traj.num_steps) if bool(traj.stochastic[:, t].all())]
    if drop_last_step and steps and steps[-1] == traj.num_steps - 1:
        steps = steps[:-1]
    return steps


def fraction_count(fraction: float, k: int) -> int:
    """⌈fraction·k⌉, at least 1, computed so that float noise (0.28·25 = 7.000000000000001) does not add one."""
    return max(1, math.ceil(round(fraction * k, 9)))


def _plan(chunks: list[tuple[int, ...]], selected: torch.Tensor) -> ChunkPlan:
    if not chunks:
        raise ValueError("the chunker found no stochastic transition to train (check sde_kind and noise_level)")
    return ChunkPlan(chunks=tuple(chunks), selected=selected)


class _Chunker:
    """Shared defaults: SDE at every step; the standard P×G rollout; the training layout equals the rollout's
    (no recompute needed)."""

    #: whether the training forward batches transitions differently from the rollout, so old log-probs must be
    #: recomputed with the training layout for the first ratio to be exactly 1 (DESIGN.md, "Exactness").
    needs_recompute = False

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        return torch.ones(num_steps, dtype=torch.bool)

    def validate(self, num_steps: int, kind: str) -> None:
        """Reject settings this chunker cannot run, before any model is loaded (raises ``ValueError``)."""
        self.sde_steps(num_steps, 0)

    def rollout(self, adapter, prompts: list[str], metadata: list[dict], prompt_ids: torch.Tensor,
                sample_index: torch.Tensor, *, settings, batch_size: int, seed: int, epoch: int,
                same_noise_in_group: bool = False, progress: bool = False, on_images=None,
                latents_on_cpu: bool = False) -> Trajectory:
        """Sample the epoch's trajectories (B = P·G, groups = prompts) with this chunker's SDE steps.

        Arguments as :func:`flowgrpo.sampling.rollout.rollout`; a chunker that changes the rollout itself
        (E-GRPO's shared-anchor branching) overrides this.
        """
        from flowgrpo.sampling.rollout import rollout

        return rollout(adapter, prompts, metadata, prompt_ids, sample_index, settings=settings,
                       sde_steps=self.sde_steps(settings.num_steps, epoch), batch_size=batch_size, seed=seed,
                       epoch=epoch, same_noise_in_group=same_noise_in_group, progress=progress,
                       on_images=on_images, latents_on_cpu=latents_on_cpu)


@CHUNKERS.register("per_step")
class PerStep(_Chunker):
    """Every stochastic transition is its own chunk (Flow-GRPO, arXiv 2505.05470, eq. 7; DanceGRPO).

    ``timestep_fraction`` < 1 trains ⌈fraction·K⌉ of the K stochastic transitions per sample: the first ones
    (``step_selection='first'``, Flow-GRPO's default) or a uniformly random subset per sample (``'random'``,
    DanceGRPO's ``timestep_fraction``).
    """

    @property
    def needs_recompute(self) -> bool:  # a random subset per sample forwards fewer rows than the rollout did
        return self.cfg.step_selection == "random" and self.cfg.timestep_fraction < 1

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        k = len(steps)
        n = fraction_count(self.cfg.timestep_fraction, k)
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


@CHUNKERS.register("chunk")
class Chunk(_Chunker):
    """Contiguous chunks of transitions share one ratio (Chunk-GRPO / GCPO, Luo et al., arXiv 2510.21583, eq. 6:
    ``r_chunk = exp(mean_{t∈chunk}(log p_θ − log p_old))``, the geometric mean of the step ratios).

    Sizes are fixed (``chunk_sizes``, summing to the number of trainable transitions) or adaptive from the
    batch's L1_rel curve (:func:`adaptive_chunks`). With ``chunk_fraction`` < 1, each trajectory trains
    ⌈fraction·K⌉ chunks drawn without replacement with probability ∝ the chunk's mean L1_rel (the paper's
    weighted sampling, Sec. 4.3). A chunk's transitions go through the transformer as one batch, a different
    layout from the rollout's, so old log-probs are recomputed first.
    """

    needs_recompute = True

    def validate(self, num_steps: int, kind: str) -> None:
        sizes = self.cfg.chunk_sizes
        if sizes is None:
            return
        # cps never makes its last transition stochastic; drop_last_step leaves it out too
        trainable = num_steps - int(self.cfg.drop_last_step or kind == "cps")
        if min(sizes) < 1 or sum(sizes) != trainable:
            raise ValueError(f"chunker.chunk_sizes {list(sizes)} must be positive and sum to the {trainable} "
                             f"trainable transitions of {num_steps} steps (sde_kind {kind!r}, drop_last_step "
                             f"{self.cfg.drop_last_step})")

    def chunk_bounds(self, traj: Trajectory) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        l1 = relative_l1(traj.latents)[steps]
        if self.cfg.chunk_sizes is not None:
            sizes = list(self.cfg.chunk_sizes)
            if sum(sizes) != len(steps) or min(sizes) < 1:
                raise ValueError(
                    f"chunker.chunk_sizes {sizes} must be positive and sum to the {len(steps)} trainable "
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
        n = fraction_count(self.cfg.chunk_fraction, k)
        if n == k:
            return _plan(chunks, torch.ones(b, k, dtype=torch.bool))
        selected = torch.zeros(b, k, dtype=torch.bool)
        w = weights.clamp(min=1e-12)
        for i in range(b):
            selected[i, torch.multinomial(w, n, replacement=False, generator=generator)] = True
        return _plan(chunks, selected)


@CHUNKERS.register("trajectory")
class WholeTrajectory(_Chunker):
    """One ratio for the whole trajectory: ``exp(mean over all trained steps of the log-ratio)``, the
    sequence-level ratio of GSPO (Zheng et al., arXiv 2507.18071, eq. 7) — ``chunk`` with a single chunk."""

    needs_recompute = True

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return _plan([tuple(steps)] if steps else [], torch.ones(traj.batch_size, 1, dtype=torch.bool))


@CHUNKERS.register("window")
class SlidingWindow(_Chunker):
    """MixGRPO's sliding window (Li et al., arXiv 2507.21802, Sec. 3.2): SDE only on ``window_size``
    transitions starting at ``l = min(stride·⌊epoch / shift_every⌋, T − w)``, ODE elsewhere; only the window
    is trained, one ratio per step. The window moves from high noise (t = 0) toward low noise and stays at the
    end once it arrives.
    """

    def window_start(self, num_steps: int, epoch: int) -> int:
        w = self.cfg.window_size
        if w > num_steps:
            raise ValueError(f"chunker.window_size={w} exceeds sampling.num_steps={num_steps}")
        return min(self.cfg.window_stride * (epoch // self.cfg.window_shift_every), num_steps - w)

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        start = self.window_start(num_steps, epoch)
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[start : start + self.cfg.window_size] = True
        return mask

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return _plan([(t,) for t in steps], torch.ones(traj.batch_size, len(steps), dtype=torch.bool))


def build_chunker(cfg):
    """The chunker named by ``cfg.name`` (a :class:`~flowgrpo.config.ChunkerConfig`)."""
    return CHUNKERS.get(cfg.name)(cfg)


# ---------------------------------------------------------------------------------------------------------------
# E-GRPO: entropy-merged SDE jumps and shared-anchor branching (Zhang et al., arXiv 2601.00423)
# ---------------------------------------------------------------------------------------------------------------

#: SDE kinds ``entropy_merge`` refuses, with the reason.
_NO_MERGE_KINDS = {
    "cps": "its std σ_next·sin(aπ/2) shrinks as a jump grows, so merging steps lowers the entropy instead of "
    "raising it",
    "ode": "it has no noise (std 0, entropy −∞), so no step can reach the threshold",
}


def _check_merge_kind(kind: str) -> None:
    if kind in _NO_MERGE_KINDS:
        raise ValueError(
            f"chunker 'entropy_merge' is not defined for sampling.sde_kind={kind!r}: {_NO_MERGE_KINDS[kind]}; "
            "use flow_sde or dance_sde"
        )


def jump_entropy(sigmas: torch.Tensor, start: int, length: int, *, kind: str, noise_level: float) -> float:
    """Entropy per latent dimension of one SDE jump from ``sigmas[start]`` to ``sigmas[start + length]``.

    ``h = ½·log(2πe·std²)`` (:func:`~flowgrpo.sampling.sde.gaussian_entropy_per_dim`; E-GRPO, arXiv 2601.00423,
    Sec. 3.2, divided by the latent size D), where std is the transition std of ``kind`` with σ_next the grid
    value ``length`` steps on: a merged jump is the ordinary transition over a longer interval. The std of every
    kind here depends on σ alone, not on the latents. float; −inf where std = 0.

    Raises:
        ValueError: ``start``/``length`` outside the grid (0 ≤ start, 1 ≤ length, start + length ≤ T).
        KeyError: unknown ``kind``.
    """
    from flowgrpo.sampling.sde import gaussian_entropy_per_dim, transition_moments

    t_count = len(sigmas) - 1
    if start < 0 or length < 1 or start + length > t_count:
        raise ValueError(f"a jump needs 0 <= start, 1 <= length, start + length <= T={t_count}; "
                         f"got start={start}, length={length}")
    zero = torch.zeros(1, 1)
    _, std = transition_moments(zero, zero, float(sigmas[start]), float(sigmas[start + length]), kind=kind,
                                noise_level=noise_level)
    return float(gaussian_entropy_per_dim(std)[0])


def step_entropies(sigmas: torch.Tensor, *, kind: str, noise_level: float) -> torch.Tensor:
    """(T,) float32 entropy per latent dimension of each single grid step (:func:`jump_entropy` with m = 1)."""
    return torch.tensor([jump_entropy(sigmas, i, 1, kind=kind, noise_level=noise_level)
                         for i in range(len(sigmas) - 1)], dtype=torch.float32)


def merge_plan(sigmas: torch.Tensor, *, kind: str, noise_level: float, tau: float | None = None,
               limit: int | None = None, steps: list[int] | None = None,
               lengths: list[int] | None = None) -> list[tuple[int, int]]:
    """E-GRPO's branch steps: a list of (step s, jump length m), s increasing, jumps not overlapping.

    Entropy rule (``tau`` set; E-GRPO, arXiv 2601.00423, Sec. 3.2–3.3, "merge consecutive low entropy steps to
    formulate one high entropy step"): walk the grid from s = 0; at each candidate s take the smallest m with
    ``jump_entropy(s, m) ≥ τ`` and ``s + m ≤ limit``, select (s, m) and continue at s + m (the merged steps are
    used up). When no such m exists (the window ends before the entropy reaches τ), s is left to the ODE and the
    walk continues at s + 1. Every other step is an ODE step. ``limit`` (default T) confines the jumps to the
    first ``limit`` steps: the paper samples with the SDE only in the first half. With ``flow_sde``, a = 0.7, 16
    steps of the FLUX.1 grid (720 or 1024 px), τ = 0.9 and limit 8 this gives [(0, 1), (1, 1), (2, 2), (4, 3)],
    the released training script's hand-set lists (``--eta_step_list 0 1 2 4 --eta_step_merge_list 1 1 2 3``).

    Hand lists (``steps`` set, the authors' ``eta_step_list`` / ``eta_step_merge_list``; ``lengths`` defaults to
    all 1): returned as given after validation; ``limit`` does not apply.

    Args:
        sigmas: (T+1,) σ grid, 1 → 0.
        kind, noise_level: the SDE of the jumps (``flow_sde`` or ``dance_sde``).
        tau: entropy threshold per latent dimension.
        limit: jumps end at or before this grid index (1..T).

    Raises:
        ValueError: ``kind`` is ``cps`` or ``ode``; both or neither of ``tau`` and ``steps``; hand lists of
            different lengths, out of the grid, not increasing, or overlapping (s_k + m_k > s_{k+1}); ``limit``
            outside 1..T; no step reaches τ (the message gives the largest reachable entropy).
    """
    _check_merge_kind(kind)
    t_count = len(sigmas) - 1
    if (tau is None) == (steps is None):
        raise ValueError("entropy_merge needs exactly one of chunker.entropy_threshold (the entropy rule) or "
                         f"chunker.merge_steps (hand-set branch steps); got entropy_threshold={tau}, "
                         f"merge_steps={steps}")
    if steps is not None:
        lengths = [1] * len(steps) if lengths is None else list(lengths)
        steps = list(steps)
        if not steps or len(lengths) != len(steps):
            raise ValueError(f"chunker.merge_steps {steps} and merge_lengths {lengths} must be non-empty lists of "
                             "equal length")
        plan = list(zip(steps, lengths, strict=True))
        for k, (s, m) in enumerate(plan):
            if s < 0 or m < 1 or s + m > t_count:
                raise ValueError(f"hand-set jump (step {s}, length {m}) leaves the grid of T={t_count} steps "
                                 "(need step >= 0, length >= 1, step + length <= T)")
            if k and plan[k - 1][0] + plan[k - 1][1] > s:
                raise ValueError(f"hand-set jumps overlap: (step {plan[k - 1][0]}, length {plan[k - 1][1]}) "
                                 f"reaches past step {s}; branch steps must increase and each jump must end at "
                                 "or before the next branch step")
        return plan
    limit = t_count if limit is None else int(limit)
    if not 1 <= limit <= t_count:
        raise ValueError(f"the entropy_merge window must cover 1..T={t_count} steps, got {limit}")
    plan: list[tuple[int, int]] = []
    best = -math.inf
    s = 0
    while s < limit:
        chosen = None
        for m in range(1, limit - s + 1):
            h = jump_entropy(sigmas, s, m, kind=kind, noise_level=noise_level)
            best = max(best, h)
            if h >= tau:
                chosen = m
                break
        if chosen is None:
            s += 1
        else:
            plan.append((s, chosen))
            s += chosen
    if not plan:
        raise ValueError(f"no jump within the first {limit} steps reaches entropy_threshold={tau} (the largest "
                         f"reachable entropy per dimension is {best:.4f}); lower the threshold, raise "
                         "sampling.noise_level or chunker.sde_fraction")
    return plan


@CHUNKERS.register("entropy_merge")
class EntropyMerge(_Chunker):
    """E-GRPO (Zhang et al., arXiv 2601.00423): entropy-merged SDE jumps, shared-anchor branching, and groups
    of (prompt, branch step).

    Rollout (:meth:`rollout`), for each prompt:

    1. one ODE anchor trajectory from the prompt's initial noise (``make_generator(seed, epoch, prompt, "init",
       0)``), batched over prompts, run up to the last branch step; its velocity at each branch step is kept;
    2. for each branch step (s, m) of :func:`merge_plan`, G samples jump from the anchor latent x_s with one SDE
       transition to σ_grid[s + m], each with its own noise (``make_generator(seed, epoch, prompt, "branch", s,
       j)``), reusing the anchor's velocity at x_s (the same input, so the same velocity: the jump costs no
       transformer call), then continue by ODE to σ = 0.

    The shared prefix costs one transformer call per step per prompt, not G; the whole rollout costs
    (s_max + 1) + G·Σ_(s,m) (T − s − m) calls per prompt, against G·T for the per-step SDE rollout.

    Record (B = P_local·|S|·G rows, in the order prompt → branch step → sample): ``latents[b, :s+1]`` are the
    anchor's latents (bit-identical copies), ``latents[b, s+1 : s+m+1]`` the jump's end (repeated inside the
    jump), then the ODE continuation; ``jump[b, s] = m``, 0 inside the jump, 1 elsewhere; ``stochastic[b, t]``
    is True only at t = s; ``log_probs[b, s]`` is the jump's log-density (0 elsewhere); ``group_ids =
    prompt_id·(T+1) + s``, so advantages are normalised within the G samples of one (prompt, branch step)
    (the paper's "multi-step group normalized advantage"). ``same_noise_in_group`` is implied (every sample of a
    prompt starts from the anchor's noise).

    Plan (:meth:`plan`): one chunk per branch step; each sample trains exactly its own jump.

    Batch sizes: the trainer cuts the B_local rows into micro-batches of ``train.train_batch_size``, which must
    divide B_local = P_local·|S|·G. A micro-batch scores a chunk for all its rows, so choose a
    ``train_batch_size`` that divides G (the per-process share of a group): each micro-batch then holds one
    (prompt, branch step) and forwards no unused row in the update. Old log-probs are recomputed in the training
    layout (the rollout scores the jump with the anchor's batched velocity), so ``needs_recompute`` is True.
    With several processes, choose P divisible by the process count so that no group is split: a prompt whose
    samples fall on two processes gets its anchor computed on each, equal only up to batching round-off.

    Differences from the released code (shengjun-zhang/VisualGRPO): its multi-granularity rewards
    (``granular_list``) are not implemented (one ODE continuation on the full grid); at σ = 1 the flow_sde std
    uses this project's guard (denominator 1 − σ_next, so a jump from σ = 1 keeps std = a whatever m), where the
    released code uses 1 − σ_grid[1].
    """

    needs_recompute = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        has_tau = cfg.entropy_threshold is not None
        has_steps = cfg.merge_steps is not None
        if has_tau == has_steps:
            raise ValueError("chunker 'entropy_merge' needs exactly one of chunker.entropy_threshold (the entropy "
                             "rule) or chunker.merge_steps (hand-set branch steps); got entropy_threshold="
                             f"{cfg.entropy_threshold}, merge_steps={cfg.merge_steps}")
        if cfg.merge_lengths is not None and not has_steps:
            raise ValueError("chunker.merge_lengths needs chunker.merge_steps")

    def branch_plan(self, sigmas: torch.Tensor, kind: str, noise_level: float) -> list[tuple[int, int]]:
        """The epoch's (branch step, jump length) list for the σ grid and SDE (see :func:`merge_plan`)."""
        t_count = len(sigmas) - 1
        return merge_plan(sigmas, kind=kind, noise_level=noise_level, tau=self.cfg.entropy_threshold,
                          limit=fraction_count(self.cfg.sde_fraction, t_count), steps=self.cfg.merge_steps,
                          lengths=self.cfg.merge_lengths)

    def validate(self, num_steps: int, kind: str) -> None:
        if kind in ("cps", "ode"):
            raise ValueError(f"chunker 'entropy_merge' cannot use sde_kind {kind!r}: cps's std shrinks as a jump "
                             "grows (and ode has none); use flow_sde or dance_sde")
        if self.cfg.merge_steps is not None and max(self.cfg.merge_steps) >= num_steps:
            raise ValueError(f"chunker.merge_steps {list(self.cfg.merge_steps)} must be < num_steps {num_steps}")

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        """(T,) bool, the branch steps; only for hand-set lists (the entropy rule needs the σ grid and the SDE:
        use :meth:`branch_plan`)."""
        if self.cfg.merge_steps is None:
            raise ValueError("entropy_merge's SDE steps follow from the σ grid and the SDE kind: call "
                             "branch_plan(sigmas, kind, noise_level)")
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[list(self.cfg.merge_steps)] = True
        return mask

    @torch.no_grad()
    def rollout(self, adapter, prompts: list[str], metadata: list[dict], prompt_ids: torch.Tensor,
                sample_index: torch.Tensor, *, settings, batch_size: int, seed: int, epoch: int,
                same_noise_in_group: bool = False, progress: bool = False, on_images=None,
                latents_on_cpu: bool = False) -> Trajectory:
        """Shared-anchor branching (see the class docstring): n input samples → n·|S| trajectories.

        Args:
            prompts, metadata, prompt_ids, sample_index: the n = P_local·G local samples, as
                :func:`flowgrpo.sampling.rollout.rollout` takes them; sample (p, j) becomes |S| trajectories
                (p, s, j), one per branch step.
            settings: :class:`~flowgrpo.sampling.rollout.SamplerSettings` (``kind`` must be flow_sde or dance_sde).
            batch_size: the most trajectories (anchors, or branches) per transformer call.
            on_images: called with (images, prompts, metadata) of each decoded batch of rows, in row order.

        Returns:
            A :class:`~flowgrpo.records.Trajectory` of B = n·|S| rows (latents on the adapter's device).

        Raises:
            ValueError: mismatched inputs, batch_size < 1, ``settings.sde_kind`` cps/ode, a sample whose prompt id
                appears with two different prompts, or a merge plan error (:func:`merge_plan`).
        """
        from tqdm.auto import tqdm

        from flowgrpo.rng import make_generator
        from flowgrpo.sampling.rollout import denoise
        from flowgrpo.sampling.sde import sde_step

        n = len(prompts)
        if len(metadata) != n or prompt_ids.shape != (n,) or sample_index.shape != (n,):
            raise ValueError(
                f"rollout got {n} prompts, {len(metadata)} metadata dicts, prompt_ids {tuple(prompt_ids.shape)}, "
                f"sample_index {tuple(sample_index.shape)}"
            )
        if batch_size < 1:
            raise ValueError(f"rollout batch_size must be >= 1, got {batch_size}")
        _check_merge_kind(settings.sde_kind)
        t_count = settings.num_steps
        sigmas = adapter.sigmas(t_count)
        plan = self.branch_plan(sigmas, settings.sde_kind, settings.noise_level)
        s_max = plan[-1][0]
        dev = adapter.device

        # 1. prompts: one anchor per prompt id, in order of first appearance
        pids, js = prompt_ids.tolist(), sample_index.tolist()
        anchors = list(dict.fromkeys(pids))  # (P_u,) prompt ids
        members = {p: [i for i in range(n) if pids[i] == p] for p in anchors}
        for p, idx in members.items():
            if len({prompts[i] for i in idx}) > 1:
                raise ValueError(f"prompt id {p} appears with different prompts: {sorted({prompts[i] for i in idx})}")
        texts = [prompts[members[p][0]] for p in anchors]
        unique = list(dict.fromkeys(texts))
        embeds_u = adapter.encode_prompts(unique)
        anchor_embeds = embeds_u.index(torch.tensor([unique.index(t) for t in texts]).to(dev))  # (P_u, …)

        # 2. anchors: ODE from the shared initial noise up to the last branch step, keeping v at branch steps
        branch_at = {s for s, _ in plan}
        a_lat, a_vel = [], {s: [] for s in branch_at}
        for start in tqdm(range(0, len(anchors), batch_size), desc="anchors", disable=not progress, leave=False):
            chunk = anchors[start : start + batch_size]
            emb = anchor_embeds.index(slice(start, start + len(chunk)))
            x = adapter.initial_latents(len(chunk), [make_generator(seed, epoch, p, "init", 0) for p in chunk])
            x = x.float()
            xs = [x]
            for t in range(s_max + 1):
                v = adapter.velocity(x, sigmas[t].expand(len(chunk)).to(x.device), emb, settings.guidance_scale)
                if t in branch_at:
                    a_vel[t].append(v.float())
                if t < s_max:
                    x = sde_step(x, v, sigmas[t].item(), sigmas[t + 1].item(), kind="ode",
                                 noise_level=settings.noise_level, reduction=settings.logprob_reduction).next_latents
                    xs.append(x)
            a_lat.append(torch.stack(xs, dim=1))
        anchor_lat = torch.cat(a_lat)  # (P_u, s_max+1, …)
        anchor_vel = {s: torch.cat(v) for s, v in a_vel.items()}  # s -> (P_u, …)

        # 3. rows: prompt → branch step → sample
        rows = [(a, k, i) for a, p in enumerate(anchors) for k in range(len(plan)) for i in members[p]]
        b = len(rows)
        lat_shape = anchor_lat.shape[2:]
        latents = torch.empty(b, t_count + 1, *lat_shape, dtype=torch.float32, device=dev)
        log_probs = torch.zeros(b, t_count)
        stochastic = torch.zeros(b, t_count, dtype=torch.bool)
        jump = torch.ones(b, t_count, dtype=torch.long)
        row_anchor = torch.tensor([a for a, _, _ in rows])
        row_embeds = anchor_embeds.index(row_anchor.to(dev))

        # 4. branches: for each branch step, SDE jump from the anchor, then ODE to the end
        no_sde = torch.zeros(t_count, dtype=torch.bool)
        for k, (s, m) in enumerate(tqdm(plan, desc="branches", disable=not progress, leave=False)):
            idx_k = [r for r in range(b) if rows[r][1] == k]
            for start in range(0, len(idx_k), batch_size):
                idx = torch.tensor(idx_k[start : start + batch_size])
                a_idx = row_anchor[idx].to(dev)
                gens = [make_generator(seed, epoch, pids[rows[r][2]], "branch", s, js[rows[r][2]])
                        for r in idx.tolist()]
                out = sde_step(anchor_lat[a_idx, s], anchor_vel[s][a_idx], sigmas[s].item(), sigmas[s + m].item(),
                               kind=settings.sde_kind, noise_level=settings.noise_level, generator=gens,
                               reduction=settings.logprob_reduction,
                               simplified_log_prob=settings.cps_simplified_logprob)
                rest, _, _ = denoise(adapter, out.next_latents, row_embeds.index(idx.to(dev)), sigmas[s + m :],
                                     settings, no_sde[s + m :], None)  # (n_b, T−s−m+1, …)
                i_dev = idx.to(dev)
                latents[i_dev, : s + 1] = anchor_lat[a_idx, : s + 1]
                latents[i_dev, s + 1 : s + m + 1] = out.next_latents.unsqueeze(1)
                latents[i_dev, s + m :] = rest
                log_probs[idx, s] = out.log_prob.cpu()
                stochastic[idx, s] = (out.std > 0).cpu()
                jump[idx, s] = m
                jump[idx, s + 1 : s + m] = 0

        src = [i for _, _, i in rows]
        decoded = []
        for i in range(0, b, batch_size):
            decoded.append(adapter.decode(latents[i : i + batch_size, -1]).cpu())
            if on_images is not None:
                part = src[i : i + batch_size]
                on_images(decoded[-1], [prompts[j] for j in part], [metadata[j] for j in part])
        images = torch.cat(decoded)
        row_pid = torch.tensor([pids[i] for i in src], dtype=torch.long)
        row_step = torch.tensor([plan[k][0] for _, k, _ in rows], dtype=torch.long)
        return Trajectory(
            latents=latents,
            log_probs=log_probs,
            sigmas=sigmas,
            stochastic=stochastic,
            jump=jump,
            group_ids=row_pid * (t_count + 1) + row_step,
            prompt_ids=row_pid,
            embeds=row_embeds,
            images=images,
            prompts=[prompts[i] for i in src],
            metadata=[metadata[i] for i in src],
            guidance_scale=settings.guidance_scale,
        )

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        """One chunk ``(s,)`` per branch step s; ``selected[b, k]`` is True only for the samples that branched at
        chunk k's step (each sample trains its one stochastic jump).

        Raises:
            ValueError: a sample without exactly one stochastic transition (not an entropy_merge rollout).
        """
        per_row = traj.stochastic.sum(dim=1)
        if not bool((per_row == 1).all()):
            raise ValueError("entropy_merge plans need exactly one stochastic transition per sample (its branch "
                             f"jump); found counts {sorted(set(per_row.tolist()))}")
        steps = [t for t in range(traj.num_steps) if bool(traj.stochastic[:, t].any())]
        return _plan([(t,) for t in steps], traj.stochastic[:, steps].clone())
