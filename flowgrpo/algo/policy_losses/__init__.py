"""Policy losses over chunks: registered strategies chosen by ``objective.policy_loss`` (verl's ``core_algos`` pattern).

==============  =====================================================================  ===================
name            what it does                                                           module
==============  =====================================================================  ===================
``clipped``     PPO's clipped surrogate, asymmetric ε (Flow-GRPO, DAPO): the default  :mod:`.ppo`
``dual_clip``   negative-advantage loss bounded by −c·A (dual-clip PPO)                :mod:`.ppo`
``sapo``        a smooth sigmoid gate on the ratio in place of the hard clip (SAPO)    :mod:`.ppo`
``grpo_guard``  per-step ratio normalisation and step re-weighting (GRPO-Guard)        :mod:`.ppo`
``flow_dppo``   a trust region on the exact per-step Gaussian KL (Flow-DPPO)           :mod:`.dppo`
==============  =====================================================================  ===================

The contract (input, settings, registry, helpers) is in :mod:`.base`; a new loss is one function registered with
``@policy_loss(name, MyConfig)`` (or ``@POLICY_LOSSES.register(name)``), from any module imported before the
config is built.
"""

from flowgrpo.algo.policy_losses.base import (
    POLICY_LOSSES,
    PairTerms,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossInput,
    check_input,
    clipped_terms,
    loss_config_class,
    needs_moments,
    own_settings,
    policy_loss,
)
from flowgrpo.algo.policy_losses.dppo import FlowDppoConfig, dppo_divergence, flow_dppo_loss
from flowgrpo.algo.policy_losses.ppo import (
    ClippedConfig,
    DualClipConfig,
    GrpoGuardConfig,
    SapoConfig,
    clipped_loss,
    clipped_surrogate,
    dual_clip_loss,
    grpo_guard_loss,
    sapo_loss,
)

__all__ = [
    "POLICY_LOSSES", "PairTerms", "PolicyLoss", "PolicyLossConfig", "PolicyLossInput", "check_input",
    "clipped_terms", "loss_config_class", "needs_moments", "own_settings", "policy_loss",
    "FlowDppoConfig", "dppo_divergence", "flow_dppo_loss",
    "ClippedConfig", "DualClipConfig", "GrpoGuardConfig", "SapoConfig", "clipped_loss", "clipped_surrogate",
    "dual_clip_loss", "grpo_guard_loss", "sapo_loss",
]
