"""Specification of the forward-process objectives (flowgrpo.algo.objectives: nft, awm, dgpo, old_copy).

Every expected number is worked out by hand in the comments, or computed in this file in float64 from the
release's own formula (NVlabs/DiffusionNFT scripts/train_nft_sd3.py; scxue/advantage_weighted_matching
scripts/train_sd3_awm.py; Luo-Yihong/DGPO scripts/train_sd3_dgpo.py), never from our functions' output. Gradients
are checked against closed forms derived by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algo.objectives.awm import AWMConfig, awm_log_prob, awm_terms, awm_train_sigma_indices
from flowgrpo.algo.objectives.dgpo import (
    DGPOConfig,
    dgpo_group_sums,
    dgpo_terms,
    dgpo_train_indices,
    dgpo_train_sigmas,
    shared_group_noise,
)
from flowgrpo.algo.objectives.flow_matching import noised
from flowgrpo.algo.objectives.nft import NFTConfig, nft_terms, nft_train_sigmas, reward_weight
from flowgrpo.algo.objectives.old_copy import NFT_DECAY_TYPES, decay_at, update_old_copy_


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ================================================================================================ old copy
@pytest.mark.parametrize(("decay_type", "step", "expected"), [
    # type 0 (flat 0, ramp 0, cap 0): always on-policy
    (0, 0, 0.0), (0, 1000, 0.0),
    # type 1 (flat 0, ramp 0.001, cap 0.5): 0.001·k up to 0.5 at k = 500
    (1, 0, 0.0), (1, 1, 0.001), (1, 250, 0.25), (1, 500, 0.5), (1, 501, 0.5), (1, 10_000, 0.5),
    # type 2 (flat 75, ramp 0.0075, cap 0.999): 0 until 75, then 0.0075·(k − 75): 0.1875 at 100, 0.9975 at 208
    (2, 74, 0.0), (2, 75, 0.0), (2, 76, 0.0075), (2, 100, 0.1875), (2, 208, 0.9975), (2, 209, 0.999),
    (2, 5000, 0.999),
])
def test_nft_decay_types_by_hand(decay_type, step, expected):
    assert decay_at(step, NFTConfig(**NFT_DECAY_TYPES[decay_type])) == pytest.approx(expected, abs=1e-12)


def test_awm_and_dgpo_decay_and_constant_by_hand():
    linear = AWMConfig(decay_flat=0, decay_ramp=0.001, decay_cap=0.3)  # min(0.3, 0.001·k)
    assert [decay_at(k, linear) for k in (0, 1, 100, 300, 301, 9999)] == pytest.approx([0, 0.001, 0.1, 0.3, 0.3, 0.3])
    assert decay_at(0, AWMConfig(decay_constant=0.3)) == 0.3
    assert decay_at(7, AWMConfig(decay_constant=0.3)) == 0.3


def test_old_copy_update_by_hand():
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[-4.0]])]
    cur = [torch.tensor([3.0, 5.0]), torch.tensor([[4.0]])]
    update_old_copy_(old, cur, 0.25)
    # 0.25·1 + 0.75·3 = 2.5; 0.25·2 + 0.75·5 = 4.25; 0.25·(−4) + 0.75·4 = 2
    assert old[0].tolist() == [2.5, 4.25] and old[1].tolist() == [[2.0]]
    assert cur[0].tolist() == [3.0, 5.0]  # the trained weights are untouched
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    update_old_copy_([a], [b], 0.0)
    assert torch.equal(a, b)  # decay 0: exactly the current weights (DiffusionNFT decay_type 0)


def test_old_copy_bad_input():
    with pytest.raises(ValueError, match="decay must be in"):
        update_old_copy_([torch.zeros(2)], [torch.zeros(2)], 1.5)
    with pytest.raises(ValueError, match="holds 1 tensors"):
        update_old_copy_([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], 0.5)
    from flowgrpo.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="objective.decay_cap"):  # the config validates the schedule, once
        build_config({"objective": {"name": "nft", "decay_cap": 1.0}})
    with pytest.raises(ValueError, match="step count"):
        decay_at(-1, NFTConfig(**NFT_DECAY_TYPES[1]))


# ================================================================================================ DiffusionNFT
@pytest.mark.parametrize(("mode", "expected"), [
    # A = [−7, −5, −2.5, 0, 2.5, 5, 9] clipped to ±5, r = A/10 + ½
    ("all", [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),
    ("positive_only", [0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0]),
    ("negative_only", [0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5]),
    ("one_only", [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6]),  # A > 0 → 1: r = 1/10 + ½
    ("binary", [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6]),  # sign(A)/10 + ½
])
def test_nft_reward_weight_by_hand(mode, expected):
    a = _t(-7.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0)
    torch.testing.assert_close(reward_weight(a, 5.0, mode), _t(*expected), rtol=0, atol=1e-7)


def test_nft_loss_by_hand_one_dim():
    """σ = ½, x₀ = 1, ε = 3: x_σ = 2. v = 1, v_old = 2, β = 1: v₊ = 1, v₋ = 2·2 − 1 = 3; x̂₀₊ = 1.5, x̂₀₋ = 0.5;
    errors ±0.5, weights 0.5, so L₊ = L₋ = 0.25/0.5 = 0.5. A = 2.5 → r = 0.75: policy = 5·(0.75·0.5 + 0.25·0.5)
    = 2.5; v_ref = 0: KL = 1, loss = 2.5 + 1e-4."""
    x0, eps = _t([1.0]), _t([3.0])
    x_t = noised(x0, eps, 0.5)
    assert x_t.tolist() == [[2.0]]
    terms = nft_terms(_t([1.0]), _t([2.0]), x_t, x0, 0.5, _t(2.5), NFTConfig(), v_ref=_t([0.0]))
    assert terms.loss.item() == pytest.approx(2.5 + 1e-4, abs=1e-6)
    assert terms.stats["positive_loss"].item() == pytest.approx(0.5)
    assert terms.stats["negative_loss"].item() == pytest.approx(0.5)
    assert terms.stats["reward_weight"].item() == pytest.approx(0.75)
    assert terms.stats["old_deviation"].item() == pytest.approx(1.0)
    # two dims, errors (0.5, 0.1) for v₊: w = 0.3, L₊ = (0.25 + 0.01)/2/0.3 = 0.43333; with r = 1 only L₊ counts
    x0 = _t([0.0, 0.0])
    terms = nft_terms(_t([-0.5, -0.1]), _t([-0.5, -0.1]), x0, x0, 1.0, _t(5.0), NFTConfig(kl_beta=0.0))
    assert terms.loss.item() == pytest.approx(5 * 0.13 / 0.3, rel=1e-6)


def _release_nft_loss(v, v_old, v_ref, x_t, x0, sigma, adv, beta, c, kl_beta):
    """train_nft_sd3.py lines 910–970 in float64: the release's per-micro-batch loss (a scalar)."""
    v, v_old, v_ref, x_t, x0 = (t.double() for t in (v, v_old, v_ref, x_t, x0))
    s = sigma.double().view(-1, *([1] * (x0.ndim - 1)))
    dims = tuple(range(1, x0.ndim))
    r = torch.clamp((torch.clamp(adv.double(), -c, c) / c) / 2.0 + 0.5, 0, 1)
    pos_v = beta * v + (1 - beta) * v_old
    neg_v = (1.0 + beta) * v_old - beta * v
    x0p, x0n = x_t - s * pos_v, x_t - s * neg_v
    wp = torch.abs(x0p - x0).mean(dim=dims, keepdim=True).clip(min=0.00001)
    wn = torch.abs(x0n - x0).mean(dim=dims, keepdim=True).clip(min=0.00001)
    lp, ln = ((x0p - x0) ** 2 / wp).mean(dim=dims), ((x0n - x0) ** 2 / wn).mean(dim=dims)
    policy = ((r * lp / beta + (1.0 - r) * ln / beta) * c).mean()
    return policy + kl_beta * ((v - v_ref) ** 2).mean(dim=dims).mean()


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_equals_the_release_on_random_rows(beta):
    g = torch.Generator().manual_seed(0)
    shape = (6, 2, 3, 3)
    x0, eps, v, v_old, v_ref = (torch.randn(shape, generator=g) for _ in range(5))
    sigma = torch.rand(6, generator=g) * 0.9 + 0.05
    adv = torch.randn(6, generator=g) * 4
    x_t = noised(x0, eps, sigma)
    settings = NFTConfig(beta=beta, kl_beta=0.01)
    ours = nft_terms(v, v_old, x_t, x0, sigma, adv, settings, v_ref=v_ref).loss.mean()
    expected = _release_nft_loss(v, v_old, v_ref, x_t, x0, sigma, adv, beta, 5.0, 0.01)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_nft_gradient_on_policy_by_hand(beta):
    """At v_θ = v_old, x̂₀₊ = x̂₀₋ = x̂ with error e and weight w = mean|e|; dL₊/dv = −2σβ·e/(D·w),
    dL₋/dv = +2σβ·e/(D·w), so d loss/dv = c·(1 − 2r)·2σ·e/(D·w): β cancels, A = 0 (r = ½) gives no gradient,
    A > 0 pulls x̂ toward x₀."""
    g = torch.Generator().manual_seed(1)
    x0, eps, v0 = (torch.randn(3, 4, generator=g) for _ in range(3))
    sigma = _t(0.3, 0.6, 0.9)
    adv = _t(2.5, 0.0, -1.0)
    x_t = noised(x0, eps, sigma)
    v = v0.clone().requires_grad_(True)
    nft_terms(v, v0, x_t, x0, sigma, adv, NFTConfig(beta=beta, kl_beta=0.0)).loss.sum().backward()
    s = sigma[:, None].double()
    e = x_t.double() - s * v0.double() - x0.double()
    w = e.abs().mean(1, keepdim=True)
    r = (adv.double() / 10 + 0.5)[:, None]
    expected = 5.0 * (1 - 2 * r) * 2 * s * e / (4 * w)
    torch.testing.assert_close(v.grad.double(), expected, rtol=1e-5, atol=1e-6)
    assert float(v.grad[1].abs().max()) < 1e-6  # A = 0 (zero up to float rounding of β·v + (1 − β)·v)


def test_nft_adaptive_weight_floor():
    """x̂₀ = x₀ exactly: the weight is the floor 1e-5 (no division by zero), the loss 0."""
    x0 = _t([1.0, 2.0])
    terms = nft_terms(_t([0.0, 0.0]), _t([0.0, 0.0]), x0, x0, 0.5, _t(1.0), NFTConfig(kl_beta=0.0))
    assert terms.loss.item() == 0.0


def test_nft_train_sigmas_are_a_random_subset_per_sample():
    grid = torch.tensor([1.0, 0.96, 0.9, 0.83, 0.75, 0.64, 0.5, 0.34, 0.17, 0.08, 0.0])  # T = 10
    s = nft_train_sigmas(grid, 5, 0.99, torch.Generator().manual_seed(0))
    assert s.shape == (5, 9)  # int(10·0.99) = 9 of the 10 steps
    for row in s:
        assert len(set(row.tolist())) == 9 and set(row.tolist()) <= set(grid[:10].tolist())
    assert len({tuple(r.tolist()) for r in s}) > 1  # each sample its own permutation
    assert nft_train_sigmas(grid, 2, 0.5).shape == (2, 5)


def test_nft_bad_input():
    with pytest.raises(ValueError, match="beta\n  Input should be greater than 0"):
        NFTConfig(beta=0.0)
    with pytest.raises(ValueError, match="objective.adv_mode: .*binary"):
        NFTConfig(adv_mode="bin")
    with pytest.raises(ValueError, match="needs the reference"):
        nft_terms(_t([1.0]), _t([1.0]), _t([1.0]), _t([1.0]), 0.5, _t(1.0), NFTConfig())
    with pytest.raises(ValueError, match="shapes disagree"):
        nft_terms(_t([1.0]), _t([1.0, 2.0]), _t([1.0]), _t([1.0]), 0.5, _t(1.0), NFTConfig(kl_beta=0))


# ================================================================================================ AWM
def test_awm_weightings_by_hand():
    """x₀ = (1, 0), ε = (0, 2): target (−1, 2); v = (0, 1): v − target = (1, −1), m = 1; σ = ½."""
    x0, eps, v = _t([1.0, 0.0]), _t([0.0, 2.0]), _t([0.0, 1.0])
    tiny4 = 10 ** -2.5  # (1e-10)^0.25
    cases = {"uniform": -1.0, "t": -0.5, "t**2": -0.25, "huber": -(math.sqrt(1 + 1e-10) - 1e-5) * 0.5,
             "ghuber": -((1 + 1e-10) ** 0.25 - tiny4) * 0.5 / 0.25}
    for name, expected in cases.items():
        assert awm_log_prob(v, eps, x0, 0.5, weighting=name).item() == pytest.approx(expected, rel=1e-6), name


def test_awm_loss_and_gradient_by_hand():
    """The case above with A = 2.5 (Â = 2.5/5·1 = 0.5), v_ref = 0 (KL = 0.5), v_ema = v (KL 0): on-policy ρ = 1,
    loss = −0.5 + 0.001·0.5. Gradient: Â·σ·(m + 1e-10)^(p−1)·2(v − target)/D + β·2(v − v_ref)/D
    = 0.5·0.5·(1, −1) + 0.001·(0, 1) = (0.25, −0.249)."""
    x0, eps = _t([1.0, 0.0]), _t([0.0, 2.0])
    v = _t([0.0, 1.0]).requires_grad_(True)
    terms = awm_terms(v, eps, x0, 0.5, _t(2.5), AWMConfig(), v_ref=_t([0.0, 0.0]), v_ema=_t([0.0, 1.0]))
    assert terms.loss.item() == pytest.approx(-0.5 + 0.0005, abs=1e-7)
    assert terms.stats["ratio"].item() == 1.0
    terms.loss.sum().backward()
    torch.testing.assert_close(v.grad, _t([0.25, -0.249]), rtol=1e-6, atol=1e-7)


def _release_awm_loss(v, v_ref, v_ema, eps, x0, sigma, adv, p, beta, ema_beta):
    """train_sd3_awm.py lines 236–252 and 1293–1350 (on-policy, exp_first, ghuber, Uniform KLs), float64."""
    v, v_ref, v_ema, eps, x0 = (t.double() for t in (v, v_ref, v_ema, eps, x0))
    dims = tuple(range(1, x0.ndim))
    lp = -((v - (eps - x0)) ** 2).mean(dim=dims)
    lp = -(torch.pow(-lp + 1e-10, p) - torch.pow(torch.tensor(1e-10, dtype=torch.float64), p)) * sigma.double() / p
    ratio = torch.exp(lp - lp.detach())
    a = torch.clamp(adv.double(), -5, 5) / 5 * 1
    policy = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.0, 2.0)))
    kl = ((v - v_ref) ** 2).mean(dim=dims).mean()
    ema_kl = ((v - v_ema) ** 2).mean(dim=dims).mean()
    return policy + beta * kl + ema_beta * ema_kl


def test_awm_loss_and_gradient_equal_the_release_on_random_rows():
    g = torch.Generator().manual_seed(2)
    shape = (6, 2, 4)
    x0, eps, v0, v_ref, v_ema = (torch.randn(shape, generator=g) for _ in range(5))
    sigma, adv = torch.rand(6, generator=g), torch.randn(6, generator=g) * 3
    v = v0.clone().requires_grad_(True)
    ours = awm_terms(v, eps, x0, sigma, adv, AWMConfig(), v_ref=v_ref, v_ema=v_ema).loss.mean()
    ours.backward()
    v_rel = v0.double().clone().requires_grad_(True)
    expected = _release_awm_loss(v_rel, v_ref, v_ema, eps, x0, sigma, adv, 0.25, 0.001, 1.0)
    expected.backward()
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(v.grad.double(), v_rel.grad, rtol=1e-5, atol=1e-8)


def test_awm_off_policy_ratio_clip_by_hand():
    """ℓ_old = ℓ − 0.5: ρ = e^0.5 = 1.6487 > 1 + ε = 1.2 with A > 0: the clipped branch −Â·1.2 is the max,
    no gradient (ε = 0.2 here; the release's ε = 1 never binds on-policy)."""
    x0, eps = _t([1.0, 0.0]), _t([0.0, 2.0])
    v = _t([0.0, 1.0]).requires_grad_(True)
    settings = AWMConfig(clip_range=0.2, kl_beta=0.0, ema_beta=0.0)
    lp = awm_log_prob(_t([0.0, 1.0]), eps, x0, 0.5)
    terms = awm_terms(v, eps, x0, 0.5, _t(5.0), settings, old_log_prob=lp - 0.5)
    assert terms.loss.item() == pytest.approx(-1.2, rel=1e-6)
    assert terms.stats["ratio"].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    assert terms.stats["clipped"].item() == 1.0
    terms.loss.sum().backward()
    assert float(v.grad.abs().max()) == 0.0


def test_awm_elbo_kl_weight_by_hand():
    """kl_weight 'elbo': mean_dims((v − v_ref)²)/(2·std²), std = √(σ/(1 − σ))·0.7: σ = 0.5 → std = 0.7,
    KL = 0.5/(2·0.49)."""
    x0, eps, v = _t([1.0, 0.0]), _t([0.0, 2.0]), _t([0.0, 1.0])
    terms = awm_terms(v, eps, x0, 0.5, _t(1.0), AWMConfig(kl_weight="elbo", ema_beta=0.0), v_ref=_t([0.0, 0.0]))
    assert terms.stats["kl_ref"].item() == pytest.approx(0.5 / (2 * 0.49), rel=1e-6)


def test_awm_train_sigma_indices_are_stratified():
    """discrete_wo_init, T = 14, f = 0.9, K = 6: linspace(1, 12, 7) = 1, 2.83, 4.67, 6.5, 8.33, 10.17, 12 truncated
    to strata [1, 2), [2, 4), [4, 6), [6, 8), [8, 10), [10, 12); 'discrete' (PickScore): linspace(0, 12, 7)."""
    strata = {"discrete_wo_init": [(1, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)],
              "discrete": [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]}
    g = torch.Generator().manual_seed(0)
    for kind, bounds in strata.items():
        seen = set()
        for _ in range(200):
            idx = awm_train_sigma_indices(14, AWMConfig(time_type=kind), g).tolist()
            assert all(lo <= i <= hi for i, (lo, hi) in zip(idx, bounds, strict=True)), (kind, idx)
            seen.update(idx)
        assert seen == {i for lo, hi in bounds for i in range(lo, hi + 1)}
    first = awm_train_sigma_indices(14, AWMConfig(time_type="discrete_with_init"), g)
    assert first[0].item() == 0 and first.shape == (6,)


def test_awm_bad_input():
    with pytest.raises(ValueError, match="needs its velocity"):
        awm_terms(_t([1.0]), _t([1.0]), _t([1.0]), 0.5, _t(1.0), AWMConfig())
    with pytest.raises(ValueError, match="objective.weighting: .*ghuber"):
        AWMConfig(weighting="gauss")
    with pytest.raises(ValueError, match=">= 2 steps"):
        awm_train_sigma_indices(1, AWMConfig())


# ================================================================================================ DGPO
# Two groups of G = 2 rows, D = 1, x₀ = 0 so the target ε − x₀ = ε = (1, 1, 0, 0).
DG_EPS, DG_X0 = _t([1.0], [1.0], [0.0], [0.0]), torch.zeros(4, 1)
DG_V, DG_REF = _t([0.5], [1.5], [1.0], [0.0]), _t([0.0], [1.0], [0.0], [1.0])
DG_ADV, DG_GROUP = _t(1.0, -1.0, 2.0, -2.0), torch.tensor([0, 0, 1, 1])
NO_CLIP = DGPOConfig(beta_dpo=1.0, kl_beta=0.02, clip_dsm=False)


def test_dgpo_loss_by_hand():
    """e_θ = (0.25, 0.25, 1, 0), e_ref = (1, 0, 0, 1): Δ = (−0.75, 0.25, 1, −1); A·Δ/G = (−0.375, −0.125, 1, 1), so
    s₀ = −0.5, s₁ = 2 and the weights σ(−0.5) = 0.377541, σ(2) = 0.880797. policy = w·A·e_θ =
    (0.0943852, −0.0943852, 1.7615942, 0); KL = (v − v_ref)² = (0.25, 0.25, 1, 1), β = 0.02."""
    terms = dgpo_terms(DG_V, DG_EPS, DG_X0, DG_ADV, DG_GROUP, 2, NO_CLIP, group_size=2, v_ref=DG_REF)
    w0, w1 = 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-2.0))
    expected = [w0 * 0.25 + 0.005, -w0 * 0.25 + 0.005, w1 * 2 + 0.02, 0.02]
    torch.testing.assert_close(terms.loss, _t(*expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(terms.stats["group_weight"], _t(w0, w0, w1, w1), rtol=1e-6, atol=1e-7)


def test_dgpo_gradient_by_hand():
    """d loss/dv = w·A·2(v − target)/D + β·2(v − v_ref)/D (the group weight is detached)."""
    v = DG_V.clone().requires_grad_(True)
    dgpo_terms(v, DG_EPS, DG_X0, DG_ADV, DG_GROUP, 2, NO_CLIP, group_size=2, v_ref=DG_REF).loss.sum().backward()
    w = _t(1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-2.0)))
    expected = w[:, None] * DG_ADV[:, None] * 2 * (DG_V - DG_EPS) + 0.02 * 2 * (DG_V - DG_REF)
    torch.testing.assert_close(v.grad, expected, rtol=1e-6, atol=1e-7)


def test_dgpo_clip_against_the_old_copy():
    """ρ = exp(e_old − e_θ) with ε = 1e-2: row 0 (A > 0) e_old = e + 0.1 → ρ = 1.105 > 1.01, clipped; row 1 (A < 0)
    e_old = e − 0.1 → ρ = 0.905 < 0.99, clipped; row 2 (A > 0, ρ < 1) and row 3 (A < 0, ρ > 1) are not. A clipped row
    keeps only its KL gradient (``clip_kl`` off), or none (on)."""
    e = (DG_EPS - DG_V).square().squeeze(1)
    e_old = e + _t(0.1, -0.1, -0.1, 0.1)
    v_old = DG_EPS - e_old.sqrt()[:, None]  # (target − v_old)² = e_old (target − v_old ≥ 0)
    for clip_kl in (False, True):
        v = DG_V.clone().requires_grad_(True)
        settings = DGPOConfig(beta_dpo=1.0, kl_beta=0.02, clip_range=1e-2, clip_kl=clip_kl)
        terms = dgpo_terms(v, DG_EPS, DG_X0, DG_ADV, DG_GROUP, 2, settings, group_size=2, v_ref=DG_REF, v_old=v_old)
        assert terms.stats["clipped"].tolist() == [1.0, 1.0, 0.0, 0.0]
        terms.loss.sum().backward()
        kl_grad = 0.02 * 2 * (DG_V - DG_REF)
        expected_01 = torch.zeros(2, 1) if clip_kl else kl_grad[:2]
        torch.testing.assert_close(v.grad[:2], expected_01, rtol=1e-6, atol=1e-7)
        assert float((v.grad[2:] - kl_grad[2:]).abs().max()) > 1e-3  # rows 2, 3 keep their preference gradient


def test_dgpo_ema_reference_uses_the_old_copy_for_the_preference_only():
    """use_ema_ref: s_g from e_old, the KL still to v_ref. With v_old = v: Δ = 0, s_g = 0, every weight ½."""
    settings = DGPOConfig(beta_dpo=1.0, kl_beta=0.02, clip_dsm=False, use_ema_ref=True)
    terms = dgpo_terms(DG_V, DG_EPS, DG_X0, DG_ADV, DG_GROUP, 2, settings, group_size=2, v_ref=DG_REF, v_old=DG_V)
    assert terms.stats["group_weight"].tolist() == [0.5] * 4
    torch.testing.assert_close(terms.stats["kl_ref"], _t(0.25, 0.25, 1.0, 1.0))


def test_dgpo_group_sums_over_processes_equal_one_process():
    """Rows 0, 2 on process A and 1, 3 on process B: summing the two processes' partial group sums (the release's
    all-reduce) gives each row the loss of the one-process computation."""
    whole = dgpo_terms(DG_V, DG_EPS, DG_X0, DG_ADV, DG_GROUP, 2, NO_CLIP, group_size=2, v_ref=DG_REF).loss
    parts = {}
    for name, rows in (("A", [0, 2]), ("B", [1, 3])):
        e = (DG_EPS[rows] - DG_V[rows]).square().squeeze(1)
        e_ref = (DG_EPS[rows] - DG_REF[rows]).square().squeeze(1)
        parts[name] = dgpo_group_sums(e - e_ref, DG_ADV[rows], DG_GROUP[rows], 2, 1.0, 2)
    for rows, other in (([0, 2], "B"), ([1, 3], "A")):
        loss = dgpo_terms(DG_V[rows], DG_EPS[rows], DG_X0[rows], DG_ADV[rows], DG_GROUP[rows], 2, NO_CLIP,
                          group_size=2, v_ref=DG_REF[rows], reduce_group_sums=lambda s, o=other: s + parts[o]).loss
        torch.testing.assert_close(loss, whole[rows], rtol=1e-6, atol=1e-7)


def test_dgpo_timesteps_and_noise():
    s = DGPOConfig()
    idx = dgpo_train_indices(s, torch.Generator().manual_seed(0))
    assert idx.shape == (4,) and len(set(idx.tolist())) == 4 and set(idx.tolist()) <= set(range(5))
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    sched.set_timesteps(10)
    all_idx = torch.arange(10)
    # the release noises with scheduler.timesteps (int64) / 1000
    torch.testing.assert_close(dgpo_train_sigmas(sched.sigmas, all_idx), sched.timesteps.float() / 1000)
    noise = shared_group_noise((2, 3), DG_GROUP, 2, torch.Generator().manual_seed(0))
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[2], noise[3]) and not torch.equal(noise[0], noise[2])


def test_dgpo_bad_input():
    with pytest.raises(ValueError, match="needs the old copy"):
        dgpo_terms(DG_V, DG_EPS, DG_X0, DG_ADV, DG_GROUP, 2, DGPOConfig(), group_size=2, v_ref=DG_REF)
    with pytest.raises(ValueError, match="group_index must lie"):
        dgpo_group_sums(_t(1.0), _t(1.0), torch.tensor([3]), 2, 1.0, 2)
    with pytest.raises(ValueError, match="num_train_timesteps=6: DGPO draws that many distinct grid steps from "
                                         "0..trunc_steps=4, so it must be <= trunc_steps"):
        DGPOConfig(num_train_timesteps=6, trunc_steps=4)
    DGPOConfig(num_train_timesteps=5, trunc_steps=4)  # the bound itself is allowed
