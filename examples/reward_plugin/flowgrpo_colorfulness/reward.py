"""Colourfulness reward (Hasler & Süsstrunk, "Measuring colourfulness in natural images", SPIE 5007, 2003).

For an RGB image with channels on the 0–255 scale, with the opponent channels ``rg = R − G`` and
``yb = (R + G)/2 − B``::

    M = sqrt(σ_rg² + σ_yb²) + 0.3 · sqrt(μ_rg² + μ_yb²)

(the paper's metric M^(3); σ and μ are the standard deviation and mean over the pixels, σ without Bessel's
correction). Grey images score 0; a solid saturated red scores 0.3·sqrt(255² + 127.5²) ≈ 85.5.
"""

from __future__ import annotations

import torch

from flowgrpo.rewards.base import BaseReward


def colorfulness(images: torch.Tensor) -> torch.Tensor:
    """(B,) float32 colourfulness M^(3) of ``images`` (B, 3, H, W) float in [0, 1] (scaled to 0–255 first)."""
    x = images.float().clamp(0, 1) * 255.0
    r, g, b = x[:, 0], x[:, 1], x[:, 2]  # (B, H, W) each
    rg = (r - g).flatten(1)
    yb = (0.5 * (r + g) - b).flatten(1)
    spread = torch.sqrt(rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False))
    offset = torch.sqrt(rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2)
    return spread + 0.3 * offset


class Colorfulness(BaseReward):
    """Colourfulness of each image, optionally divided by ``scale`` (default 1).

    The reward has no weights; a model-based reward builds or loads its network in :meth:`setup`, never in
    ``__init__`` (the trainer constructs every reward before it knows the device).

    Args:
        scale: divide the score by this (> 0), e.g. 100 to bring it near [0, 1].

    Raises:
        ValueError: ``scale`` <= 0.
    """

    name = "colorfulness"

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"colorfulness scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.device = torch.device("cpu")

    def setup(self, device: torch.device) -> None:
        # A model-based reward would load its weights here: self.model = load(...).to(device).eval()
        self.device = torch.device(device)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 CPU scores for ``images`` (B, 3, H, W) in [0, 1]; prompts and metadata are unused."""
        with torch.no_grad():
            return (colorfulness(images.to(self.device)) / self.scale).float().cpu()
