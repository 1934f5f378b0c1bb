"""``entropy_merge``: E-GRPO's entropy-merged SDE jumps and shared-anchor branching (Zhang et al., arXiv 2601.00423).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from tqdm.auto import tqdm

from flowgrpo.algo.chunkers.base import CHUNKERS, BaseChunker, ChunkerConfig, fraction_count, make_plan
from flowgrpo.records import ChunkPlan, PromptEmbeds, Trajectory
from flowgrpo.rng import make_generator
from flowgrpo.sampling.feature_cache import ode_step_cache
from flowgrpo.sampling.rollout import RolloutRequest, decode_and_report, denoise, encode_rows
from flowgrpo.sampling.sde import gaussian_entropy_per_dim, sde_step, sigma_one_next, transition_moments

#: SDE kinds ``entropy_merge`` refuses, with the reason.
_NO_MERGE_KINDS = {
    "cps": "its std σ_next·sin(aπ/2) shrinks as a jump grows, so merging steps lowers the entropy instead of "
    "raising it",
    "ode": "it has no noise (std 0, entropy −∞), so no step can reach the threshold",
}


def _check_merge_kind(kind: str) -> None:
    if kind in _NO_MERGE_KINDS:
        raise ValueError(
            f"chunker 'entropy_merge' cannot use sampling.sde_kind={kind!r}: {_NO_MERGE_KINDS[kind]}; "
            "use flow_sde or dance_sde"
        )


def jump_entropy(sigmas: torch.Tensor, start: int, length: int, *, kind: str, noise_level: float,
                 sigma_one_next: float | None = None) -> float:
    """Entropy per latent dimension of one SDE jump from ``sigmas[start]`` to ``sigmas[start + length]``.

    ``h = ½·log(2πe·std²)`` (:func:`~flowgrpo.sampling.sde.gaussian_entropy_per_dim`; E-GRPO, arXiv 2601.00423,
    Sec. 3.2, divided by the latent size D), where std is the transition std of ``kind`` with σ_next the grid
    value ``length`` steps on: a merged jump is the ordinary transition over a longer interval. The std of every
    kind here depends on σ alone, not on the latents. float; −inf where std = 0. ``sigma_one_next``: flow_sde's
    σ = 1 guard (:func:`~flowgrpo.sampling.sde.transition_moments`), None for the jump's own σ_next.

    Raises:
        ValueError: ``start``/``length`` outside the grid (0 ≤ start, 1 ≤ length, start + length ≤ T).
        KeyError: unknown ``kind``.
    """
    t_count = len(sigmas) - 1
    if start < 0 or length < 1 or start + length > t_count:
        raise ValueError(f"a jump needs 0 <= start, 1 <= length, start + length <= T={t_count}; "
                         f"got start={start}, length={length}")
    zero = torch.zeros(1, 1)
    _, std = transition_moments(zero, zero, float(sigmas[start]), float(sigmas[start + length]), kind=kind,
                                noise_level=noise_level, sigma_one_next=sigma_one_next)
    return float(gaussian_entropy_per_dim(std)[0])


def step_entropies(sigmas: torch.Tensor, *, kind: str, noise_level: float) -> torch.Tensor:
    """(T,) float32 entropy per latent dimension of each single grid step (:func:`jump_entropy` with m = 1)."""
    return torch.tensor([jump_entropy(sigmas, i, 1, kind=kind, noise_level=noise_level)
                         for i in range(len(sigmas) - 1)], dtype=torch.float32)


def merge_plan(sigmas: torch.Tensor, *, kind: str, noise_level: float, tau: float | None = None,
               limit: int | None = None, steps: list[int] | None = None, lengths: list[int] | None = None,
               sigma_one_next: float | None = None) -> list[tuple[int, int]]:
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
        sigma_one_next: flow_sde's σ = 1 guard for the jumps' entropy (see :func:`jump_entropy`).

    Raises:
        ValueError: ``kind`` is ``cps`` or ``ode``; both or neither of ``tau`` and ``steps``; hand lists of
            different lengths, out of the grid, not increasing, or overlapping (s_k + m_k > s_{k+1}); ``limit``
            outside 1..T; no step reaches τ (the message gives the largest reachable entropy).
    """
    _check_merge_kind(kind)
    t_count = len(sigmas) - 1
    if (tau is None) == (steps is None):
        raise ValueError("entropy_merge needs exactly one of chunker.entropy_threshold (the entropy rule) or "
                         f"objective.chunker.merge_steps (hand-set branch steps); got entropy_threshold={tau}, "
                         f"merge_steps={steps}")
    if steps is not None:
        return _hand_plan(list(steps), [1] * len(steps) if lengths is None else list(lengths), t_count)
    limit = t_count if limit is None else int(limit)
    if not 1 <= limit <= t_count:
        raise ValueError(f"the entropy_merge window must cover 1..T={t_count} steps, got {limit}")
    return _entropy_rule_plan(sigmas, kind, noise_level, tau, limit, sigma_one_next)


def _hand_plan(steps: list[int], lengths: list[int], t_count: int) -> list[tuple[int, int]]:
    """The hand-set (step, length) list after validation (see :func:`merge_plan`)."""
    if not steps or len(lengths) != len(steps):
        raise ValueError(f"objective.chunker.merge_steps {steps} and merge_lengths {lengths} must be non-empty lists "
                         "of equal length")
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


def _entropy_rule_plan(sigmas: torch.Tensor, kind: str, noise_level: float, tau: float, limit: int,
                       sigma_one_next: float | None = None) -> list[tuple[int, int]]:
    """E-GRPO's walk over the grid (see :func:`merge_plan`): the smallest jump from each free step whose entropy
    reaches ``tau`` within ``limit`` steps."""
    plan: list[tuple[int, int]] = []
    best = -math.inf
    s = 0
    while s < limit:
        chosen = None
        for m in range(1, limit - s + 1):
            h = jump_entropy(sigmas, s, m, kind=kind, noise_level=noise_level, sigma_one_next=sigma_one_next)
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


class EntropyMergeConfig(ChunkerConfig):
    """Settings of ``entropy_merge`` (E-GRPO, arXiv 2601.00423): the entropy rule (``entropy_threshold``) or
    hand-set branch steps (``merge_steps``), exactly one of them."""

    name: Literal["entropy_merge"] = "entropy_merge"
    multiplies_batch: ClassVar[bool] = True  # P·|branch steps|·G trajectories an epoch
    caches_ode_steps: ClassVar[bool] = True  # the anchor prefix and the ODE continuations
    entropy_threshold: float | None = Field(
        None, description="tau, the entropy per latent dim 0.5*log(2*pi*e*std^2) a merged SDE jump must reach "
        "(E-GRPO Sec. 3.2, divided by the latent size)"
    )
    sde_fraction: float = Field(
        0.5, gt=0, le=1, description="entropy-rule jumps lie within the first ceil(fraction*T) steps (E-GRPO: the "
        "first half)"
    )
    merge_steps: list[int] | None = Field(
        None, description="hand-set branch steps, increasing (the E-GRPO code's eta_step_list)"
    )
    merge_lengths: list[int] | None = Field(
        None, description="grid steps each hand-set jump spans (eta_step_merge_list; default all 1)"
    )
    ode_after_jump: Literal["next_step", "landing"] = Field(
        "next_step", description="after a merged jump from step s to sigma_{s+m}, the ODE runs on the grid from "
        "step s+1 (next_step: the released sampler's _run_ode_sample, which treats the landed latent as if at "
        "sigma_{s+1}) or from sigma_{s+m}, where the latent is (landing); the same for m = 1"
    )

    @model_validator(mode="after")
    def _one_rule(self) -> EntropyMergeConfig:
        if (self.entropy_threshold is None) == (self.merge_steps is None):
            raise ValueError("chunker 'entropy_merge' needs exactly one of chunker.entropy_threshold (the entropy "
                             "rule) or objective.chunker.merge_steps (hand-set branch steps); got entropy_threshold="
                             f"{self.entropy_threshold}, merge_steps={self.merge_steps}")
        if self.merge_lengths is not None and self.merge_steps is None:
            raise ValueError("objective.chunker.merge_lengths needs objective.chunker.merge_steps")
        return self


@CHUNKERS.register("entropy_merge")
class EntropyMerge(BaseChunker):
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
    divide B_local = P_local·|S|·G. Choose a multiple of G (the per-process share of a group): a micro-batch then
    holds whole (prompt, branch step) groups, each one transformer row in the update (``shares_inputs``), and
    its chunks share one call (the digits default: 32 rows, four groups, one call of four rows). Old log-probs
    are recomputed in the training layout (the rollout scores the jump with the anchor's batched velocity), so
    ``needs_recompute`` is True.
    With several processes, choose P divisible by the process count so that no group is split: a prompt whose
    samples fall on two processes gets its anchor computed on each, equal only up to batching round-off.

    Against the released code (shengjun-zhang/VisualGRPO): a merged jump from σ = 1 uses its guard 1 − σ_grid[1]
    (``sampling.sigma_one_guard: grid``; ``next`` keeps std = a whatever m) and the ODE after a merged jump runs
    from grid step s + 1 as its ``_run_ode_sample`` (``ode_after_jump: next_step``; ``landing`` continues from
    σ_{s+m}; with ``next_step`` the record's latents after s + m are that continuation's last T − s − m states,
    m − 1 more transformer calls per row). Its multi-granularity rewards (``granular_list``) are not implemented
    (one ODE continuation on the full grid).
    """

    Config = EntropyMergeConfig
    needs_recompute = True
    shares_inputs = True  # the G rows of a (prompt, branch step) group jump from one anchor latent

    def branch_plan(self, sigmas: torch.Tensor, kind: str, noise_level: float,
                    sigma_one_next: float | None = None) -> list[tuple[int, int]]:
        """The epoch's (branch step, jump length) list for the σ grid and SDE (see :func:`merge_plan`)."""
        t_count = len(sigmas) - 1
        return merge_plan(sigmas, kind=kind, noise_level=noise_level, tau=self.cfg.entropy_threshold,
                          limit=fraction_count(self.cfg.sde_fraction, t_count), steps=self.cfg.merge_steps,
                          lengths=self.cfg.merge_lengths, sigma_one_next=sigma_one_next)

    def validate(self, num_steps: int, sde_kind: str) -> None:
        _check_merge_kind(sde_kind)
        if self.cfg.merge_steps is not None and max(self.cfg.merge_steps) >= num_steps:
            raise ValueError(f"objective.chunker.merge_steps {list(self.cfg.merge_steps)} must be < num_steps "
                             f"{num_steps}")

    def validate_grid(self, sigmas: torch.Tensor, settings) -> None:
        """The entropy rule's branch plan on the model's grid (``ValueError`` when no jump reaches τ)."""
        self.branch_plan(sigmas, settings.sde_kind, settings.noise_level, sigma_one_next(settings, sigmas))

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """|S|: a sample branches once at every branch step of the plan."""
        return len(self.branch_plan(sigmas, settings.sde_kind, settings.noise_level, sigma_one_next(settings, sigmas)))

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
    def rollout(self, adapter, request: RolloutRequest) -> Trajectory:
        """Shared-anchor branching (see the class docstring): n requested samples → n·|S| trajectories.

        ``request`` holds the n = P_local·G local samples as :func:`flowgrpo.sampling.rollout.rollout` takes them;
        sample (p, j) becomes |S| trajectories (p, s, j), one per branch step; ``request.batch_size`` is the most
        trajectories (anchors, or branches) per transformer call; ``on_images`` is called with each decoded
        batch of rows, in row order.

        Returns:
            A :class:`~flowgrpo.records.Trajectory` of B = n·|S| rows (latents on the adapter's device).

        Raises:
            ValueError: mismatched inputs, sde_kind cps/ode, a prompt id that appears with two different
                prompts, or a merge plan error (:func:`merge_plan`).
        """
        settings = request.settings
        _check_merge_kind(settings.sde_kind)
        sigmas = adapter.sigmas(settings.num_steps)
        plan = self.branch_plan(sigmas, settings.sde_kind, settings.noise_level, sigma_one_next(settings, sigmas))
        anchors = _Anchors.sample(adapter, request, sigmas, plan)
        rows = [(a, k, i) for a, p in enumerate(anchors.prompt_ids) for k in range(len(plan))
                for i in anchors.members[p]]  # prompt → branch step → sample
        rec = _branch(adapter, request, sigmas, plan, anchors, rows, self.cfg.ode_after_jump)
        src = [i for _, _, i in rows]
        images = decode_and_report(adapter, rec.pop("final"), [request.prompts[i] for i in src],
                                   [request.metadata[i] for i in src], request)
        pids = request.prompt_ids.tolist()
        row_pid = torch.tensor([pids[i] for i in src], dtype=torch.long)
        row_step = torch.tensor([plan[k][0] for _, k, _ in rows], dtype=torch.long)
        return Trajectory(
            **rec, sigmas=sigmas, group_ids=row_pid * (settings.num_steps + 1) + row_step, prompt_ids=row_pid,
            images=images, prompts=[request.prompts[i] for i in src], metadata=[request.metadata[i] for i in src],
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
        return make_plan([(t,) for t in steps], traj.stochastic[:, steps].clone())


@dataclass(frozen=True)
class _Anchors:
    """One ODE anchor per distinct prompt id, run from the prompt's initial noise up to the last branch step.

    Attributes:
        prompt_ids: the P_u distinct prompt ids, in order of first appearance.
        members: prompt id → indices of its samples in the request.
        embeds: (P_u, …) prompt embeddings.
        latents: (P_u, s_max+1, …) float32 anchor latents on the adapter's device.
        velocity: branch step s → (P_u, …) float32 velocity at the anchor latent x_s.
    """

    prompt_ids: list[int]
    members: dict[int, list[int]]
    embeds: PromptEmbeds
    latents: torch.Tensor
    velocity: dict[int, torch.Tensor]

    @classmethod
    def sample(cls, adapter, request: RolloutRequest, sigmas: torch.Tensor, plan) -> _Anchors:
        s_max = plan[-1][0]
        settings = request.settings
        pids = request.prompt_ids.tolist()
        anchors = list(dict.fromkeys(pids))
        members = {p: [i for i in range(len(pids)) if pids[i] == p] for p in anchors}
        for p, idx in members.items():
            if len({request.prompts[i] for i in idx}) > 1:
                raise ValueError(f"prompt id {p} appears with different prompts: "
                                 f"{sorted({request.prompts[i] for i in idx})}")
        first = [members[p][0] for p in anchors]
        embeds = encode_rows(adapter, [request.prompts[i] for i in first], [request.metadata[i] for i in first])
        branch_at = {s for s, _ in plan}
        lat, vel = [], {s: [] for s in branch_at}
        bs = request.batch_size
        for start in tqdm(range(0, len(anchors), bs), desc="anchors", disable=not request.progress, leave=False):
            part = anchors[start : start + bs]
            emb = embeds.index(slice(start, start + len(part)))
            gens = [make_generator(request.seed, request.epoch, p, "init", 0) for p in part]
            x = adapter.initial_latents(len(part), gens).float()
            xs = [x]
            with ode_step_cache(adapter, request.ode_cache, s_max + 1) as ode_cache:
                for t in range(s_max + 1):
                    if ode_cache is not None:  # off at a branch step: its velocity is the jump's mean
                        ode_cache.step(float(sigmas[t]), cached=t not in branch_at)
                    v = adapter.velocity(x, sigmas[t].expand(len(part)).to(x.device), emb, settings.guidance_scale)
                    if t in branch_at:
                        vel[t].append(v.float())
                    if t < s_max:
                        x = sde_step(x, v, sigmas[t].item(), sigmas[t + 1].item(), kind="ode",
                                     noise_level=settings.noise_level).next_latents
                        xs.append(x)
            lat.append(torch.stack(xs, dim=1))
        return cls(anchors, members, embeds, torch.cat(lat), {s: torch.cat(v) for s, v in vel.items()})


def _branch(adapter, request: RolloutRequest, sigmas: torch.Tensor, plan, anchors: _Anchors, rows,
            ode_after_jump: str = "next_step") -> dict:
    """For each branch step (s, m): one SDE jump of every row of that step from its anchor latent x_s to
    σ_grid[s + m], reusing the anchor's velocity, then ODE to σ = 0 from grid step s + 1 (``next_step``) or
    s + m (``landing``). Returns the record's per-row fields and ``final`` (B, …), the ODE's last latent, which
    is decoded (with ``next_step`` and a merged jump ending at σ = 0 it is not in the record: position T holds
    the jump's landing, which training scores)."""
    settings = request.settings
    t_count, dev = settings.num_steps, adapter.device
    b = len(rows)
    latents = torch.empty(b, t_count + 1, *anchors.latents.shape[2:], dtype=torch.float32, device=dev)
    final = torch.empty(b, *anchors.latents.shape[2:], dtype=torch.float32, device=dev)
    log_probs = torch.zeros(b, t_count)
    stochastic = torch.zeros(b, t_count, dtype=torch.bool)
    jump = torch.ones(b, t_count, dtype=torch.long)
    row_anchor = torch.tensor([a for a, _, _ in rows])
    row_embeds = anchors.embeds.index(row_anchor.to(dev))
    pids, js = request.prompt_ids.tolist(), request.sample_index.tolist()
    no_sde = torch.zeros(t_count, dtype=torch.bool)
    guard = sigma_one_next(settings, sigmas)
    for k, (s, m) in enumerate(tqdm(plan, desc="branches", disable=not request.progress, leave=False)):
        idx_k = [r for r in range(b) if rows[r][1] == k]
        for start in range(0, len(idx_k), request.batch_size):
            idx = torch.tensor(idx_k[start : start + request.batch_size])
            a_idx, i_dev = row_anchor[idx].to(dev), idx.to(dev)
            gens = [make_generator(request.seed, request.epoch, pids[rows[r][2]], "branch", s, js[rows[r][2]])
                    for r in idx.tolist()]
            out = sde_step(anchors.latents[a_idx, s], anchors.velocity[s][a_idx], sigmas[s].item(),
                           sigmas[s + m].item(), kind=settings.sde_kind, noise_level=settings.noise_level,
                           generator=gens, reduction=settings.logprob_reduction,
                           simplified_log_prob=settings.cps_simplified_logprob, sigma_one_next=guard)
            start = s + 1 if ode_after_jump == "next_step" else s + m
            # (n_b, T−start+1, …), rest[:, 0] the landed latent; a cache only on these ODE steps
            with ode_step_cache(adapter, request.ode_cache, t_count - start) as ode_cache:
                rest, _, _ = denoise(adapter, out.next_latents, row_embeds.index(i_dev), sigmas[start:], settings,
                                     no_sde[start:], None, ode_cache=ode_cache)
            latents[i_dev, : s + 1] = anchors.latents[a_idx, : s + 1]
            latents[i_dev, s + 1 : s + m + 1] = out.next_latents.unsqueeze(1)
            latents[i_dev, s + m + 1 :] = rest[:, s + m + 1 - start :]
            final[i_dev] = rest[:, -1]
            log_probs[idx, s] = out.log_prob.cpu()
            stochastic[idx, s] = (out.std > 0).cpu()
            jump[idx, s] = m
            jump[idx, s + 1 : s + m] = 0
    return {"latents": latents, "log_probs": log_probs, "stochastic": stochastic, "jump": jump,
            "embeds": row_embeds, "final": final}
