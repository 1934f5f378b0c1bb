"""DGPO: Direct Group Preference Optimization on the forward process (Luo, Hu & Tang, arXiv 2510.08425, ICLR
2026; Luo-Yihong/DGPO).

A group's samples are split by the sign of their advantage into a positive and a negative group, and the model
maximises log σ(R_θ(G⁺) − R_θ(G⁻)) with DPO's implicit reward on the forward process. For the rollout's final
latent x₀, noise ε (shared by a group) and a training σ, with x_σ = (1 − σ)·x₀ + σ·ε and target ε − x₀:

    e_θ   = mean_dims((ε − x₀ − v_θ)²)        e_ref = mean_dims((ε − x₀ − v_ref)²)     per row
    s_g   = Σ_{i ∈ g} A_i·β_dpo·(sg(e_θ,i) − e_ref,i) / G                                  per group (G: group size)
    loss  = sigmoid(s_g)·A_i·e_θ,i + β_KL·mean_dims((v_θ − v_ref)²)                        per row

(train_sd3_dgpo.py ``compute_group_dgpo_loss_allreduce``, lines 162–193: the group sums are all-reduced over the
processes, so s_g covers every row of group g in the micro-batch; the KL is lines 1150–1156.) ``sigmoid(s_g)`` is
the detached gradient weight of −log σ(R⁺ − R⁻). With ``clip_dsm`` a PPO-style clip against the old copy's error
e_old stops the gradient of rows that moved too far: ρ = exp(e_old − e_θ); a row is clipped when A > 0 and
ρ > 1 + ε, or A ≤ 0 and ρ < 1 − ε (lines 1133–1144). Advantages are clipped to ±``adv_clip_max`` first
(lines 1127–1131).

References: v_ref is the frozen base model, guided with ``kl_cfg`` when that is > 1 (mode 2a, CFG-free rollout);
with ``use_ema_ref`` the preference reference (not the KL's) is the old copy instead (mode 2b, TDM-R1's dynamic
reference, lines 1122–1124).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from flowgrpo.algo.objectives.base import CLIP_RANGE, OBJECTIVES, shared_field
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, noised, velocity_mse, velocity_target
from flowgrpo.algo.objectives.forward import ForwardConfig, ForwardObjective, ForwardWork, RowDraw, SolverName, shared
from flowgrpo.distributed import dist
from flowgrpo.records import FinalSamples
from flowgrpo.rng import make_generator

__all__ = ["DGPO", "DGPOConfig", "dgpo_clip_mask", "dgpo_group_sums", "dgpo_terms",
           "dgpo_train_indices", "dgpo_train_sigmas", "shared_group_noise"]


def dgpo_clip_mask(err: torch.Tensor, old_err: torch.Tensor, advantages: torch.Tensor,
                   clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ (N,), clipped (N,) bool) with ρ = exp(e_old − e_θ) (detached) and clipped where A > 0 and ρ > 1 + ε, or
    A ≤ 0 and ρ < 1 − ε (train_sd3_dgpo.py lines 1136–1142)."""
    ratio = torch.exp(old_err.detach().float() - err.detach().float())
    clipped = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return ratio, clipped


def dgpo_group_sums(delta: torch.Tensor, advantages: torch.Tensor, group_index: torch.Tensor, num_groups: int,
                    beta_dpo: float, group_size: int) -> torch.Tensor:
    """This process's part of s_g = Σ_{i ∈ g} A_i·β_dpo·Δ_i / G, (num_groups,) float32 (detached); the caller sums
    it over the processes (lines 176–185).

    Args:
        delta: (N,) sg(e_θ) − e_ref per row; advantages: (N,) clipped advantages.
        group_index: (N,) long in [0, num_groups), the same numbering on every process.
        group_size: G, the samples a prompt has (the release divides by its configured group size).

    Raises:
        ValueError: mismatched shapes, an index outside [0, num_groups), or G < 1.
    """
    if delta.shape != advantages.shape or delta.shape != group_index.shape or delta.ndim != 1:
        raise ValueError(f"dgpo_group_sums shapes disagree: delta {tuple(delta.shape)}, advantages "
                         f"{tuple(advantages.shape)}, group_index {tuple(group_index.shape)}")
    if group_size < 1:
        raise ValueError(f"DGPO group_size must be >= 1, got {group_size}")
    if delta.numel() and (int(group_index.min()) < 0 or int(group_index.max()) >= num_groups):
        raise ValueError(f"group_index must lie in [0, {num_groups}), got {group_index.min()}..{group_index.max()}")
    term = (advantages.float() * beta_dpo * delta.detach().float() / group_size).detach()
    return torch.zeros(num_groups, device=term.device, dtype=term.dtype).index_add_(0, group_index.to(term.device),
                                                                                    term)


def _check_terms_input(v, noise, x0, v_ref, v_old, advantages, settings: DGPOConfig) -> None:
    if noise.shape != v.shape or x0.shape != v.shape or v_ref.shape != v.shape or advantages.shape != v.shape[:1]:
        raise ValueError(f"dgpo_terms shapes disagree: v {tuple(v.shape)}, noise {tuple(noise.shape)}, x0 "
                         f"{tuple(x0.shape)}, v_ref {tuple(v_ref.shape)}, advantages {tuple(advantages.shape)}")
    if settings.uses_old_copy and v_old is None:
        raise ValueError("DGPO with clip_dsm, clip_kl or use_ema_ref needs the old copy's velocity v_old")


def dgpo_terms(
    v: torch.Tensor,
    noise: torch.Tensor,
    x0: torch.Tensor,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    settings: DGPOConfig,
    *,
    group_size: int,
    v_ref: torch.Tensor,
    v_old: torch.Tensor | None = None,
    reduce_group_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ObjectiveTerms:
    """DGPO's loss for N rows (module docstring), float32.

    Args:
        v: (N, …) the trained velocity at x_σ, with gradient. noise, x0: (N, …) ε and the rollout's final latents.
        advantages: (N,) advantages of each row's sample (clipped here to ±``adv_clip_max``).
        group_index, num_groups: each row's group, numbered alike on every process (see :func:`dgpo_group_sums`).
        settings: the validated :class:`DGPOConfig` (its loss knobs are read); group_size: G.
        v_ref: (N, …) the frozen reference's velocity (with ``kl_cfg`` guidance when > 1).
        v_old: (N, …) the old copy's velocity, needed when ``settings.uses_old_copy``.
        reduce_group_sums: sums the (num_groups,) partial sums over the processes (an all-reduce); None: one process.

    Returns:
        ``ObjectiveTerms`` with ``loss`` (N,) and the detached stats ``policy_loss``, ``fm_error`` (e_θ),
        ``ref_fm_error`` (e of the preference reference), ``group_weight`` (sigmoid(s_g)), ``clipped`` (0/1),
        ``kl_ref``.

    Raises:
        ValueError: mismatched shapes, or ``v_old`` missing when the settings need it.
    """
    _check_terms_input(v, noise, x0, v_ref, v_old, advantages, settings)
    n = v.shape[0]
    adv = advantages.float().to(v.device).clamp(-settings.adv_clip_max, settings.adv_clip_max)
    target = velocity_target(x0, noise)
    err = velocity_mse(target, v)
    clipped = torch.zeros(n, dtype=torch.bool, device=v.device)
    if settings.clip_dsm or settings.clip_kl:
        _, clipped = dgpo_clip_mask(err, velocity_mse(target, v_old), adv, settings.clip_range)
        if settings.clip_dsm:
            err = torch.where(clipped, err.detach(), err)
    pref_ref = v_old if settings.use_ema_ref else v_ref
    ref_err = velocity_mse(target, pref_ref.detach())
    sums = dgpo_group_sums(err.detach() - ref_err, adv, group_index, num_groups, settings.beta_dpo, group_size)
    if reduce_group_sums is not None:
        sums = reduce_group_sums(sums)
    weight = torch.sigmoid(sums)[group_index.to(v.device)].detach()
    policy = weight * adv * err
    kl = velocity_mse(v, v_ref.detach())
    if settings.clip_kl:
        kl = torch.where(clipped, kl.detach(), kl)
    loss = policy + settings.kl_beta * kl if settings.kl_beta else policy
    stats = {"policy_loss": policy.detach(), "fm_error": err.detach(), "ref_fm_error": ref_err.detach(),
             "group_weight": weight, "clipped": clipped.float(), "kl_ref": kl.detach()}
    return ObjectiveTerms(loss=loss, stats=stats)


def dgpo_train_indices(settings: DGPOConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The M grid steps an epoch trains on, (M,) long: M distinct steps drawn uniformly from 0 … trunc_steps in
    random order, shared by every micro-batch of the epoch and every process (the release's
    ``random.sample(range(trunc_steps + 1), M)`` broadcast from rank 0, lines 1062–1064 and 52–74)."""
    return torch.randperm(settings.trunc_steps + 1, generator=generator)[: settings.num_train_timesteps]


def dgpo_train_sigmas(sigmas: torch.Tensor, indices: torch.Tensor, *, timestep_rounding: bool = True) -> torch.Tensor:
    """The training σ of grid steps ``indices``, (M,) float32.

    With ``timestep_rounding`` (the release) σ is the scheduler's integer timestep / 1000, ⌊σ·1000⌋/1000: DGPO's
    DPM-Solver scheduler stores ``timesteps`` as int64 and the update noises with ``t / 1000`` (train_sd3_dgpo.py
    line 1100); without it, the grid's σ itself.
    """
    s = sigmas[indices].double()
    return (torch.floor(s * 1000) / 1000).float() if timestep_rounding else s.float()


def shared_group_noise(shape: tuple[int, ...], group_index: torch.Tensor, num_groups: int,
                       generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """ε for N rows, (N, …) float32, one standard-normal draw per group shared by its rows (``use_shared_noise``,
    ``generate_shared_noise_for_groups``, lines 76–108). ``shape`` is one row's latent shape."""
    draws = torch.randn(num_groups, *shape, generator=generator, device=device)
    return draws[group_index.to(draws.device)]


class DGPOConfig(ForwardConfig):
    """``objective: {name: dgpo, ...}``: DGPO with the release's defaults (Luo-Yihong/DGPO, config/dgpo.py
    ``geneval_sd3_4gpu``, mode 1: CFG at rollout only; docs/fidelity_forward.md). The pure functions above read it
    as it is (validated once, here).

    Attributes:
        beta_dpo: β_dpo of the group preference (dgpo.py line 88: 100; PickScore 10; EMA-reference mode 2000).
        kl_beta: β_KL of the velocity KL to the frozen reference (line 63: 0.02; EMA-reference mode 1e-3).
        clip_range: ε of the clip against the old copy (line 59: 1e-2; ``dgpo_wocfg.py`` 1e-3, EMA-reference 1e-5).
        clip_dsm: clip the flow-matching error's gradient (line 39: True).
        clip_kl: clip the KL's gradient with the same mask (line 40: False).
        adv_clip_max: advantages clipped to ±c (config/base.py line 89: 5).
        use_ema_ref: the preference reference is the old copy, not the frozen model (base.py line 30: False).
        kl_cfg: guidance of the frozen reference's velocity, applied when > 1 (base.py line 29: 1.0;
            ``dgpo_wocfg.py`` 4.5).
        num_train_timesteps: M training σ's per epoch (dgpo.py line 28: 4).
        trunc_steps: they are drawn from grid steps 0 … trunc_steps (line 64: 4; OCR 6, line 29); M must not
            exceed trunc_steps + 1 (checked on validation).
        shared_noise: the rows of a group share ε (line 30: True).
        switch_ema_ref: past this many optimizer steps the rollout samples with the old copy (line 61: 500;
            OCR 200, line 32).
        decay_*: the old copy's schedule, applied after every optimizer step k (before k counts it):
            min(0.3, 0.001·k) (train_sd3_dgpo.py line 1176).
    """

    name: Literal["dgpo"] = "dgpo"
    caches_rollout: ClassVar[bool] = True  # an ODE rollout that keeps only the final latents
    solver: SolverName = shared("solver", "dpmpp_2m")
    grid: Literal["model", "flow_shift"] = shared("grid", "flow_shift")
    kl_beta: float = shared("kl_beta", 0.02)
    decay_cap: float = shared("decay_cap", 0.3)
    beta_dpo: float = Field(100.0, ge=0, description="DGPO beta_dpo of the group preference (mode 2b: 2000)")
    clip_range: float = shared_field(CLIP_RANGE, 1e-2)
    clip_dsm: bool = Field(True, description="DGPO: clipped rows' flow-matching error carries no gradient")
    clip_kl: bool = Field(False, description="DGPO: nor their KL")
    use_ema_ref: bool = Field(False, description="DGPO: the preference reference is the old copy (mode 2b)")
    kl_cfg: float = Field(1.0, ge=0, description="DGPO: guidance of the reference's velocity when > 1 (mode 2a: "
                          "4.5); else objective.train_guidance_scale")
    num_train_timesteps: int = Field(4, ge=1, description="DGPO: M training sigmas an epoch, shared by every "
                                     "micro-batch and process")
    trunc_steps: int = Field(4, ge=0, description="DGPO: drawn from grid steps 0..trunc_steps (OCR 6)")
    shared_noise: bool = Field(True, description="DGPO: the rows of a group share their noise")
    switch_ema_ref: int = Field(500, ge=0, description="DGPO: past this many optimizer steps the old copy rolls "
                                "out (OCR 200)")
    timestep_rounding: bool = Field(True, description="DGPO: training sigma floor(1000*sigma)/1000, the release's "
                                    "integer scheduler timestep")

    @model_validator(mode="after")
    def _timesteps_fit(self) -> DGPOConfig:
        if self.num_train_timesteps > self.trunc_steps + 1:
            raise ValueError(f"objective.num_train_timesteps={self.num_train_timesteps}: DGPO draws that many distinct "
                             f"grid steps from 0..trunc_steps={self.trunc_steps}, so it must be <= trunc_steps + 1")
        return self

    @property
    def uses_old_copy(self) -> bool:
        """Whether the update reads the old copy's velocity (clipping or the EMA reference)."""
        return self.clip_dsm or self.clip_kl or self.use_ema_ref


@OBJECTIVES.register("dgpo")
class DGPO(ForwardObjective):
    """DGPO (module docstring) in the training loop: the trained weights roll out (the old copy past
    ``switch_ema_ref`` steps), the epoch's M σ's are drawn once for every micro-batch and process, a group's rows
    share ε, the group sums are all-reduced (every micro-batch holds whole groups), and the old copy, the clip
    anchor, moves after every optimizer step (k = the steps before it)."""
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None

    Config = DGPOConfig

    @property
    def needs_reference(self) -> bool:
        """DGPO always forwards the frozen reference (its KL and, without ``use_ema_ref``, its preference)."""
        return True

    def validate(self) -> None:
        """Micro-batches of whole groups (the group sums run over a group's rows)."""
        super().validate()
        tb, g = self.cfg.train_batch_size, self.cfg.train.group_size
        if tb % g:
            raise ValueError(f"objective dgpo sums its preference over each group's rows in a micro-batch: "
                             f"train.train_batch_size={tb} must be a multiple of train.group_size={g}")

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return self.o.num_train_timesteps

    def check_grid(self, sigmas: torch.Tensor) -> None:
        """Grid steps 0..trunc_steps exist, and every process holds whole groups."""
        t = sigmas.numel() - 1
        if self.o.trunc_steps >= t:
            raise ValueError(f"objective dgpo: trunc_steps={self.o.trunc_steps} draws grid steps past the "
                             f"{t}-step grid; lower it below sampling.num_steps")
        self.check_whole_groups("sums its preference over each group's rows")

    def rollout_weights(self):
        """The trained weights until ``switch_ema_ref`` optimizer steps, then the old copy
        (train_sd3_dgpo.py: ``if global_step > config.switch_ema_ref``)."""
        return self.old.swapped() if self.optim.steps > self.o.switch_ema_ref else super().rollout_weights()

    def after_step(self, steps_before: int) -> None:
        """old ← d·old + (1 − d)·θ with d = decay(k), k the steps before this one (line 1176)."""
        self.old.update(steps_before)

    def plan_extra(self, samples: FinalSamples, epoch: int) -> dict:
        """The epoch's M grid steps and σ's (the same on every process) and the groups' global numbering."""
        idx = dgpo_train_indices(self.o, make_generator(self.cfg.train.seed, epoch, "dgpo_t"))
        groups = torch.unique(dist.gather_cat(samples.group_ids))  # sorted: the same numbering everywhere
        return {"indices": idx, "sigmas": dgpo_train_sigmas(samples.sigmas, idx, timestep_rounding=self.o
                                                            .timestep_rounding),
                "group_index": torch.searchsorted(groups, samples.group_ids), "num_groups": len(groups)}

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[RowDraw]:
        """The epoch's M σ's; ε per (group, σ) when shared, else per (sample, σ), the same in every pass."""
        s, x = work.samples, work.extra
        out = []
        for j, sigma in enumerate(x["sigmas"].tolist()):
            keys = ([(int(s.group_ids[r]),) for r in rows.tolist()] if self.o.shared_noise else
                    [(int(s.group_ids[r]), int(s.sample_index[r])) for r in rows.tolist()])
            eps = {k: torch.randn(s.x0.shape[1:], generator=make_generator(self.cfg.train.seed, work.epoch,
                                                                           "dgpo_eps", j, *k))
                   for k in dict.fromkeys(keys)}
            out.append(RowDraw(rows, torch.full((len(rows),), sigma), torch.stack([eps[k] for k in keys])))
        return out

    def terms(self, adapter, work: ForwardWork, draw: RowDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """v_ref (base model, at ``kl_cfg`` when > 1), v_old (old copy, when clipping or ``use_ema_ref``), then
        v_θ; :func:`dgpo_terms` with the group sums all-reduced over the processes."""
        settings, dev = self.o, x0.device
        sigma, noise = draw.sigma.to(dev), draw.noise.to(dev)
        x_t = noised(x0, noise, sigma)
        ref_g = self.o.kl_cfg if self.o.kl_cfg > 1 else None
        v_ref = self.velocity(adapter, x_t, sigma, embeds, weights="reference", guidance=ref_g)
        v_old = self.velocity(adapter, x_t, sigma, embeds, weights="old") if settings.uses_old_copy else None
        v = self.velocity(adapter, x_t, sigma, embeds)
        x = work.extra
        # the group index stays on the host (its range check reads it; dgpo_terms moves it for the sums)
        return dgpo_terms(v, noise, x0, work.advantages[draw.rows].to(dev), x["group_index"][draw.rows],
                          x["num_groups"], settings, group_size=self.cfg.train.group_size, v_ref=v_ref, v_old=v_old,
                          reduce_group_sums=dist.all_reduce_sum)
