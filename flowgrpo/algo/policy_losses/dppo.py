"""Flow-DPPO: a trust region on the exact per-step Gaussian KL instead of ratio clipping (arXiv 2606.11025; the
implementation followed is verl-omni's ``FlowDPPOLoss``, verl_omni/trainer/diffusion/diffusion_algos.py lines
361–443).

The old (rollout) and the trained policy share each step's transition std, so their divergence is exactly

    D_t = mean_dims((μ_θ − μ_old)²) / (2·std_t²)        (``add_kl_coefficient``; else mean_dims(…)/2)

with std_t = s_t·√(−dt) the transition std (verl-omni's ``std_dev_t·sqrt_dt``). The loss is the unclipped
surrogate −A·ρ, with ρ the step's importance ratio, except that a pair's gradient is removed when the policy is
outside the trust region *and* still moving away from the rollout policy:

    masked = D ≥ ε_D  and  ((A > 0 and ρ > 1) or (A < 0 and ρ < 1))
    loss   = 0 if masked else −A·ρ                           (+ β·KL to the reference, as every policy loss)

Corrective updates (ρ moving back toward 1) always keep their gradient. verl-omni scores one transition per pair;
for a chunk of k steps (Chunk-GRPO) this module uses the chunk's ratio ρ = exp(mean_t Δ_t), as the other losses,
and the chunk's mean divergence D = mean_t D_t: for k = 1 both are verl-omni's. Unlike verl-omni's Flow-GRPO loss,
its DPPO loss does not clip the advantages (ours arrive clipped by ``advantage.clip`` either way).

Registered as the policy loss ``flow_dppo`` of the SDE-ratio objective (``objective.policy_loss: {name: flow_dppo,
kl_mask_threshold: 1e-5, add_kl_coefficient: true}``); it reads the transition moments (``needs_moments``, as
``grpo_guard``), so the rollout policy's means are recomputed before its update, and its KL to the reference is
the objective's ``objective.kl_beta`` (verl-omni: none, 0).
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

__all__ = ["FlowDppoConfig", "dppo_divergence", "flow_dppo_loss", "flow_dppo"]


def dppo_divergence(mean_drift_sq: torch.Tensor, std: torch.Tensor, *, add_kl_coefficient: bool = True) -> torch.Tensor:
    """D = mean_dims((μ_θ − μ_old)²) / (2·std²) (or / 2), same shape as the inputs ((N, k) float32).

    Args:
        mean_drift_sq: the squared drift of the transition mean averaged over latent dims (``PolicyLossInput``).
        std: the transition std of each step (> 0 when ``add_kl_coefficient``).

    Raises:
        ValueError: a step with std <= 0 when ``add_kl_coefficient``.
    """
    sq = mean_drift_sq.float()
    if not add_kl_coefficient:
        return sq / 2
    std = std.float()
    if bool((std <= 0).any()):
        raise ValueError("Flow-DPPO: every trained step must be stochastic (transition std > 0)")
    return sq / (2 * std**2)


def flow_dppo_loss(inp: PolicyLossInput, config: FlowDppoConfig, *, kl_beta: float = 0.0) -> PairTerms:
    """Flow-DPPO's per-pair loss (module docstring) as :class:`~flowgrpo.algo.policy_losses.PairTerms`; ``clipped`` is
    the divergence mask (the pairs whose gradient was removed).

    Args:
        inp: the pairs; needs ``std`` and ``mean_drift_sq`` (N, k) besides the log-probs (the trainer provides them
            for a loss that declares ``needs_moments``).
        config: the validated :class:`FlowDppoConfig` (``kl_mask_threshold``, ``add_kl_coefficient``).
        kl_beta: β of the KL to the reference (verl-omni: ``use_kl_loss: false``, i.e. 0; the trainer passes
            ``objective.kl_beta``), >= 0.

    Raises:
        ValueError: missing ``std``/``mean_drift_sq``, a deterministic step, bad shapes or a negative ``kl_beta``.
    """
    if kl_beta < 0:
        raise ValueError(f"Flow-DPPO kl_beta must be >= 0, got {kl_beta}")
    check_input(inp)
    if inp.std is None or inp.mean_drift_sq is None:
        raise ValueError("flow_dppo needs std and mean_drift_sq for every step (the trainer passes them when the "
                         "loss declares needs_moments)")
    delta = inp.new_log_probs.float() - inp.old_log_probs.float()
    ratio = torch.exp(delta.mean(dim=1))
    adv = inp.advantages.float().detach()
    div = dppo_divergence(inp.mean_drift_sq, inp.std, add_kl_coefficient=config.add_kl_coefficient).mean(dim=1)
    high = div >= config.kl_mask_threshold
    masked = (high & (ratio > 1.0) & (adv > 0)) | (high & (ratio < 1.0) & (adv < 0))
    loss = torch.where(masked.detach(), torch.zeros_like(ratio), -adv * ratio)
    return clipped_terms(inp, kl_beta, loss, ratio, masked)


class FlowDppoConfig(PolicyLossConfig):
    """Settings of ``flow_dppo`` with verl-omni's defaults (verl_omni/trainer/config/diffusion/actor/
    diffusion_actor.yaml); it reads the transition moments.

    Attributes:
        kl_mask_threshold: ε_D, the divergence past which a pair moving away is masked (line 51: 1e-5; the
            Qwen-Image OCR example, run_qwen_image_ocr_lora.sh line 37: 1e-5); > 0.
        add_kl_coefficient: divide the squared mean drift by 2·std² (the exact KL; line 54: true) rather than by 2.
    """

    name: Literal["flow_dppo"] = "flow_dppo"
    needs_moments: ClassVar[bool] = True
    kl_mask_threshold: float = Field(1e-5, gt=0, description="flow_dppo: the divergence D (exact per-step Gaussian "
                                     "KL to the rollout policy) past which a pair moving away is masked "
                                     "(verl-omni kl_mask_threshold)")
    add_kl_coefficient: bool = Field(True, description="flow_dppo: D = mean drift^2 / (2 std^2), the exact KL "
                                     "(false: drift^2 / 2; verl-omni add_kl_coefficient)")


@policy_loss("flow_dppo", FlowDppoConfig)
def flow_dppo(inp: PolicyLossInput, settings: LossSection) -> PairTerms:
    """The registered ``flow_dppo`` loss: :func:`flow_dppo_loss` with the run's ``objective.policy_loss`` knobs and
    ``objective.kl_beta``."""
    return flow_dppo_loss(inp, own_settings(settings, FlowDppoConfig), kl_beta=settings.kl_beta)
