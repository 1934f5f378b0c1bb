"""The clipped policy-gradient surrogate over chunks, with the KL penalty to the reference policy.

For a trained (sample, chunk) pair with advantage A and per-step log-ratios Δ_t = log p_θ − log p_old:

    r = exp(mean_{t∈chunk} Δ_t)                                  (Chunk-GRPO eq. 6; one step: the PPO ratio)
    L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))             (PPO, Schulman et al. 2017, eq. 7; Flow-GRPO eq. 7;
                                                                  asymmetric ε: DAPO, arXiv 2503.14476, eq. 10)
    loss = mean over pairs of L + β·mean over pairs of KL_pair   (Flow-GRPO eq. 11)

where ``KL_pair`` is the mean over the chunk's steps of :func:`~flowgrpo.sampling.sde.kl_between_means`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairTerms:
    """Per-pair quantities (N pairs), float32.

    Attributes:
        loss: (N,) clipped surrogate (+ β·KL), with gradient.
        ratio: (N,) importance ratio (detached).
        clipped: (N,) bool, the clipped branch is active (the ratio left [1 − ε_low, 1 + ε_high] in the
            direction the advantage pushes).
        approx_kl: (N,) ½·mean_t Δ_t² (detached), the k2 estimator of KL(old ‖ new) per step.
        kl_ref: (N,) KL to the reference per latent dim (detached; 0 without a reference).
        log_ratio_abs_max: (N,) max_t |Δ_t| (detached), the log-prob mismatch diagnostic at the first update.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    approx_kl: torch.Tensor
    kl_ref: torch.Tensor
    log_ratio_abs_max: torch.Tensor


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
    """Per-pair loss terms.

    Args:
        new_log_probs, old_log_probs: (N, k) float32 log-probs of each pair's k chunk steps.
        advantages: (N,) float32.
        kl_ref: (N, k) per-step KL to the reference (None when β = 0).

    Raises:
        ValueError: mismatched shapes or a negative clip range.
    """
    if new_log_probs.shape != old_log_probs.shape or new_log_probs.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"log-prob shapes {tuple(new_log_probs.shape)}, {tuple(old_log_probs.shape)} and advantages "
            f"{tuple(advantages.shape)} disagree"
        )
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got {clip_low}, {clip_high}")
    delta = new_log_probs.float() - old_log_probs.float()
    ratio = torch.exp(delta.mean(dim=1))
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    kl = torch.zeros_like(ratio) if kl_ref is None else kl_ref.float().mean(dim=1)
    if kl_ref is not None and kl_beta:
        loss = loss + kl_beta * kl
    return PairTerms(
        loss=loss,
        ratio=ratio.detach(),
        clipped=(clipped_loss > unclipped).detach(),
        approx_kl=(0.5 * delta.detach() ** 2).mean(dim=1),
        kl_ref=kl.detach(),
        log_ratio_abs_max=delta.detach().abs().amax(dim=1),
    )
