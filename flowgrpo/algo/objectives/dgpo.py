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
from dataclasses import dataclass, field

import torch

from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, velocity_mse, velocity_target
from flowgrpo.algo.objectives.old_copy import DecaySchedule

__all__ = ["DGPOSettings", "dgpo_clip_mask", "dgpo_group_sums", "dgpo_terms", "dgpo_train_indices",
           "dgpo_train_sigmas", "shared_group_noise"]


@dataclass(frozen=True)
class DGPOSettings:
    """DGPO's knobs with the release's defaults (config/dgpo.py ``geneval_sd3_4gpu``, mode 1: CFG at rollout only).

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
        trunc_steps: they are drawn from grid steps 0 … trunc_steps (line 64: 4; OCR 6, line 29).
        shared_noise: the rows of a group share ε (line 30: True).
        switch_ema_ref: past this many optimizer steps the rollout samples with the old copy (line 61: 500;
            OCR 200, line 32).
        decay: the old copy's schedule, applied after every optimizer step k (before k counts it):
            min(0.3, 0.001·k) (train_sd3_dgpo.py line 1176).

    Raises:
        ValueError: on construction, a negative β, ε or c <= 0, M < 1, or M > trunc_steps + 1.
    """

    beta_dpo: float = 100.0
    kl_beta: float = 0.02
    clip_range: float = 1e-2
    clip_dsm: bool = True
    clip_kl: bool = False
    adv_clip_max: float = 5.0
    use_ema_ref: bool = False
    kl_cfg: float = 1.0
    num_train_timesteps: int = 4
    trunc_steps: int = 4
    shared_noise: bool = True
    switch_ema_ref: int = 500
    decay: DecaySchedule = field(default_factory=lambda: DecaySchedule(flat=0, ramp=0.001, cap=0.3))

    def __post_init__(self) -> None:
        if self.beta_dpo < 0 or self.kl_beta < 0 or self.clip_range < 0:
            raise ValueError(f"DGPO beta_dpo, kl_beta and clip_range must be >= 0, got {self.beta_dpo}, "
                             f"{self.kl_beta}, {self.clip_range}")
        if self.adv_clip_max <= 0:
            raise ValueError(f"DGPO adv_clip_max must be > 0, got {self.adv_clip_max}")
        if not 1 <= self.num_train_timesteps <= self.trunc_steps + 1:
            raise ValueError(f"DGPO draws num_train_timesteps={self.num_train_timesteps} distinct grid steps from "
                             f"0..trunc_steps={self.trunc_steps}: needs 1 <= M <= trunc_steps + 1")

    @property
    def uses_old_copy(self) -> bool:
        """Whether the update reads the old copy's velocity (clipping or the EMA reference)."""
        return self.clip_dsm or self.clip_kl or self.use_ema_ref


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


def _check_terms_input(v, noise, x0, v_ref, v_old, advantages, settings: DGPOSettings) -> None:
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
    settings: DGPOSettings,
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
        settings: :class:`DGPOSettings`; group_size: G.
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


def dgpo_train_indices(settings: DGPOSettings, generator: torch.Generator | None = None) -> torch.Tensor:
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
