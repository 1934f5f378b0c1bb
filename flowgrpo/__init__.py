"""flowgrpo: reinforcement learning (the GRPO family) for text-to-image flow-matching models.

The public API, by layer (each name is importable from here; the modules hold the details):

* configuration: :class:`Config`, :func:`load_config`, :class:`ConfigError`;
* records passed between phases: :class:`Trajectory`, :class:`Rewards`, :class:`Advantages`, :class:`ChunkPlan`,
  :class:`PromptEmbeds`;
* the SDE step: :func:`sde_step`, registry :data:`SDE_KINDS`;
* strategies: :data:`OBJECTIVES` (what the update optimises), :data:`CHUNKERS` (which transitions share a
  ratio), :data:`ESTIMATORS` (advantages), :data:`POLICY_LOSSES`, :data:`GROUP_FILTERS`;
* models: :func:`load_model`, registry :data:`ADAPTERS` (by diffusers pipeline class);
* the loop: :class:`Trainer`, :func:`run` (build everything from a config and train).

Imports are lazy so that ``import flowgrpo`` stays cheap and a script can set up logging first.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "flowgrpo.config",
    "ConfigError": "flowgrpo.config",
    "load_config": "flowgrpo.config",
    "Trajectory": "flowgrpo.records",
    "Rewards": "flowgrpo.records",
    "Advantages": "flowgrpo.records",
    "ChunkPlan": "flowgrpo.records",
    "PromptEmbeds": "flowgrpo.records",
    "sde_step": "flowgrpo.sampling.sde",
    "SDE_KINDS": "flowgrpo.sampling.sde",
    "OBJECTIVES": "flowgrpo.algo.objectives",
    "CHUNKERS": "flowgrpo.algo.chunkers",
    "ESTIMATORS": "flowgrpo.algo.advantages",
    "POLICY_LOSSES": "flowgrpo.algo.policy_losses",
    "GROUP_FILTERS": "flowgrpo.algo.filters",
    "load_model": "flowgrpo.models",
    "ADAPTERS": "flowgrpo.models",
    "Trainer": "flowgrpo.training.loop",
    "run": "flowgrpo.runner",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flowgrpo' has no attribute {name!r}")
