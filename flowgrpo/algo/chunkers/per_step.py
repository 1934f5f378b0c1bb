"""``per_step``: every stochastic transition is its own chunk (Flow-GRPO, DanceGRPO)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.chunkers import base
from flowgrpo.algo.chunkers.base import CHUNKERS, BaseChunker, DropLastConfig
from flowgrpo.records import ChunkPlan, Trajectory


class PerStepConfig(DropLastConfig):
    """Settings of ``per_step``."""

    name: Literal["per_step"] = "per_step"
    step_selection: Literal["first", "random"] = Field(
        "first", description="train the first steps of the fraction (Flow-GRPO) or a random subset per sample "
        "(DanceGRPO)"
    )


@CHUNKERS.register("per_step")
class PerStep(BaseChunker):
    """Every stochastic transition is its own chunk (Flow-GRPO, arXiv 2505.05470, eq. 7; DanceGRPO).

    ``objective.timestep_fraction`` (the objective's, which it reads: ``reads_timestep_fraction``) < 1 trains
    int(K·fraction) of the K trainable transitions per sample (the releases'
    count, :func:`~flowgrpo.algo.chunkers.base.release_count`): the first ones (``step_selection='first'``,
    Flow-GRPO: K = T, so 0.99 of T = 10 trains steps 0–8) or a uniformly random subset per sample
    (``'random'``, DanceGRPO: its samples drop the last transition, so ``drop_last_step: true`` and
    K = T − 1).
    """

    Config = PerStepConfig
    reads_timestep_fraction: ClassVar[bool] = True

    def __init__(self, cfg: PerStepConfig, timestep_fraction: float = 1.0) -> None:
        super().__init__(cfg)
        self.timestep_fraction = timestep_fraction

    def validate(self, num_steps: int, sde_kind: str) -> None:
        trainable = base.check_trainable(self.cfg, num_steps, sde_kind)
        base.release_count(self.timestep_fraction, trainable, "objective.timestep_fraction")

    @property
    def needs_recompute(self) -> bool:  # a random subset per sample forwards fewer rows than the rollout did
        return self.cfg.step_selection == "random" and self.timestep_fraction < 1

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = base.trainable_steps(traj, self.cfg.drop_last_step)
        k = len(steps)
        n = base.release_count(self.timestep_fraction, k, "objective.timestep_fraction")
        b = traj.batch_size
        selected = torch.zeros(b, k, dtype=torch.bool)
        if self.cfg.step_selection == "first":
            selected[:, :n] = True
        else:
            for i in range(b):
                selected[i, torch.randperm(k, generator=generator)[:n]] = True
        return base.make_plan([(t,) for t in steps], selected)
