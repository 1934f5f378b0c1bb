"""One denoising transition of a flow-matching model as a Gaussian policy step.

Convention (diffusers' flow matching): ``x_σ = (1 − σ)·x₀ + σ·ε``, σ = 1 is pure noise, the model predicts the
velocity ``v = ε − x₀``, and a step goes from σ to σ_next < σ, so ``dt = σ_next − σ < 0``.

Every kind below defines the transition ``x_next ~ N(mean(x, v, σ, σ_next), std²·I)``; :func:`sde_step` samples
it (or scores a given ``next_latents``) and returns its log-density. All arithmetic is float32 whatever the model's
dtype, and the functions are pure: no step counter, no scheduler state. Rollout and training both call
:func:`sde_step`, so the importance ratio is exactly 1 on-policy.

The log-density is the Gaussian log-density **averaged over the latent dimensions** (``reduction="mean"``, the
convention of Flow-GRPO, DanceGRPO and their descendants: a sum over ~10⁵ dimensions makes clip ranges of 1e-4
meaningless) or summed (``reduction="sum"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

from flowgrpo.strategies.registry import Registry

__all__ = [
    "SDEStepOutput",
    "SDE_KINDS",
    "RELEASE_NOISE_LEVELS",
    "NOISELESS_LAST_STEP",
    "noise_level_warning",
    "sde_step",
    "transition_moments",
    "gaussian_log_prob",
    "gaussian_entropy_per_dim",
    "kl_between_means",
    "KL_FORMS",
    "KL_STD",
    "kl_to_reference",
]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


#: the noise levels the releases run each kind with: kind -> (smallest, largest, where). flow_sde's a: 0.7 in
#: Flow-GRPO's config/base.py (sample.noise_level; configs/sd35_grpo.yaml) to 1.2 in its Qwen-Image setting
#: (config/grpo.py pickscore_qwenimage; configs/qwenimage.yaml). dance_sde's eta: 0.3 in DanceGRPO's
#: scripts/finetune/finetune_wan_2_1_grpo.sh (--eta; configs/wan21_t2v_1.3b_dance.yaml) to 1.2 in verl-omni's
#: examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh (rollout.algo.noise_level;
#: configs/wan22_5b_dance.yaml). cps's a is refused outside [0, 1] (:func:`_cps_moments`), the releases' 0.8
#: (Flow-Factory's LTX-2 example; configs/ltx2_t2v.yaml) inside it.
RELEASE_NOISE_LEVELS: dict[str, tuple[float, float, str]] = {
    "flow_sde": (0.7, 1.2, "Flow-GRPO: SD3.5 0.7, Qwen-Image 1.2"),
    "dance_sde": (0.3, 1.2, "DanceGRPO's Wan2.1 0.3, verl-omni's Wan2.2 1.2"),
}
#: the kinds whose last transition (to σ_next = 0) has std 0 at every noise level, so it is never stochastic and a
#: chunker never trains it: cps (std σ_next·sin(aπ/2)). A plugin kind of that sort adds its name here.
NOISELESS_LAST_STEP: set[str] = {"cps"}
#: :func:`noise_level_warning` warns above this multiple of a kind's largest release value: far enough out that no
#: release-like setting trips it, near enough to catch a misplaced decimal point (7 typed for 0.7)
NOISE_LEVEL_WARN_FACTOR = 2.0


def sigma_one_next(sampling, sigmas: torch.Tensor) -> float | None:
    """``sigma_one_next`` for :func:`sde_step` on the grid ``sigmas`` (T+1,) under the run's sampling settings
    (a :class:`~flowgrpo.config.SamplingConfig`): the grid's σ₁ for ``sigma_one_guard: grid`` (the releases'
    ``sigmas[1]``), None for ``next`` (each transition's own σ_next) or a one-point grid."""
    return float(sigmas[1]) if sampling.sigma_one_guard == "grid" and len(sigmas) > 1 else None


def noise_level_warning(kind: str, noise_level: float, key: str = "sampling.noise_level") -> str | None:
    """One line, naming the setting ``key``, when ``noise_level`` is more than :data:`NOISE_LEVEL_WARN_FACTOR`
    times the largest value the releases run ``kind`` with (:data:`RELEASE_NOISE_LEVELS`), else None (also for a
    kind without release values: ``ode``, ``cps``, whose range its step refuses, or a plugin's)."""
    if kind not in RELEASE_NOISE_LEVELS:
        return None
    low, high, where = RELEASE_NOISE_LEVELS[kind]
    if noise_level <= NOISE_LEVEL_WARN_FACTOR * high:
        return None
    return (f"{key}={noise_level:g} is {noise_level / high:.1f} times the largest the releases run "
            f"sde_kind {kind!r} with ({low:g} to {high:g}; {where}): every SDE step's noise grows with it (a "
            f"typo for {noise_level / 10:g}?); the run uses it as given")


@dataclass(frozen=True)
class SDEStepOutput:
    """The result of one transition.

    Attributes:
        next_latents: (B, …) float32, the latents at σ_next (sampled, or the ``next_latents`` passed in).
        log_prob: (B,) float32, log N(next_latents; mean, std²) reduced over latent dims (0 where std = 0).
        mean: (B, …) float32, the transition mean.
        std: (B,) float32, the transition standard deviation (the same for every latent dim).
    """

    next_latents: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


# A kind maps (x, v, σ, σ_next, noise_level, *, sigma_one_next) -> (mean, std); σ, σ_next, sigma_one_next are
# (B, 1, …) float32 broadcastable to x (sigma_one_next: see transition_moments).
MomentsFn = Callable[..., tuple]
SDE_KINDS: Registry[MomentsFn] = Registry("SDE kind")


@SDE_KINDS.register("ode")
def _ode_moments(x, v, sigma, sigma_next, noise_level, *, sigma_one_next=None):
    """Deterministic Euler step ``x + (σ_next − σ)·v``: diffusers' ``FlowMatchEulerDiscreteScheduler.step``."""
    return x + (sigma_next - sigma) * v, torch.zeros_like(sigma)


@SDE_KINDS.register("flow_sde")
def _flow_sde_moments(x, v, sigma, sigma_next, noise_level, *, sigma_one_next=None):
    """Flow-GRPO's reverse SDE, Euler–Maruyama (Liu et al., arXiv 2505.05470, eq. 9 and App. A).

    ``s = a·√(σ / (1 − σ))``, ``mean = x·(1 + s²·dt/(2σ)) + v·(1 + s²·(1 − σ)/(2σ))·dt``, ``std = s·√(−dt)``
    with ``a = noise_level``. At σ = 1 the ratio is infinite; the denominator then uses 1 − ``sigma_one_next``
    (default σ_next; the reference code's ``sigma_max = sigmas[1]``, the grid's second σ, which is σ_next on a
    one-step transition from σ = 1).
    """
    dt = sigma_next - sigma
    guard = sigma_next if sigma_one_next is None else sigma_one_next
    denom = torch.where(sigma >= 1.0, 1.0 - guard, 1.0 - sigma)
    s = noise_level * torch.sqrt(sigma / denom)
    half_var = s**2 / (2 * sigma)  # (B, 1, …): the per-sample coefficients first, then three full-size ops
    # (not a fused addcmul: with a = 0 this must be the Euler step x + dt·v to the last bit)
    mean = x * (1 + half_var * dt) + v * ((1 + half_var * (1 - sigma)) * dt)
    return mean, s * torch.sqrt(-dt)


@SDE_KINDS.register("dance_sde")
def _dance_sde_moments(x, v, sigma, sigma_next, noise_level, *, sigma_one_next=None):
    """DanceGRPO's SDE step (Xue et al., arXiv 2505.07818, Sec. 3 and its released sampler).

    ``std = η·√(σ − σ_next)``; ``x̂₀ = x − σ·v``; score ``= −(x − (1 − σ)·x̂₀)/σ²``;
    ``mean = x + dt·v − ½·η²·score·dt`` with ``η = noise_level``. Algebraically ``flow_sde`` with ``s ≡ η``.
    """
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    mean = x + dt * v - 0.5 * noise_level**2 * score * dt
    return mean, noise_level * torch.sqrt(sigma - sigma_next)


@SDE_KINDS.register("cps")
def _cps_moments(x, v, sigma, sigma_next, noise_level, *, sigma_one_next=None):
    """Coefficients-Preserving Sampling (Wang & Yu, arXiv 2509.05952, eq. 8).

    ``std = σ_next·sin(a·π/2)``; ``x̂₀ = x − σ·v``, ``x̂₁ = x + (1 − σ)·v``;
    ``mean = (1 − σ_next)·x̂₀ + √(σ_next² − std²)·x̂₁``. With a = 0 this is the Euler step; at σ_next = 0 the
    std is 0, so the last transition is never stochastic.

    Raises:
        ValueError: ``noise_level`` outside [0, 1], where sin(a·π/2) folds back (a = 1.5 would give a = 0.5's std,
            a = 2 none).
    """
    if not 0.0 <= float(noise_level) <= 1.0:
        raise ValueError(f"sampling.noise_level={noise_level} is outside [0, 1], the range of sde_kind 'cps' "
                         "(std = sigma_next*sin(a*pi/2) folds back above 1: 1.5 gives the std of 0.5)")
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0)) * x1
    return mean, std


def _as_batch_sigma(sigma, batch: int, ndim: int, device) -> torch.Tensor:
    """σ as a (B, 1, …, 1) float32 tensor; accepts a float, a 0-d tensor or a (B,) tensor."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=device)
    if s.ndim == 0:
        s = s.expand(batch)
    if s.shape != (batch,):
        raise ValueError(f"sigma must be a float or a ({batch},) tensor, got shape {tuple(s.shape)}")
    return s.reshape(batch, *([1] * (ndim - 1)))


def transition_moments(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    *,
    kind: str = "flow_sde",
    noise_level: float = 0.7,
    sigma_one_next=None,
    check_sigmas: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (B, …) and std (B,) of the transition from σ to σ_next, float32.

    ``sigma_one_next`` (float or (B,), optional): for ``flow_sde`` at σ = 1, the σ whose 1 − σ replaces the
    infinite 1 − σ in s = a·√(σ/(1 − σ)). Default: this transition's σ_next. The releases use the grid's σ₁ (their
    ``sigma_max = sigmas[1]``): the same on a one-step transition, a larger std on a merged jump from σ = 1.

    σ and σ_next (floats, 0-dim or (B,) tensors) are checked where they are given, then moved to the latents'
    device: pass host σ to keep the check from waiting on the device. ``check_sigmas=False`` skips the check, for
    a caller re-scoring transitions that a checked call already took (the trainer, on its rollout's grid).

    Raises:
        KeyError: ``kind`` is not a registered SDE kind (the message lists them).
        ValueError: σ_next ≥ σ, or σ outside (0, 1].
    """
    x = latents.float()
    v = velocity.float()
    b = x.shape[0]
    s_given = torch.as_tensor(sigma, dtype=torch.float32)
    sn_given = torch.as_tensor(sigma_next, dtype=torch.float32, device=s_given.device)
    if check_sigmas and not bool(((sn_given >= 0) & (sn_given < s_given) & (s_given <= 1)).all()):  # σ > 0 follows
        raise ValueError(
            f"a transition needs 0 <= sigma_next < sigma <= 1, got sigma={s_given.flatten().tolist()}, "
            f"sigma_next={sn_given.flatten().tolist()}"
        )
    s = _as_batch_sigma(s_given, b, x.ndim, x.device)
    sn = _as_batch_sigma(sn_given, b, x.ndim, x.device)
    guard = (sigma_one_next if sigma_one_next is None or isinstance(sigma_one_next, float)  # a float broadcasts
             else _as_batch_sigma(sigma_one_next, b, x.ndim, x.device))
    mean, std = SDE_KINDS.get(kind)(x, v, s, sn, float(noise_level), sigma_one_next=guard)
    return mean, torch.as_tensor(std, dtype=torch.float32, device=x.device).reshape(b)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, *, reduction: str = "mean",
                      simplified: bool = False) -> torch.Tensor:
    """log N(x; mean, std²·I) reduced over all non-batch dims; (B,) float32, 0 where std = 0.

    ``simplified=True`` is the reference CPS code's surrogate ``−(x − mean)²`` (no 1/(2·std²), no normaliser):
    its values are ~1/(2·std²) times smaller than true log-ratios, so its importance ratios barely move and the
    clip range must be correspondingly smaller (the CPS paper uses 1e-5 with it; see the README).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"log-prob reduction must be 'mean' or 'sum', got {reduction!r}")
    x, mean = x.float(), mean.float()
    dims = tuple(range(1, x.ndim))
    # std is one per sample, so the density reduces to the squared distance's mean (or sum) over the latent dims,
    # a (B,) tensor; the per-sample terms are applied there (two full-size ops instead of six)
    sq = (x - mean).square()
    sq = sq.mean(dim=dims) if reduction == "mean" else sq.sum(dim=dims)  # (B,)
    std = std.float().reshape(-1)
    stochastic = std > 0
    if simplified:
        lp = -sq
    else:
        safe_std = torch.where(stochastic, std, 1.0)
        log_norm = torch.log(safe_std) + _LOG_SQRT_2PI  # per latent dim
        if reduction == "sum":
            log_norm = math.prod(x.shape[1:]) * log_norm
        lp = sq / (-2 * safe_std**2) - log_norm  # = −sq/(2·std²) − log_norm to the bit (division is sign-symmetric)
    return torch.where(stochastic, lp, 0.0)


def gaussian_entropy_per_dim(std: torch.Tensor) -> torch.Tensor:
    """Differential entropy of N(·, std²) per latent dimension, ``h = ½·log(2πe·std²)``, same shape as ``std``.

    E-GRPO (arXiv 2601.00423, Sec. 3.2) uses (D/2)·log(2πe·σ²); dividing by D keeps its threshold τ independent
    of the latent size.
    """
    return 0.5 * torch.log(2 * math.pi * math.e * std.float() ** 2)


def kl_between_means(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std²) ‖ N(ref_mean, std²)) per latent dimension, ``(mean − ref_mean)² / (2·std²)``, averaged
    over the latent dims; (B,) float32, 0 where std = 0 (Flow-GRPO, arXiv 2505.05470, eq. 11)."""
    std = std.float().reshape(-1)
    safe = torch.where(std > 0, std, torch.ones_like(std))
    sq = (mean.float() - ref_mean.float()).square().mean(dim=tuple(range(1, mean.ndim)))  # (B,)
    return torch.where(std > 0, sq / (2 * safe**2), torch.zeros_like(sq))


# The std that Flow-GRPO's KL divides by, per SDE kind: (std (B,), σ (B,), σ_next (B,)) -> (B,).
KL_STD: Registry[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("SDE kind (KL std)")


@KL_STD.register("flow_sde")
@KL_STD.register("dance_sde")
def _diffusion_coefficient(std, sigma, sigma_next):
    """Euler–Maruyama kinds (std = g·√(σ − σ_next)): the diffusion coefficient g, i.e. Flow-GRPO's ``std_dev_t``
    = a·√(σ/(1 − σ)) for ``flow_sde`` (its σ = 1 guard included, since ``std`` carries it) and η for
    ``dance_sde``. No Δσ: this is the release's KL scale, 1/(σ − σ_next) times the exact Gaussian KL."""
    return std / torch.sqrt(sigma - sigma_next)


@KL_STD.register("cps")
@KL_STD.register("ode")
def _transition_std(std, sigma, sigma_next):
    """CPS (Flow-GRPO's ``sde_type='cps'`` returns ``std_dev_t = σ_next·sin(aπ/2)``, the transition std itself) and
    ODE (std 0: KL 0)."""
    return std


# A KL form maps (std, σ, σ_next, kind) to the std the squared mean difference is divided by.
KL_FORMS: Registry[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]] = Registry("KL form")


@KL_FORMS.register("flow_grpo")
def _flow_grpo_kl_std(std, sigma, sigma_next, kind):
    """Flow-GRPO's training scripts: ``mean_dims((μθ − μref)²) / (2·std_dev_t²)`` with the kind's ``KL_STD``."""
    return KL_STD.get(kind)(std, sigma, sigma_next)


@KL_FORMS.register("gaussian")
def _gaussian_kl_std(std, sigma, sigma_next, kind):
    """The exact KL between the two Gaussian transitions, divided by the transition's own std."""
    return std


def kl_to_reference(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor,
    sigma,
    sigma_next,
    *,
    kind: str,
    form: str = "flow_grpo",
) -> torch.Tensor:
    """The per-step KL penalty to the reference policy, (B,) float32, averaged over latent dims.

    ``KL = mean_dims((mean − ref_mean)²) / (2·d²)`` (Flow-GRPO, arXiv 2505.05470, eq. 11), where d is

    * ``form="flow_grpo"`` (default, the released training scripts): for ``flow_sde`` Flow-GRPO's
      ``std_dev_t = a·√(σ/(1 − σ))`` (at σ = 1 the denominator uses 1 − σ_next, which on a per-step grid is the
      release's ``1 − sigmas[1]``), for ``dance_sde`` η, for ``cps`` the transition std σ_next·sin(aπ/2);
    * ``form="gaussian"``: the transition std (``flow_sde``: std_dev_t·√(σ − σ_next)), i.e. the exact
      KL(N(mean, d²) ‖ N(ref_mean, d²)) per dim; 1/(σ − σ_next) times the ``flow_grpo`` form for the
      Euler–Maruyama kinds.

    Args:
        mean, ref_mean: (B, …) the policy's and the reference's transition means.
        std: (B,) the transition std (from :func:`transition_moments`).
        sigma, sigma_next: floats or (B,) tensors of the transition.
        kind: the registered SDE kind the transition used; form: a registered KL form.

    Raises:
        KeyError: an unknown ``form``, or a ``kind`` without a registered KL std (the message lists them).
    """
    b = mean.shape[0]
    s = _as_batch_sigma(sigma, b, 1, mean.device)
    sn = _as_batch_sigma(sigma_next, b, 1, mean.device)
    d = KL_FORMS.get(form)(std.float().reshape(b), s, sn, kind)
    return kl_between_means(mean, ref_mean, d)


def sde_step(latents: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next, *, kind: str = "flow_sde",
             noise_level: float = 0.7, next_latents: torch.Tensor | None = None,
             generator: torch.Generator | Sequence[torch.Generator] | None = None, reduction: str = "mean",
             simplified_log_prob: bool = False, sigma_one_next=None, check_sigmas: bool = True) -> SDEStepOutput:
    """Take (or score) one transition from σ to σ_next.

    Args:
        latents: (B, …) the current latents x at σ (any float dtype; computed in float32).
        velocity: (B, …) the model's velocity prediction at (x, σ).
        sigma, sigma_next: floats or (B,) tensors with 0 ≤ σ_next < σ ≤ 1 (a (B,) σ_next serves merged jumps).
        kind: a registered SDE kind: ``flow_sde`` (a = ``noise_level``), ``dance_sde`` (η = ``noise_level``),
            ``cps`` (a = ``noise_level``) or ``ode``.
        next_latents: (B, …) if given, score this x_next instead of sampling one (the training pass).
        generator: one generator, or one per sample (as diffusers' ``randn_tensor``), for the sampled noise.
        reduction: ``mean`` (default) or ``sum`` of the log-density over latent dims.
        simplified_log_prob: the CPS reference code's ``−(x − mean)²`` surrogate (see :func:`gaussian_log_prob`).
        sigma_one_next: ``flow_sde``'s σ = 1 guard (see :func:`transition_moments`).
        check_sigmas: check 0 ≤ σ_next < σ ≤ 1 (see :func:`transition_moments`).

    Returns:
        :class:`SDEStepOutput`. Where std = 0 (``ode``, or ``cps`` at σ_next = 0), ``next_latents`` is the mean
        and ``log_prob`` is 0.
    """
    mean, std = transition_moments(latents, velocity, sigma, sigma_next, kind=kind, noise_level=noise_level,
                                   sigma_one_next=sigma_one_next, check_sigmas=check_sigmas)
    if next_latents is None:
        if bool(torch.any(std > 0)):
            noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
            next_latents = mean + std.reshape(-1, *([1] * (mean.ndim - 1))) * noise
        else:
            next_latents = mean
    log_prob = gaussian_log_prob(next_latents, mean, std, reduction=reduction, simplified=simplified_log_prob)
    return SDEStepOutput(next_latents=next_latents.float(), log_prob=log_prob, mean=mean, std=std)


#: which latents of a trajectory's last step are decoded into the rewarded image (``sampling.final_decode``): each
#: maps (x (B, …) at the last step's σ, its velocity v, that σ, the last step's output) to (B, …) latents
FINAL_DECODES: Registry[Callable[[torch.Tensor, torch.Tensor, float, SDEStepOutput], torch.Tensor]] = Registry(
    "final decode"
)


@FINAL_DECODES.register("sample")
def _decode_sample(x, v, sigma, out):
    """The last transition's sample x_T (Flow-GRPO: its pipeline decodes the final SDE latent)."""
    return out.next_latents


@FINAL_DECODES.register("x0_pred")
def _decode_x0_pred(x, v, sigma, out):
    """The clean latent predicted at the last step, ``x̂₀ = x − σ·v`` (DanceGRPO, GCPO, MixGRPO, E-GRPO: their
    sampler returns ``pred_original_sample`` of the last step). Equals ``sample`` when the last step is an ODE step
    to σ = 0; differs by the last step's noise (std a·√(σ/(1−σ))·√σ for flow_sde) when it is stochastic."""
    return x - sigma * v
