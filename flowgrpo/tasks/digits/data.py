"""The digits task's data: scikit-learn's handwritten digits, their splits, the prompts, and the map between the
8×8 digits and the pipeline's images.

Data: scikit-learn's bundled ``load_digits`` (1,797 8×8 greyscale digits, values 0–16; UCI "Optical Recognition
of Handwritten Digits", Alpaydin & Kaynak 1998). Each digit is upscaled bilinearly to 32×32 and drawn as dark ink
on white paper, replicated to 3 channels (:func:`digits_to_images`); :func:`images_to_digits` is the
least-squares inverse of that upscaling, used by the classifiers and the diversity measure.

Split of the 1,797 digits (per class, fixed permutation): 40 % ``reward`` (the reward classifier's training
data), 40 % ``judge`` (the judge's training data), 20 % ``test`` (held out from everything). The generator
trains on ``train`` = ``reward`` ∪ ``judge``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

DIGIT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
"""The English word for each digit 0–9, as the prompts name it."""

PHRASINGS: tuple[str, ...] = (
    "a handwritten digit {word}",
    "the number {digit} written by hand",
    "a scan of a handwritten {word}",
)
"""Prompt templates; ``{word}`` is the digit's English word, ``{digit}`` its numeral. The first is canonical."""

NATIVE_SIZE = 8  # load_digits' resolution
IMAGE_SIZE = 32  # the pipeline's resolution (4× upscaled)
SPLIT_FRACTIONS = {"reward": 0.4, "judge": 0.4, "test": 0.2}
SPLITS = ("reward", "judge", "test", "train", "all")

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "digits"
PROMPT_FILES = {"train": ASSETS / "prompts.jsonl", "eval": ASSETS / "eval.jsonl"}


# --------------------------------------------------------------------------------------------------- prompts
def digit_prompt(digit: int, phrasing: int = 0) -> str:
    """The prompt for ``digit`` (0–9) in template ``PHRASINGS[phrasing]``, e.g. ``"a handwritten digit seven"``."""
    check_digit(digit, "digit")
    return PHRASINGS[phrasing].format(word=DIGIT_WORDS[digit], digit=digit)


def prompt_records(split: str = "train") -> list[dict]:
    """The prompt file's lines as dicts ``{"prompt": str, "digit": int}``.

    ``train`` (:data:`PROMPT_FILES` ``["train"]``) holds every phrasing of every digit (30 prompts), ``eval`` the
    canonical phrasing once per digit (10 prompts). The eval phrasings are a subset of the training ones, not held
    out: the frozen random text encoders carry no language knowledge, so an unseen phrasing would be noise.
    Raises ``ValueError`` for another split name.
    """
    if split not in PROMPT_FILES:
        raise ValueError(f"unknown digits prompt split {split!r}; choose one of {sorted(PROMPT_FILES)}")
    with open(PROMPT_FILES[split], encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_digit(value, field: str = "digit") -> int:
    """``value`` as an int if it is an integer 0–9 (bool excluded), else ``ValueError`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= 9:
        raise ValueError(f"{field} must be an integer digit 0–9, got {value!r}")
    return int(value)


# ------------------------------------------------------------------------------------------------------ data
@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


@functools.lru_cache(maxsize=1)
def _split_indices() -> dict[str, np.ndarray]:
    """Per class: a fixed permutation (numpy PCG64, seed 0) cut 40/40/20 into reward/judge/test."""
    _, y = _load_digits()
    rng = np.random.default_rng(0)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in SPLIT_FRACTIONS}
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        a = round(SPLIT_FRACTIONS["reward"] * len(idx))
        b = round((SPLIT_FRACTIONS["reward"] + SPLIT_FRACTIONS["judge"]) * len(idx))
        parts["reward"].append(idx[:a])
        parts["judge"].append(idx[a:b])
        parts["test"].append(idx[b:])
    out = {k: np.sort(np.concatenate(v)) for k, v in parts.items()}
    out["train"] = np.sort(np.concatenate([out["reward"], out["judge"]]))
    out["all"] = np.arange(len(y))
    return out


def load_digit_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Real digits of one split: ``(grids (N, 8, 8) float32 in [0, 16], labels (N,) int64)``.

    Splits: ``reward`` (719), ``judge`` (719), ``test`` (359), ``train`` = reward ∪ judge (1,438), ``all``
    (1,797). Raises ``ValueError`` for another name.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown digits split {split!r}; choose one of {list(SPLITS)}")
    x, y = _load_digits()
    idx = _split_indices()[split]
    return x[idx].copy(), y[idx].copy()


@functools.lru_cache(maxsize=8)
def _upsample_matrix(size: int) -> torch.Tensor:
    """(size, 8) float64 1-D bilinear upsampling matrix U (half-pixel centres, as ``F.interpolate(
    mode="linear", align_corners=False)``): column j is the upsampled unit vector e_j."""
    eye = torch.eye(NATIVE_SIZE, dtype=torch.float64).reshape(NATIVE_SIZE, 1, NATIVE_SIZE)
    up = torch.nn.functional.interpolate(eye, size=size, mode="linear", align_corners=False)
    return up.reshape(NATIVE_SIZE, size).T.contiguous()


@functools.lru_cache(maxsize=8)
def _downsample_matrix(size: int) -> torch.Tensor:
    """(8, size) float64 P = U⁺, the Moore–Penrose pseudo-inverse of :func:`_upsample_matrix` (U has full column
    rank, condition number 1.7 at size 32): P·U = I, and P·x is the least-squares 8-sample signal for x."""
    return torch.linalg.pinv(_upsample_matrix(size))


def digits_to_images(grids: torch.Tensor | np.ndarray, size: int = IMAGE_SIZE) -> torch.Tensor:
    """8×8 digits (N, 8, 8) in load_digits' 0–16 ink scale → images (N, 3, size, size) float32 in [0, 1].

    Image = 1 − U·(g/16)·Uᵀ replicated to 3 channels (dark ink on white), U the bilinear upsampling matrix; a
    bilinear interpolation is a convex combination, so values stay in [0, 1]. Raises ``ValueError`` on a shape
    other than (N, 8, 8).
    """
    g = torch.as_tensor(grids, dtype=torch.float64)
    if g.ndim != 3 or g.shape[1:] != (NATIVE_SIZE, NATIVE_SIZE):
        raise ValueError(f"digit grids must be (N, 8, 8), got {tuple(g.shape)}")
    u = _upsample_matrix(size)
    ink = u @ (g / 16.0) @ u.T  # (N, size, size)
    return (1.0 - ink).clamp(0.0, 1.0).to(torch.float32).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def images_to_digits(images: torch.Tensor) -> torch.Tensor:
    """Images (N, 3, H, H) float in [0, 1] → digits (N, 8, 8) float32 in load_digits' 0–16 ink scale.

    The inverse of :func:`digits_to_images`: grey = channel mean, ink = 1 − grey, g = 16·P·ink·Pᵀ with P the
    pseudo-inverse of the bilinear upsampling matrix, clipped to [0, 16] (exact, up to float rounding, on images
    made by :func:`digits_to_images`). Raises ``ValueError`` unless images are (N, 3, H, H) with H ≥ 8.
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a (N, 3, H, H) tensor in [0, 1], got {shape}")
    h, w = images.shape[-2:]
    if h != w or h < NATIVE_SIZE:
        raise ValueError(f"images must be square and at least 8 pixels, got {h}×{w}")
    p = _downsample_matrix(int(h))
    ink = 1.0 - images.detach().to("cpu", torch.float64).mean(dim=1)  # (N, H, H)
    return (16.0 * (p @ ink @ p.T)).clamp(0.0, 16.0).to(torch.float32)
