"""``window``: MixGRPO's sliding SDE window (arXiv 2507.21802)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.chunkers.base import CHUNKERS, BaseChunker, DropLastConfig, make_plan, trainable_steps
from flowgrpo.records import ChunkPlan, Trajectory


class WindowConfig(DropLastConfig):
    """Settings of ``window`` (MixGRPO, arXiv 2507.21802)."""

    name: Literal["window"] = "window"
    caches_ode_steps: ClassVar[bool] = True  # the steps outside the window
    window_size: int = Field(4, ge=1, description="w, SDE steps inside the sliding window")
    window_stride: int = Field(1, ge=1, description="steps the window advances each shift")
    window_shift_every: int = Field(1, ge=1, description="epochs between shifts")
    window_end: Literal["roll_back", "stay"] = Field(
        "roll_back", description="at the end of the schedule: roll_back (MixGRPO's code: starts stop at T-2, "
        "windows are cut at step T-2, then the window returns to step 0) or stay (the last full window, "
        "T-w..T-1, from then on)"
    )


@CHUNKERS.register("window")
class SlidingWindow(BaseChunker):
    """MixGRPO's sliding window (Li et al., arXiv 2507.21802, Sec. 3.2): SDE only on the window's transitions,
    ODE elsewhere; only the window is trained, one ratio per step. The window moves from high noise (t = 0)
    toward low noise, ``window_stride`` steps every ``window_shift_every`` epochs; with k = ⌊epoch / shift_every⌋:

    * ``window_end: roll_back`` (MixGRPO's ``GRPOTrainingStates``, progressive with ``--roll_back``, max timestep
      T − 2): start l = stride·(k mod n), the window is steps l … min(l + w, T − 2) − 1, where n counts the starts
      0, stride, … below T − 2. The release also visits l = T − 2, whose window is empty (it trains nothing for
      ``shift_every`` iterations); here the roll-back comes one start earlier. Steps T − 2 and T − 1 are never
      stochastic.
    * ``window_end: stay``: l = min(stride·k, T − w), the window is steps l … l + w − 1 and stays at the end.
    """

    Config = WindowConfig

    def window_steps(self, num_steps: int, epoch: int) -> range:
        """The window's transitions at ``epoch`` (T = ``num_steps``).

        Raises:
            ValueError: ``window_size`` > T, or T < 3 with ``roll_back`` (no step before T − 2).
        """
        w, stride, k = self.cfg.window_size, self.cfg.window_stride, epoch // self.cfg.window_shift_every
        if w > num_steps:
            raise ValueError(f"objective.chunker.window_size={w} exceeds sampling.num_steps={num_steps}")
        if self.cfg.window_end == "stay":
            start = min(stride * k, num_steps - w)
            return range(start, start + w)
        last = num_steps - 2  # MixGRPO's max_timesteps: windows end before it
        if last < 1:
            raise ValueError(f"objective.chunker.window_end=roll_back needs sampling.num_steps >= 3, got {num_steps}")
        starts = (last - 1) // stride + 1  # 0, stride, … < last
        start = stride * (k % starts)
        return range(start, min(start + w, last))

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[list(self.window_steps(num_steps, epoch))] = True
        return mask

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        steps = trainable_steps(traj, self.cfg.drop_last_step)
        return make_plan([(t,) for t in steps], torch.ones(traj.batch_size, len(steps), dtype=torch.bool))
