"""``trajectory``: one importance ratio for the whole trajectory (GSPO-style sequence ratio)."""

from __future__ import annotations

from typing import Literal

import torch

from flowgrpo.algo.chunkers.base import CHUNKERS, BaseChunker, DropLastConfig, make_plan, trainable_steps
from flowgrpo.records import ChunkPlan, Trajectory


class TrajectoryConfig(DropLastConfig):
    """Settings of ``trajectory``."""

    name: Literal["trajectory"] = "trajectory"


@CHUNKERS.register("trajectory")
class WholeTrajectory(BaseChunker):
    """One ratio for the whole trajectory: ``exp(mean over all trained steps of the log-ratio)``, the
    sequence-level ratio of GSPO (Zheng et al., arXiv 2507.18071, eq. 7) — ``chunk`` with a single chunk."""

    Config = TrajectoryConfig
    needs_recompute = True

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return make_plan([tuple(steps)] if steps else [], torch.ones(traj.batch_size, 1, dtype=torch.bool))


