"""Weighted composition of rewards (flowgrpo.rewards.compose): NaN is "not applicable" and left out of the
weighted sum, negative weights are penalties, None is NaN, an infinite score is an error naming the reward; a
reward with a documented NaN case passes the conformance suite (flowgrpo.testing.rewards). Expected totals are
weighted sums written out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility, jpeg_size_kb

from flowgrpo.rewards.compose import ComposedReward, compose_rewards
from flowgrpo.testing.rewards import RewardConformance
from tests.rewards.stubs import CatNotApplicable, images_8bit


def test_nan_components_are_left_out_of_the_weighted_sum():
    nan = float("nan")
    a = torch.tensor([1.0, nan, 3.0, nan, -2.0])
    b = torch.tensor([2.0, 4.0, nan, nan, 0.5])
    out = compose_rewards({"a": a, "b": b}, {"a": 1.0, "b": 3.0})
    # sample 0: 1·1 + 3·2 = 7; 1: only b → 3·4 = 12; 2: only a → 1·3 = 3; 3: none → NaN;
    # 4: 1·(−2) + 3·0.5 = −0.5
    assert out.total[:3].tolist() == [7.0, 12.0, 3.0]
    assert math.isnan(out.total[3])
    assert out.total[4].item() == pytest.approx(-0.5)
    assert out.total.dtype == torch.float32
    torch.testing.assert_close(out.components["a"], a, equal_nan=True)
    assert out.weights == {"a": 1.0, "b": 3.0}
    # the same through ComposedReward with a plugin and a reward that is NaN ("not applicable") for cat prompts
    images = images_8bit(4)
    prompts = ["a cat", "a dog", "a cat on a mat", "a tree"]
    composed = ComposedReward({"jpeg": JpegCompressibility(), "cat_na": CatNotApplicable()},
                              {"jpeg": 2.0, "cat_na": 1.0})
    out = composed(images, prompts, [{}] * 4)
    j = -jpeg_size_kb(images)
    # by hand: cat prompts have only the JPEG component present (2·j); the others add both, 2·j + 1·0.5
    expected = torch.stack([2 * j[0], 2 * j[1] + 0.5, 2 * j[2], 2 * j[3] + 0.5])
    torch.testing.assert_close(out.total, expected)
    assert torch.isnan(out.components["cat_na"]).tolist() == [True, False, True, False]
    # no component present: the composed reward is NaN
    alone = ComposedReward({"cat_na": CatNotApplicable()}, {"cat_na": 1.0})(images, prompts, [{}] * 4)
    assert torch.isnan(alone.total).tolist() == [True, False, True, False]
    assert alone.total[1].item() == 0.5
    out = ComposedReward({"ok": _Const([1.0, float("nan")])}, {"ok": 1.0})(torch.zeros(2, 3, 4, 4), ["a", "b"],
                                                                         [{}, {}])
    assert out.total[0] == 1.0 and torch.isnan(out.total[1])


def test_a_weight_0_metric_does_not_make_a_nan_reward_present():
    """A weight-0 component (a metric, or one a group filter reads) once turned a sample whose only weighted reward
    was NaN into a reward of 0, trained on as a real score."""
    nan = float("nan")
    r = torch.tensor([nan, 1.0, nan, 2.0])
    metric = torch.tensor([0.3, 0.4, nan, 0.6])
    out = compose_rewards({"r": r, "metric": metric}, {"r": 0.5, "metric": 0.0})
    # by hand: 0 and 2 have no weighted component → NaN; 1: 0.5·1 = 0.5; 3: 0.5·2 = 1.0 (the metric adds 0·m)
    assert torch.isnan(out.total).tolist() == [True, False, True, False]
    assert out.total[1].item() == 0.5 and out.total[3].item() == 1.0
    torch.testing.assert_close(out.components["metric"], metric, equal_nan=True)


@pytest.mark.parametrize("weights, expected", [
    # a penalty: the weighted mean's denominator 1 − 1 = 0 made every total NaN
    ({"quality": 1.0, "penalty": -1.0}, [0.5 - 0.25, 0.75 - 1.0]),
    # 0.5·q − 1.0·p: the weighted mean divided by −0.5 and flipped the sign of every total
    ({"quality": 0.5, "penalty": -1.0}, [0.25 - 0.25, 0.375 - 1.0]),
])
def test_negative_weights_are_penalties_not_nan_or_sign_flips(weights, expected):
    q = torch.tensor([0.5, 0.75])
    p = torch.tensor([0.25, 1.0])
    out = compose_rewards({"quality": q, "penalty": p}, weights)
    assert out.total.tolist() == pytest.approx(expected)


def test_one_reward_composes_to_its_weighted_score():
    r = torch.tensor([0.25, -1.5, 7.0])
    assert torch.equal(compose_rewards({"r": r}, {"r": 1.0}).total, r)
    assert compose_rewards({"r": r}, {"r": 2.5}).total.tolist() == [0.625, -3.75, 17.5]


def test_composition_rejects_mismatched_names_and_shapes():
    with pytest.raises(ValueError, match="differ"):
        compose_rewards({"a": torch.zeros(2)}, {"b": 1.0})
    with pytest.raises(ValueError, match="shapes"):
        compose_rewards({"a": torch.zeros(2), "b": torch.zeros(3)}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="shapes"):
        compose_rewards({"a": torch.zeros(2, 2)}, {"a": 1.0})


class _Const:
    name = "const"

    def __init__(self, values):
        self.values = values

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        return torch.tensor(self.values)


class _List(_Const):
    def __call__(self, images, prompts, metadata):
        return list(self.values)


def test_composed_reward_scores_each_and_checks_shapes():
    composed = ComposedReward({"x": _Const([1.0, 2.0]), "y": _Const([3.0, float("nan")])}, {"x": 1.0, "y": 1.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert out.total.tolist() == [4.0, 2.0]  # 1 + 3, and 2 + (y not applicable)
    bad = ComposedReward({"x": _Const([1.0, 2.0, 3.0])}, {"x": 1.0})
    from flowgrpo.rewards.compose import RewardError

    with pytest.raises(RewardError, match="'x' returned shape"):
        bad.score_components(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_an_infinite_reward_is_an_error_naming_the_reward():
    from flowgrpo.rewards.compose import RewardError

    composed = ComposedReward({"bad": _Const([1.0, float("inf")])}, {"bad": 1.0})
    with pytest.raises(RewardError, match=r"reward 'bad' returned an infinite score for sample\(s\) \[1\]"):
        composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_none_is_not_applicable():
    composed = ComposedReward({"x": _Const([0.5, 1.0]), "maybe": _List([None, 2.0])}, {"x": 1.0, "maybe": 2.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert torch.isnan(out.components["maybe"][0]) and out.total.tolist() == [0.5, 5.0]


class _Half(_Const):
    def __call__(self, images, prompts, metadata):
        return torch.tensor(self.values, dtype=torch.bfloat16)


def test_half_precision_scores_are_cast_with_one_warning(caplog):
    """The contract is float32; bfloat16 scores (0.1235 and 0.1236 both round to 0.12353515625) are taken, cast, and
    the reward named once."""
    import logging

    composed = ComposedReward({"half": _Half([0.1235, 0.1236])}, {"half": 1.0})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.compose"):
        out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
        composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert out.total.dtype == torch.float32
    assert out.total[0].item() == out.total[1].item() == 0.12353515625  # bfloat16 ties the two scores
    warned = [r.getMessage() for r in caplog.records if "returned bfloat16 scores" in r.getMessage()]
    assert len(warned) == 1 and "reward 'half'" in warned[0] and "return float32" in warned[0]


def test_composed_reward_shows_the_training_prompts_to_the_rewards_that_ask():
    """The optional ``check_training_prompts`` hook (flowgrpo.rewards.base) reaches every component that has it."""
    seen = []

    class Asks(_Const):
        def check_training_prompts(self, prompts):
            seen.append((self.values, prompts))

    prompts = SimpleNamespace(prompts=["a"], metadata=[{}], source="p.txt")
    ComposedReward({"x": _Const([1.0]), "y": Asks([2.0]), "z": Asks([3.0])}, {"x": 1.0, "y": 1.0, "z": 1.0}) \
        .check_training_prompts(prompts)
    assert seen == [([2.0], prompts), ([3.0], prompts)]


class JpegUnlessCat(JpegCompressibility):
    """JPEG compressibility, documented as NaN ("not applicable") for prompts that mention a cat."""

    name = "jpeg_unless_cat"

    def score(self, images, prompts, metadata):
        s = super().score(images, prompts, metadata)
        return torch.where(torch.tensor(["cat" in p for p in prompts]), torch.nan, s)


class TestDocumentedNanConformance(RewardConformance):
    """A reward with a documented NaN case passes the suite, which checks NaN exactly where documented."""

    reward_factory = JpegUnlessCat
    prompt_factory = staticmethod(lambda n: [f"a dog, picture {i}" for i in range(n)])
    nan_case = staticmethod(lambda: (images_8bit(3), ["a cat", "a dog", "two cats"], [{}] * 3, [True, False, True]))
