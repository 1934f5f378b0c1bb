"""ODE solvers for rollouts that only need the final sample (the forward-process objectives: DiffusionNFT, AWM,
DGPO train on x₀ alone, so any solver may produce it).

A solver is a pure step function registered in :data:`SOLVERS`::

    x_next, state = step(x, v, sigmas, i, state, generator=None, noise_level=0.0)

``x`` (B, …) is the latent the model saw at σ_i = ``sigmas[i]``, ``v`` (B, …) its velocity there, ``sigmas`` the
(T+1,) grid from σ₀ (noise) down to σ_T = 0, ``state`` what the solver carried from step i − 1 (None at i = 0).
``x_next`` is the latent the model sees next, at σ_{i+1}; after the last step (i = T − 1) it is the sample.
``generator`` (one, or one per sample) and ``noise_level`` serve stochastic solvers; the others ignore them. All
arithmetic is float32 on the latents; the grid's coefficients are formed in float64 from the grid values. Nothing
here holds a step counter or touches a model: :func:`solve` runs the loop with a velocity function.

Conventions as docs/design.md: x_σ = (1 − σ)·x₀ + σ·ε, v = ε − x₀, so x̂₀ = x − σ·v and, with α = 1 − σ,
the half log-SNR is λ = log(α/σ) (DPM-Solver, Lu et al., arXiv 2206.00927, with α_t = 1 − t, σ_t = t).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from flowgrpo.strategies.registry import Registry

__all__ = ["SOLVERS", "SolverStep", "DPMState", "SAState", "solve", "flow_sigmas", "awm_sa_grid", "half_log_snr",
           "check_grid"]

SolverStep = Callable[..., tuple[torch.Tensor, object]]
SOLVERS: Registry[SolverStep] = Registry("solver")


def half_log_snr(sigma: float) -> float:
    """λ(σ) = log(1 − σ) − log σ in float64; −inf at σ = 1 and +inf at σ = 0 (as ``torch.log`` gives)."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log(1.0 - sigma) - math.log(sigma)


def check_grid(sigmas: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``sigmas`` is a (T+1,) grid, T ≥ 1, strictly decreasing in (0, 1] and ending
    at 0."""
    s = sigmas.detach().double().cpu()
    if s.ndim != 1 or s.numel() < 2:
        raise ValueError(f"a solver grid is a (T+1,) tensor with T >= 1, got shape {tuple(sigmas.shape)}")
    if not (bool((s[1:] < s[:-1]).all()) and float(s[0]) <= 1.0 and float(s[-1]) == 0.0):
        raise ValueError(f"a solver grid must decrease strictly from sigma <= 1 to exactly 0, got {s.tolist()}")


@SOLVERS.register("euler")
def euler_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, state=None, generator=None, **_):
    """``x + (σ_{i+1} − σ_i)·v``: diffusers' ``FlowMatchEulerDiscreteScheduler.step``. Carries no state."""
    dt = float(sigmas[i + 1]) - float(sigmas[i])
    return x.float() + dt * v.float(), None


@dataclass(frozen=True)
class DPMState:
    """DPM-Solver++(2M)'s history: ``x0_prev`` (B, …) the data prediction of the previous step."""

    x0_prev: torch.Tensor


@SOLVERS.register("dpmpp_2m")
def dpmpp_2m_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, state: DPMState | None = None,
                  generator=None, **_):
    """Multistep DPM-Solver++(2M) in data prediction, midpoint form (Lu et al., arXiv 2211.01095, Alg. 2), on a
    flow grid. With s = σ_i, t = σ_{i+1}, x̂₀ = x − s·v and h = λ(t) − λ(s):

    * first step (no history) and last step (t = 0): first order, ``(t/s)·x + (1 − t/s)·x̂₀`` (= the Euler step;
      at t = 0 exactly x̂₀);
    * otherwise, with the previous prediction x̂₀' at σ_{i−1} and h₀ = λ(s) − λ(σ_{i−1}):
      ``(t/s)·x + (1 − t/s)·(x̂₀ + h/(2·h₀)·(x̂₀ − x̂₀'))`` (the midpoint D₁ = (x̂₀ − x̂₀')/r₀, r₀ = h₀/h, halved).
      From σ_{i−1} = 1 (λ = −∞) the correction vanishes: the second step of a grid starting at 1 is first order.

    This is DiffusionNFT's ``dpm2`` (flow_grpo/diffusers_patch/solver.py ``dpm_step``, order 2) and diffusers'
    ``DPMSolverMultistepScheduler`` with ``algorithm_type='dpmsolver++'``, ``solver_order=2``,
    ``solver_type='midpoint'``, ``prediction_type='flow_prediction'``, ``use_flow_sigmas=True``,
    ``final_sigmas_type='zero'`` (DGPO's rollout), step for step. (1 − t/s) is −α_t·(e^{−h} − 1) in closed form.
    """
    s, t = float(sigmas[i]), float(sigmas[i + 1])
    x, v = x.float(), v.float()
    x0 = x - s * v
    last = i == sigmas.numel() - 2 or t == 0.0
    if state is None or last:
        out = (t / s) * x + (1.0 - t / s) * x0
        return out, DPMState(x0_prev=x0)
    lam_t, lam_s, lam_prev = half_log_snr(t), half_log_snr(s), half_log_snr(float(sigmas[i - 1]))
    h, h0 = lam_t - lam_s, lam_s - lam_prev
    k = 0.0 if math.isinf(h0) else h / (2.0 * h0)
    out = (t / s) * x + (1.0 - t / s) * ((1.0 + k) * x0 - k * state.x0_prev)
    return out, DPMState(x0_prev=x0)


@dataclass(frozen=True)
class SAState:
    """SA-Solver's history after step i: ``x`` (B, …) the corrected latent x_i, ``x0s`` the data predictions at
    the last (up to) two evaluated σ's (oldest first) and ``ts`` those σ's, ``noise`` (B, …) the draw ξ shared by
    the predictor and the corrector of step i + 1 (None when step i + 1 is the final one)."""

    x: torch.Tensor
    x0s: tuple[torch.Tensor, ...]
    ts: tuple[float, ...]
    noise: torch.Tensor | None


SA_TAU_WINDOW = (0.3, 0.9)  # AWM: τ(t) = noise_level for 0.3 <= t <= 0.9, else 0 (sd3_pipeline_with_logprob.py)


def _sa_tau(t: float, noise_level: float) -> float:
    lo, hi = SA_TAU_WINDOW
    return float(noise_level) if lo <= t <= hi else 0.0


def _sa_integrals(a: float, b: float, tau: float) -> tuple[float, float]:
    """E_k = ∫_a^b e^{(1+τ²)λ}·λ^k dλ for k = 0, 1 in closed form (SA-Solver, Xue et al., arXiv 2309.05019,
    eq. 15 and App. B, data prediction)."""
    k = 1.0 + tau**2
    kb, ka = k * b, k * a
    decay = math.exp(-(kb - ka))
    e0 = math.exp(kb) * (1.0 - decay) / k
    e1 = math.exp(kb) * ((kb - 1.0) - (ka - 1.0) * decay) / k**2
    return e0, e1


def _sa_update(x, x0s, s: float, t: float, nodes: Sequence[float], tau: float, noise, extra: float):
    """One stochastic Adams step from σ = s to t on the data predictions ``x0s`` (newest last), interpolated at
    the half log-SNR ``nodes`` (newest first) with Lagrange polynomials:
    x_t = e^{−τ²h}·(t/s)·x + Σ_i (1+τ²)·t·e^{−τ²λ_t}·C_i·x̂₀⁽ⁱ⁾ + t·√(1 − e^{−2τ²h})·ξ, h = λ_t − λ_s.
    ``extra`` is the few-step correction added to C₀ and taken from C₁ (order 2 only)."""
    lam_s, lam_t = half_log_snr(s), half_log_snr(t)
    h = lam_t - lam_s
    e0, e1 = _sa_integrals(lam_s, lam_t, tau)
    if len(nodes) == 1:
        coeffs = [e0]
    else:
        n0, n1 = nodes
        coeffs = [(e1 - n1 * e0) / (n0 - n1) + extra, (e1 - n0 * e0) / (n1 - n0) - extra]
    scale = (1.0 + tau**2) * t * math.exp(-(tau**2) * lam_t)
    out = math.exp(-(tau**2) * h) * (t / s) * x
    for c, m in zip(coeffs, reversed(x0s[-len(coeffs):]), strict=True):
        out = out + (scale * c) * m
    if tau > 0.0:
        out = out + t * math.sqrt(1.0 - math.exp(-2.0 * tau**2 * h)) * noise
    return out


def _sa_predictor(state: SAState, t: float, tau: float, order: int) -> torch.Tensor:
    """SA-Predictor (stochastic Adams–Bashforth) from the last evaluated σ to t, with the release's few-step
    rescaling of order 2 (AWM sa_solver.py ``adams_bashforth_update_few_steps``)."""
    s = state.ts[-1]
    nodes = [half_log_snr(u) for u in reversed(state.ts[-order:])]
    extra = 0.0
    if order == 2:
        k, lam_t = 1.0 + tau**2, half_log_snr(t)
        h = lam_t - nodes[0]
        extra = math.exp(k * lam_t) * (h**2 / 2 - (h * k - 1 + math.exp(-k * h)) / k**2) / (nodes[0] - nodes[1])
    return _sa_update(state.x, state.x0s[-order:], s, t, nodes, tau, state.noise, extra)


def _sa_corrector(state: SAState, x0_new: torch.Tensor, t: float, tau: float) -> torch.Tensor:
    """SA-Corrector (stochastic Adams–Moulton, order 2) from the last evaluated σ to t, using the new data
    prediction x0_new at t, with the release's few-step rescaling (``adams_moulton_update_few_steps``)."""
    s = state.ts[-1]
    k, lam_t = 1.0 + tau**2, half_log_snr(t)
    h = lam_t - half_log_snr(s)
    nodes = [lam_t, half_log_snr(s)]
    extra = math.exp(k * lam_t) * (h / 2 - (h * k - 1 + math.exp(-k * h)) / (k**2 * h))
    return _sa_update(state.x, (state.x0s[-1], x0_new), s, t, nodes, tau, state.noise, extra)


@SOLVERS.register("sa_solver")
def sa_solver_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, state: SAState | None = None,
                   generator=None, noise_level: float = 0.0):
    """SA-Solver as AWM's rollout runs it (Xue et al., arXiv 2309.05019; AWM flow_grpo/diffusers_patch/
    sa_solver.py ``SASolver.sample`` with ``predictor_order=2, corrector_order=2, pc_mode='PEC'``): data
    prediction, τ(t) = ``noise_level`` for 0.3 ≤ t ≤ 0.9 else 0, one model call per step.

    ``x`` is the point the model evaluated at σ_i (the initial noise, then each step's predictor). Step i:
    x̂₀ = x − σ_i·v; the corrector (order 2, from step 2 on: the first corrector is disabled) moves the
    carried latent to σ_i with x̂₀ and the noise drawn at step i − 1; the predictor (order 1 at step 0, then 2)
    gives the next point to evaluate, at σ_{i+1}, with a fresh draw ξ shared with the next corrector. The last
    step returns x̂₀ itself ("denoise to zero"; its corrected latent is not needed). AWM also moves the grid:
    see :func:`awm_sa_grid`.

    Raises:
        ValueError: a grid of fewer than 2 steps (the release asserts steps >= 2), or σ₀ = 1.
    """
    n = sigmas.numel() - 1
    if n < 2:
        raise ValueError(f"sa_solver needs at least 2 steps, got a grid of {n}")
    t_i = float(sigmas[i])
    if i == 0 and t_i >= 1.0:
        raise ValueError("sa_solver needs sigma_0 < 1 (lambda(1) = -inf): AWM starts at 1 - 1e-3, see awm_sa_grid")
    x0 = x.float() - t_i * v.float()
    if i == n - 1:  # denoise to zero: the sample is the last data prediction
        return x0, None
    if state is None:  # step 0: the initial noise, no corrector
        x_i, x0s, ts = x.float(), (x0,), (t_i,)
    elif i == 1:  # the first corrector is disabled: keep the predictor's point
        x_i, x0s, ts = x.float(), (state.x0s[-1], x0), (state.ts[-1], t_i)
    else:
        x_i = _sa_corrector(state, x0, t_i, _sa_tau(t_i, noise_level))
        x0s, ts = (state.x0s[-1], x0), (state.ts[-1], t_i)
    xi = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=torch.float32)
    cur = SAState(x=x_i, x0s=x0s, ts=ts, noise=xi)
    t_next = float(sigmas[i + 1])
    return _sa_predictor(cur, t_next, _sa_tau(t_next, noise_level), 1 if i == 0 else 2), cur


def awm_sa_grid(sigmas: torch.Tensor) -> torch.Tensor:
    """AWM's SA-Solver grid from the model's (T+1,) grid: the first σ set to 1 − 1e-3 and the last non-zero σ to
    half the one before it (sd3_pipeline_with_logprob.py: ``t[0] = 1 - 1e-3``, ``t[-2] = t[-3] / 2``), float32.

    Raises:
        ValueError: fewer than 3 grid points.
    """
    if sigmas.ndim != 1 or sigmas.numel() < 3:
        raise ValueError(f"awm_sa_grid needs a (T+1,) grid with T >= 2, got shape {tuple(sigmas.shape)}")
    t = sigmas.detach().float().clone()
    t[-2] = t[-3] / 2
    t[0] = 1 - 1e-3
    return t


def solve(velocity: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, sigmas: torch.Tensor,
          solver: str = "euler", generator: torch.Generator | Sequence[torch.Generator] | None = None,
          **options) -> torch.Tensor:
    """Integrate from ``x`` (B, …) at σ₀ down the grid with a registered solver; returns the (B, …) sample.

    ``velocity(x, σ)`` is called once per grid step (T times) on the latents the solver asks for.

    Raises:
        ValueError: a bad grid (:func:`check_grid`); KeyError: an unknown solver (the message lists them).
    """
    check_grid(sigmas)
    step = SOLVERS.get(solver)
    state = None
    for i in range(sigmas.numel() - 1):
        v = velocity(x, float(sigmas[i]))
        x, state = step(x, v, sigmas, i, state, generator=generator, **options)
    return x


def flow_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The (T+1,) float32 grid of diffusers' ``DPMSolverMultistepScheduler`` with ``use_flow_sigmas=True``:
    σ = shift·u/(1 + (shift − 1)·u) for u = 1 − linspace(1, 1/N, T+1), reversed, the last (0) dropped and a final
    0 appended (``set_timesteps``). DGPO's rollout grid (the Sana scheduler config with ``flow_shift = 3``):
    it starts at shift(0.999) ≈ 0.99967, not at 1.

    Raises:
        ValueError: T < 1 or shift <= 0.
    """
    if num_steps < 1 or shift <= 0:
        raise ValueError(f"flow_sigmas needs num_steps >= 1 and shift > 0, got {num_steps}, {shift}")
    alphas = np.linspace(1, 1 / num_train_timesteps, num_steps + 1)
    u = 1.0 - alphas
    sig = np.flip(shift * u / (1 + (shift - 1) * u))[:-1].copy()
    return torch.from_numpy(np.concatenate([sig, [0.0]]).astype(np.float32))
