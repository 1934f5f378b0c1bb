"""Objectives: what the update optimises given an epoch's rollout and advantages (registered strategies).

===============  ===========================================================================  =======================
name             what it does                                                                 module
===============  ===========================================================================  =======================
``sde_ratio``    the GRPO family: SDE rollout with log-probs, chunk plan, clipped-ratio loss  :mod:`.sde_ratio`
``nft``          DiffusionNFT: implicit positive/negative policies on the final samples       :mod:`.nft`
``awm``          AWM: advantage-weighted flow matching on the final samples                   :mod:`.awm`
``dgpo``         DGPO: group preference (DPO) on the forward process                          :mod:`.dgpo`
``refl``         ReFL / DRaFT: a differentiable reward's gradient through the last steps      :mod:`.reward_backprop`
``opd``          on-policy distillation (DiffusionOPD): a teacher scores the student's path   :mod:`.opd`
``srpo``         SRPO: Direct-Align's one step from the re-noised sample, a relative reward   :mod:`.srpo`
``dmd2``         DMD2: distribution matching against a teacher and an online fake score       :mod:`.dmd2`
``tdm_r1``       TDM-R1: a few-step generator led by a surrogate reward learned from rewards  :mod:`.tdm_r1`
``dpo``          Diffusion-DPO, online: pairs chosen by the reward within each group          :mod:`.dpo`
``dpo_offline``  Diffusion-DPO, offline: the pairs of a preference dataset                    :mod:`.dpo_offline`
``sft``          supervised flow matching on a dataset of (prompt, image)                     :mod:`.sft`
===============  ===========================================================================  =======================

``nft``, ``awm`` and ``dgpo`` are the forward-process family (:mod:`.forward`): an ODE rollout with any solver, only
the final samples kept, a flow-matching loss at fresh noise, an old copy of the weights (:mod:`.old_copy`). ``dpo``,
``dpo_offline`` and ``sft`` run on the same phases: online DPO on the family's rollout, the other two on a dataset's
images (:mod:`flowgrpo.data.image_sets`), none with an old copy.

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
from flowgrpo.algo.objectives.dmd2 import DMD2, DMD2Config
from flowgrpo.algo.objectives.dpo import DPO, DPOConfig
from flowgrpo.algo.objectives.dpo_offline import DPOOffline, DPOOfflineConfig
from flowgrpo.algo.objectives.forward import ForwardConfig, ForwardObjective, ForwardWork
from flowgrpo.algo.objectives.nft import NFT, NFTConfig
from flowgrpo.algo.objectives.opd import OPD, OPDConfig
from flowgrpo.algo.objectives.reward_backprop import RewardBackprop, RewardBackpropConfig
from flowgrpo.algo.objectives.sde_ratio import SdeRatio, SdeRatioConfig, SdeRatioWork
from flowgrpo.algo.objectives.sft import SFT, SFTConfig
from flowgrpo.algo.objectives.srpo import SRPO, SRPOConfig
from flowgrpo.algo.objectives.tdm_r1 import TDMR1, TDMR1Config

__all__ = ["OBJECTIVES", "BaseObjective", "Objective", "ObjectiveConfig", "UpdateStep", "MicroBatchAt",
           "build_objective", "objective_config_class",
           "SdeRatio", "SdeRatioConfig", "SdeRatioWork", "ForwardConfig", "ForwardObjective", "ForwardWork",
           "NFT", "NFTConfig", "AWM", "AWMConfig", "DGPO", "DGPOConfig", "RewardBackprop",
           "RewardBackpropConfig", "OPD", "OPDConfig", "DPO", "DPOConfig", "DPOOffline", "DPOOfflineConfig",
           "SFT", "SFTConfig", "SRPO", "SRPOConfig", "DMD2",
           "DMD2Config", "TDMR1", "TDMR1Config"]
