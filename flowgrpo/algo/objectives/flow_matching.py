"""Shared pieces of the forward-process objectives (DiffusionNFT, AWM, DGPO): noising, targets, per-sample errors.

Convention (docs/design.md): ``x_σ = (1 − σ)·x₀ + σ·ε``, σ = 1 is pure noise, the model predicts the velocity
``v = ε − x₀``, so the clean latent it implies at (x_σ, σ) is ``x̂₀ = x_σ − σ·v``. These objectives never look at a
trajectory: they noise the rollout's final sample x₀ afresh at training σ's and compare velocities there.

Every function is pure float32 arithmetic on (N, …) tensors, N rows of (sample, σ) draws; per-row reductions are
means over the latent dims (the releases' ``.mean(dim=tuple(range(1, ndim)))``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "ObjectiveTerms",
    "as_row_sigma",
    "noised",
    "velocity_target",
    "x0_from_velocity",
    "mean_dims",
    "velocity_mse",
]


@dataclass(frozen=True)
class ObjectiveTerms:
    """What a forward-process objective returns for N rows (sample, σ draw), float32.

    Attributes:
        loss: (N,) per-row loss with gradient; the release's loss of a micro-batch is ``loss.mean()``.
        stats: name → (N,) detached per-row diagnostic (the trainer averages each over the rows of an optimizer
            step and logs it as ``objective/<name>``).
    """

    loss: torch.Tensor
    stats: Mapping[str, torch.Tensor] = field(default_factory=dict)


def as_row_sigma(sigma, rows: int, ndim: int, device) -> torch.Tensor:
    """σ as a (N, 1, …, 1) float32 tensor broadcastable to (N, …) latents; accepts a float or an (N,) tensor.

    Raises:
        ValueError: an (N,) tensor of the wrong length, or a σ outside [0, 1].
    """
    s = torch.as_tensor(sigma, dtype=torch.float32, device=device)
    if s.ndim == 0:
        s = s.expand(rows)
    if s.shape != (rows,):
        raise ValueError(f"sigma must be a float or a ({rows},) tensor, got shape {tuple(s.shape)}")
    return s.reshape(rows, *([1] * (ndim - 1)))


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
    """The forward process ``x_σ = (1 − σ)·x₀ + σ·ε`` (rectified flow; SD3, arXiv 2403.03206, eq. 1 with
    a_t = 1 − t, b_t = t), (N, …) float32. ``sigma``: float or (N,)."""
    s = as_row_sigma(sigma, x0.shape[0], x0.ndim, x0.device)
    return (1 - s) * x0.float() + s * noise.float()


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching target ``v* = ε − x₀`` (diffusers' flow-matching convention), (N, …) float32."""
    return noise.float() - x0.float()


def x0_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigma) -> torch.Tensor:
    """The clean latent a velocity implies, ``x̂₀ = x_σ − σ·v``, (N, …) float32. ``sigma``: float or (N,)."""
    s = as_row_sigma(sigma, x_t.shape[0], x_t.ndim, x_t.device)
    return x_t.float() - s * velocity.float()


def mean_dims(t: torch.Tensor) -> torch.Tensor:
    """Mean over every non-row dim: (N, …) → (N,)."""
    return t.mean(dim=tuple(range(1, t.ndim)))


def velocity_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mean_dims((a − b)²)``, (N,) float32: the releases' flow-matching error and their velocity-space KL to a
    reference (DiffusionNFT ``kl_div_loss``, AWM ``kl_weight='Uniform'``, DGPO ``dsm_loss``/``kl_loss``)."""
    return mean_dims((a.float() - b.float()).square())
