"""The objectives a decoupled rollout (``runtime.engine: ray``) can run, checked with the schema before any model
loads (:func:`refuse_on_ray`). Imports nothing of Ray."""

from __future__ import annotations

#: objectives that train from their own rollouts, whose update reads only the rollout record (with its behaviour
#: log-probs where it has them): they run with rollout workers
ON_RAY = ("sde_ratio", "nft", "awm", "dgpo", "dpo", "opd")

#: why an objective cannot take its rollout from a worker
REFUSED = {
    "refl": "its update back-propagates the reward through a sampling chain restarted from the rollout's own path, "
            "with no importance ratio to correct a path another copy of the policy sampled",
    "sft": "it trains on a dataset and samples no rollout",
    "dpo_offline": "it trains on a preference dataset and samples no rollout",
}


def refuse_on_ray(name: str) -> None:
    """``ValueError`` (one line naming the objective and why) for an objective that cannot run with
    ``runtime.engine: ray``: one in :data:`REFUSED`, or any not in :data:`ON_RAY` (a plugin's, not verified)."""
    from flowgrpo.algo.objectives import OBJECTIVES

    canonical = OBJECTIVES.canonical(name) if name in OBJECTIVES else name
    if canonical in ON_RAY:
        return
    why = REFUSED.get(canonical, "it is not among the objectives verified with rollout workers "
                                 f"({', '.join(ON_RAY)})")
    raise ValueError(f"runtime.engine=ray cannot run objective {name!r}: {why}; use runtime.engine=torchrun")
