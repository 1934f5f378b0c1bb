"""Images and a reward the reward-infrastructure tests share (composition, background scoring, the remote
reward)."""

from __future__ import annotations

import math

import torch

from flowgrpo.rewards.base import BaseReward


def images_8bit(n: int, h: int = 32, w: int = 32, seed: int = 0, noise: float = 0.3) -> torch.Tensor:
    """(n, 3, H, W) float32 on the 8-bit grid with per-image detail, so JPEG sizes differ."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    x = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    amp = torch.linspace(0, noise, n).view(n, 1, 1, 1)
    x = x + amp * (torch.rand(n, 3, h, w, generator=g) - 0.5)
    return (x.clamp(0, 1) * 255).round() / 255


class CatNotApplicable(BaseReward):
    """0.5 for every prompt, except NaN ("not applicable") for prompts that mention a cat."""

    name = "cat_na"

    def score(self, images, prompts, metadata):
        return torch.tensor([math.nan if "cat" in p else 0.5 for p in prompts], dtype=torch.float32)
