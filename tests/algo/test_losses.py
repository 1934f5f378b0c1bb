"""Specification of the clipped chunk surrogate (flowgrpo.algo.policy_losses).

Per pair: r = exp(mean_t Δ_t) (Chunk-GRPO eq. 6, the geometric mean of the step ratios),
L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) (PPO eq. 7; asymmetric ε: DAPO eq. 10), + β·mean_t KL_t.
The expected numbers below are worked out by hand with ε_low = 0.1, ε_high = 0.2.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algo.policy_losses import clipped_surrogate

EPS_LOW, EPS_HIGH = 0.1, 0.2

# (A, Δ for the chunk's two steps, expected loss, expected clipped flag), each derived by hand:
CASES = [
    # r = e^0.2 = 1.2214 > 1 + 0.2, A > 0: the clipped term −1.2 is the max → clipped
    (1.0, (0.1, 0.3), -1.2, True),
    # r = e^−0.2 = 0.8187 < 0.9, A > 0: −A·r = −0.8187 > −0.9 → unclipped
    (1.0, (-0.4, 0.0), -math.exp(-0.2), False),
    # r = e^−0.2, A = −2: −A·r = 1.6375 < −A·0.9 = 1.8 → clipped at the low side
    (-2.0, (-0.3, -0.1), 1.8, True),
    # r = e^0.2, A = −2: −A·r = 2.4428 > −A·1.2 = 2.4 → unclipped
    (-2.0, (0.2, 0.2), 2 * math.exp(0.2), False),
    # r = e^0 = 1, inside the range: −A·r
    (0.5, (0.05, -0.05), -0.5, False),
    # r = e^0.18 = 1.1972: above 1 + ε_low but below 1 + ε_high → not clipped (a symmetric 0.1 would clip)
    (1.0, (0.17, 0.19), -math.exp(0.18), False),
    # r = e^−0.13 = 0.8781 < 1 − ε_low, A = −1: −A·r = 0.8781 < 0.9 → clipped (a symmetric 0.2 would not)
    (-1.0, (-0.12, -0.14), 0.9, True),
]


def _inputs(old_offset=0.0):
    adv = torch.tensor([c[0] for c in CASES])
    delta = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    old = torch.full(delta.shape, -1.5, dtype=torch.float64) + old_offset
    return adv, (old + delta).float(), old.float(), delta


def test_clipped_surrogate_by_hand():
    adv, new, old, delta = _inputs()
    terms = clipped_surrogate(new, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    torch.testing.assert_close(terms.loss.double(), torch.tensor([c[2] for c in CASES], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    assert terms.clipped.tolist() == [c[3] for c in CASES]
    # geometric mean of the step ratios, not their arithmetic mean (which differs by ~6e-3 for case 0)
    geo = torch.exp(delta.mean(1))
    torch.testing.assert_close(terms.ratio.double(), geo, rtol=1e-5, atol=1e-6)
    assert abs(float(torch.exp(delta[0]).mean()) - float(terms.ratio[0])) > 1e-3
    # k2 estimator ½·mean Δ² and the max |Δ| diagnostic
    torch.testing.assert_close(terms.approx_kl.double(), 0.5 * (delta**2).mean(1), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(terms.log_ratio_abs_max.double(), delta.abs().amax(1), rtol=1e-4, atol=1e-6)
    assert terms.kl_ref.tolist() == [0.0] * len(CASES)


def test_the_ratio_depends_only_on_the_difference_of_log_probs():
    adv, new, old, _ = _inputs()
    a = clipped_surrogate(new, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    adv, new2, old2, _ = _inputs(old_offset=3.0)
    b = clipped_surrogate(new2, old2, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    torch.testing.assert_close(a.ratio, b.ratio, rtol=1e-5, atol=1e-6)


def test_on_policy_ratio_is_one_and_loss_is_minus_advantage():
    adv = torch.tensor([0.7, -1.3, 0.0])
    lp = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    terms = clipped_surrogate(lp, lp.clone(), adv, clip_low=1e-4, clip_high=1e-4)
    assert torch.equal(terms.ratio, torch.ones(3))
    assert torch.equal(terms.loss, -adv)
    assert not terms.clipped.any()
    assert torch.equal(terms.approx_kl, torch.zeros(3))


def test_gradient_flows_only_through_unclipped_pairs():
    # d/dΔ_j of −A·exp(mean Δ) = −A·r/k for an unclipped pair; a clipped pair's loss is constant → 0.
    adv, new, old, delta = _inputs()
    new = new.clone().requires_grad_(True)
    terms = clipped_surrogate(new, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    terms.loss.sum().backward()
    k = new.shape[1]
    for i, (a, _, _, clipped) in enumerate(CASES):
        expected = 0.0 if clipped else -a * math.exp(float(delta[i].mean())) / k
        torch.testing.assert_close(new.grad[i].double(), torch.full((k,), expected, dtype=torch.float64),
                                   rtol=1e-4, atol=1e-6)


def test_kl_term_is_added_with_beta():
    adv, new, old, _ = _inputs()
    kl = torch.rand(new.shape, generator=torch.Generator().manual_seed(1))
    base = clipped_surrogate(new, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    with_kl = clipped_surrogate(new, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH, kl_ref=kl, kl_beta=0.25)
    torch.testing.assert_close(with_kl.loss.double(), base.loss.double() + 0.25 * kl.double().mean(1),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(with_kl.kl_ref, kl.mean(1))
    # β = 0 reports the KL but does not add it
    no_beta = clipped_surrogate(new, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH, kl_ref=kl, kl_beta=0.0)
    assert torch.equal(no_beta.loss, base.loss)
    torch.testing.assert_close(no_beta.kl_ref, kl.mean(1))


def test_single_step_chunk_is_the_ppo_ratio():
    adv = torch.tensor([1.0])
    terms = clipped_surrogate(torch.tensor([[-0.95]]), torch.tensor([[-1.0]]), adv, clip_low=0.1, clip_high=0.1)
    assert float(terms.ratio) == pytest.approx(math.exp(0.05), rel=1e-6)
    assert float(terms.loss) == pytest.approx(-math.exp(0.05), rel=1e-6)


def test_bad_inputs_raise():
    lp = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="disagree"):
        clipped_surrogate(lp, torch.zeros(3, 3), torch.zeros(3), clip_low=0.1, clip_high=0.1)
    with pytest.raises(ValueError, match="disagree"):
        clipped_surrogate(lp, lp, torch.zeros(2), clip_low=0.1, clip_high=0.1)
    with pytest.raises(ValueError, match="clip"):
        clipped_surrogate(lp, lp, torch.zeros(3), clip_low=-0.1, clip_high=0.1)


def test_values_and_gradients_equal_the_literal_max_to_the_bit():
    # The loss must be max(−A·r, −A·clip(r)) as torch.maximum computes it and autograd differentiates it, to the
    # last bit, including the rare pairs whose two terms round to one float32 value although r lies just outside
    # the range (a tie: the max sends half the gradient to each branch, the clamp cuts the clipped half). A
    # rewrite as a where over the clipped flag agrees everywhere else and changed the main job from epoch 47 on.
    g = torch.Generator().manual_seed(3)
    lo = hi = 1e-4
    cand_delta = (torch.rand(400_000, 1, generator=g) - 0.5) * 4e-4
    cand_adv = torch.randn(400_000, generator=g)
    r = torch.exp(cand_delta.mean(1))
    c = torch.clamp(r, 1 - lo, 1 + hi)
    rounding_ties = ((-cand_adv * r == -cand_adv * c) & (r != c)).nonzero().flatten()
    assert len(rounding_ties) >= 3
    delta = torch.cat([torch.zeros(16, 1),  # on policy: r = 1, every pair a tie
                       cand_delta[:48],  # inside and outside the range, both signs of A
                       cand_delta[rounding_ties]])
    adv = torch.cat([torch.randn(16, generator=g), cand_adv[:48], cand_adv[rounding_ties]])
    adv[::7] = 0.0
    old = torch.randn(len(adv), 1, generator=g)
    upstream = torch.randn(len(adv), generator=g)
    new = (old + delta).requires_grad_(True)
    terms = clipped_surrogate(new, old, adv, clip_low=lo, clip_high=hi)
    (terms.loss * upstream).sum().backward()

    literal_new = (old + delta).requires_grad_(True)
    ratio = torch.exp((literal_new - old).mean(dim=1))
    literal = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi))
    (literal * upstream).sum().backward()
    assert torch.equal(terms.loss, literal)
    assert torch.equal(new.grad, literal_new.grad)
    assert terms.clipped.any() and not terms.clipped.all()
