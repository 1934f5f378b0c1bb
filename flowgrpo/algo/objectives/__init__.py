"""Objectives: what the update optimises given an epoch's rollout and advantages (registered strategies).

=============  ==========================================================================  ======================
name           what it does                                                                module
=============  ==========================================================================  ======================
``sde_ratio``  the GRPO family: SDE rollout with log-probs, chunk plan, clipped-ratio loss  :mod:`.sde_ratio`
``nft``        DiffusionNFT: implicit positive/negative policies on the final samples      :mod:`.nft`
``awm``        AWM: advantage-weighted flow matching on the final samples                  :mod:`.awm`
``dgpo``       DGPO: group preference (DPO) on the forward process                         :mod:`.dgpo`
=============  ==========================================================================  ======================

The last three are the forward-process family (:mod:`.forward`): an ODE rollout with any solver, only the final
samples kept, a flow-matching loss at fresh noise, an old copy of the weights (:mod:`.old_copy`).

A new objective is a subclass of :class:`BaseObjective` with a ``Config`` (subclass of :class:`ObjectiveConfig`)
registered with ``@OBJECTIVES.register(name)``, from any module imported before the config is built; the phases
the training loop calls, and in which order, are in :mod:`.base`.
"""

from flowgrpo.algo.objectives.awm import AWM, AWMConfig
from flowgrpo.algo.objectives.base import (
    OBJECTIVES,
    BaseObjective,
    MicroBatchAt,
    Objective,
    ObjectiveConfig,
    UpdateStep,
    build_objective,
    objective_config_class,
)
from flowgrpo.algo.objectives.dgpo import DGPO, DGPOConfig
from flowgrpo.algo.objectives.forward import ForwardConfig, ForwardObjective, ForwardWork
from flowgrpo.algo.objectives.nft import NFT, NFTConfig
from flowgrpo.algo.objectives.sde_ratio import SdeRatio, SdeRatioConfig, SdeRatioWork

__all__ = ["OBJECTIVES", "BaseObjective", "Objective", "ObjectiveConfig", "UpdateStep", "MicroBatchAt",
           "build_objective", "objective_config_class",
           "SdeRatio", "SdeRatioConfig", "SdeRatioWork", "ForwardConfig", "ForwardObjective", "ForwardWork",
           "NFT", "NFTConfig", "AWM", "AWMConfig", "DGPO", "DGPOConfig"]
