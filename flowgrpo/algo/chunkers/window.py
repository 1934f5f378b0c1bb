"""``window``: MixGRPO's sliding SDE window (arXiv 2507.21802)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from flowgrpo.algo.chunkers.base import CHUNKERS, BaseChunker, DropLastConfig, make_plan, trainable_steps
from flowgrpo.records import ChunkPlan, Trajectory


class WindowConfig(DropLastConfig):
    """Settings of ``window`` (MixGRPO, arXiv 2507.21802)."""

    name: Literal["window"] = "window"
    window_size: int = Field(4, ge=1, description="w, SDE steps inside the sliding window")
    window_stride: int = Field(1, ge=1, description="steps the window advances each shift")
    window_shift_every: int = Field(1, ge=1, description="epochs between shifts")


@CHUNKERS.register("window")
class SlidingWindow(BaseChunker):
    """MixGRPO's sliding window (Li et al., arXiv 2507.21802, Sec. 3.2): SDE only on ``window_size``
    transitions starting at ``l = min(stride·⌊epoch / shift_every⌋, T − w)``, ODE elsewhere; only the window
    is trained, one ratio per step. The window moves from high noise (t = 0) toward low noise and stays at the
    end once it arrives.
    """

    Config = WindowConfig

    def window_start(self, num_steps: int, epoch: int) -> int:
        w = self.cfg.window_size
        if w > num_steps:
            raise ValueError(f"chunker.window_size={w} exceeds sampling.num_steps={num_steps}")
        return min(self.cfg.window_stride * (epoch // self.cfg.window_shift_every), num_steps - w)

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        start = self.window_start(num_steps, epoch)
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[start : start + self.cfg.window_size] = True
        return mask

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return make_plan([(t,) for t in steps], torch.ones(traj.batch_size, len(steps), dtype=torch.bool))
