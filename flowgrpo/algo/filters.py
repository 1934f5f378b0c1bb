"""Group filters: which of the G' samples drawn per prompt enter the advantages (a phase between reward and
advantage; registered strategies chosen by ``group_filter``).

GFPO (Group Filtered Policy Optimization, Shrivastava et al., arXiv 2508.09726, its GFPO objective): sample a larger
group of G' per prompt, keep the subset S of G samples that a metric prefers, and compute the advantages from the
kept samples only, ``A_i = (r_i − mean_S r) / std_S r`` for i ∈ S and ``A_i = 0`` (no training) outside S. The
extra cost is the rollout and scoring of G' − G samples per prompt; the rejected samples are not trained.

Selections (``group_filter.select``), each a registered rule over one group's metric values:

* ``top``: the G highest (GFPO with a quality metric; NaN ranks last);
* ``bottom``: the G lowest (GFPO's own use: shortest responses; here e.g. a cost such as file size);
* ``max_spread``: the G samples whose metric values have the largest population variance (max-variance
  down-sampling of PODS, Xu et al., arXiv 2504.13818, which proves the optimum takes the i highest and the
  G − i lowest values for some i, so checking the G + 1 such splits is exact).

Online difficulty filtering (``pass_rate``; Bae et al., "Online Difficulty Filtering for Reasoning Oriented
Reinforcement Learning", arXiv 2504.03380, balanced filtering): a group is trained only when its pass rate — the
fraction of its samples whose metric reaches ``pass_threshold`` — lies in [``min_pass_rate``, ``max_pass_rate``].
The paper shows the expected policy improvement is bounded below by the variance of the pass rate, largest at
intermediate difficulty; groups almost every sample of which already passes are left out whole. With a capped
reward (``pass_threshold`` = the cap) a prompt stops training once nearly all its samples pass, instead of
pulling its last stragglers toward the reward model's prototype. No extra samples are drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from flowgrpo.records import Advantages, Rewards
from flowgrpo.strategies.registry import Registry
from flowgrpo.strategies.settings import Section, registered_name

# A selection maps one group's metric values (n,) float64 (NaN allowed) and G to the kept positions (G,) long.
Selection = Callable[[torch.Tensor, int], torch.Tensor]
SELECTIONS: Registry[Selection] = Registry("group-filter selection")


@dataclass(frozen=True)
class FilterResult:
    """Which samples the advantages use.

    Attributes:
        keep: (B,) bool over the gathered batch.
        metrics: ``filter/…`` figures: samples drawn and kept per group, the extra rollout cost, and the metric and
            reward means of the drawn and the kept samples (the filter's effect).
    """

    keep: torch.Tensor
    metrics: dict[str, float]


GroupFilter = Callable[[Rewards, torch.Tensor, object], FilterResult]
GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter")
SelectionName = registered_name(SELECTIONS, "group_filter.select")


class GroupFilterConfig(Section):
    """Settings every group filter has (``group_filter``). A filter with knobs subclasses this, fixes
    ``name`` to its registered name and adds its own fields."""

    name: str = Field(
        "none", description="registered group filter (flowgrpo.algo.filters.GROUP_FILTERS): none; gfpo (Group "
        "Filtered Policy Optimization, arXiv 2508.09726: sample train.group_size = G' per prompt, keep `keep`); "
        "pass_rate (online difficulty filtering, arXiv 2504.03380: train a group only if the fraction of its "
        "samples with metric >= pass_threshold is within [min_pass_rate, max_pass_rate]); a plain name is "
        "shorthand for {name: ...}"
    )

    def check(self, config) -> None:
        """Reject run settings (``config``, the whole :class:`~flowgrpo.config.Config`) this filter cannot work
        with (``ValueError``); nothing by default."""


class NoFilterConfig(GroupFilterConfig):
    """Settings of ``none``."""

    name: Literal["none"] = "none"


class MetricFilterConfig(GroupFilterConfig):
    """Settings of the filters that judge samples by a metric."""

    metric: str = Field(
        "total", description="what ranks or passes the samples: 'total' (the composed reward) or a reward's name "
        "(add a reward used only for filtering with weight 0)"
    )

    def check(self, config) -> None:
        keys = [r.name.split(":")[-1] for r in config.rewards]  # the names the composition gives the rewards
        if self.metric != "total" and self.metric not in keys:
            raise ValueError(f"group_filter.metric={self.metric!r} is neither 'total' nor one of the rewards "
                             f"{keys}; add it to rewards with weight 0")


class GfpoConfig(MetricFilterConfig):
    """Settings of ``gfpo``."""

    name: Literal["gfpo"] = "gfpo"
    keep: int | None = Field(None, ge=2, description="G, samples kept per group (< train.group_size)")
    select: SelectionName = Field(
        "top", description="registered selection (flowgrpo.algo.filters.SELECTIONS): top (highest metric), "
        "bottom (lowest, e.g. a cost), max_spread (the subset of largest metric variance, PODS arXiv 2504.13818)"
    )

    @model_validator(mode="after")
    def _keep_given(self) -> GfpoConfig:
        if self.keep is None:
            raise ValueError("group_filter.keep is needed for the filter 'gfpo'")
        return self

    def check(self, config) -> None:
        if self.keep >= config.train.group_size:
            raise ValueError(f"group_filter.keep={self.keep} must be below train.group_size="
                             f"{config.train.group_size} (the samples drawn per prompt)")
        super().check(config)


class PassRateConfig(MetricFilterConfig):
    """Settings of ``pass_rate``."""

    name: Literal["pass_rate"] = "pass_rate"
    pass_threshold: float | None = Field(
        None, description="a sample passes when its metric is >= this (e.g. a capped reward's cap)"
    )
    min_pass_rate: float = Field(0.0, ge=0, le=1, description="groups passing less often are dropped")
    max_pass_rate: float = Field(1.0, ge=0, le=1, description="groups passing more often are dropped")

    @model_validator(mode="after")
    def _band(self) -> PassRateConfig:
        if self.pass_threshold is None:
            raise ValueError("group_filter.pass_threshold is needed for the filter 'pass_rate'")
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(f"group_filter.min_pass_rate={self.min_pass_rate} exceeds max_pass_rate="
                             f"{self.max_pass_rate}: no group could train")
        return self


def group_filter(name: str, config: type[GroupFilterConfig]) -> Callable[[GroupFilter], GroupFilter]:
    """Register a filter function as ``name`` with its settings model ``config`` (its ``Config``)."""

    def deco(fn: GroupFilter) -> GroupFilter:
        fn.Config = config
        return GROUP_FILTERS.register(name)(fn)

    return deco


def _nan_last(values: torch.Tensor, sign: float) -> torch.Tensor:
    v = sign * values.double()
    return torch.where(torch.isnan(v), torch.full_like(v, -torch.inf), v)


@SELECTIONS.register("top")
def select_top(values: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` highest values (ties: the earlier sample first; NaN last)."""
    return torch.sort(_nan_last(values, 1.0), descending=True, stable=True).indices[:keep]


@SELECTIONS.register("bottom")
def select_bottom(values: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` lowest values (ties: the earlier sample first; NaN last)."""
    return torch.sort(_nan_last(values, -1.0), descending=True, stable=True).indices[:keep]


@SELECTIONS.register("max_spread")
def select_max_spread(values: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` values of largest population variance: the best of the splits "i highest + keep − i lowest"
    (PODS, arXiv 2504.13818). NaN values are taken only when fewer than ``keep`` are valid."""
    valid = torch.nonzero(~torch.isnan(values)).flatten()
    if len(valid) <= keep:
        return select_top(values, keep)
    order = valid[torch.sort(values[valid].double(), stable=True).indices]  # ascending
    best, best_var = None, -1.0
    for i in range(keep + 1):
        idx = torch.cat([order[len(order) - i:], order[: keep - i]]) if i else order[:keep]
        var = float(values[idx].double().var(unbiased=False))
        if var > best_var:
            best, best_var = idx, var
    return best


@group_filter("none", NoFilterConfig)
def no_filter(rewards: Rewards, group_ids: torch.Tensor, settings) -> FilterResult:
    """Keep every sample (plain GRPO)."""
    return FilterResult(keep=torch.ones(len(group_ids), dtype=torch.bool), metrics={})


def _metric(rewards: Rewards, name: str) -> torch.Tensor:
    if name == "total":
        return rewards.total
    if name not in rewards.components:
        raise ValueError(f"group filter metric {name!r} is not a reward component; have {sorted(rewards.components)}")
    return rewards.components[name]


def _mean(x: torch.Tensor) -> float:
    v = x[~torch.isnan(x)].double()
    return float(v.mean()) if v.numel() else float("nan")


@group_filter("gfpo", GfpoConfig)
def gfpo_filter(rewards: Rewards, group_ids: torch.Tensor, settings) -> FilterResult:
    """GFPO (arXiv 2508.09726): keep ``settings.keep`` samples per group by ``settings.metric`` and
    ``settings.select`` (see the module docstring).

    Args:
        rewards: the composed rewards of the gathered batch (B,).
        group_ids: (B,) long.
        settings: :class:`GfpoConfig`.

    Raises:
        ValueError: a group with fewer than ``keep`` samples, or an unknown metric.
    """
    metric = _metric(rewards, settings.metric)
    select = SELECTIONS.get(settings.select)
    keep = torch.zeros(len(group_ids), dtype=torch.bool)
    uniq, counts = torch.unique(group_ids, return_counts=True)
    if bool((counts < settings.keep).any()):
        raise ValueError(f"gfpo keeps {settings.keep} samples per group but some groups have only "
                         f"{int(counts.min())}; raise train.group_size above group_filter.keep")
    for g in uniq:
        members = torch.nonzero(group_ids == g).flatten()
        keep[members[select(metric[members], settings.keep)]] = True
    drawn = float(counts.double().mean())
    return FilterResult(keep=keep, metrics={
        "filter/drawn_per_group": drawn,
        "filter/kept_per_group": float(settings.keep),
        "filter/extra_sample_frac": drawn / settings.keep - 1.0,  # rollout+reward cost over plain GRPO with G
        "filter/metric_mean_drawn": _mean(metric),
        "filter/metric_mean_kept": _mean(metric[keep]),
        "filter/reward_mean_drawn": _mean(rewards.total),
        "filter/reward_mean_kept": _mean(rewards.total[keep]),
    })


@group_filter("pass_rate", PassRateConfig)
def pass_rate_filter(rewards: Rewards, group_ids: torch.Tensor, settings) -> FilterResult:
    """Online difficulty filtering (arXiv 2504.03380): keep the groups whose pass rate is in
    [``settings.min_pass_rate``, ``settings.max_pass_rate``], whole (see the module docstring).

    Args:
        rewards: the composed rewards of the gathered batch (B,).
        group_ids: (B,) long.
        settings: :class:`PassRateConfig`; a sample passes when its ``metric`` value is
            ``>= pass_threshold``; a NaN value never passes, and a group's pass rate is over all its samples.

    Raises:
        ValueError: an unknown metric.
    """
    metric = _metric(rewards, settings.metric).double()
    passed = (metric >= settings.pass_threshold).double()  # NaN compares False
    uniq, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rate = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, passed) / counts  # (groups,)
    kept_groups = (rate >= settings.min_pass_rate) & (rate <= settings.max_pass_rate)
    keep = kept_groups[inverse]
    return FilterResult(keep=keep, metrics={
        "filter/kept_group_frac": float(kept_groups.double().mean()),
        "filter/pass_rate_mean": float(rate.mean()),
        "filter/extra_sample_frac": 0.0,
        "filter/reward_mean_drawn": _mean(rewards.total),
        "filter/reward_mean_kept": _mean(rewards.total[keep]),
    })


def advantages_of_kept(compute: Callable[[Rewards, torch.Tensor], Advantages], rewards: Rewards,
                       group_ids: torch.Tensor, keep: torch.Tensor) -> Advantages:
    """Advantages computed from the kept samples only and scattered back to (B,): a rejected sample gets 0 and
    ``train_mask`` False (GFPO's masked advantage). ``compute(rewards, group_ids)`` is the configured estimator.

    ``zero_spread_frac`` and ``nan_frac`` describe the kept groups and samples (what the estimator saw, 0 when
    nothing is kept); ``learning_frac`` is over all B samples, a rejected one carrying no signal."""
    if bool(keep.all()):
        return compute(rewards, group_ids)
    values = torch.zeros(len(keep), dtype=torch.float32)
    mask = torch.zeros(len(keep), dtype=torch.bool)
    if not bool(keep.any()):  # every group dropped (pass_rate): nothing trains, nothing to normalise
        return Advantages(values=values, train_mask=mask, zero_spread_frac=0.0, nan_frac=0.0, learning_frac=0.0)
    sub = Rewards(components={k: v[keep] for k, v in rewards.components.items()}, weights=rewards.weights,
                  total=rewards.total[keep])
    a = compute(sub, group_ids[keep])
    values = values.to(a.values.dtype)
    values[keep] = a.values
    mask[keep] = a.train_mask
    learning = round(a.learning_frac * int(keep.sum())) / len(keep)  # the kept learning samples, over all B
    return Advantages(values=values, train_mask=mask, zero_spread_frac=a.zero_spread_frac, nan_frac=a.nan_frac,
                      learning_frac=learning)
