"""A reward continuous in the pixels, for runs compared to float32 rounding: ``tests.training.smooth_reward:MeanRed``.

A JPEG size steps by whole bytes, so a rounding-level change of an image can move it by 1e-3 kB and the
advantages by 3e-2; the mean red value moves by the rounding only.
"""

from __future__ import annotations

import torch

from flowgrpo.rewards.base import BaseReward

#: images scored in this process since the last report (``tests/training/sharded_train.py`` reads and resets it)
SCORED = [0]


class MeanRed(BaseReward):
    """(B,) float32: the mean of each image's red channel, in [0, 1]."""

    name = "mean_red"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        SCORED[0] += images.shape[0]
        return images[:, 0].float().mean((1, 2)).cpu()
