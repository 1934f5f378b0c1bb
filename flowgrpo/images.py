"""The one 8-bit quantisation of generated images.

Saving a PNG, sending images to a reward server, measuring JPEG size, reading text and detecting objects all see
the same 8-bit pixels: ``round(255·clamp(x, 0, 1))`` of the float image (round half to even, as
``torch.round``; an exact k/255 stays k). Every place that turns float images into bytes calls
:func:`to_uint8`, so the remote wire format and the local rewards agree pixel for pixel.
"""

from __future__ import annotations

import numpy as np
import torch


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """8-bit channels-last pixels of float images.

    Args:
        images: (B, F, 3, H, W) videos, (B, 3, H, W) or (3, H, W) float tensor, values in [0, 1] (clamped), on
            any device.

    Returns:
        (B, F, H, W, 3), (B, H, W, 3) or (H, W, 3) C-contiguous ``uint8`` NumPy array on the CPU:
        ``round(255·clamp(x, 0, 1))``.

    Raises:
        ValueError: ``images`` is not a floating tensor with 3 channels in dimension -3, or holds NaN.
    """
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        kind = images.dtype if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"to_uint8 needs a float tensor in [0, 1], got {kind}")
    if images.ndim not in (3, 4, 5) or images.shape[-3] != 3:
        raise ValueError(f"to_uint8 needs (B, F, 3, H, W), (B, 3, H, W) or (3, H, W) images, got shape "
                         f"{tuple(images.shape)}")
    if bool(torch.isnan(images).any()):
        raise ValueError("to_uint8: the images hold NaN; there is no 8-bit value for it")
    u8 = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    return np.ascontiguousarray(u8.movedim(-3, -1).numpy())
