"""Specification of the rollout solvers (flowgrpo.sampling.solvers).

Expected values come from diffusers' own schedulers run step by step (``FlowMatchEulerDiscreteScheduler``,
``DPMSolverMultistepScheduler`` with flow sigmas), from the releases' formulas transcribed by hand in float64 in
this file (DiffusionNFT ``dpm2``; AWM's SA-Solver loop), and from the closed-form probability-flow ODE of Gaussian
data — never from our own output.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

from flowgrpo.sampling.solvers import SOLVERS, awm_sa_grid, flow_sigmas, sa_solver_step, solve

# DGPO's rollout scheduler: the Sana scheduler config (Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers)
# with flow_shift = 3 (train_sd3_dgpo.py lines 557-559).
SANA_DPM = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", solver_order=2,
                prediction_type="flow_prediction", algorithm_type="dpmsolver++", solver_type="midpoint",
                lower_order_final=True, euler_at_final=False, use_flow_sigmas=True, flow_shift=3.0,
                final_sigmas_type="zero", timestep_spacing="linspace")


def _velocity_field(seed: int = 0):
    """A smooth nonlinear velocity v(x, σ) on (B, 3, 4) latents (any field does: the solvers must agree)."""
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.3

    def vel(x, sigma):
        return torch.tanh(x @ w.to(x.dtype)) * (1 + sigma) + 0.1 * sigma

    return vel


def _sd35_sigmas(num_steps: int) -> torch.Tensor:
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(num_steps)
    return sched.sigmas.float()


def _x_init(seed: int = 1):
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed))


def _run_diffusers(sched, sigmas_used, vel, x):
    for i, t in enumerate(sched.timesteps):
        x = sched.step(vel(x, float(sigmas_used[i])), t, x, return_dict=False)[0]
    return x


# ------------------------------------------------------------------------------------------------ diffusers
def test_euler_equals_flow_match_euler_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    vel, x = _velocity_field(), _x_init()
    expected = _run_diffusers(sched, sched.sigmas, vel, x.clone())
    torch.testing.assert_close(solve(vel, x.clone(), sched.sigmas, "euler"), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_steps", [10, 20])
def test_dpmpp_2m_equals_diffusers_dpm_solver_on_its_flow_grid(num_steps):
    """DGPO's rollout: DPMSolverMultistepScheduler(dpmsolver++, order 2, flow sigmas); T < 15 and T >= 15 both end
    with a first-order step (final_sigmas_type 'zero')."""
    sched = DPMSolverMultistepScheduler(**SANA_DPM)
    sched.set_timesteps(num_steps)
    torch.testing.assert_close(flow_sigmas(num_steps), sched.sigmas, rtol=0, atol=0)
    vel, x = _velocity_field(), _x_init()
    expected = _run_diffusers(sched, sched.sigmas, vel, x.clone())
    ours = solve(vel, x.clone(), flow_sigmas(num_steps), "dpmpp_2m")
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    # not the Euler result: the second-order correction matters here
    assert float((solve(vel, x.clone(), flow_sigmas(num_steps), "euler") - expected).abs().max()) > 1e-3


def test_dpmpp_2m_equals_diffusers_dpm_solver_on_the_sd35_grid():
    """DiffusionNFT's dpm2 runs on SD3.5's own grid (starting at sigma = 1): the same diffusers scheduler with
    that grid swapped in gives the same steps."""
    grid = _sd35_sigmas(10)
    sched = DPMSolverMultistepScheduler(**SANA_DPM)
    sched.set_timesteps(10)
    sched.sigmas = grid.clone()
    vel, x = _velocity_field(2), _x_init(3)
    expected = _run_diffusers(sched, grid, vel, x.clone())
    assert bool(torch.isfinite(expected).all())
    torch.testing.assert_close(solve(vel, x.clone(), grid, "dpmpp_2m"), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the release's dpm2
def _lam(s: float) -> float:
    return -math.inf if s >= 1 else (math.inf if s <= 0 else math.log(1 - s) - math.log(s))


def _release_dpm2(vel, x, sigmas):
    """DiffusionNFT flow_grpo/diffusers_patch/solver.py, solver 'dpm2', in float64: the first and the last step are
    its deterministic ``ddim_update`` ((1 − t)·x̂₀ + t·ε̂, ε̂ = (x − (1 − s)·x̂₀)/s); every other step its
    ``multistep_dpm_solver_second_order_update`` ((σ_t/σ_s0)·x − α_t(e^{−h} − 1)·D0 − ½·α_t(e^{−h} − 1)·D1,
    D1 = (m0 − m1)/r0, r0 = h0/h)."""
    x = x.double()
    sig = [float(s) for s in sigmas]
    n = len(sig) - 1
    prev = None
    for i in range(n):
        s, t = sig[i], sig[i + 1]
        m0 = x - s * vel(x, s)
        if i == 0 or i == n - 1:
            eps_hat = (x - (1 - s) * m0) / s
            x = (1 - t) * m0 + math.sqrt(t**2) * eps_hat
        else:
            h, h0 = _lam(t) - _lam(s), _lam(s) - _lam(sig[i - 1])
            inv_r0 = h / h0  # 1/r0; 0 when sigma_{i-1} = 1 (h0 = inf)
            d1 = inv_r0 * (m0 - prev)
            coef = (1 - t) * (math.exp(-h) - 1)
            x = (t / s) * x - coef * m0 - 0.5 * coef * d1
        prev = m0
    return x


@pytest.mark.parametrize("grid", ["sd35", "flow"])
def test_dpmpp_2m_equals_the_release_dpm2_by_hand(grid):
    sigmas = _sd35_sigmas(10) if grid == "sd35" else flow_sigmas(10)
    vel, x = _velocity_field(4), _x_init(5)
    expected = _release_dpm2(vel, x.clone(), sigmas)
    torch.testing.assert_close(solve(vel, x.clone(), sigmas, "dpmpp_2m").double(), expected, rtol=1e-6, atol=1e-6)


def test_dpmpp_2m_last_step_returns_the_data_prediction_exactly():
    sigmas = torch.tensor([1.0, 0.6, 0.25, 0.0])
    x, v = _x_init(6), _x_init(7)
    out, _ = SOLVERS.get("dpmpp_2m")(x, v, sigmas, 2, SOLVERS.get("dpmpp_2m")(x, v, sigmas, 1, None)[1])
    assert torch.equal(out, x - 0.25 * v)


# ------------------------------------------------------------------------------------------------ SA-Solver (AWM)
def _release_sa_solver(vel, x, ts, tau_of, noises):
    """AWM flow_grpo/diffusers_patch/sa_solver.py ``SASolver.sample`` (data prediction, predictor 2, corrector 2,
    PEC, first corrector disabled, skip_final_step, lower_order_final, the *_few_steps updates) in float64, written
    as the release's list-based loop; ``noises[k]`` is the draw of its step k."""
    def coef(order, a, b, nodes, tau):
        k = 1 + tau**2
        e0 = math.exp(k * b) * (1 - math.exp(-(k * b - k * a))) / k
        e1 = math.exp(k * b) * ((k * b - 1) - (k * a - 1) * math.exp(-(k * b - k * a))) / k**2
        if order == 1:
            return [e0]
        l0, l1 = nodes
        return [e1 / (l0 - l1) - l1 / (l0 - l1) * e0, e1 / (l1 - l0) - l0 / (l1 - l0) * e0]

    def update(order, x, tau, models, tprev, noise, t, corrector):
        lt, ls = _lam(t), _lam(tprev[-1])
        h = lt - ls
        tl = tprev + [t] if corrector else tprev
        c = coef(order, ls, lt, [_lam(tl[-(j + 1)]) for j in range(order)], tau)
        if order == 2:
            k = 1 + tau**2
            if corrector:
                d = math.exp(k * lt) * (h / 2 - (h * k - 1 + math.exp(-k * h)) / (k**2 * h))
            else:
                d = math.exp(k * lt) * (h**2 / 2 - (h * k - 1 + math.exp(-k * h)) / k**2) / (ls - _lam(tprev[-2]))
            c = [c[0] + d, c[1] - d]
        grad = sum((1 + tau**2) * t * math.exp(-(tau**2) * lt) * c[j] * models[-(j + 1)] for j in range(order))
        noise_part = t * math.sqrt(1 - math.exp(-2 * tau**2 * h)) * noise
        return math.exp(-(tau**2) * h) * (t / tprev[-1]) * x + grad + noise_part

    steps = len(ts) - 1
    model = lambda z, t: z - t * vel(z, t)  # noqa: E731
    models, tprev = [model(x, ts[0])], [ts[0]]
    xp = update(1, x, tau_of(ts[1]), models, tprev, noises[1], ts[1], False)
    models.append(model(xp, ts[1]))
    x = xp
    tprev.append(ts[1])
    for step in range(2, steps + 1):
        t = ts[step]
        if step == steps:
            x = models[-1]
        else:
            xp = update(min(2, steps - step + 1), x, tau_of(t), models, tprev, noises[step], t, False)
            models.append(model(xp, t))
            x = update(min(2, steps - step + 2), x, tau_of(t), models, tprev, noises[step], t, True)
        tprev.append(t)
        del models[0]
    return x


@pytest.mark.parametrize("noise_level", [0.0, 0.4])
def test_sa_solver_equals_the_awm_release_loop_by_hand(noise_level):
    grid = awm_sa_grid(_sd35_sigmas(14))  # AWM: 14 steps
    vel, x = _velocity_field(8), _x_init(9)
    gen = torch.Generator().manual_seed(10)
    state, z, noises = None, x.clone(), {}
    for i in range(grid.numel() - 1):
        z, state = sa_solver_step(z, vel(z, float(grid[i])), grid, i, state, generator=gen, noise_level=noise_level)
        if state is not None:
            noises[i + 1] = state.noise.double()  # the draw for step i + 1 (its predictor and its corrector)
    expected = _release_sa_solver(vel, x.double(), [float(t) for t in grid],
                                  lambda t: noise_level if 0.3 <= t <= 0.9 else 0.0, noises)
    torch.testing.assert_close(z.double(), expected, rtol=1e-6, atol=2e-6)


def test_sa_solver_noise_enters_only_with_a_noise_level():
    grid = awm_sa_grid(_sd35_sigmas(8))
    vel, x = _velocity_field(11), _x_init(12)
    a = solve(vel, x.clone(), grid, "sa_solver", generator=torch.Generator().manual_seed(0), noise_level=0.0)
    b = solve(vel, x.clone(), grid, "sa_solver", generator=torch.Generator().manual_seed(1), noise_level=0.0)
    c = solve(vel, x.clone(), grid, "sa_solver", generator=torch.Generator().manual_seed(1), noise_level=0.4)
    assert torch.equal(a, b)
    assert float((c - b).abs().max()) > 1e-3


def test_awm_sa_grid_by_hand():
    grid = _sd35_sigmas(14)
    t = awm_sa_grid(grid)
    assert float(t[0]) == pytest.approx(0.999, abs=1e-7)
    assert float(t[-2]) == pytest.approx(float(grid[-3]) / 2, rel=1e-7)
    assert float(t[-1]) == 0.0
    torch.testing.assert_close(t[1:-2], grid[1:-2], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ Gaussian data
MU, STD = 0.7, 0.8


def _gaussian_velocity(x, sigma):
    """The exact velocity E[ε − x₀ | x_σ] for x₀ ~ N(MU, STD²): (x − E[x₀|x_σ])/σ."""
    a = 1 - sigma
    var = a * a * STD * STD + sigma * sigma
    return (x - (MU + a * STD * STD / var * (x - a * MU))) / sigma


def _gaussian_error(solver: str, num_steps: int) -> float:
    """Max error of the sample against the exact flow map x(σ) = (1 − σ)·MU + √((1 − σ)²·STD² + σ²)·z."""
    sigmas = torch.linspace(0.999, 0.0, num_steps + 1, dtype=torch.float64)
    z = torch.randn(500, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s0 = float(sigmas[0])
    x = (1 - s0) * MU + math.sqrt((1 - s0) ** 2 * STD**2 + s0**2) * z
    out = solve(_gaussian_velocity, x, sigmas.float(), solver).double()
    return float((out - (MU + STD * z)).abs().max())


@pytest.mark.parametrize(("solver", "order"), [("euler", 1), ("dpmpp_2m", 2), ("sa_solver", 2)])
def test_solvers_converge_at_their_order_on_gaussian_data(solver, order):
    """Halving the step divides the error by about 2^order (measured: Euler 1.98, DPM-Solver++(2M) 3.35,
    SA-Solver 4.35 from 40 to 80 steps)."""
    e1, e2 = _gaussian_error(solver, 40), _gaussian_error(solver, 80)
    assert e1 / e2 > 2**order * 0.75, (e1, e2)


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_grids_and_names_are_refused():
    vel, x = _velocity_field(), _x_init()
    with pytest.raises(ValueError, match="decrease strictly"):
        solve(vel, x, torch.tensor([1.0, 0.5, 0.1]), "euler")
    with pytest.raises(ValueError, match="decrease strictly"):
        solve(vel, x, torch.tensor([1.0, 0.5, 0.7, 0.0]), "euler")
    with pytest.raises(KeyError, match="dpmpp_2m"):
        solve(vel, x, torch.tensor([1.0, 0.0]), "dpm++")
    with pytest.raises(ValueError, match="sigma_0 < 1"):
        solve(vel, x, torch.tensor([1.0, 0.5, 0.0]), "sa_solver")
    with pytest.raises(ValueError, match="at least 2 steps"):
        solve(vel, x, torch.tensor([0.9, 0.0]), "sa_solver")
