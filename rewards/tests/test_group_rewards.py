"""Group-wise rewards (flowgrpo_rewards.group) and their place in scoring, composition and GDPO.

Expected values are worked out here from the definitions: fractional rank (rank − 1)/(G − 1) with tied scores
sharing their mean rank; Bradley–Terry win rate mean_{j≠i} sigmoid((s_i − s_j)/τ) (Bradley & Terry 1952).
"""

from __future__ import annotations

import math

import pytest
import torch
from flowgrpo_rewards.group import GroupRank, PairwisePreference

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.rewards.base import BaseReward, score_groups
from flowgrpo.rewards.compose import ComposedReward
from flowgrpo.testing.rewards import RewardConformance

BASE = "flowgrpo_rewards.jpeg:JpegIncompressibility"


class Brightness(BaseReward):
    """Mean pixel value; NaN for an image whose first pixel is exactly 0 (to test NaN handling)."""

    name = "brightness"

    def score(self, images, prompts, metadata):
        s = images.float().mean(dim=(1, 2, 3)).cpu()
        return torch.where(images[:, 0, 0, 0].cpu() == 0, torch.nan, s)


BRIGHT = f"{__name__}:Brightness"


def _images(values):
    return torch.stack([torch.full((3, 4, 4), v) for v in values])


def test_rank_with_ties_and_nan():
    r = GroupRank(BRIGHT)
    r.setup("cpu")
    # scores 0.2, 0.6, 0.4, 0.6, NaN → ranks 1, 3.5, 2, 3.5 among 4 valid → (r−1)/3
    s = r(_images([0.2, 0.6, 0.4, 0.6, 0.0]), ["p"] * 5, [{}] * 5)
    torch.testing.assert_close(s[:4], torch.tensor([0.0, 2.5 / 3, 1 / 3, 2.5 / 3]))
    assert math.isnan(float(s[4]))
    assert float(s[:4].mean()) == pytest.approx(0.5)
    one = r(_images([0.3, 0.0]), ["p"] * 2, [{}] * 2)
    assert float(one[0]) == 0.5 and math.isnan(float(one[1]))
    assert r.name == "brightness_rank" and r.group_wise


def test_pairwise_preference_is_the_bradley_terry_win_rate():
    tau = 0.1
    r = PairwisePreference(BRIGHT, temperature=tau)
    r.setup("cpu")
    v = [0.2, 0.5, 0.45]
    s = r(_images(v), ["p"] * 3, [{}] * 3)
    for i in range(3):
        expected = sum(1 / (1 + math.exp(-(v[i] - v[j]) / tau)) for j in range(3) if j != i) / 2
        assert float(s[i]) == pytest.approx(expected, rel=1e-5)
    hard = PairwisePreference(BRIGHT, temperature=0)
    hard.setup("cpu")
    torch.testing.assert_close(hard(_images([0.2, 0.5, 0.5]), ["p"] * 3, [{}] * 3), torch.tensor([0.0, 0.75, 0.75]))
    with pytest.raises(ValueError, match="temperature"):
        PairwisePreference(BRIGHT, temperature=-1)
    with pytest.raises(ValueError, match="itself group-wise"):
        GroupRank("flowgrpo_rewards.group:pickscore_rank")


def test_score_groups_splits_interleaved_groups_and_rejects_mixed_prompts():
    r = GroupRank(BRIGHT)
    r.setup("cpu")
    images = _images([0.1, 0.9, 0.5, 0.2, 0.3, 0.4])
    gids = torch.tensor([0, 1, 0, 1, 0, 1])
    prompts = ["a", "b", "a", "b", "a", "b"]
    s = score_groups(r, images, prompts, [{}] * 6, gids)
    torch.testing.assert_close(s, torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 0.5]))
    with pytest.raises(ValueError, match="mixes prompts"):
        score_groups(r, images, ["a"] * 5 + ["c"], [{}] * 6, gids)


def test_composition_and_gdpo_with_a_group_wise_reward():
    rank = GroupRank(BRIGHT)
    bright = Brightness()
    composed = ComposedReward({"rank": rank, "bright": bright}, {"rank": 1.0, "bright": 0.5})
    composed.setup("cpu")
    images = _images([0.1, 0.9, 0.5, 0.2, 0.3, 0.4])
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = composed(images, ["a"] * 3 + ["b"] * 3, [{}] * 6, gids)
    torch.testing.assert_close(rewards.components["rank"], torch.tensor([0.0, 1.0, 0.5, 0.0, 0.5, 1.0]))
    expected_total = rewards.components["rank"] + 0.5 * images.mean(dim=(1, 2, 3))  # the weighted sum
    torch.testing.assert_close(rewards.total, expected_total)
    adv = compute_advantages(rewards, gids, multi_reward="gdpo")
    # GDPO: each component normalised in its groups; rank and brightness order agree in each group, so the
    # advantages keep that order
    assert adv.values[1] > adv.values[2] > adv.values[0] and adv.values[5] > adv.values[4] > adv.values[3]


class TestGroupRankConformance(RewardConformance):
    reward_factory = staticmethod(lambda: GroupRank(BASE))


class TestPairwisePreferenceConformance(RewardConformance):
    reward_factory = staticmethod(lambda: PairwisePreference(BASE, temperature=5.0))


class TestPointwiseStillCovered(RewardConformance):
    """The point-wise path of the suite is unchanged by the group-wise clauses."""

    reward_factory = staticmethod(lambda: Brightness())
    nan_case = None
    image_factory = staticmethod(lambda n, h, w, g: torch.rand(n, 3, h, w, generator=g) * 0.9 + 0.05)


