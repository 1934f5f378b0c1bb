"""The shared 8-bit quantisation (flowgrpo.images.to_uint8) against values worked out by hand, and every writer of
8-bit pixels using it."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.images import to_uint8


def test_to_uint8_is_round_255_x_clamped_channels_last():
    x = torch.zeros(1, 3, 1, 6)
    x[0, 0, 0] = torch.tensor([-0.2, 0.0, 1 / 255, 0.5, 1.0, 1.7])
    x[0, 1, 0] = torch.tensor([0.5 / 255, 1.5 / 255, 2.5 / 255, 254.4 / 255, 254.6 / 255, 0.25])
    out = to_uint8(x)
    assert out.dtype == np.uint8 and out.shape == (1, 1, 6, 3) and out.flags["C_CONTIGUOUS"]
    # 0.5 * 255 = 127.5 rounds half to even -> 128; 0.25 * 255 = 63.75 -> 64
    assert out[0, 0, :, 0].tolist() == [0, 0, 1, 128, 255, 255]
    # 0.5, 1.5, 2.5 (as float32 products) round half to even: 0, 2, 2
    assert out[0, 0, :, 1].tolist() == [0, 2, 2, 254, 255, 64]
    assert to_uint8(x[0]).shape == (1, 6, 3)  # a single (3, H, W) image


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, 1, 4, 4),
                                 torch.full((1, 3, 2, 2), float("nan")), np.zeros((1, 3, 2, 2))])
def test_to_uint8_refuses_what_has_no_8bit_form(bad):
    with pytest.raises(ValueError, match="to_uint8"):
        to_uint8(bad)


def test_every_writer_of_8bit_pixels_uses_the_same_quantisation():
    """The PNG wire format, JPEG sizes and saved samples all see to_uint8's pixels."""
    from flowgrpo.rewards.wire import images_to_png_b64, png_b64_to_images

    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    back = png_b64_to_images(images_to_png_b64(images))
    assert torch.equal((back * 255).round().to(torch.uint8).permute(0, 2, 3, 1), torch.from_numpy(to_uint8(images)))
    jpeg = pytest.importorskip("flowgrpo_rewards.jpeg")
    buf = io.BytesIO()
    Image.fromarray(to_uint8(images[0])).save(buf, format="JPEG", quality=95)
    assert float(jpeg.jpeg_size_kb(images[:1])[0]) == pytest.approx(buf.tell() / 1000.0)
