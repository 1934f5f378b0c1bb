"""Measuring the digits task: the reward classifier, an independent judge, and intra-digit diversity.

Two classifiers of different kinds, trained on disjoint splits of the real digits (:func:`load_digit_split`),
both at load_digits' native 8×8 resolution (images are brought back there by :func:`images_to_digits`):

* the **reward classifier**, multinomial logistic regression on the ``reward`` split (features g/16 ∈ [0, 1],
  L2 penalty C = 1): its softmax probabilities are what the ``digit_correctness`` reward returns;
* the **judge**, an RBF support-vector classifier (C = 10, γ = 1/(64·Var(X)), scikit-learn's ``"scale"``) on the
  ``judge`` split. It is never used as a reward, so images that fool the reward classifier (adversarial to a
  linear model) are not counted as correct.

Both train in well under a second on first use and are cached in the process. Held-out accuracy on the ``test``
split: :func:`classifier_accuracies`.

RL on this task can reach high correctness by collapsing each digit to one prototype, so correctness is reported
next to :func:`intra_digit_diversity` (mean pairwise Euclidean distance between 8×8 samples of the same digit)
and the same measure on real digits, :func:`real_diversity`.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from flowgrpo.tasks.digits.data import (
    check_digit,
    images_to_digits,
    load_digit_split,
)

logger = logging.getLogger(__name__)


def _features(grids: np.ndarray | torch.Tensor) -> np.ndarray:
    """(N, 8, 8) grids in 0–16 → (N, 64) float64 features in [0, 1]."""
    g = grids.detach().cpu().numpy() if isinstance(grids, torch.Tensor) else np.asarray(grids)
    return g.reshape(len(g), -1).astype(np.float64) / 16.0


@functools.lru_cache(maxsize=1)
def reward_classifier():
    """The reward's ``sklearn.linear_model.LogisticRegression`` (multinomial, C = 1), fitted on the ``reward``
    split; features are the 64 pixels / 16."""
    from sklearn.linear_model import LogisticRegression

    x, y = load_digit_split("reward")
    return LogisticRegression(C=1.0, max_iter=5000).fit(_features(x), y)


@functools.lru_cache(maxsize=1)
def judge_classifier():
    """The judge's ``sklearn.svm.SVC`` (RBF kernel, C = 10, γ = ``"scale"``), fitted on the ``judge`` split."""
    from sklearn.svm import SVC

    x, y = load_digit_split("judge")
    return SVC(C=10.0, gamma="scale").fit(_features(x), y)


def classifier_accuracies() -> dict[str, float]:
    """Held-out accuracy on the real ``test`` digits: ``{"reward": …, "judge": …}`` (fractions in [0, 1])."""
    x, y = load_digit_split("test")
    f = _features(x)
    return {"reward": float(reward_classifier().score(f, y)), "judge": float(judge_classifier().score(f, y))}


def digit_probabilities(images: torch.Tensor) -> torch.Tensor:
    """Reward classifier probabilities p(digit | image): (B, 10) float32 on the CPU, rows sum to 1.

    Multinomial logistic regression (Bishop 2006, §4.3.4): p = softmax(W·f + b), f = :func:`images_to_digits`
    (images) / 16 flattened (B, 64), W (10, 64), b (10,) from :func:`reward_classifier`. Computed in float64 on
    the CPU.
    ``images``: (B, 3, H, H) float in [0, 1]; raises ``ValueError`` on another shape.
    """
    clf = reward_classifier()
    feats = images_to_digits(images).to(torch.float64).reshape(len(images), -1) / 16.0  # (B, 64)
    w = torch.as_tensor(clf.coef_, dtype=torch.float64)  # (10, 64)
    b = torch.as_tensor(clf.intercept_, dtype=torch.float64)  # (10,)
    return torch.softmax(feats @ w.T + b, dim=1).to(torch.float32)


def digit_probabilities_differentiable(images: torch.Tensor) -> torch.Tensor:
    """:func:`digit_probabilities` with the autograd graph back to ``images``: (B, 10) float32 on the images'
    device. The same arithmetic (float64): ink = 1 − channel mean, g = clamp(16·P·ink·Pᵀ, 0, 16) (P the
    least-squares downsampling of :func:`~flowgrpo.tasks.digits.data.images_to_digits`), p = softmax(W·g/16 + b).
    Its gradient is zero where the clamp is active (an 8×8 cell outside 0–16 ink). ``images``: (B, 3, H, H) float in
    [0, 1]; raises ``ValueError`` on another shape."""
    from flowgrpo.tasks.digits.data import NATIVE_SIZE, _downsample_matrix

    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3 \
            or images.shape[2] != images.shape[3] or images.shape[2] < NATIVE_SIZE:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a square (N, 3, H, H) tensor, H >= 8, in [0, 1], got {shape}")
    clf = reward_classifier()
    dev = images.device
    p = _downsample_matrix(int(images.shape[-1])).to(dev)
    ink = 1.0 - images.to(torch.float64).mean(dim=1)  # (B, H, H)
    feats = (16.0 * (p @ ink @ p.T)).clamp(0.0, 16.0).reshape(len(images), -1) / 16.0  # (B, 64)
    w = torch.as_tensor(clf.coef_, dtype=torch.float64, device=dev)  # (10, 64)
    b = torch.as_tensor(clf.intercept_, dtype=torch.float64, device=dev)  # (10,)
    return torch.softmax(feats @ w.T + b, dim=1).to(torch.float32)


def _labels(labels) -> np.ndarray:
    arr = [check_digit(v, f"labels[{i}]") for i, v in enumerate(labels.tolist() if hasattr(labels, "tolist")
                                                                    else labels)]
    return np.asarray(arr, dtype=np.int64)


def judge_predict(images: torch.Tensor) -> torch.Tensor:
    """The judge's predicted digit for each image: (B,) int64. ``images`` (B, 3, H, H) float in [0, 1]."""
    return torch.from_numpy(judge_classifier().predict(_features(images_to_digits(images))).astype(np.int64))


def judge_correctness(images: torch.Tensor, labels) -> torch.Tensor:
    """Whether the judge reads each image as its intended digit: (B,) bool.

    ``images`` (B, 3, H, H) float in [0, 1]; ``labels`` B integers 0–9 (list, array or tensor). Raises
    ``ValueError`` when the lengths differ or a label is not an integer 0–9.
    """
    lab = _labels(labels)
    if len(lab) != len(images):
        raise ValueError(f"judge_correctness got {len(images)} images but {len(lab)} labels")
    return judge_predict(images) == torch.from_numpy(lab)


def _per_digit_grid_diversity(grids: torch.Tensor, labels: np.ndarray) -> dict[int, float]:
    """{digit: mean pairwise L2 distance between that digit's 8×8 grids} for every digit with ≥ 2 samples."""
    flat = grids.to(torch.float64).reshape(len(grids), -1)
    out = {}
    for d in np.unique(labels):
        g = flat[torch.from_numpy(labels == d)]
        n = len(g)
        if n < 2:
            continue
        dist = torch.cdist(g, g)  # (n, n), zero diagonal
        out[int(d)] = float(dist.sum()) / (n * (n - 1))
    return out


def _grid_diversity(grids: torch.Tensor, labels: np.ndarray) -> float:
    """Mean over digits (with ≥ 2 samples) of the mean pairwise L2 distance between that digit's 8×8 grids."""
    per_digit = _per_digit_grid_diversity(grids, labels)
    if not per_digit:
        raise ValueError("intra-digit diversity needs at least two samples of some digit")
    return float(np.mean(list(per_digit.values())))


def intra_digit_diversity(images: torch.Tensor, labels) -> float:
    """Intra-digit diversity of generated images, in load_digits' 0–16 ink units.

    For each digit d with n_d ≥ 2 samples: D_d = (1 / (n_d(n_d−1))) Σ_{i≠j} ‖g_i − g_j‖₂ over the 8×8 grids
    g = :func:`images_to_digits` (images) (64-vectors); the result is the mean of D_d over those digits. The mean
    pairwise distance is an unbiased estimate of E‖g − g'‖ for any n_d ≥ 2, so it compares fairly with
    :func:`real_diversity` computed on many more samples. A collapse to one prototype per digit gives 0.
    ``images`` (B, 3, H, H) in [0, 1]; ``labels`` B integers 0–9. Raises ``ValueError`` on bad labels or when no
    digit has two samples.
    """
    lab = _labels(labels)
    if len(lab) != len(images):
        raise ValueError(f"intra_digit_diversity got {len(images)} images but {len(lab)} labels")
    return _grid_diversity(images_to_digits(images), lab)


def per_digit_diversity(images: torch.Tensor, labels) -> dict[int, float]:
    """D_d of :func:`intra_digit_diversity` for each digit d with at least two samples: ``{d: D_d}`` (0–16 ink
    units); digits with fewer samples are absent. Raises ``ValueError`` on bad labels or mismatched lengths."""
    lab = _labels(labels)
    if len(lab) != len(images):
        raise ValueError(f"per_digit_diversity got {len(images)} images but {len(lab)} labels")
    return _per_digit_grid_diversity(images_to_digits(images), lab)


def real_diversity(split: str = "all") -> float:
    """:func:`intra_digit_diversity` of the real digits of ``split`` (default all 1,797), same units."""
    x, y = load_digit_split(split)
    return _grid_diversity(torch.from_numpy(x), y)


@functools.lru_cache(maxsize=4)
def real_diversity_per_digit(split: str = "all") -> dict[int, float]:
    """:func:`per_digit_diversity` of the real digits of ``split``: ``{d: D_d}`` for d = 0…9 (0–16 ink units;
    on all 1,797 digits they range from 27.5 for "0" to 41.6 for "1", so each digit is compared with its own)."""
    x, y = load_digit_split(split)
    return _per_digit_grid_diversity(torch.from_numpy(x), y)


def min_diversity_ratio(per_digit: dict[int, float], real: dict[int, float]) -> float:
    """min over the digits of ``per_digit`` of D_d / D_d(real): 1 means every digit as varied as the real ones,
    near 0 means some digit collapsed to one prototype. Raises ``ValueError`` when ``per_digit`` is empty or
    names a digit missing from ``real``."""
    if not per_digit:
        raise ValueError("min_diversity_ratio needs the diversity of at least one digit")
    missing = sorted(set(per_digit) - set(real))
    if missing:
        raise ValueError(f"min_diversity_ratio: no real diversity for digits {missing}")
    return min(v / real[d] for d, v in per_digit.items())
