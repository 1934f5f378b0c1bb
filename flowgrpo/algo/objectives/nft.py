"""DiffusionNFT: online RL on the forward process (Zheng et al., arXiv 2509.16117; NVlabs/DiffusionNFT).

The rollout is any sampler; only each sample's final latent x₀ and its advantage A are kept. For fresh noise ε at
training σ's, ``x_σ = (1 − σ)·x₀ + σ·ε`` is scored by the trained velocity v_θ and by the old copy's v_old
(:mod:`flowgrpo.algo.objectives.old_copy`). With β the mixing coefficient and c = ``adv_clip_max``:

    r      = clamp(clamp(A, −c, c) / (2c) + ½, 0, 1)                 the "optimality" weight (paper eq. 9)
    v₊     = β·v_θ + (1 − β)·v_old          v₋ = (1 + β)·v_old − β·v_θ   implicit positive / negative policies
    x̂₀±    = x_σ − σ·v±
    L±     = mean_dims((x̂₀± − x₀)² / sg(max(mean_dims|x̂₀± − x₀|, w_min)))   adaptive weighting, per row
    loss   = c·(r·L₊/β + (1 − r)·L₋/β) + β_KL·mean_dims((v_θ − v_ref)²)

(scripts/train_nft_sd3.py, lines 910–970: the advantage clip 910–914, ``adv_mode`` 915–925, r 928–929, the implicit
velocities 934–937, the adaptive weights 939–957 with ``clip(min=0.00001)``, the loss 959–960, the KL 966–970.)
The release averages the loss over a micro-batch's rows; a row here is one (sample, σ) draw, so the release's loss
is ``terms.loss.mean()``. The adaptive weight is detached (``torch.no_grad``) and per row: the mean absolute error
over that row's latent dims, floored at ``w_min``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.objectives.base import OBJECTIVES, TIMESTEP_FRACTION, shared_field
from flowgrpo.algo.objectives.flow_matching import (
    ObjectiveTerms,
    mean_dims,
    noised,
    velocity_mse,
    x0_from_velocity,
)
from flowgrpo.algo.objectives.forward import ForwardConfig, ForwardObjective, ForwardWork, RowDraw, SolverName, shared
from flowgrpo.rng import make_generator
from flowgrpo.strategies.registry import Registry
from flowgrpo.strategies.settings import registered_name

__all__ = [
    "NFT",
    "NFTConfig",
    "ADV_MODES",
    "reward_weight",
    "implicit_velocities",
    "adaptive_x0_loss",
    "nft_terms",
    "nft_train_sigmas",
]

# ``train.adv_mode`` (train_nft_sd3.py lines 915–925): (clipped advantages (N,), c) -> advantages (N,).
ADV_MODES: Registry[Callable[[torch.Tensor, float], torch.Tensor]] = Registry("DiffusionNFT adv_mode")


@ADV_MODES.register("all")
def _adv_all(a: torch.Tensor, c: float) -> torch.Tensor:
    """Every advantage as it is (config/nft.py: ``adv_mode = "all"``)."""
    return a


@ADV_MODES.register("positive_only")
def _adv_positive(a: torch.Tensor, c: float) -> torch.Tensor:
    """Negative advantages set to 0 (r = ½: equal weight on the two implicit policies)."""
    return a.clamp(0.0, c)


@ADV_MODES.register("negative_only")
def _adv_negative(a: torch.Tensor, c: float) -> torch.Tensor:
    """Positive advantages set to 0."""
    return a.clamp(-c, 0.0)


@ADV_MODES.register("one_only")
def _adv_one(a: torch.Tensor, c: float) -> torch.Tensor:
    """1 where A > 0, else 0."""
    return torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))


@ADV_MODES.register("binary")
def _adv_binary(a: torch.Tensor, c: float) -> torch.Tensor:
    """sign(A)."""
    return torch.sign(a)


def reward_weight(advantages: torch.Tensor, adv_clip_max: float = 5.0, adv_mode: str = "all") -> torch.Tensor:
    """r = clamp(m(clamp(A, −c, c)) / (2c) + ½, 0, 1), (N,) float32, with m the ``adv_mode`` map.

    Source: train_nft_sd3.py lines 910–929 (the paper's optimality probability, arXiv 2509.16117 eq. 9).
    """
    c = float(adv_clip_max)
    a = ADV_MODES.get(adv_mode)(advantages.float().clamp(-c, c), c)
    return torch.clamp(a / c / 2.0 + 0.5, 0.0, 1.0)


def implicit_velocities(v: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit positive and negative velocities ``v₊ = β·v_θ + (1 − β)·v_old``, ``v₋ = (1 + β)·v_old − β·v_θ``
    (arXiv 2509.16117 eq. 8; train_nft_sd3.py lines 934–937), (N, …) float32 each; v_old is detached."""
    v, v_old = v.float(), v_old.detach().float()
    return beta * v + (1 - beta) * v_old, (1.0 + beta) * v_old - beta * v


def adaptive_x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor, min_weight: float = 1e-5) -> torch.Tensor:
    """``mean_dims((x̂₀ − x₀)² / w)`` with the detached per-row weight ``w = max(mean_dims|x̂₀ − x₀|, w_min)``,
    (N,) float32 (train_nft_sd3.py lines 939–957; the release forms w in float64, here float32).

    The gradient is that of ``mean_dims((x̂₀ − x₀)²)`` divided by the row's mean absolute error: each row's
    squared error is normalised by its own size, so every row contributes on a comparable scale.
    """
    err = x0_pred.float() - x0.float()
    with torch.no_grad():
        w = mean_dims(err.abs()).clamp(min=min_weight)
    return mean_dims(err.square()) / w


def nft_terms(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma,
    advantages: torch.Tensor,
    settings: NFTConfig,
    *,
    v_ref: torch.Tensor | None = None,
) -> ObjectiveTerms:
    """DiffusionNFT's loss for N rows (module docstring), float32.

    Args:
        v: (N, …) the trained velocity at (x_t, σ), with gradient.
        v_old: (N, …) the old copy's velocity at the same input (detached here).
        x_t: (N, …) the noised latents ``(1 − σ)·x₀ + σ·ε``.
        x0: (N, …) the rollout's final latents.
        sigma: float or (N,) training σ of each row.
        advantages: (N,) group-normalised advantages of each row's sample.
        settings: the validated :class:`NFTConfig` (``beta``, ``adv_clip_max``, ``adv_mode``,
            ``adaptive_weight_min``, ``kl_beta`` are read).
        v_ref: (N, …) the reference (base model) velocity, needed when ``settings.kl_beta > 0``.

    Returns:
        :class:`~flowgrpo.algo.objectives.flow_matching.ObjectiveTerms` with ``loss`` (N,) and the detached stats
        ``policy_loss``, ``positive_loss`` (L₊), ``negative_loss`` (L₋), ``reward_weight`` (r), ``old_deviation``
        (mean_dims (v_θ − v_old)²) and ``kl_ref`` (0 without a reference).

    Raises:
        ValueError: mismatched shapes, or ``kl_beta > 0`` without ``v_ref``.
    """
    n = v.shape[0]
    if v_old.shape != v.shape or x_t.shape != v.shape or x0.shape != v.shape or advantages.shape != (n,):
        raise ValueError(f"nft_terms shapes disagree: v {tuple(v.shape)}, v_old {tuple(v_old.shape)}, x_t "
                         f"{tuple(x_t.shape)}, x0 {tuple(x0.shape)}, advantages {tuple(advantages.shape)}")
    if settings.kl_beta > 0 and v_ref is None:
        raise ValueError(f"DiffusionNFT kl_beta={settings.kl_beta} needs the reference velocity v_ref")
    r = reward_weight(advantages, settings.adv_clip_max, settings.adv_mode).to(v.device)
    v_pos, v_neg = implicit_velocities(v, v_old, settings.beta)
    pos = adaptive_x0_loss(x0_from_velocity(x_t, v_pos, sigma), x0, settings.adaptive_weight_min)
    neg = adaptive_x0_loss(x0_from_velocity(x_t, v_neg, sigma), x0, settings.adaptive_weight_min)
    policy = (r * pos / settings.beta + (1.0 - r) * neg / settings.beta) * settings.adv_clip_max
    kl = velocity_mse(v, v_ref.detach()) if v_ref is not None else torch.zeros_like(policy)
    loss = policy + settings.kl_beta * kl if settings.kl_beta else policy
    with torch.no_grad():
        stats = {"policy_loss": policy.detach(), "positive_loss": pos.detach(), "negative_loss": neg.detach(),
                 "reward_weight": r, "old_deviation": velocity_mse(v.detach(), v_old), "kl_ref": kl.detach()}
    return ObjectiveTerms(loss=loss, stats=stats)


def nft_train_sigmas(sigmas: torch.Tensor, batch: int, fraction: float = 0.99,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """The training σ's of B samples, (B, K) float32 with K = int(T·fraction): for each sample, a random
    permutation of the rollout grid's T σ's (σ₀ … σ_{T−1}, without the final 0), cut to its first K.

    Source: train_nft_sd3.py lines 569 (K = int(num_steps·timestep_fraction)), 807–816 (a ``randperm`` of the
    timesteps per sample), 854–864 (the first K of them, t = timestep/1000).

    Raises:
        ValueError: a grid with fewer than 2 entries, or K = 0.
    """
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"nft_train_sigmas needs the (T+1,) sigma grid, got shape {tuple(sigmas.shape)}")
    t = sigmas.numel() - 1
    k = int(t * fraction)
    if k < 1:
        raise ValueError(f"timestep_fraction={fraction} of {t} steps trains no sigma (int(T*f) = 0)")
    perms = torch.stack([torch.randperm(t, generator=generator) for _ in range(batch)])  # (B, T)
    return sigmas[:t].float()[perms[:, :k]]


class NFTConfig(ForwardConfig):
    """``objective: {name: nft, ...}``: DiffusionNFT with the release's defaults (NVlabs/DiffusionNFT,
    config/nft.py ``sd3_geneval`` over config/base.py; docs/fidelity_forward.md). The pure functions above read
    it as it is (validated once, here).

    Attributes:
        beta: β, the mixing of v_θ into the implicit policies (config/nft.py line 61: 1.0; ``sd3_ocr`` and
            ``sd3_multi_reward`` 0.1, lines 77 and 137); > 0 (the loss divides by it).
        adv_clip_max: c, advantages are clipped to ±c and mapped to r; also the loss scale (config/base.py
            line 84: 5).
        kl_beta: β_KL of the velocity-space KL to the reference (``train.beta``, config/nft.py line 24: 1e-4).
        adv_mode: a registered :data:`ADV_MODES` name (config/nft.py line 62: ``all``).
        adaptive_weight_min: w_min, the floor of the adaptive weight (train_nft_sd3.py lines 945 and 952: 1e-5).
        timestep_fraction: each sample trains on int(T·f) of the rollout grid's T σ's, a random subset per sample
            (config/base.py line 87: 0.99, i.e. 9 of 10).
        decay_*: the old copy's schedule (``decay_type``, config/nft.py line 60: 1, i.e.
            :data:`~flowgrpo.algo.objectives.old_copy.NFT_DECAY_TYPES` [1]; ``sd3_ocr`` 2, line 78).
    """

    name: Literal["nft"] = "nft"
    caches_rollout: ClassVar[bool] = True  # an ODE rollout that keeps only the final latents
    solver: SolverName = shared("solver", "dpmpp_2m")
    kl_beta: float = shared("kl_beta", 1e-4)
    decay_cap: float = shared("decay_cap", 0.5)
    beta: float = Field(1.0, gt=0, description="DiffusionNFT beta: v+ = b*v + (1-b)*v_old, v- = (1+b)*v_old - b*v "
                        "(OCR 0.1)")
    adv_mode: registered_name(ADV_MODES, "objective.adv_mode") = Field(
        "all", description="DiffusionNFT adv_mode: all, positive_only, negative_only, one_only, binary")
    adaptive_weight_min: float = Field(1e-5, ge=0, description="DiffusionNFT: floor of the adaptive weight "
                                       "mean_dims|x0_hat - x0|")
    timestep_fraction: float = shared_field(TIMESTEP_FRACTION, 0.99)


@OBJECTIVES.register("nft")
class NFT(ForwardObjective):
    """DiffusionNFT (module docstring) in the training loop: the old copy rolls out and gives v_old, it moves
    once an epoch after the update (k = optimizer steps so far), each sample trains K = int(T·f) σ's of the grid
    drawn for it alone, with fresh ε per (sample, σ)."""
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None

    Config = NFTConfig

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return int((sigmas.numel() - 1) * self.o.timestep_fraction)

    def rollout_weights(self):
        """The old copy samples (train_nft_sd3.py 640–659: ``set_adapter("old")`` around the sampler)."""
        return self.old.swapped()

    def after_epoch(self, steps: int) -> None:
        """old ← d·old + (1 − d)·θ, d = decay(k), k = the optimizer steps so far (lines 1034–1039)."""
        self.old.update(steps)

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[RowDraw]:
        """Per sample, its own K σ's (a permutation of the grid, cut to K) and K fresh ε, from a generator of
        (seed, epoch, pass, the sample)."""
        s, k = work.samples, self.sigmas_per_sample(work.samples.sigmas)
        sig, eps = [], []
        for r in rows.tolist():
            g = make_generator(self.cfg.train.seed, work.epoch, inner, "nft", int(s.group_ids[r]),
                               int(s.sample_index[r]))
            sig.append(nft_train_sigmas(s.sigmas, 1, self.o.timestep_fraction, g)[0])
            eps.append(torch.randn((k, *s.x0.shape[1:]), generator=g))
        sig_t, eps_t = torch.stack(sig), torch.stack(eps)  # (n, K), (n, K, …)
        return [RowDraw(rows, sig_t[:, j], eps_t[:, j]) for j in range(k)]

    def terms(self, adapter, work: ForwardWork, draw: RowDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """v_old (old copy), v_ref (base model, when kl_beta > 0), then v_θ; :func:`nft_terms`."""
        settings = self.o
        sigma, noise = draw.sigma.to(x0.device), draw.noise.to(x0.device)
        x_t = noised(x0, noise, sigma)
        v_old = self.velocity(adapter, x_t, sigma, embeds, weights="old")
        v_ref = self.velocity(adapter, x_t, sigma, embeds, weights="reference") if settings.kl_beta > 0 else None
        v = self.velocity(adapter, x_t, sigma, embeds)
        return nft_terms(v, v_old, x_t, x0, sigma, work.advantages[draw.rows].to(x0.device), settings, v_ref=v_ref)
