"""Specification of the group filters (flowgrpo.algo.filters): GFPO (arXiv 2508.09726) keeps G of the G' samples
of each group by a metric, and the advantages come from the kept samples only; max_spread is PODS' max-variance
down-sampling (arXiv 2504.13818), checked here against brute force over all subsets."""

from __future__ import annotations

import itertools

import pytest
import torch

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.algo.filters import GROUP_FILTERS, SELECTIONS, GfpoConfig, PassRateConfig, advantages_of_kept
from flowgrpo.records import Rewards


def test_top_and_bottom_with_nan_last():
    v = torch.tensor([0.3, float("nan"), 0.9, 0.1, 0.9])
    assert sorted(SELECTIONS.get("top")(v, 2).tolist()) == [2, 4]
    assert sorted(SELECTIONS.get("bottom")(v, 2).tolist()) == [0, 3]
    assert 1 not in SELECTIONS.get("top")(v, 4).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_max_spread_is_the_max_variance_subset(seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(7, generator=g, dtype=torch.float64)
    for keep in (2, 3, 4):
        best_var = max(float(v[list(c)].var(unbiased=False)) for c in itertools.combinations(range(7), keep))
        got = SELECTIONS.get("max_spread")(v, keep)
        assert len(set(got.tolist())) == keep
        assert float(v[got].var(unbiased=False)) == pytest.approx(best_var, rel=1e-12)


def _rewards(total, **components):
    comps = {"r": torch.tensor(total)} | {k: torch.tensor(v) for k, v in components.items()}
    return Rewards(components=comps, weights={k: (1.0 if k == "r" else 0.0) for k in comps},
                   total=torch.tensor(total))


def test_gfpo_keeps_by_another_reward_and_normalises_over_the_kept():
    # two groups of G' = 4; keep 2 by the lowest "cost" (e.g. an image-size proxy), GFPO's own use
    total = [1.0, 0.0, 0.5, 0.2, 0.3, 0.9, 0.9, 0.1]
    cost = [5.0, 1.0, 2.0, 9.0, 0.5, 0.1, 7.0, 3.0]
    rewards = _rewards(total, cost=cost)
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    res = GROUP_FILTERS.get("gfpo")(rewards, gids, GfpoConfig(name="gfpo", keep=2, metric="cost", select="bottom"))
    assert res.keep.tolist() == [False, True, True, False, True, True, False, False]
    assert res.metrics["filter/extra_sample_frac"] == 1.0
    assert res.metrics["filter/metric_mean_kept"] == pytest.approx((1 + 2 + 0.5 + 0.1) / 4)

    def compute(r, g):
        return compute_advantages(r, g)

    adv = advantages_of_kept(compute, rewards, gids, res.keep)
    # kept group 0: rewards (0.0, 0.5): mean 0.25, population std 0.25 → A = ∓0.25/(0.25+1e-4)
    a = 0.25 / (0.25 + 1e-4)
    b = 0.3 / (0.3 + 1e-4)  # kept group 1: (0.3, 0.9)
    torch.testing.assert_close(adv.values, torch.tensor([0.0, -a, a, 0.0, -b, b, 0.0, 0.0]))
    assert adv.train_mask.tolist() == res.keep.tolist()


def test_gfpo_refuses_groups_smaller_than_keep():
    with pytest.raises(ValueError, match="only 2"):
        GROUP_FILTERS.get("gfpo")(_rewards([0.0, 1.0]), torch.tensor([0, 0]),
                                  GfpoConfig(name="gfpo", keep=3))


def test_config_checks_keep_and_metric():
    from flowgrpo.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="keep=4 must be below train.group_size=4"):
        build_config({}, ["group_filter.name=gfpo", "group_filter.keep=4"])
    with pytest.raises(ConfigError, match="add it to rewards with weight 0"):
        build_config({}, ["group_filter.name=gfpo", "group_filter.keep=2", "group_filter.metric=x"])
    with pytest.raises(ConfigError, match="keep is needed"):
        build_config({}, ["group_filter.name=gfpo"])


def test_pass_rate_keeps_whole_groups_of_intermediate_pass_rate():
    """Balanced online difficulty filtering (arXiv 2504.03380): pass rates counted by hand per group."""
    total = [0.8, 0.8, 0.8, 0.8,   # group 0: 4/4 pass → dropped (> 0.75)
             0.8, 0.8, 0.8, 0.2,   # group 1: 3/4 = 0.75 → kept (bounds inclusive)
             0.8, 0.1, 0.2, float("nan"),  # group 2: 1/4 (NaN never passes) → kept
             0.1, 0.2, 0.3, 0.4]   # group 3: 0/4 → dropped (< 0.25)
    gids = torch.arange(4).repeat_interleave(4)
    cfg = PassRateConfig(name="pass_rate", pass_threshold=0.8, min_pass_rate=0.25, max_pass_rate=0.75)
    res = GROUP_FILTERS.get("pass_rate")(_rewards(total), gids, cfg)
    assert res.keep.tolist() == [False] * 4 + [True] * 8 + [False] * 4
    assert res.metrics["filter/kept_group_frac"] == 0.5
    assert res.metrics["filter/pass_rate_mean"] == pytest.approx((1 + 0.75 + 0.25 + 0) / 4)
    assert res.metrics["filter/extra_sample_frac"] == 0.0
    # the kept groups' advantages are exactly their own GRPO advantages; the dropped ones are not trained
    adv = advantages_of_kept(lambda r, g: compute_advantages(r, g), _rewards(total), gids, res.keep)
    assert adv.train_mask[:4].tolist() == [False] * 4 and adv.train_mask[12:].tolist() == [False] * 4
    alone = compute_advantages(_rewards(total[4:8]), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv.values[4:8], alone.values)


def test_pass_rate_config_needs_a_threshold_and_an_ordered_band():
    from flowgrpo.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="pass_threshold is needed"):
        build_config({}, ["group_filter.name=pass_rate"])
    with pytest.raises(ConfigError, match="min_pass_rate=0.8 exceeds max_pass_rate=0.5"):
        build_config({}, ["group_filter.name=pass_rate", "group_filter.pass_threshold=1",
                          "group_filter.min_pass_rate=0.8", "group_filter.max_pass_rate=0.5"])
    with pytest.raises(ConfigError, match="max_pass_rate=0.5 is read only by group_filter.name=pass_rate"):
        build_config({}, ["group_filter.max_pass_rate=0.5"])
    with pytest.raises(ConfigError, match="pass_threshold=0.5 is read only by"):
        build_config({}, ["group_filter.name=gfpo", "group_filter.keep=2",
                          "group_filter.pass_threshold=0.5"])


def test_learning_frac_under_a_filter_counts_the_kept_share_of_all_samples():
    """adv/learning_frac is the share of all B samples with a learning signal: GFPO keeping 2 of 4 per group,
    every kept group with spread, is 0.5 (it logged 1.0: the kept advantages were rebuilt without the field)."""
    total = [1.0, 0.0, 0.5, 0.2, 0.3, 0.9, 0.7, 0.1]  # kept: (1.0, 0.5), (0.9, 0.7)
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    res = GROUP_FILTERS.get("gfpo")(_rewards(total), gids, GfpoConfig(keep=2))
    adv = advantages_of_kept(lambda r, g: compute_advantages(r, g), _rewards(total), gids, res.keep)
    assert int(res.keep.sum()) == 4 and adv.learning_frac == 0.5  # 4 of 8 samples, each in a group with spread
    # one kept group without spread: 2 of 8 samples learn
    flat = [1.0, 1.0, 0.0, 0.0, 0.3, 0.9, 0.7, 0.1]  # kept: (1.0, 1.0) flat, (0.9, 0.7)
    res = GROUP_FILTERS.get("gfpo")(_rewards(flat), gids, GfpoConfig(keep=2))
    adv = advantages_of_kept(lambda r, g: compute_advantages(r, g), _rewards(flat), gids, res.keep)
    assert adv.learning_frac == 0.25 and adv.zero_spread_frac == 0.5


def test_a_pass_rate_filter_dropping_every_group_learns_nothing_and_gives_no_nan():
    total = [0.9, 0.9, 0.9, 0.9, 0.95, 0.9, 0.85, 0.99]  # every sample passes: every group's rate 1 > 0.5
    gids = torch.arange(2).repeat_interleave(4)
    cfg = PassRateConfig(pass_threshold=0.8, max_pass_rate=0.5)
    res = GROUP_FILTERS.get("pass_rate")(_rewards(total), gids, cfg)
    assert not bool(res.keep.any())
    adv = advantages_of_kept(lambda r, g: compute_advantages(r, g), _rewards(total), gids, res.keep)
    assert adv.learning_frac == 0.0 and adv.zero_spread_frac == 0.0 and adv.nan_frac == 0.0
    assert torch.equal(adv.values, torch.zeros(8)) and not bool(adv.train_mask.any())
