"""Advantage Weighted Matching (Xue et al., arXiv 2509.25050; scxue/advantage_weighted_matching).

AWM replaces the per-step SDE log-probability of policy-gradient methods by a flow-matching surrogate on the
forward process: for the rollout's final latent x₀, fresh noise ε and a training σ, ``x_σ = (1 − σ)·x₀ + σ·ε`` and

    m      = mean_dims((v_θ − (ε − x₀))²)                      the flow-matching error of the row
    ℓ      = w(m, σ)                                         its "log-probability" (ghuber by default, below)
    ρ      = exp(ℓ − ℓ_old)                                  ℓ_old = sg(ℓ) on-policy (the release's setting)
    Â      = clamp(A, −c, c) / c · a_max
    loss   = max(−Â·ρ, −Â·clip(ρ, 1 − ε, 1 + ε)) + β_ref·KL(v_θ, v_ref) + β_ema·KL(v_θ, v_ema)

with KL(a, b) = mean_dims((a − b)²) (``kl_weight='Uniform'``). On-policy ρ = 1 exactly and the gradient is
−Â·∇ℓ: the flow-matching loss of every row weighted by its advantage (paper eq. 11). The weightings w
(train_sd3_awm.py ``compute_log_prob_awm``, lines 234–251): ``Uniform`` −m, ``t`` −m·σ, ``t**2`` −m·σ²,
``huber`` −(√(m + 1e-10) − 1e-5)·σ, ``ghuber`` −((m + 1e-10)^p − (1e-10)^p)·σ/p.
The policy loss and the KL terms are in train_sd3_awm.py lines 1293–1354; v_ema is the old copy ("ema" adapter,
updated once an epoch with decay min(0.3, 0.001·k), lines 1409–1419).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.objectives.base import CLIP_RANGE, OBJECTIVES, TIMESTEP_FRACTION, shared_field
from flowgrpo.algo.objectives.flow_matching import (
    ObjectiveTerms,
    as_row_sigma,
    noised,
    velocity_mse,
    velocity_target,
)
from flowgrpo.algo.objectives.forward import ForwardConfig, ForwardObjective, ForwardWork, RowDraw, SolverName, shared
from flowgrpo.rng import make_generator
from flowgrpo.strategies.registry import Registry
from flowgrpo.strategies.settings import registered_name

__all__ = ["AWM", "AWMConfig", "AWM_WEIGHTINGS", "AWM_KL_WEIGHTS", "AWM_TIME_TYPES", "awm_log_prob",
           "awm_terms", "awm_train_sigma_indices"]

_TINY = 1e-10  # the release's guard inside the square root / power

# weighting (m (N,) flow-matching error, σ (N,), p) -> ℓ (N,): train_sd3_awm.py lines 240–251.
AWM_WEIGHTINGS: Registry[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = Registry("AWM weighting")


@AWM_WEIGHTINGS.register("uniform")
def _w_uniform(m, sigma, p):
    """ℓ = −m (``weighting='Uniform'``)."""
    return -m


@AWM_WEIGHTINGS.register("t")
def _w_t(m, sigma, p):
    """ℓ = −m·σ."""
    return -m * sigma


@AWM_WEIGHTINGS.register("t**2")
def _w_t2(m, sigma, p):
    """ℓ = −m·σ²."""
    return -m * sigma**2


@AWM_WEIGHTINGS.register("huber")
def _w_huber(m, sigma, p):
    """ℓ = −(√(m + 1e-10) − 1e-5)·σ."""
    return -(torch.sqrt(m + _TINY) - 1e-5) * sigma


@AWM_WEIGHTINGS.register("ghuber")
def _w_ghuber(m, sigma, p):
    """ℓ = −((m + 1e-10)^p − (1e-10)^p)·σ/p, the generalised Huber weighting (the release's default, p = 0.25):
    its gradient −σ·(m + 1e-10)^(p−1)·∇m weights large errors less."""
    return -(torch.pow(m + _TINY, p) - _TINY**p) * sigma / p


def _elbo_std(sigma: torch.Tensor) -> torch.Tensor:
    """``std_dev_t = √(σ / (1 − clamp(σ, 0, 0.99)))·0.7`` (train_sd3_awm.py line 236)."""
    return torch.sqrt(sigma / (1 - sigma.clamp(0.0, 0.99))) * 0.7


# KL weighting (mean_dims((a − b)²) (N,), σ (N,)) -> (N,): ``kl_weight`` / ``kl_ema_weight``, lines 1334–1348.
AWM_KL_WEIGHTS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("AWM KL weight")


@AWM_KL_WEIGHTS.register("uniform")
def _kl_uniform(sq, sigma):
    """mean_dims((v_θ − v_ref)²) (``'Uniform'``, every release config)."""
    return sq


@AWM_KL_WEIGHTS.register("elbo")
def _kl_elbo(sq, sigma):
    """mean_dims((v_θ − v_ref)²) / (2·std_dev_t²) (``'ELBO'``)."""
    return sq / (2 * _elbo_std(sigma) ** 2)


def awm_log_prob(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, sigma, *, weighting: str = "ghuber",
                 ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's surrogate log-probability ℓ = w(mean_dims((v − (ε − x₀))²), σ), (N,) float32 (module docstring).

    ``sigma``: float or (N,). Raises KeyError for an unknown ``weighting``.
    """
    m = velocity_mse(v, velocity_target(x0, noise))
    s = as_row_sigma(sigma, v.shape[0], 1, v.device)
    return AWM_WEIGHTINGS.get(weighting)(m, s, float(ghuber_power))


def _scaled_advantages(advantages: torch.Tensor, settings: AWMConfig) -> torch.Tensor:
    c = settings.adv_clip_max
    a = advantages.float().clamp(-c, c)
    return a if settings.advantage_max is None else a / c * settings.advantage_max


def _kl_term(v, other, sigma, beta, weight, what):
    if not beta:
        return torch.zeros(v.shape[0], device=v.device)
    if other is None:
        raise ValueError(f"AWM {what} = {beta} needs its velocity ({'v_ref' if what == 'kl_beta' else 'v_ema'})")
    return AWM_KL_WEIGHTS.get(weight)(velocity_mse(v, other.detach()), sigma)


def awm_terms(
    v: torch.Tensor,
    noise: torch.Tensor,
    x0: torch.Tensor,
    sigma,
    advantages: torch.Tensor,
    settings: AWMConfig,
    *,
    old_log_prob: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    v_ema: torch.Tensor | None = None,
) -> ObjectiveTerms:
    """AWM's loss for N rows (module docstring), float32.

    Args:
        v: (N, …) the trained velocity at x_σ = (1 − σ)·x₀ + σ·ε, with gradient.
        noise: (N, …) ε of each row; x0: (N, …) the rollout's final latents; sigma: float or (N,).
        advantages: (N,) advantages of each row's sample.
        settings: the validated :class:`AWMConfig` (its loss knobs are read).
        old_log_prob: (N,) ℓ under the sampling policy (off-policy); None: ``sg(ℓ)``, the release's on-policy case.
        v_ref: (N, …) the reference velocity (needed when ``kl_beta > 0``); v_ema: the old copy's (``ema_beta``).

    Returns:
        ``ObjectiveTerms`` with ``loss`` (N,) and the detached stats ``policy_loss``, ``log_prob`` (ℓ), ``ratio``
        (ρ), ``clipped`` (|ρ − 1| > ε, 0/1), ``fm_error`` (m), ``kl_ref`` and ``kl_ema`` (unweighted by β).

    Raises:
        ValueError: mismatched shapes, or a β > 0 whose velocity is missing.
    """
    n = v.shape[0]
    if noise.shape != v.shape or x0.shape != v.shape or advantages.shape != (n,):
        raise ValueError(f"awm_terms shapes disagree: v {tuple(v.shape)}, noise {tuple(noise.shape)}, x0 "
                         f"{tuple(x0.shape)}, advantages {tuple(advantages.shape)}")
    s = as_row_sigma(sigma, n, 1, v.device)
    lp = awm_log_prob(v, noise, x0, s, weighting=settings.weighting, ghuber_power=settings.ghuber_power)
    old = lp.detach() if old_log_prob is None else old_log_prob.float().to(v.device)
    ratio = torch.exp(lp - old)
    adv = _scaled_advantages(advantages, settings).to(v.device)
    eps = settings.clip_range
    policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps))
    kl_ref = _kl_term(v, v_ref, s, settings.kl_beta, settings.kl_weight, "kl_beta")
    kl_ema = _kl_term(v, v_ema, s, settings.ema_beta, settings.kl_ema_weight, "ema_beta")
    loss = policy + settings.kl_beta * kl_ref + settings.ema_beta * kl_ema
    with torch.no_grad():
        stats = {"policy_loss": policy.detach(), "log_prob": lp.detach(), "ratio": ratio.detach(),
                 "clipped": ((ratio - 1.0).abs() > eps).float(),
                 "fm_error": velocity_mse(v.detach(), velocity_target(x0, noise)),
                 "kl_ref": kl_ref.detach(), "kl_ema": kl_ema.detach()}
    return ObjectiveTerms(loss=loss, stats=stats)


def _stratified(lo: float, hi: float, k: int, generator) -> torch.Tensor:
    """k indices, one per stratum of ``linspace(lo, hi, k + 1)`` truncated to integers: ``lower + ⌊u·(upper −
    lower)⌋`` with u ~ U(0, 1) (train_sd3_awm.py lines 1173–1177)."""
    bounds = torch.linspace(lo, hi, steps=k + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(k, generator=generator)
    return lower + (u * (upper - lower)).long()


# time_type (T grid steps, K, fraction, generator) -> (K,) long grid indices, train_sd3_awm.py lines 1172–1205.
AWM_TIME_TYPES: Registry[Callable[[int, int, float, torch.Generator | None], torch.Tensor]] = Registry(
    "AWM time_type")


@AWM_TIME_TYPES.register("discrete")
def _t_discrete(t: int, k: int, f: float, generator):
    """Strata of ``linspace(0, int(T·f), K + 1)``: grid steps 0 … int(T·f) − 1 (σ = 1 included)."""
    return _stratified(0.0, float(int(t * f)), k, generator)


@AWM_TIME_TYPES.register("discrete_wo_init")
def _t_discrete_wo_init(t: int, k: int, f: float, generator):
    """Strata of ``linspace(1, int(T·f), K + 1)``: grid steps 1 … int(T·f) − 1 (the first σ left out)."""
    return _stratified(1.0, float(int(t * f)), k, generator)


@AWM_TIME_TYPES.register("discrete_with_init")
def _t_discrete_with_init(t: int, k: int, f: float, generator):
    """Step 0, then K − 1 strata of ``linspace(1, int(T·f), K)``."""
    first = torch.zeros(1, dtype=torch.long)
    if k == 1:
        return first
    return torch.cat([first, _stratified(1.0, float(int(t * f)), k - 1, generator)])


def awm_train_sigma_indices(num_steps: int, settings: AWMConfig,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """The K grid indices a micro-batch trains on, (K,) long, shared by every sample of the micro-batch (the
    release repeats each of the K σ's over the batch: ``repeat_interleave(t_indices, batch_size)``, line 1204).
    The training σ of index i is the rollout grid's σ_i.

    Raises:
        ValueError: fewer than 2 grid steps, or int(T·f) too small for the strata (an index past the grid).
    """
    if num_steps < 2:
        raise ValueError(f"AWM needs a rollout of >= 2 steps, got {num_steps}")
    idx = AWM_TIME_TYPES.get(settings.time_type)(num_steps, settings.train_timesteps, settings.timestep_fraction,
                                                 generator)
    if bool((idx >= num_steps).any()) or bool((idx < 0).any()):
        raise ValueError(f"AWM time_type {settings.time_type!r} drew grid indices {idx.tolist()} outside "
                         f"0..{num_steps - 1}")
    return idx


class AWMConfig(ForwardConfig):
    """``objective: {name: awm, ...}``: AWM with the release's defaults (scxue/advantage_weighted_matching,
    config/dgx_awm.py ``geneval_sd3_no_cfg_1node`` over config/base_awm.py; docs/fidelity_forward.md). The pure
    functions above read it as it is (validated once, here).

    Attributes:
        adv_clip_max: c, advantages clipped to ±c (config/base_awm.py line 91: 5).
        advantage_max: a_max, the clipped advantages are rescaled to ±a_max (dgx_awm.py line 58: 1), or None
            (no rescale).
        weighting: a registered :data:`AWM_WEIGHTINGS` name (line 63: ``ghuber``).
        ghuber_power: p of ``ghuber`` (line 64: 0.25).
        clip_range: ε of the ratio clip (line 86: 1; on-policy ρ = 1, so it never binds).
        kl_beta: β_ref of the KL to the reference (line 55: 0.001 GenEval; OCR 0.003, PickScore 1e-4).
        kl_weight: a registered :data:`AWM_KL_WEIGHTS` name for the reference KL (line 57: ``uniform``).
        ema_beta: β_ema of the KL to the old copy (line 67: 1).
        kl_ema_weight: the same for the old-copy KL (line 65: ``uniform``).
        decay_*: the old copy's schedule (lines 66, 68: ``linear``, min(0.3, 0.001·k)).
        train_timesteps: K training σ's per micro-batch (line 56: 6).
        timestep_fraction: they are drawn from the first int(T·f) grid steps (line 60: 0.9).
        time_type: a registered :data:`AWM_TIME_TYPES` name (line 88: ``discrete_wo_init``; PickScore
            ``discrete``, line 367).
    """

    name: Literal["awm"] = "awm"
    caches_rollout: ClassVar[bool] = True  # an ODE rollout that keeps only the final latents
    solver: SolverName = shared("solver", "sa_solver")
    solver_noise_level: float = shared("solver_noise_level", 0.4)
    kl_beta: float = shared("kl_beta", 0.001)
    decay_cap: float = shared("decay_cap", 0.3)
    decay_constant: float | None = Field(None, ge=0, lt=1, description="old copy: a constant decay instead of the "
                                         "ramp (AWM kl_ema_decay_type constant: 0.3)")
    advantage_max: float | None = Field(1.0, gt=0, description="AWM: clipped advantages rescaled to +-a_max "
                                        "(null: no rescale)")
    weighting: registered_name(AWM_WEIGHTINGS, "objective.weighting") = Field(
        "ghuber", description="AWM's log-probability weighting: ghuber, huber, uniform, t, t**2")
    ghuber_power: float = Field(0.25, gt=0, description="AWM: p of the ghuber weighting")
    clip_range: float = shared_field(CLIP_RANGE, 1.0)
    kl_weight: registered_name(AWM_KL_WEIGHTS, "objective.kl_weight") = Field(
        "uniform", description="AWM: the reference KL's weight (uniform, elbo)")
    ema_beta: float = Field(1.0, ge=0, description="AWM: weight of the KL to the old copy")
    kl_ema_weight: registered_name(AWM_KL_WEIGHTS, "objective.kl_ema_weight") = Field(
        "uniform", description="AWM: the old-copy KL's weight (uniform, elbo)")
    train_timesteps: int = Field(6, ge=1, description="AWM: K training sigmas per micro-batch, shared by its samples")
    timestep_fraction: float = shared_field(TIMESTEP_FRACTION, 0.9)
    shuffle_micro_batches: bool = Field(True, description="AWM: cut the micro-batches (which share their training "
                                        "sigmas) from a seeded permutation of each rollout batch, so they mix "
                                        "prompts as the release's shuffle does (train_sd3_awm.py 1085-1087); "
                                        "false: consecutive samples (one prompt's group together)")
    time_type: registered_name(AWM_TIME_TYPES, "objective.time_type") = Field(
        "discrete_wo_init", description="AWM time_type: discrete_wo_init (steps 1..), discrete (0..), "
        "discrete_with_init (step 0 and strata)")


@OBJECTIVES.register("awm")
class AWM(ForwardObjective):
    """AWM (module docstring) in the training loop: the trained weights roll out (on-policy), each micro-batch
    trains K σ's drawn for it (shared by its samples) with fresh ε per (sample, σ), and the old copy, a second KL
    anchor, moves once an epoch after the update (k = optimizer steps so far)."""
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None

    Config = AWMConfig

    @property
    def needs_reference(self) -> bool:
        return self.o.kl_beta > 0

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return self.o.train_timesteps

    def check_grid(self, sigmas: torch.Tensor) -> None:
        """The strata fit the grid (:func:`awm_train_sigma_indices` raises for an index past it; the strata's
        bounds do not depend on the draw)."""
        awm_train_sigma_indices(sigmas.numel() - 1, self.o, torch.Generator().manual_seed(0))

    def after_epoch(self, steps: int) -> None:
        """old ← d·old + (1 − d)·θ, d = decay(k), k = the optimizer steps so far (train_sd3_awm.py 1409–1419)."""
        self.old.update(steps)

    def micro_batch_order(self, n: int, epoch: int, offset: int) -> torch.Tensor | None:
        """With ``objective.shuffle_micro_batches`` (the default) the release's layout, micro-batches that mix
        prompts (it shuffles its samples before cutting them, train_sd3_awm.py 1085–1087): each rollout batch of
        ``train.rollout_batch_size`` local samples in the order of a permutation from a generator of (seed, epoch,
        ``awm_shuffle``, the batch's global index); on one process with ``rollout_batch_size`` = the batch, the
        release's one permutation of the process's samples. Rollout batches never straddle processes, so the
        micro-batches (and the epoch) are the same on any number of processes. Else None: consecutive samples (one
        prompt's group together)."""
        if not self.o.shuffle_micro_batches:
            return None
        size = self.cfg.train.rollout_batch_size
        if n % size or offset % size:
            raise ValueError(f"train.rollout_batch_size={size} must divide this process's {n} samples and its first "
                             f"sample's index {offset}")
        return torch.cat([j + torch.randperm(size, generator=make_generator(
            self.cfg.train.seed, epoch, "awm_shuffle", (offset + j) // size)) for j in range(0, n, size)])

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[RowDraw]:
        """K grid indices for the micro-batch, from a generator of (seed, epoch, pass, its global index
        :meth:`ForwardWork.micro_batch_index`); ε per (sample, σ) from a generator of the sample."""
        s, t = work.samples, work.samples.sigmas.numel() - 1
        mb = work.micro_batch_index(rows)
        idx = awm_train_sigma_indices(t, self.o, make_generator(self.cfg.train.seed, work.epoch, inner, "awm_t", mb))
        eps = torch.stack([torch.randn((len(idx), *s.x0.shape[1:]), generator=make_generator(
            self.cfg.train.seed, work.epoch, inner, "awm_eps", int(s.group_ids[r]), int(s.sample_index[r])))
            for r in rows.tolist()])  # (n, K, …)
        return [RowDraw(rows, s.sigmas[i].float().expand(len(rows)).clone(), eps[:, j]) for j, i in
                enumerate(idx.tolist())]

    def terms(self, adapter, work: ForwardWork, draw: RowDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """v_ref (base model, when kl_beta > 0), v_ema (old copy, when ema_beta > 0), then v_θ;
        :func:`awm_terms` on-policy."""
        settings = self.o
        sigma, noise = draw.sigma.to(x0.device), draw.noise.to(x0.device)
        x_t = noised(x0, noise, sigma)
        v_ref = self.velocity(adapter, x_t, sigma, embeds, weights="reference") if settings.kl_beta > 0 else None
        v_ema = self.velocity(adapter, x_t, sigma, embeds, weights="old") if settings.ema_beta > 0 else None
        v = self.velocity(adapter, x_t, sigma, embeds)
        return awm_terms(v, noise, x0, sigma, work.advantages[draw.rows].to(x0.device), settings, v_ref=v_ref,
                         v_ema=v_ema)
