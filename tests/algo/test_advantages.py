"""Specification of the group-relative advantages (flowgrpo.algo.advantages).

Every expected value is worked out by hand from a small reward table written in the test (population std,
A = (r − mean)/(std + 1e-4), Flow-GRPO arXiv 2505.05470 eq. 6; Dr. GRPO; RLOO; GDPO arXiv 2601.05242).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.records import Rewards

EPS = 1e-4


def _rewards(total, dtype=torch.float32, components=None, weights=None):
    total = torch.tensor(total, dtype=dtype)
    if components is None:
        components, weights = {"r": total}, {"r": 1.0}
    else:
        components = {k: torch.tensor(v, dtype=dtype) for k, v in components.items()}
    return Rewards(components=components, weights=weights, total=total)


def _ids(*sizes):
    return torch.cat([torch.full((n,), g, dtype=torch.long) for g, n in enumerate(sizes)])


def _assert_adv(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=atol)


def test_grpo_on_a_hand_table():
    # group 0: [1, 2, 3, 4]: mean 2.5, population variance (2.25+0.25+0.25+2.25)/4 = 1.25
    # group 1: [10, 0]: mean 5, population std 5
    adv = compute_advantages(_rewards([1, 2, 3, 4, 10, 0]), _ids(4, 2))
    s0 = math.sqrt(1.25) + EPS
    _assert_adv(adv.values, [-1.5 / s0, -0.5 / s0, 0.5 / s0, 1.5 / s0, 5 / (5 + EPS), -5 / (5 + EPS)])
    assert adv.values.dtype == torch.float32 and adv.train_mask.all()
    assert adv.zero_spread_frac == 0 and adv.nan_frac == 0


def test_grpo_with_global_std():
    # group means 2 and 11; batch [1, 2, 3, 10, 12] (group 1 is [10, 12]): batch mean 28/5 = 5.6,
    # population variance ((4.6)² + (3.6)² + (2.6)² + (4.4)² + (6.4)²)/5 = (21.16+12.96+6.76+19.36+40.96)/5 = 20.24
    adv = compute_advantages(_rewards([1, 2, 3, 10, 12]), _ids(3, 2), global_std=True)
    s = math.sqrt(20.24) + EPS
    _assert_adv(adv.values, [-1 / s, 0, 1 / s, -1 / s, 1 / s])


def test_dr_grpo_subtracts_the_group_mean_only():
    adv = compute_advantages(_rewards([1, 2, 6, 0.5, 1.5]), _ids(3, 2), estimator="dr_grpo")
    _assert_adv(adv.values, [1 - 3, 2 - 3, 6 - 3, -0.5, 0.5])


def test_rloo_uses_the_leave_one_out_mean():
    r = [1.0, 2.0, 6.0, 3.0, 0.5, 1.5]
    # group 0 = [1, 2, 6, 3]: r_i − mean of the other three
    expected = [1 - (2 + 6 + 3) / 3, 2 - (1 + 6 + 3) / 3, 6 - (1 + 2 + 3) / 3, 3 - (1 + 2 + 6) / 3,
                0.5 - 1.5, 1.5 - 0.5]
    adv = compute_advantages(_rewards(r), _ids(4, 2), estimator="rloo")
    _assert_adv(adv.values, expected)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_advantages_have_zero_mean_in_each_group(estimator):
    r = torch.rand(24, generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.arange(6).repeat_interleave(4)
    adv = compute_advantages(_rewards(r), ids, estimator=estimator).values.double()
    assert adv.reshape(6, 4).sum(1).abs().max() < 1e-6
    assert adv.abs().min() > 0


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("global_std", [False, True])
def test_a_zero_spread_group_gets_exactly_zero(estimator, global_std):
    # In float64, (0.1 + 0.1 + 0.1)/3 = 0.10000000000000002 ≠ 0.1, so r − mean is ~1e-17, not 0: the estimator
    # must test max == min, not rely on the arithmetic.
    assert (0.1 + 0.1 + 0.1) / 3 != 0.1
    rewards = _rewards([0.1, 0.1, 0.1, 1.0, 2.0, 4.0], dtype=torch.float64)
    adv = compute_advantages(rewards, _ids(3, 3), estimator=estimator, global_std=global_std)
    assert adv.values[:3].tolist() == [0.0, 0.0, 0.0]
    assert (adv.values[3:] != 0).all()
    assert adv.zero_spread_frac == 0.5
    assert adv.train_mask.all()  # kept unless dropping is asked for


def test_drop_zero_spread_groups_sets_train_mask():
    rewards = _rewards([0.3, 0.3, 1.0, 2.0, 5.0, 5.0, 7.0, 7.0])
    adv = compute_advantages(rewards, _ids(2, 2, 2, 2), drop_zero_spread=True)
    assert adv.train_mask.tolist() == [False, False, True, True, False, False, False, False]
    assert adv.zero_spread_frac == 0.75
    assert adv.values[[0, 1, 4, 5, 6, 7]].tolist() == [0.0] * 6


def test_nan_reward_is_left_out_of_its_group_statistics(caplog):
    # group 0 = [1, NaN, 2, 4]: the statistics use [1, 2, 4] only: mean 7/3,
    # population variance ((4/3)² + (1/3)² + (5/3)²)/3 = (16 + 1 + 25)/27 = 42/27
    # group 1 = [0, 3, 3, 6] untouched: mean 3, variance (9 + 0 + 0 + 9)/4 = 4.5
    r = [1.0, float("nan"), 2.0, 4.0, 0.0, 3.0, 3.0, 6.0]
    with caplog.at_level(logging.WARNING, logger="flowgrpo.algo.advantages"):
        adv = compute_advantages(_rewards(r), _ids(4, 4))
    s0 = math.sqrt(42 / 27) + EPS
    s1 = math.sqrt(4.5) + EPS
    _assert_adv(adv.values, [(1 - 7 / 3) / s0, 0.0, (2 - 7 / 3) / s0, (4 - 7 / 3) / s0,
                             -3 / s1, 0.0, 0.0, 3 / s1])
    assert adv.values[1] == 0.0
    assert adv.train_mask.tolist() == [True, False, True, True, True, True, True, True]
    assert adv.nan_frac == pytest.approx(1 / 8)
    assert any("NaN" in rec.getMessage() and rec.levelno == logging.WARNING for rec in caplog.records)


def test_no_warning_without_nan(caplog):
    with caplog.at_level(logging.WARNING, logger="flowgrpo.algo.advantages"):
        compute_advantages(_rewards([1.0, 2.0]), _ids(2))
    assert not caplog.records


def test_a_group_of_only_nan_rewards_is_zero_and_untrained():
    nan = float("nan")
    adv = compute_advantages(_rewards([nan, nan, 1.0, 3.0]), _ids(2, 2))
    assert adv.values[:2].tolist() == [0.0, 0.0]
    assert adv.train_mask.tolist() == [False, False, True, True]
    assert adv.nan_frac == 0.5
    assert torch.isfinite(adv.values).all()


def test_single_sample_group_is_an_error():
    with pytest.raises(ValueError, match="G >= 2"):
        compute_advantages(_rewards([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


def test_advantages_are_clipped():
    # grpo, one success in 30: p = 1/30, mean p, population std √(p(1−p)) = √29/30;
    # the success gets (1 − 1/30)/(√29/30 + 1e-4) ≈ 5.38 > 5 → clipped to 5; the others −(1/30)/(√29/30 + 1e-4).
    r = [1.0] + [0.0] * 29
    adv = compute_advantages(_rewards(r), torch.zeros(30, dtype=torch.long))
    s = math.sqrt(29) / 30 + EPS
    assert (29 / 30) / s > 5
    _assert_adv(adv.values, [5.0] + [-(1 / 30) / s] * 29)
    # dr_grpo [0, 20]: ±10 → ±5 (default), ±2 with clip=2
    assert compute_advantages(_rewards([0.0, 20.0]), _ids(2), estimator="dr_grpo").values.tolist() == [-5, 5]
    assert compute_advantages(_rewards([0.0, 20.0]), _ids(2), estimator="dr_grpo", clip=2.0).values.tolist() == [
        -2, 2]


def test_groups_are_found_by_id_not_by_position():
    # interleaved groups give the same advantages as contiguous ones
    r = [1.0, 10.0, 3.0, 0.0]
    adv = compute_advantages(_rewards(r), torch.tensor([7, 3, 7, 3])).values
    _assert_adv(adv, [-1 / (1 + EPS), 5 / (5 + EPS), 1 / (1 + EPS), -5 / (5 + EPS)])


def test_gdpo_separates_reward_combinations_that_sum_normalization_collapses():
    # Two binary rewards a, b with weights 1, 1; groups of 2:
    #   group 0: (a, b) = (0, 1) and (0, 0)   group 1: (1, 1) and (0, 0)
    # totals as given (a weighted mean would give these; the test concerns how the components are used)
    # sum_then_normalize: group 0 ±0.25/(0.25 + 1e-4), group 1 ±0.5/(0.5 + 1e-4): both ≈ ±1, the
    # combinations collide.
    # gdpo: each component normalised in its group: a: group 0 all zero → 0, group 1 ±k; b: ±k in both,
    # with k = 0.5/(0.5 + 1e-4); weighted sum [k, −k, 2k, −2k]; batch mean 0, population std
    # √((k² + k² + 4k² + 4k²)/4) = k·√2.5; A = sum / (k·√2.5 + 1e-4).
    comps = {"a": [0.0, 0.0, 1.0, 0.0], "b": [1.0, 0.0, 1.0, 0.0]}
    rewards = _rewards([0.5, 0.0, 1.0, 0.0], components=comps, weights={"a": 1.0, "b": 1.0})
    ids = _ids(2, 2)
    summed = compute_advantages(rewards, ids, multi_reward="sum_then_normalize").values
    _assert_adv(summed, [0.25 / (0.25 + EPS), -0.25 / (0.25 + EPS), 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])
    gdpo = compute_advantages(rewards, ids, multi_reward="gdpo").values
    k = 0.5 / (0.5 + EPS)
    d = k * math.sqrt(2.5) + EPS
    _assert_adv(gdpo, [k / d, -k / d, 2 * k / d, -2 * k / d])
    assert abs(float(gdpo[2] - gdpo[0])) > 0.5  # (1, 1) is rewarded more than (0, 1) under gdpo only
    assert abs(float(summed[2] - summed[0])) < 1e-3


def test_gdpo_with_weights():
    # weights 2 (a) and 1 (b); group 0: a = [1, 0], b = [0, 0]; group 1: a = [0, 0], b = [1, 0].
    # per component: a → [k, −k, 0, 0], b → [0, 0, k, −k] (k = 0.5/(0.5 + 1e-4));
    # weighted sum [2k, −2k, k, −k]; batch mean 0, std √((4+4+1+1)k²/4) = k·√2.5.
    comps = {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0, 0.0, 1.0, 0.0]}
    rewards = _rewards([2 / 3, 0.0, 1 / 3, 0.0], components=comps, weights={"a": 2.0, "b": 1.0})
    gdpo = compute_advantages(rewards, _ids(2, 2), multi_reward="gdpo").values
    k = 0.5 / (0.5 + EPS)
    d = k * math.sqrt(2.5) + EPS
    _assert_adv(gdpo, [2 * k / d, -2 * k / d, k / d, -k / d])


def test_gdpo_leaves_a_weight_0_metric_out_of_the_zero_spread_check():
    # group 0: the weighted reward a is flat (1, 1), the weight-0 metric m varies (0, 1); group 1: a = (1, 0).
    # A varying metric once kept group 0 in the update (advantage 0, counted as a learning signal).
    comps = {"a": [1.0, 1.0, 1.0, 0.0], "m": [0.0, 1.0, 0.0, 0.0]}
    rewards = _rewards([1.0, 1.0, 1.0, 0.0], components=comps, weights={"a": 1.0, "m": 0.0})
    out = compute_advantages(rewards, _ids(2, 2), multi_reward="gdpo", drop_zero_spread=True)
    assert out.train_mask.tolist() == [False, False, True, True]
    assert out.zero_spread_frac == 0.5
    # group 1 alone carries the signal: per component [0, 0, k, −k], batch mean 0, std k/√2 → A = ±√2 (to eps)
    k = 0.5 / (0.5 + EPS)
    d = k / math.sqrt(2) + EPS
    _assert_adv(out.values, [0.0, 0.0, k / d, -k / d])


def test_unknown_multi_reward_and_estimator_are_errors():
    with pytest.raises(ValueError, match="gdpo"):
        compute_advantages(_rewards([1.0, 2.0]), _ids(2), multi_reward="gpdo")
    with pytest.raises(KeyError, match="did you mean 'rloo'"):
        compute_advantages(_rewards([1.0, 2.0]), _ids(2), estimator="rlooo")
