"""JPEG (in)compressibility rewards (Black et al., DDPO, arXiv 2305.13301, Sec. 6.1).

``jpeg_compressibility`` = −(size in kB of the image saved as JPEG at quality 95); ``jpeg_incompressibility`` =
+size. They need no weights, so they double as the plumbing test of the plugin mechanism.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from flowgrpo.images import to_uint8
from flowgrpo.rewards.base import BaseReward


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """(B,) float32 JPEG sizes in kB (1 kB = 1000 bytes) of (B, 3, H, W) images in [0, 1], as 8-bit RGB."""
    sizes = []
    for a in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility(BaseReward):
    """−JPEG size in kB at ``quality`` (default 95): smaller files score higher."""

    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95) -> None:
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
        self.quality = int(quality)

    def score(self, images, prompts, metadata):
        return -jpeg_size_kb(images, self.quality)


class JpegIncompressibility(JpegCompressibility):
    """+JPEG size in kB at ``quality``: larger files score higher."""

    name = "jpeg_incompressibility"

    def score(self, images, prompts, metadata):
        return jpeg_size_kb(images, self.quality)
