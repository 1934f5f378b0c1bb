"""Specification of the SDE transition (flowgrpo.sampling.sde).

Expected values come from the papers' formulas evaluated by hand in float64 in this file (Flow-GRPO arXiv
2505.05470 eq. 9; DanceGRPO arXiv 2505.07818; CPS arXiv 2509.05952 eq. 8), from ``torch.distributions`` and from
diffusers' ``FlowMatchEulerDiscreteScheduler.step`` — never from our own output.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch.distributions import Normal, kl_divergence

from flowgrpo.sampling.sde import (
    gaussian_entropy_per_dim,
    gaussian_log_prob,
    kl_between_means,
    sde_step,
    transition_moments,
)

# A σ grid of float32 values (the code computes in float32: the hand formulas below use exactly these values),
# starting at pure noise σ = 1 (Flow-GRPO's guard) and ending at σ = 0.
GRID = torch.tensor([1.0, 0.93, 0.81, 0.62, 0.4, 0.17, 0.0], dtype=torch.float32).double().tolist()
TRANSITIONS = list(zip(GRID[:-1], GRID[1:], strict=True))


def _xv(shape=(3, 5, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _flow_sde_by_hand(x, v, sigma, sigma_next, a):
    """Flow-GRPO eq. 9 in float64: s = a·√(σ/(1−σ)), at σ = 1 the denominator is 1 − σ_next."""
    x, v = x.double(), v.double()
    denom = 1.0 - sigma_next if sigma == 1.0 else 1.0 - sigma
    s = a * math.sqrt(sigma / denom)
    return _flow_mean_with_s(x, v, sigma, sigma_next, s), s * math.sqrt(sigma - sigma_next)


def _flow_mean_with_s(x, v, sigma, sigma_next, s):
    dt = sigma_next - sigma
    return x * (1 + s**2 * dt / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt


def _cps_by_hand(x, v, sigma, sigma_next, a):
    """CPS eq. 8 in float64: std = σ_next·sin(aπ/2), and √(σ_next² − std²) = σ_next·cos(aπ/2)."""
    x, v = x.double(), v.double()
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    return (1 - sigma_next) * x0 + sigma_next * math.cos(a * math.pi / 2) * x1, sigma_next * math.sin(a * math.pi / 2)


def _close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected).double().expand_as(actual),
                               rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------------- flow_sde


def test_flow_sde_scalar_example_by_hand():
    # x = 1, v = 2, σ = 0.5 → σ_next = 0.25, a = 0.7: s = 0.7·√(0.5/0.5) = 0.7, s² = 0.49, dt = −0.25.
    # mean = 1·(1 + 0.49·(−0.25)/1) + 2·(1 + 0.49·0.5/1)·(−0.25) = 0.8775 − 0.6225 = 0.255
    # std = 0.7·√0.25 = 0.35
    mean, std = transition_moments(torch.ones(1, 3), torch.full((1, 3), 2.0), 0.5, 0.25, kind="flow_sde",
                                   noise_level=0.7)
    _close(mean, 0.255)
    _close(std, 0.35)


def test_flow_sde_sigma_one_uses_one_minus_sigma_next():
    # σ = 1 → σ_next = 0.8, a = 0.7: 1 − σ = 0 would make s infinite; the guard uses 1 − σ_next = 0.2:
    # s² = 0.49·1/0.2 = 2.45; mean = x·(1 + 2.45·(−0.2)/2) + v·(1 + 0)·(−0.2) = 0.755·x − 0.2·v;
    # std = s·√0.2 = 0.7·√(1/0.2)·√0.2 = 0.7.
    x, v = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 3.0]])
    mean, std = transition_moments(x, v, 1.0, 0.8, kind="flow_sde", noise_level=0.7)
    _close(mean, torch.tensor([[0.755 * 1.0 - 0.2 * 0.5, 0.755 * -2.0 - 0.2 * 3.0]]))
    _close(std, 0.7)
    assert torch.isfinite(mean).all()


@pytest.mark.parametrize("a", [0.7, 0.9])
@pytest.mark.parametrize(("sigma", "sigma_next"), TRANSITIONS)
def test_flow_sde_moments_match_closed_form(sigma, sigma_next, a):
    x, v = _xv()
    mean, std = transition_moments(x, v, sigma, sigma_next, kind="flow_sde", noise_level=a)
    exp_mean, exp_std = _flow_sde_by_hand(x, v, sigma, sigma_next, a)
    _close(mean, exp_mean)
    _close(std, torch.full((3,), exp_std))
    assert mean.dtype == torch.float32 and std.shape == (3,)


def test_flow_sde_tends_to_ode_as_noise_vanishes():
    x, v = _xv(seed=1)
    sigma, sigma_next = GRID[2], GRID[3]
    ode = x.double() + (sigma_next - sigma) * v.double()
    errs, stds = [], []
    for a in (0.1, 0.01, 0.001):
        mean, std = transition_moments(x, v, sigma, sigma_next, kind="flow_sde", noise_level=a)
        errs.append(float((mean.double() - ode).abs().max()))
        stds.append(float(std.max()))
        # std = a·√(σ/(1−σ))·√(σ−σ_next): linear in a
        assert stds[-1] == pytest.approx(a * math.sqrt(sigma / (1 - sigma)) * math.sqrt(sigma - sigma_next),
                                         rel=1e-5)
    # the mean's deviation from the Euler step is O(a²): each 10× smaller a is ~100× closer
    assert errs[1] < errs[0] / 50 and errs[2] < 1e-5
    assert stds[0] > stds[1] > stds[2]
    # a = 0 exactly is the Euler step with no noise and log-prob 0
    out = sde_step(x, v, sigma, sigma_next, kind="flow_sde", noise_level=0.0)
    torch.testing.assert_close(out.next_latents.double(), ode, rtol=1e-6, atol=1e-6)
    assert torch.equal(out.std, torch.zeros(3)) and torch.equal(out.log_prob, torch.zeros(3))


# ----------------------------------------------------------------------------------------------- log-prob


@pytest.mark.parametrize("kind", ["flow_sde", "dance_sde", "cps"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_log_prob_is_normal_log_density_reduced_over_dims(kind, reduction):
    x, v = _xv(seed=2)
    prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    out = sde_step(x, v, GRID[1], GRID[2], kind=kind, noise_level=0.7, next_latents=prev, reduction=reduction)
    dens = Normal(out.mean.double(), out.std.double().reshape(-1, 1, 1)).log_prob(prev.double())
    expected = dens.mean(dim=(1, 2)) if reduction == "mean" else dens.sum(dim=(1, 2))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    assert out.log_prob.shape == (3,) and out.log_prob.dtype == torch.float32
    assert torch.equal(out.next_latents, prev)


def test_gaussian_log_prob_with_per_sample_std():
    g = torch.Generator().manual_seed(4)
    x, mean = torch.randn(4, 7, 3, generator=g), torch.randn(4, 7, 3, generator=g)
    std = torch.tensor([0.05, 0.3, 1.0, 2.5])
    for reduction in ("mean", "sum"):
        dens = Normal(mean.double(), std.double().reshape(-1, 1, 1)).log_prob(x.double())
        expected = dens.mean(dim=(1, 2)) if reduction == "mean" else dens.sum(dim=(1, 2))
        torch.testing.assert_close(gaussian_log_prob(x, mean, std, reduction=reduction).double(), expected,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        gaussian_log_prob(x, mean, std, reduction="max")


# ----------------------------------------------------------------------------------------------- ode


def test_ode_equals_diffusers_scheduler_step_over_a_schedule():
    # The reference: set_timesteps, then a step() loop, compared at every step (both are x + (σ_next − σ)·v in
    # float32, so they agree exactly).
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(8)
    sigmas = scheduler.sigmas.clone()
    g = torch.Generator().manual_seed(5)
    ref = ours = ours_vec = torch.randn(2, 16, 8, generator=g)
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn(2, 16, 8, generator=g)
        ref = scheduler.step(v, t, ref, return_dict=False)[0]
        out = sde_step(ours, v, sigmas[i].item(), sigmas[i + 1].item(), kind="ode")
        ours = out.next_latents
        # σ as (B,) tensors (the training layout) gives the same step
        ours_vec = sde_step(ours_vec, v, sigmas[i].expand(2), sigmas[i + 1].expand(2), kind="ode").next_latents
        assert torch.equal(ours, ref), f"step {i}: max diff {(ours - ref).abs().max()}"
        assert torch.equal(ours_vec, ref)
        assert torch.equal(out.std, torch.zeros(2)) and torch.equal(out.log_prob, torch.zeros(2))
    assert sigmas[-1] == 0  # the loop went all the way to σ = 0


# ----------------------------------------------------------------------------------------------- dance_sde


def test_dance_sde_scalar_example_by_hand():
    # x = 1, v = 2, σ = 0.5 → 0.25, η = 0.3: x̂₀ = 1 − 0.5·2 = 0, score = −(1 − 0.5·0)/0.25 = −4,
    # mean = 1 + (−0.25)·2 − ½·0.09·(−4)·(−0.25) = 1 − 0.5 − 0.045 = 0.455; std = 0.3·√0.25 = 0.15.
    mean, std = transition_moments(torch.ones(1, 2), torch.full((1, 2), 2.0), 0.5, 0.25, kind="dance_sde",
                                   noise_level=0.3)
    _close(mean, 0.455)
    _close(std, 0.15)


@pytest.mark.parametrize("eta", [0.3, 0.7])
@pytest.mark.parametrize(("sigma", "sigma_next"), TRANSITIONS)
def test_dance_sde_is_flow_sde_formula_with_s_equal_eta(sigma, sigma_next, eta):
    # Substituting score = −(x + (1−σ)·v)/σ into DanceGRPO's mean gives Flow-GRPO's mean with s = η; its std
    # η·√(σ − σ_next) is Flow-GRPO's s·√(−dt) with s = η.
    x, v = _xv(seed=6)
    mean, std = transition_moments(x, v, sigma, sigma_next, kind="dance_sde", noise_level=eta)
    _close(mean, _flow_mean_with_s(x.double(), v.double(), sigma, sigma_next, eta))
    _close(std, torch.full((3,), eta * math.sqrt(sigma - sigma_next)))


# ----------------------------------------------------------------------------------------------- cps


def test_cps_scalar_example_by_hand():
    # x = 1, v = 2, σ = 0.5 → 0.25, a = 0.5: x̂₀ = 1 − 0.5·2 = 0, x̂₁ = 1 + 0.5·2 = 2,
    # std = 0.25·sin(π/4) = 0.1767767, mean = 0.75·0 + √(0.0625 − 0.03125)·2 = 0.3535534.
    mean, std = transition_moments(torch.ones(1, 2), torch.full((1, 2), 2.0), 0.5, 0.25, kind="cps",
                                   noise_level=0.5)
    _close(mean, 2 * math.sqrt(0.0625 - 0.03125))
    _close(std, 0.25 * math.sqrt(0.5))


@pytest.mark.parametrize("a", [0.3, 0.8])
@pytest.mark.parametrize(("sigma", "sigma_next"), TRANSITIONS)
def test_cps_moments_match_closed_form(sigma, sigma_next, a):
    x, v = _xv(seed=7)
    mean, std = transition_moments(x, v, sigma, sigma_next, kind="cps", noise_level=a)
    exp_mean, exp_std = _cps_by_hand(x, v, sigma, sigma_next, a)
    _close(mean, exp_mean)
    _close(std, torch.full((3,), exp_std))


@pytest.mark.parametrize(("sigma", "sigma_next"), TRANSITIONS)
def test_cps_with_a_zero_is_the_euler_step(sigma, sigma_next):
    # (1−σ')(x − σv) + σ'(x + (1−σ)v) = x + (σ' − σ)v algebraically; in float32 the two orders of operations
    # round differently, so they agree to ~1e-6, not bit for bit.
    x, v = _xv(seed=8)
    cps = sde_step(x, v, sigma, sigma_next, kind="cps", noise_level=0.0)
    ode = sde_step(x, v, sigma, sigma_next, kind="ode")
    torch.testing.assert_close(cps.next_latents, ode.next_latents, rtol=0, atol=2e-6)
    assert torch.equal(cps.std, torch.zeros(3)) and torch.equal(cps.log_prob, torch.zeros(3))


@pytest.mark.parametrize("simplified", [False, True])
def test_cps_last_transition_is_deterministic(simplified):
    x, v = _xv(seed=9)
    sigma = GRID[-2]
    out = sde_step(x, v, sigma, 0.0, kind="cps", noise_level=0.8, generator=torch.Generator().manual_seed(0),
                   simplified_log_prob=simplified)
    assert torch.equal(out.std, torch.zeros(3))
    assert torch.equal(out.log_prob, torch.zeros(3))
    # at σ_next = 0 the mean is x̂₀ = x − σ·v and nothing is added to it
    torch.testing.assert_close(out.next_latents.double(), x.double() - sigma * v.double(), rtol=1e-6, atol=1e-6)
    # scoring any other x_next still gives log-prob 0 (the transition is never trained)
    scored = sde_step(x, v, sigma, 0.0, kind="cps", noise_level=0.8, next_latents=x,
                      simplified_log_prob=simplified)
    assert torch.equal(scored.log_prob, torch.zeros(3))


def test_cps_simplified_log_prob_is_negative_mean_squared_error():
    x, v = _xv(seed=10)
    prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(11))
    out = sde_step(x, v, GRID[2], GRID[3], kind="cps", noise_level=0.8, next_latents=prev,
                   simplified_log_prob=True)
    exp_mean, _ = _cps_by_hand(x, v, GRID[2], GRID[3], 0.8)
    _close(out.log_prob, -((prev.double() - exp_mean) ** 2).mean(dim=(1, 2)))


# ----------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("kind", ["flow_sde", "dance_sde", "cps"])
def test_sampled_latents_have_the_transition_mean_and_std(kind):
    n = 20000  # draws: one row of the batch each, all from the same (x, v)
    x = torch.tensor([0.5, -1.0, 2.0]).expand(n, 3)
    v = torch.tensor([1.0, 0.3, -0.7]).expand(n, 3)
    sigma, sigma_next = GRID[2], GRID[3]
    out = sde_step(x, v, sigma, sigma_next, kind=kind, noise_level=0.7, generator=torch.Generator().manual_seed(12))
    if kind == "cps":
        exp_mean, exp_std = _cps_by_hand(x[:1], v[:1], sigma, sigma_next, 0.7)
    elif kind == "flow_sde":
        exp_mean, exp_std = _flow_sde_by_hand(x[:1], v[:1], sigma, sigma_next, 0.7)
    else:
        exp_mean = _flow_mean_with_s(x[:1].double(), v[:1].double(), sigma, sigma_next, 0.7)
        exp_std = 0.7 * math.sqrt(sigma - sigma_next)
    emp_mean = out.next_latents.double().mean(0)
    emp_std = out.next_latents.double().std(0)
    # 5 standard errors: the mean's is std/√n, the std's is std/√(2n)
    assert (emp_mean - exp_mean[0]).abs().max() < 5 * exp_std / math.sqrt(n)
    assert (emp_std - exp_std).abs().max() < 5 * exp_std / math.sqrt(2 * n)


def test_per_sample_generators_make_each_sample_independent_of_its_batch():
    x, v = _xv(shape=(3, 6, 4), seed=13)
    seeds = [101, 202, 303]

    def gens(ss):
        return [torch.Generator().manual_seed(s) for s in ss]

    full = sde_step(x, v, GRID[1], GRID[2], generator=gens(seeds)).next_latents
    alone = sde_step(x[1:2], v[1:2], GRID[1], GRID[2], generator=gens([202])).next_latents
    reordered = sde_step(x[[2, 0]], v[[2, 0]], GRID[1], GRID[2], generator=gens([303, 101])).next_latents
    assert torch.equal(full[1:2], alone)
    assert torch.equal(full[[2, 0]], reordered)
    again = sde_step(x, v, GRID[1], GRID[2], generator=gens(seeds)).next_latents
    assert torch.equal(full, again)
    other = sde_step(x, v, GRID[1], GRID[2], generator=gens([1, 2, 3])).next_latents
    assert not torch.equal(full, other)


def test_per_sample_sigma_tensors_equal_scalar_calls():
    # A (B,) σ_next serves E-GRPO's merged jumps: row b must be the transition σ[b] → σ_next[b].
    x, v = _xv(seed=14)
    prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(15))
    sig = torch.tensor([GRID[0], GRID[1], GRID[2]])
    nxt = torch.tensor([GRID[1], GRID[4], GRID[6]])
    batched = sde_step(x, v, sig, nxt, kind="flow_sde", noise_level=0.7, next_latents=prev)
    for b in range(3):
        one = sde_step(x[b : b + 1], v[b : b + 1], sig[b].item(), nxt[b].item(), kind="flow_sde",
                       noise_level=0.7, next_latents=prev[b : b + 1])
        exp_mean, exp_std = _flow_sde_by_hand(x[b : b + 1], v[b : b + 1], sig[b].item(), nxt[b].item(), 0.7)
        torch.testing.assert_close(batched.mean[b : b + 1], one.mean)
        torch.testing.assert_close(batched.log_prob[b : b + 1], one.log_prob)
        _close(batched.mean[b : b + 1], exp_mean)
        _close(batched.std[b], exp_std)


def test_arithmetic_is_float32_whatever_the_input_dtype():
    x, v = _xv(seed=16)
    xb, vb = x.bfloat16(), v.bfloat16()
    low = sde_step(xb, vb, GRID[2], GRID[3], kind="flow_sde", noise_level=0.7, next_latents=x)
    ref = sde_step(xb.float(), vb.float(), GRID[2], GRID[3], kind="flow_sde", noise_level=0.7, next_latents=x)
    assert low.mean.dtype == low.log_prob.dtype == low.next_latents.dtype == torch.float32
    assert torch.equal(low.mean, ref.mean) and torch.equal(low.log_prob, ref.log_prob)


def test_log_prob_equals_the_literal_formula_to_the_bit():
    # −sq/(2·std²) − D'·(log std + log √(2π)), 0 where std = 0, written literally in float32: the implementation's
    # rearrangement (the sign folded into the divisor, no ·1 for the mean) must not change a bit, nor the gradient.
    g = torch.Generator().manual_seed(21)
    x = torch.randn(64, 6, 4, generator=g)
    std = torch.rand(64, generator=g) * 2
    std[::9] = 0.0
    upstream = torch.randn(64, generator=g)
    for reduction, per_dim in (("mean", 1), ("sum", 24)):
        mean = torch.randn(64, 6, 4, generator=g).requires_grad_(True)
        lp = gaussian_log_prob(x, mean, std, reduction=reduction)
        (lp * upstream).sum().backward()
        ref_mean = mean.detach().clone().requires_grad_(True)
        sq = (x - ref_mean).square()
        sq = sq.mean(dim=(1, 2)) if reduction == "mean" else sq.sum(dim=(1, 2))
        safe = torch.where(std > 0, std, torch.ones_like(std))
        literal = -sq / (2 * safe**2) - per_dim * (torch.log(safe) + 0.5 * math.log(2 * math.pi))
        literal = torch.where(std > 0, literal, torch.zeros_like(literal))
        (literal * upstream).sum().backward()
        assert torch.equal(lp, literal), reduction
        assert torch.equal(mean.grad, ref_mean.grad), reduction


def test_sigma_one_guard_as_a_float_equals_the_guard_as_a_tensor():
    x, v = _xv(seed=22)
    sig, nxt = torch.tensor([1.0, 1.0, 0.81]), torch.tensor([0.93, 0.62, 0.62])
    as_float = transition_moments(x, v, sig, nxt, sigma_one_next=GRID[1])
    as_tensor = transition_moments(x, v, sig, nxt, sigma_one_next=torch.full((3,), GRID[1]))
    assert torch.equal(as_float[0], as_tensor[0]) and torch.equal(as_float[1], as_tensor[1])
    # and the float guard is used: the jump from σ = 1 to 0.62 takes the grid's σ₁, not its own σ_next
    own = transition_moments(x, v, sig, nxt)
    assert as_float[1][1] != own[1][1] and as_float[1][0] == own[1][0]


def test_check_sigmas_false_skips_only_the_check():
    x, v = _xv(seed=23)
    checked = sde_step(x, v, GRID[2], GRID[3], next_latents=x)
    unchecked = sde_step(x, v, GRID[2], GRID[3], next_latents=x, check_sigmas=False)
    assert torch.equal(checked.log_prob, unchecked.log_prob) and torch.equal(checked.mean, unchecked.mean)
    sde_step(x, v, 0.4, 0.6, next_latents=x, check_sigmas=False)  # the caller vouches for its σ: no error
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x, v, 0.4, 0.6, next_latents=x)


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("sigma", "sigma_next"), [(0.5, 0.5), (0.4, 0.6), (1.2, 0.5), (0.0, -0.1)])
def test_bad_sigmas_raise(sigma, sigma_next):
    x, v = _xv()
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x, v, sigma, sigma_next)


@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
def test_negative_sigma_next_raises(kind):
    # the docstring and the error message both promise 0 <= sigma_next < sigma <= 1
    x, v = _xv()
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step(x, v, 0.5, -0.1, kind=kind, noise_level=0.5)


def test_one_bad_row_of_a_sigma_tensor_raises():
    x, v = _xv()
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step(x, v, torch.tensor([0.9, 0.5, 0.4]), torch.tensor([0.8, 0.5, 0.1]))


def test_sigma_tensor_of_wrong_length_raises():
    x, v = _xv()
    with pytest.raises(ValueError, match=r"\(3,\)"):
        sde_step(x, v, torch.tensor([0.9, 0.5]), 0.1)


def test_unknown_kind_names_the_kinds_and_suggests():
    x, v = _xv()
    with pytest.raises(KeyError) as err:
        sde_step(x, v, 0.9, 0.5, kind="flow-sde")
    msg = str(err.value)
    assert "did you mean 'flow_sde'" in msg
    for kind in ("cps", "dance_sde", "flow_sde", "ode"):
        assert kind in msg


# ----------------------------------------------------------------------------------------------- entropy, KL


def test_entropy_per_dim_equals_torch_normal_entropy():
    std = torch.tensor([1e-3, 0.05, 0.3, 1.0, 4.0])
    expected = Normal(torch.zeros(5, dtype=torch.float64), std.double()).entropy()
    torch.testing.assert_close(gaussian_entropy_per_dim(std).double(), expected, rtol=1e-6, atol=1e-6)


def test_kl_between_means_equals_torch_kl_averaged_over_dims():
    g = torch.Generator().manual_seed(17)
    mean, ref = torch.randn(3, 5, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    std = torch.tensor([0.1, 0.5, 2.0])
    s = std.double().reshape(-1, 1, 1).expand(3, 5, 4)
    expected = kl_divergence(Normal(mean.double(), s), Normal(ref.double(), s)).mean(dim=(1, 2))
    torch.testing.assert_close(kl_between_means(mean, ref, std).double(), expected, rtol=1e-5, atol=1e-6)
    # a deterministic transition (std = 0) has KL 0, not inf or nan
    zero = kl_between_means(mean, ref, torch.tensor([0.0, 0.5, 0.0]))
    assert zero[0] == 0 and zero[2] == 0 and torch.isfinite(zero).all()
