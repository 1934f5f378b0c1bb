"""The reward server's wire format for images: PNG bytes in base64, encoded by the client
(:func:`images_to_png_b64`) and read by the server, whose memory budget is charged from the PNG headers before any
pixel is decoded (:func:`read_png_headers`, then :func:`decode_pngs`). Never pickle (docs/reward_server.md)."""

from __future__ import annotations

import base64
import io
import struct
import warnings

import numpy as np
import torch

from flowgrpo.images import to_uint8


def images_to_png_b64(images: torch.Tensor, compress_level: int = 1) -> list[str]:
    """Base64 strings of the 8-bit RGB PNG encodings of ``images`` (B, 3, H, W) float in [0, 1].

    Pixels are ``round(255·clamp(x, 0, 1))``; PNG is lossless, so :func:`png_b64_to_images` returns exactly
    these 8-bit values (over 255). ``compress_level`` (0–9) trades size for speed; it never changes pixels.
    """
    from PIL import Image

    out = []
    for a in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(a, mode="RGB").save(buf, format="PNG", compress_level=compress_level)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_header_size(raw: bytes, i: int) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, read without PIL (PNG spec, section 11.2.2: the first chunk)."""
    if raw[:8] != PNG_SIGNATURE or raw[12:16] != b"IHDR" or len(raw) < 26:
        raise ValueError(f"images[{i}] is not a PNG image (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", raw[16:24])
    if raw[24:26] != b"\x08\x02":  # bit depth 8, colour type 2 (truecolour): 8-bit RGB
        depth, colour = raw[24], raw[25]
        kind = {0: "greyscale", 2: "RGB", 3: "palette", 4: "greyscale+alpha", 6: "RGBA"}.get(colour, f"type {colour}")
        raise ValueError(f"images[{i}] is a {depth}-bit {kind} PNG (its header); only 8-bit 'RGB' is accepted")
    return width, height


def decode_png_b64(items: list, max_pixels: int = 4096 * 4096) -> np.ndarray:
    """(B, H, W, 3) uint8 pixels of base64 8-bit RGB PNG strings, all of one size.

    The declared size is read from the PNG header and checked against ``max_pixels`` before PIL opens the
    image, so a small PNG that declares a huge image (a decompression bomb) is refused cheaply; any failure to
    open or decode a client's bytes is a ``ValueError`` (the server answers it with 400), never another error.
    :func:`read_png_headers` then :func:`decode_pngs`: the server checks its decoded-pixel budgets in between.

    Raises:
        ValueError: not a list of base64 strings, not a PNG, not 8-bit RGB, more than ``max_pixels`` pixels
            (width·height, the message names the limit), corrupt data, or sizes that differ (the message names
            the index and what is allowed).
    """
    raws, width, height = read_png_headers(items, max_pixels)
    return decode_pngs(raws, width, height)


def read_png_headers(items: list, max_pixels: int = 4096 * 4096) -> tuple[list[bytes], int, int]:
    """(the PNG bytes, width, height) of base64 8-bit RGB PNG strings, all of one size, from their headers alone
    (nothing is decoded: B·width·height is what decoding them would take, 3 bytes a pixel).

    Raises:
        ValueError: as :func:`decode_png_b64`, except for what only decoding finds (mode, corrupt data).
    """
    if not isinstance(items, list) or not items:
        raise ValueError("'images' must be a non-empty list of base64-encoded PNG strings")
    raws = []
    size = None
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"images[{i}] must be a base64 string, got {type(s).__name__}")
        try:
            raw = base64.b64decode(s, validate=True)
        except ValueError as err:
            raise ValueError(f"images[{i}] is not valid base64: {err}") from None
        width, height = _png_header_size(raw, i)
        if width * height > max_pixels:
            raise ValueError(f"images[{i}] declares {width}x{height} = {width * height} pixels, over the limit of "
                             f"{max_pixels} pixels (width·height; the server's --max-image-pixels)")
        if size is None:
            size = (width, height)
        elif (width, height) != size:
            raise ValueError(f"images[{i}] is {width}x{height} but images[0] is {size[0]}x{size[1]}")
        raws.append(raw)
    return raws, size[0], size[1]


def decode_pngs(raws: list[bytes], width: int, height: int) -> np.ndarray:
    """(B, height, width, 3) uint8 of PNGs whose headers :func:`read_png_headers` checked, decoded one at a time
    into one array (the decoded pixels are held once). Raises ``ValueError`` for a PNG that is not 8-bit RGB or
    is corrupt."""
    out = np.empty((len(raws), height, width, 3), dtype=np.uint8)
    for i, raw in enumerate(raws):
        out[i] = _decode_png(raw, i)
    return out


def _decode_png(raw: bytes, i: int) -> np.ndarray:
    """(H, W, 3) uint8 of one PNG whose header has been checked; every decoding failure is a ValueError."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # the size is checked against our own limit already
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw), formats=["PNG"])
            if img.mode != "RGB":
                raise ValueError(f"images[{i}] has PNG mode {img.mode!r}; only 8-bit 'RGB' is accepted")
            return np.asarray(img, dtype=np.uint8)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever PIL raises on a client's bytes is bad input, not a crash
        raise ValueError(f"images[{i}] is a truncated or corrupt PNG: {type(err).__name__}: {err}") from None


def pixels_to_images(pixels: np.ndarray) -> torch.Tensor:
    """(B, 3, H, W) float32 in [0, 1] (value/255) from (B, H, W, 3) uint8 pixels."""
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2).float().div_(255.0)  # one copy


def png_b64_to_images(items: list, max_pixels: int = 4096 * 4096) -> torch.Tensor:
    """(B, 3, H, W) float32 in [0, 1] from base64 8-bit RGB PNG strings, all of one size.

    Raises:
        ValueError: as :func:`decode_png_b64`.
    """
    return pixels_to_images(decode_png_b64(items, max_pixels))
