"""The objectives a decoupled rollout (``runtime.engine: ray``) can run, checked with the schema before any model
loads (:func:`refuse_on_ray`): each objective says why it cannot
(:attr:`~flowgrpo.algo.objectives.base.BaseObjective.rollout_workers_refusal`), or None. Imports nothing of Ray."""

from __future__ import annotations


def refuse_on_ray(name: str) -> None:
    """``ValueError`` (one line naming the objective and why) for an objective that cannot run with
    ``runtime.engine: ray``: one whose ``rollout_workers_refusal`` is set (a plugin's by default: not verified)."""
    from flowgrpo.algo.objectives import OBJECTIVES

    why = OBJECTIVES.get(name).rollout_workers_refusal
    if why is not None:
        raise ValueError(f"runtime.engine=ray cannot run objective {name!r}: {why}; use runtime.engine=torchrun")
