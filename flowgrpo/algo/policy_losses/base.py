"""What every policy loss shares: its input, its settings, the registry and the helpers a new loss builds on.

Every loss maps one :class:`PolicyLossInput` (N trained (sample, chunk) pairs, each with the log-probs of its k
chunk steps) and the validated settings of the SDE-ratio objective (``objective:``, a
:class:`~flowgrpo.algo.objectives.sde_ratio.SdeRatioConfig`: ``clip_low``, ``clip_high``, ``kl_beta`` and the loss's
own section ``policy_loss``) to :class:`PairTerms` (per-pair loss with gradient, and detached
statistics). The trainer averages ``PairTerms.loss`` over the trained pairs of an optimizer step and adds nothing
else, so a new loss (GSPO-, CISPO-style, …) is one registered function and no trainer edit::

    from flowgrpo.algo.policy_losses import POLICY_LOSSES, clipped_terms

    @POLICY_LOSSES.register("my_loss")
    def my_loss(inp, settings):
        ...                                   # return PairTerms(...), e.g. via clipped_terms(...)

or, with a knob (``objective: {name: sde_ratio, policy_loss: {name: my_loss, alpha: 0.5}}``)::

    class MyLossConfig(PolicyLossConfig):
        name: Literal["my_loss"] = "my_loss"
        alpha: float = Field(0.5, gt=0, description="...")

    @policy_loss("my_loss", MyLossConfig)
    def my_loss(inp, settings):
        alpha = own_settings(settings, MyLossConfig).alpha

A loss with knobs declares them in its settings model, a subclass of :class:`PolicyLossConfig` registered with
the function (``@policy_loss(name, MyConfig)``), so a new loss is one file; the run config's
``objective.policy_loss`` section (or the plain name, shorthand for ``{name: ...}``) is validated against the model of
the loss it names, and the loss reads its knobs from ``settings.policy_loss`` (:func:`own_settings`). The model
may also set ``needs_moments = True`` (the trainer then passes each step's transition std, dt and the squared drift
of the transition mean from the rollout policy's, recomputing the rollout means before the update, and which pairs
are trained and which share a micro-batch and chunk) and override ``check(config)`` (raise ``ValueError`` for run
settings it cannot work with; called before any model is loaded).

Shared definitions, for a pair with advantage A and per-step log-ratios Δ_t = log p_θ − log p_old:

    r = exp(mean_{t∈chunk} Δ_t)              (Chunk-GRPO, arXiv 2510.21583, eq. 6; one step: the PPO ratio)
    loss = L(r, A) + β·mean_t KL_t           (Flow-GRPO, arXiv 2505.05470, eq. 11)

where ``KL_t`` is :func:`~flowgrpo.sampling.sde.kl_to_reference` (``objective.kl_form``) to the reference. The
registered ``L`` are in :mod:`.ppo` and :mod:`.dppo`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import torch
from pydantic import Field

from flowgrpo.strategies.registry import Registry
from flowgrpo.strategies.settings import Section


class LossSection(Protocol):
    """What a loss reads of the section that holds it: the SDE-ratio objective's
    (:class:`~flowgrpo.algo.objectives.sde_ratio.SdeRatioConfig`, which imports the losses, so it is named here by
    what it has): the trust region ε_low/ε_high, the KL weight β and the loss's own settings."""

    clip_low: float
    clip_high: float
    kl_beta: float
    policy_loss: PolicyLossConfig


@dataclass(frozen=True)
class PairTerms:
    """Per-pair quantities (N pairs), float32.

    Attributes:
        loss: (N,) policy loss (+ β·KL), with gradient.
        ratio: (N,) importance ratio (detached).
        clipped: (N,) bool, the loss's trust region is active for the pair (hard clip: the clipped branch is the
            max; ``sapo``: the gate has cut the gradient weight below one half).
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


@dataclass(frozen=True)
class PolicyLossInput:
    """What a policy loss sees for N (sample, chunk) pairs of k steps each. All float32 on one device.

    Attributes:
        new_log_probs, old_log_probs: (N, k) log-probs under the trained and the rollout policy.
        advantages: (N,).
        kl_ref: (N, k) per-step KL to the reference, or None (β = 0).
        std: (N, k) transition std of each step (latent units), or None when the loss does not ask for moments.
        dt: (N, k) σ_next − σ of each step (< 0), or None likewise.
        mean_drift_sq: (N, k) mean over latent dims of (μ_θ − μ_old)², the squared drift of the transition mean
            from the rollout policy's, or None likewise.
        trained: (N,) bool, the pairs the trainer trains (the others are forwarded and masked out of the loss), or
            None (all). A loss whose statistics are reduced over pairs reads them from these.
        groups: (N,) long, equal for pairs of one micro-batch and one chunk (the release's micro-batch at one
            step), or None (all pairs one group).
    """

    new_log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    kl_ref: torch.Tensor | None = None
    std: torch.Tensor | None = None
    dt: torch.Tensor | None = None
    mean_drift_sq: torch.Tensor | None = None
    trained: torch.Tensor | None = None
    groups: torch.Tensor | None = None


class PolicyLossConfig(Section):
    """Settings every policy loss has (``objective.policy_loss``). A loss with knobs subclasses this, fixes ``name``
    to its registered name and adds its own fields."""

    name: str = Field(
        "clipped", description="registered policy loss (flowgrpo.algo.policy_losses): clipped (PPO/Flow-GRPO), "
        "dual_clip (Ye et al. 2020, arXiv 1912.09729), sapo (arXiv 2511.20347), grpo_guard (arXiv 2510.22319), "
        "flow_dppo (arXiv 2606.11025), or one a plugin registers; a plain name is shorthand for {name: ...}"
    )
    #: the loss reads each step's transition std, dt and mean drift (the trainer keeps the rollout means)
    needs_moments: ClassVar[bool] = False

    def check(self, config) -> None:
        """Reject run settings (``config``, the whole :class:`~flowgrpo.config.Config`) this loss cannot work
        with, before any model loads (``ValueError``); nothing by default."""


PolicyLoss = Callable[[PolicyLossInput, LossSection], PairTerms]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
C = TypeVar("C", bound=PolicyLossConfig)


def policy_loss(name: str, config: type[PolicyLossConfig] = PolicyLossConfig) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a loss function as ``name`` with its settings model ``config`` (its ``Config``)."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        fn.Config = config
        return POLICY_LOSSES.register(name)(fn)

    return deco


def loss_config_class(name: str) -> type[PolicyLossConfig]:
    """The settings model of the loss registered as ``name`` (``KeyError`` listing the valid names)."""
    return getattr(POLICY_LOSSES.get(name), "Config", PolicyLossConfig)


def own_settings(settings: LossSection, config: type[C]) -> C:
    """A loss's own settings: ``settings.policy_loss`` (an instance of ``config``). Raises ``TypeError`` for
    another loss's settings."""
    if not isinstance(settings.policy_loss, config):
        raise TypeError(f"{config.__name__} settings are needed, got {type(settings.policy_loss).__name__}")
    return settings.policy_loss


def needs_moments(loss: PolicyLoss) -> bool:
    """Whether ``loss`` reads ``std``, ``dt`` and ``mean_drift_sq`` (the trainer then keeps the rollout means)."""
    return getattr(loss, "Config", PolicyLossConfig).needs_moments


def check_input(inp: PolicyLossInput, clip_low: float = 0.0, clip_high: float = 0.0) -> None:
    """Raise ``ValueError`` on mismatched shapes or negative clip ranges."""
    new, old, adv = inp.new_log_probs, inp.old_log_probs, inp.advantages
    if new.shape != old.shape or new.ndim != 2 or new.shape[0] != adv.shape[0]:
        raise ValueError(f"log-prob shapes {tuple(new.shape)}, {tuple(old.shape)} and advantages "
                         f"{tuple(adv.shape)} disagree")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got {clip_low}, {clip_high}")


def clipped_terms(inp: PolicyLossInput, kl_beta: float, loss: torch.Tensor, ratio: torch.Tensor,
                  clipped: torch.Tensor) -> PairTerms:
    """Assemble :class:`PairTerms` from a loss's per-pair ``loss`` (N,), ``ratio`` (N,) and ``clipped`` (N,) bool:
    adds β·mean_t KL_t (β = ``kl_beta``, the loss's ``settings.kl_beta``) and the shared statistics (helper for
    registered losses)."""
    delta = (inp.new_log_probs.float() - inp.old_log_probs.float()).detach()
    kl = torch.zeros_like(ratio) if inp.kl_ref is None else inp.kl_ref.float().mean(dim=1)
    if inp.kl_ref is not None and kl_beta:
        loss = loss + kl_beta * kl
    return PairTerms(loss=loss, ratio=ratio.detach(), clipped=clipped.detach(), approx_kl=(0.5 * delta**2).mean(1),
                     kl_ref=kl.detach(), log_ratio_abs_max=delta.abs().amax(dim=1))
