"""Objectives: what the update optimises given an epoch's rollout and advantages (registered strategies).

=============  ==========================================================================  ======================
name           what it does                                                                module
=============  ==========================================================================  ======================
``sde_ratio``  the GRPO family: SDE rollout with log-probs, chunk plan, clipped-ratio loss  :mod:`.sde_ratio`
=============  ==========================================================================  ======================

A new objective is a subclass of :class:`BaseObjective` with a ``Config`` (subclass of :class:`ObjectiveConfig`)
registered with ``@OBJECTIVES.register(name)``, from any module imported before the config is built; the phases
the training loop calls, and in which order, are in :mod:`.base`.
"""

from flowgrpo.algo.objectives.base import (
    OBJECTIVES,
    BaseObjective,
    Objective,
    ObjectiveConfig,
    build_objective,
    objective_config_class,
)
from flowgrpo.algo.objectives.sde_ratio import SdeRatio, SdeRatioConfig, SdeRatioWork

__all__ = ["OBJECTIVES", "BaseObjective", "Objective", "ObjectiveConfig", "build_objective", "objective_config_class",
           "SdeRatio", "SdeRatioConfig", "SdeRatioWork"]
