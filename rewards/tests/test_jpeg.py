"""The JPEG rewards (``jpeg_compressibility``, ``jpeg_incompressibility``): minus / plus the JPEG file size in kB
that PIL writes for the 8-bit image, checked against PIL's own encoder."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards.registry import load_reward


def _images() -> tuple[torch.Tensor, np.ndarray]:
    """(B, 3, H, W) float images in [0, 1] whose 8-bit values are exactly ``arr`` (B, H, W, 3) uint8."""
    g = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 32)[None, :, None] * np.ones((32, 1, 3))
    arr = np.stack([
        ramp.astype(np.uint8),                                           # smooth: compresses well
        g.integers(0, 256, (32, 32, 3)).astype(np.uint8),                # noise: compresses badly
        np.clip(ramp + g.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8),
    ])
    images = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255
    return images, arr


def _pil_jpeg_kb(arr: np.ndarray, quality: int) -> list[float]:
    sizes = []
    for a in arr:
        buf = io.BytesIO()
        Image.fromarray(a, mode="RGB").save(buf, format="JPEG", quality=quality)
        sizes.append(len(buf.getvalue()) / 1000)
    return sizes


@pytest.mark.parametrize("quality", [95, 50])
def test_jpeg_reward_is_minus_the_pil_jpeg_size(quality):
    images, arr = _images()
    expected = _pil_jpeg_kb(arr, quality)
    assert expected[0] < expected[2] < expected[1]
    comp, _ = load_reward("jpeg_compressibility", quality=quality)
    incomp, _ = load_reward("jpeg_incompressibility", quality=quality)
    scores = comp(images, ["p"] * 3, [{}] * 3)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores.double(), -torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(incomp(images, ["p"] * 3, [{}] * 3), -scores)


def test_jpeg_reward_default_quality_is_95():
    images, arr = _images()
    comp, _ = load_reward("jpeg_compressibility")
    torch.testing.assert_close(comp(images, ["p"] * 3, [{}] * 3).double(),
                               -torch.tensor(_pil_jpeg_kb(arr, 95), dtype=torch.float64), rtol=1e-6, atol=0)


def test_reward_rejects_mismatched_inputs():
    comp, _ = load_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="3 images"):
        comp(torch.zeros(3, 3, 8, 8), ["a", "b"], [{}] * 3)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        comp(torch.zeros(3, 8, 8), ["a"] * 3, [{}] * 3)
