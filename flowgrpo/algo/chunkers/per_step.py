"""``per_step``: every stochastic transition is its own chunk (Flow-GRPO, DanceGRPO)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowgrpo.algo.chunkers.base import (
    CHUNKERS,
    BaseChunker,
    DropLastConfig,
    fraction_count,
    make_plan,
    trainable_steps,
)
from flowgrpo.records import ChunkPlan, Trajectory


class PerStepConfig(DropLastConfig):
    """Settings of ``per_step``."""

    name: Literal["per_step"] = "per_step"
    timestep_fraction: float = Field(
        1.0, gt=0, le=1, description="fraction of the stochastic steps trained per sample (Flow-GRPO "
        "config.train.timestep_fraction; DanceGRPO --timestep_fraction)"
    )
    step_selection: Literal["first", "random"] = Field(
        "first", description="train the first steps of the fraction (Flow-GRPO) or a random subset per sample "
        "(DanceGRPO)"
    )


@CHUNKERS.register("per_step")
class PerStep(BaseChunker):
    """Every stochastic transition is its own chunk (Flow-GRPO, arXiv 2505.05470, eq. 7; DanceGRPO).

    ``timestep_fraction`` < 1 trains ⌈fraction·K⌉ of the K stochastic transitions per sample: the first ones
    (``step_selection='first'``, Flow-GRPO's default) or a uniformly random subset per sample (``'random'``,
    DanceGRPO's ``timestep_fraction``).
    """

    Config = PerStepConfig

    @property
    def needs_recompute(self) -> bool:  # a random subset per sample forwards fewer rows than the rollout did
        return self.cfg.step_selection == "random" and self.cfg.timestep_fraction < 1

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        k = len(steps)
        n = fraction_count(self.cfg.timestep_fraction, k)
        b = traj.batch_size
        selected = torch.zeros(b, k, dtype=torch.bool)
        if self.cfg.step_selection == "first":
            selected[:, :n] = True
        else:
            for i in range(b):
                selected[i, torch.randperm(k, generator=generator)[:n]] = True
        return make_plan([(t,) for t in steps], selected)
