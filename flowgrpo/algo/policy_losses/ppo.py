"""The PPO family of policy losses over chunks, with the shared definitions of :mod:`.base` (``r``, ``KL_t``):

* ``clipped`` (default): ``max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))`` (PPO, Schulman et al. 2017,
  arXiv 1707.06347, eq. 7; Flow-GRPO eq. 7; asymmetric ε: DAPO, arXiv 2503.14476, eq. 10).
* ``dual_clip``: for A < 0 the clipped objective is bounded below by c·A (Ye et al. 2020, "Mastering Complex
  Control in MOBA Games with Deep RL", arXiv 1912.09729, the dual-clip objective): in loss form
  ``min(max(−A·r, −A·clip(r)), −c·A)`` for A < 0, the ``clipped`` loss for A ≥ 0; c > 1.
* ``sapo``: ``−A·(4/τ)·sigmoid(τ·(r − 1))`` with τ = τ_pos for A > 0 and τ_neg otherwise (Soft Adaptive Policy
  Optimization, Gao et al., arXiv 2511.20347, its soft gate f(r) = sigmoid(τ(r − 1))·4/τ): a smooth gate in place
  of the hard clip; its gradient weight ``4·s·(1 − s)``, s = sigmoid(τ(r − 1)), is 1 at r = 1 and decays as r leaves 1.
* ``grpo_guard``: RatioNorm and step re-weighting (Wang et al., arXiv 2510.22319, GRPO-Guard, eq. 8 and 12), as
  the Flow-GRPO release computes them (yifan123/flow_grpo, ``scripts/train_sd3_GRPO_Guard.py``, the
  ``config.rationorm`` branch). Per step t, with the transition std ``std_t = s_t·q_t`` (``s_t = a·√(σ/(1−σ))``
  for ``flow_sde``, ``q_t = √(−dt)``, ``dt = σ_next − σ``) and the squared drift of the transition mean from the
  rollout policy's, ``m_t = mean_d(μ_θ − μ_old)²``:
  ``ℓ_t = (Δ_t + m_t / (2·S_t²))·S_t``, ``r = exp(mean_t ℓ_t)``, ``loss = w·max(−A·r, −A·clip(r))``.
  With ``objective.policy_loss: {name: grpo_guard, stats: micro_batch}`` (default, the release) the scale, the bias
  and the weight are one value per micro-batch and step, shared by its trained pairs:
  ``S_t = mean(s_t)·mean(q_t)``, the bias ``mean(m_t) / (2·S_t²)`` and ``w = mean_t 1/mean(q_t)²``, each mean
  over the pairs of the group (:attr:`PolicyLossInput.groups`, the trained ones: :attr:`PolicyLossInput.trained`).
  The release's line reads ``(μ_θ − μ_old)².mean(dim=tuple(range(1, log_prob.ndim)))`` with ``log_prob`` already
  (B,): an empty ``dim``, which torch reads as every dim, so its bias is the mean over the micro-batch and the
  latent dims, one value.
  With ``per_sample`` each pair uses its own: ``S_t = std_t``, bias ``m_t / (2·std_t²)`` (so
  ``ℓ_t = mean_d(ε ⊙ (μ_θ − μ_old))``, the drift projected on the rollout noise) and ``w = mean_t 1/(−dt_t)``.
  The two agree when every pair of a micro-batch drifted equally; with unequal drifts a pair's log-ratio differs
  by its drift's distance from the micro-batch mean over 2·S_t, which against clip ranges of ~1e-6 changes which
  pairs are clipped.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.policy_losses.base import (
    LossSection,
    PairTerms,
    PolicyLossConfig,
    PolicyLossInput,
    check_input,
    clipped_terms,
    own_settings,
    policy_loss,
)


class ClippedConfig(PolicyLossConfig):
    """Settings of ``clipped`` (none of its own: it reads ``objective.clip_range*`` and ``objective.kl_beta``)."""

    name: Literal["clipped"] = "clipped"


class DualClipConfig(PolicyLossConfig):
    """Settings of ``dual_clip``."""

    name: Literal["dual_clip"] = "dual_clip"
    c: float = Field(
        3.0, gt=1, description="lower bound c on the objective of negative-advantage pairs (paper: 3)"
    )


class SapoConfig(PolicyLossConfig):
    """Settings of ``sapo``."""

    name: Literal["sapo"] = "sapo"
    tau_pos: float = Field(
        1.0, gt=0, description="gate temperature for A > 0 (paper: 1.0 for LLM token ratios; flow-model ratios "
        "move ~1e-4 from 1, so a temperature near 1/clip_range gives a comparable trust region)"
    )
    tau_neg: float = Field(1.05, gt=0, description="gate temperature for A <= 0 (paper: 1.05)")


class GrpoGuardConfig(PolicyLossConfig):
    """Settings of ``grpo_guard``: it reads the transition moments, and Gaussian log-densities averaged over
    latent dims (its ratio normalisation and drift bias are means)."""

    name: Literal["grpo_guard"] = "grpo_guard"
    needs_moments: ClassVar[bool] = True
    stats: Literal["micro_batch", "per_sample"] = Field(
        "micro_batch", description="RatioNorm's mean-drift bias, noise scale and step weight from the micro-batch's "
        "trained pairs at each step, one shared value (micro_batch: the release) or from each pair's own"
    )

    def check(self, config) -> None:
        smp = config.sampling
        if smp.logprob_reduction != "mean" or smp.cps_simplified_logprob:
            raise ValueError("objective.policy_loss=grpo_guard needs sampling.logprob_reduction=mean and "
                             "sampling.cps_simplified_logprob=false (its ratio normalisation assumes the Gaussian "
                             f"log-density averaged over latent dims); got {smp.logprob_reduction!r}, "
                             f"{smp.cps_simplified_logprob}")


def _ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float):
    """(loss, clipped) of PPO's eq. 7 with asymmetric ε: ``max(−A·r, −A·clip(r))``.

    The max itself, not a ``where`` over the clipped flag: where the two terms round to the same float32 value
    although r lies outside the clip range, the max sends half the gradient down each branch (the clipped half is
    then cut by the clamp), a ``where`` all of it down one, which changes training."""
    neg_adv = -adv
    unclipped = neg_adv * ratio
    clipped_loss = neg_adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped


def _chunk_ratio(inp: PolicyLossInput) -> torch.Tensor:
    return torch.exp((inp.new_log_probs.float() - inp.old_log_probs.float()).mean(dim=1))


@policy_loss("clipped", ClippedConfig)
def clipped_loss(inp: PolicyLossInput, settings: LossSection) -> PairTerms:
    """PPO's clipped surrogate with asymmetric ε (module docstring, ``clipped``)."""
    check_input(inp, settings.clip_low, settings.clip_high)
    ratio = _chunk_ratio(inp)
    loss, clipped = _ppo_clip(ratio, inp.advantages.float(), settings.clip_low, settings.clip_high)
    return clipped_terms(inp, settings.kl_beta, loss, ratio, clipped)


@policy_loss("dual_clip", DualClipConfig)
def dual_clip_loss(inp: PolicyLossInput, settings: LossSection) -> PairTerms:
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): for A < 0 the loss is at most −c·A, so a ratio far above
    1 + ε cannot produce an unbounded push-down. ``clipped`` also counts pairs held at the lower bound c.

    Raises:
        ValueError: c <= 1 (the bound would cut the ordinary clipped region), or bad shapes.
    """
    check_input(inp, settings.clip_low, settings.clip_high)
    c = own_settings(settings, DualClipConfig).c
    if c <= 1:
        raise ValueError(f"objective.policy_loss.c must be > 1, got {c}")
    ratio = _chunk_ratio(inp)
    adv = inp.advantages.float()
    ppo, clipped = _ppo_clip(ratio, adv, settings.clip_low, settings.clip_high)
    bound = -c * adv
    capped = (adv < 0) & (ppo > bound)
    loss = torch.where(capped, bound, ppo)
    return clipped_terms(inp, settings.kl_beta, loss, ratio, clipped | capped)


@policy_loss("sapo", SapoConfig)
def sapo_loss(inp: PolicyLossInput, settings: LossSection) -> PairTerms:
    """SAPO's soft gate (Gao et al., arXiv 2511.20347): ``−A·(4/τ)·sigmoid(τ(r − 1))``, τ by the sign of A.

    Raises:
        ValueError: a temperature <= 0, or bad shapes.
    """
    check_input(inp, settings.clip_low, settings.clip_high)
    own = own_settings(settings, SapoConfig)
    if own.tau_pos <= 0 or own.tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={own.tau_pos}, tau_neg={own.tau_neg}")
    ratio = _chunk_ratio(inp)
    adv = inp.advantages.float()
    tau = torch.where(adv > 0, torch.full_like(adv, own.tau_pos), torch.full_like(adv, own.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -adv * gate * (4.0 / tau)
    weight = 4.0 * gate * (1.0 - gate)  # d gate-term / d r; 1 on-policy
    return clipped_terms(inp, settings.kl_beta, loss, ratio, weight < 0.5)


def group_mean(x: torch.Tensor, groups: torch.Tensor | None, trained: torch.Tensor | None) -> torch.Tensor:
    """(N, k) → (N, k): in each step column, the mean of ``x`` over the trained pairs of each pair's group
    (:class:`PolicyLossInput` ``groups`` (N,) long and ``trained`` (N,) bool; None: one group, all trained), the
    same value for every pair of a group; over all the group's pairs when none of them is trained (the trainer
    masks such pairs out; a finite value keeps the masked loss finite). No host synchronisation."""
    n = x.shape[0]
    g = torch.zeros(n, dtype=torch.long, device=x.device) if groups is None else groups.to(x.device)
    same = (g[:, None] == g[None, :]).to(x.dtype)  # (N, N)
    w = torch.ones(n, dtype=x.dtype, device=x.device) if trained is None else trained.to(x.device, x.dtype)
    w = torch.where(same @ w > 0, w, torch.ones_like(w))  # a group without a trained pair: all of its pairs
    return (same @ (w[:, None] * x)) / (same @ w)[:, None]


@policy_loss("grpo_guard", GrpoGuardConfig)
def grpo_guard_loss(inp: PolicyLossInput, settings: LossSection) -> PairTerms:
    """GRPO-Guard (Wang et al., arXiv 2510.22319): RatioNorm ``ℓ_t = (Δ_t + m_t/(2·S_t²))·S_t``,
    ``r = exp(mean_t ℓ_t)``, the clipped surrogate on r, re-weighted by ``w`` (module docstring): with
    ``stats: micro_batch`` (:class:`GrpoGuardConfig`) the scale, bias and weight are shared by each group's
    trained pairs (:func:`group_mean`; the release), with ``per_sample`` each pair's own.

    Raises:
        ValueError: the input lacks ``std``/``dt``/``mean_drift_sq``, a deterministic step (std = 0, dt = 0) is
            in a chunk, or bad shapes.
    """
    check_input(inp, settings.clip_low, settings.clip_high)
    if inp.std is None or inp.dt is None or inp.mean_drift_sq is None:
        raise ValueError("grpo_guard needs std, dt and mean_drift_sq for every step (the trainer passes them when "
                         "the loss declares needs_moments)")
    std, dt, drift = inp.std.float(), inp.dt.float(), inp.mean_drift_sq.float()
    if bool((std <= 0).any()) or bool((dt >= 0).any()):
        raise ValueError("grpo_guard: every trained step must be stochastic (std > 0) and go down in sigma (dt < 0)")
    delta = inp.new_log_probs.float() - inp.old_log_probs.float()
    if own_settings(settings, GrpoGuardConfig).stats == "micro_batch":
        q = group_mean(torch.sqrt(-dt), inp.groups, inp.trained)  # mean √(−dt) of the group, (N, k)
        scale = q * group_mean(std / torch.sqrt(-dt), inp.groups, inp.trained)  # mean(√−dt)·mean(s_t)
        bias = group_mean(drift, inp.groups, inp.trained) / (2 * scale**2)
        weight = (1.0 / q**2).mean(dim=1)
    else:  # per_sample
        scale, bias, weight = std, drift / (2 * std**2), (1.0 / -dt).mean(dim=1)
    ratio = torch.exp(((delta + bias) * scale).mean(dim=1))
    loss, clipped = _ppo_clip(ratio, inp.advantages.float(), settings.clip_low, settings.clip_high)
    return clipped_terms(inp, settings.kl_beta, weight * loss, ratio, clipped)


def clipped_surrogate(
    new_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> PairTerms:
    """The ``clipped`` loss with plain arguments.

    Args:
        new_log_probs, old_log_probs: (N, k) float32 log-probs of each pair's k chunk steps.
        advantages: (N,) float32.
        kl_ref: (N, k) per-step KL to the reference (None when β = 0).

    Raises:
        ValueError: mismatched shapes or a negative clip range.
    """
    inp = PolicyLossInput(new_log_probs, old_log_probs, advantages, kl_ref=kl_ref)
    check_input(inp, clip_low, clip_high)
    ratio = _chunk_ratio(inp)
    loss, clipped = _ppo_clip(ratio, inp.advantages.float(), clip_low, clip_high)
    return clipped_terms(inp, kl_beta, loss, ratio, clipped)

