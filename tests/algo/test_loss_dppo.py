"""Specification of Flow-DPPO's policy loss (flowgrpo.algo.policy_losses.dppo).

Expected values are worked out by hand below, or computed in float64 from verl-omni's ``FlowDPPOLoss.compute_loss``
(verl_omni/trainer/diffusion/diffusion_algos.py lines 374–443) transcribed in this file — never from our output.
Threshold ε_D = 1e-5, std 0.1: D = drift/(2·0.01) = 50·drift.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algo.policy_losses import PolicyLossInput
from flowgrpo.algo.policy_losses.dppo import FlowDppoConfig, dppo_divergence, flow_dppo_loss

STD = 0.1
HIGH, LOW = 1e-6, 1e-8  # drifts: D = 5e-5 ≥ 1e-5 (outside the trust region), D = 5e-7 (inside)

# (A, Δ, drift, masked): masked only when outside and moving away from the rollout policy
CASES = [
    (1.0, 0.2, HIGH, True),     # A > 0, ρ = e^0.2 > 1, outside → masked
    (1.0, -0.2, HIGH, False),   # A > 0 but ρ < 1: corrective, kept
    (-1.0, -0.2, HIGH, True),   # A < 0, ρ < 1, outside → masked
    (-1.0, 0.2, HIGH, False),   # A < 0, ρ > 1: corrective, kept
    (1.0, 0.2, LOW, False),     # inside the trust region: kept whatever the direction
    (-2.0, -0.3, LOW, False),
    (0.0, 0.2, HIGH, False),    # A = 0 never masked
    (1.0, 0.0, HIGH, False),    # ρ = 1 exactly: not "moving away"
    (0.5, 0.1, 2e-7, True),     # D = 1e-5 exactly: the mask uses D ≥ ε_D
]


def _input(cases=CASES, requires_grad=False):
    adv = torch.tensor([c[0] for c in cases])
    delta = torch.tensor([[c[1]] for c in cases])
    old = torch.full_like(delta, -1.3)
    new = (old + delta).clone().requires_grad_(requires_grad)
    drift = torch.tensor([[c[2]] for c in cases])
    return PolicyLossInput(new, old, adv, std=torch.full_like(delta, STD), dt=torch.full_like(delta, -0.1),
                           mean_drift_sq=drift), new


def test_flow_dppo_mask_and_loss_by_hand():
    inp, _ = _input()
    terms = flow_dppo_loss(inp, FlowDppoConfig())
    assert terms.clipped.tolist() == [c[3] for c in CASES]
    expected = [0.0 if c[3] else -c[0] * math.exp(c[1]) for c in CASES]
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(terms.ratio, torch.tensor([math.exp(c[1]) for c in CASES]), rtol=1e-6, atol=0)


def test_flow_dppo_gradient_is_removed_only_where_masked():
    """d(−A·ρ)/dΔ = −A·ρ for a kept pair, 0 for a masked one."""
    inp, new = _input(requires_grad=True)
    flow_dppo_loss(inp, FlowDppoConfig()).loss.sum().backward()
    expected = [0.0 if c[3] else -c[0] * math.exp(c[1]) for c in CASES]
    torch.testing.assert_close(new.grad.squeeze(1), torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_divergence_by_hand():
    """D = drift/(2·std²): 1e-6/(2·0.01) = 5e-5; without the coefficient drift/2."""
    d = dppo_divergence(torch.tensor([[1e-6]]), torch.tensor([[0.1]]))
    assert d.item() == pytest.approx(5e-5, rel=1e-6)
    assert dppo_divergence(torch.tensor([[1e-6]]), torch.tensor([[0.1]]), add_kl_coefficient=False).item() == \
        pytest.approx(5e-7, rel=1e-6)
    # without the coefficient every HIGH case (D = 5e-7) is inside the trust region: nothing is masked
    inp, _ = _input()
    assert not bool(flow_dppo_loss(inp, FlowDppoConfig(add_kl_coefficient=False)).clipped.any())


def _verl_omni_dppo(old_lp, lp, adv, old_mean, mean, std_dev_t, sqrt_dt, threshold, add_kl_coefficient):
    """verl-omni FlowDPPOLoss.compute_loss, float64 (one step per row)."""
    ratio = torch.exp(lp - old_lp)
    unclipped = -adv * ratio
    sq = (mean - old_mean).pow(2)
    sigma_t = std_dev_t * sqrt_dt.reshape(-1, *([1] * (std_dev_t.ndim - 1)))
    kl = (sq / (2 * sigma_t.pow(2)) if add_kl_coefficient else sq / 2).mean(dim=tuple(range(1, sq.ndim)))
    high = kl >= threshold
    rm = (high & (ratio > 1.0) & (adv > 0)) | (high & (ratio < 1.0) & (adv < 0))
    return torch.mean(torch.where(~rm, unclipped, torch.zeros(()))), rm


@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_flow_dppo_equals_verl_omni_on_random_steps(add_kl_coefficient):
    g = torch.Generator().manual_seed(0)
    n = 64
    mean = torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64)
    old_mean = mean + torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64) * 1e-3
    std_dev_t = (torch.rand(n, 1, 1, 1, generator=g, dtype=torch.float64) + 0.5)
    sqrt_dt = torch.rand(n, generator=g, dtype=torch.float64) * 0.3 + 0.05
    lp = torch.randn(n, generator=g, dtype=torch.float64) * 0.01 - 1.4
    old_lp = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.01
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    threshold = 2e-6 if add_kl_coefficient else 5e-7  # near the median divergence of each form
    expected, rm = _verl_omni_dppo(old_lp, lp, adv, old_mean, mean, std_dev_t, sqrt_dt, threshold, add_kl_coefficient)
    assert 0 < int(rm.sum()) < n  # the case mixes masked and kept pairs
    drift = (mean - old_mean).pow(2).mean(dim=(1, 2, 3))
    std = std_dev_t.flatten() * sqrt_dt  # our transition std s·√(−dt)
    inp = PolicyLossInput(lp[:, None].float(), old_lp[:, None].float(), adv.float(), std=std[:, None].float(),
                          dt=-(sqrt_dt**2)[:, None].float(), mean_drift_sq=drift[:, None].float())
    terms = flow_dppo_loss(inp, FlowDppoConfig(kl_mask_threshold=threshold, add_kl_coefficient=add_kl_coefficient))
    assert terms.clipped.tolist() == rm.tolist()
    assert terms.loss.mean().item() == pytest.approx(expected.item(), rel=1e-5)


def test_flow_dppo_chunk_uses_the_chunk_ratio_and_mean_divergence():
    """Two steps: Δ = (0.1, 0.3) → ρ = e^0.2; D = mean(5e-5, 0) = 2.5e-5 ≥ 1e-5 with A > 0, ρ > 1 → masked;
    with drifts (1e-7, 1e-7) D = 5e-6 < 1e-5 → kept, loss −e^0.2."""
    old = torch.full((2, 2), -1.0)
    new = old + torch.tensor([[0.1, 0.3], [0.1, 0.3]])
    drift = torch.tensor([[1e-6, 0.0], [1e-7, 1e-7]])
    inp = PolicyLossInput(new, old, torch.tensor([1.0, 1.0]), std=torch.full((2, 2), STD), dt=torch.full((2, 2), -0.1),
                          mean_drift_sq=drift)
    terms = flow_dppo_loss(inp, FlowDppoConfig())
    assert terms.clipped.tolist() == [True, False]
    torch.testing.assert_close(terms.loss, torch.tensor([0.0, -math.exp(0.2)]), rtol=1e-6, atol=1e-7)


def test_flow_dppo_adds_the_reference_kl():
    inp, _ = _input()
    kl = torch.full((len(CASES), 1), 0.4)
    inp = PolicyLossInput(inp.new_log_probs, inp.old_log_probs, inp.advantages, kl_ref=kl, std=inp.std, dt=inp.dt,
                          mean_drift_sq=inp.mean_drift_sq)
    base = flow_dppo_loss(inp, FlowDppoConfig()).loss
    torch.testing.assert_close(flow_dppo_loss(inp, FlowDppoConfig(), kl_beta=0.5).loss, base + 0.2)


def test_flow_dppo_bad_input():
    inp, _ = _input()
    with pytest.raises(ValueError, match="needs std and mean_drift_sq"):
        flow_dppo_loss(PolicyLossInput(inp.new_log_probs, inp.old_log_probs, inp.advantages), FlowDppoConfig())
    zero_std = PolicyLossInput(inp.new_log_probs, inp.old_log_probs, inp.advantages, std=torch.zeros_like(inp.std),
                               dt=inp.dt, mean_drift_sq=inp.mean_drift_sq)
    with pytest.raises(ValueError, match="stochastic"):
        flow_dppo_loss(zero_std, FlowDppoConfig())
    with pytest.raises(ValueError, match="kl_mask_threshold\n  Input should be greater than 0"):
        FlowDppoConfig(kl_mask_threshold=0.0)
    with pytest.raises(ValueError, match="kl_beta must be >= 0, got -0.1"):
        flow_dppo_loss(inp, FlowDppoConfig(), kl_beta=-0.1)
