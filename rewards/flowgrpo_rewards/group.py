"""Group-wise rewards built on any point-wise one: each scores the G images of one prompt relative to each other.

* :class:`GroupRank`: the rank of each image's base score within its group mapped to [0, 1],
  ``(rank − 1) / (G − 1)`` with rank 1 the lowest; tied scores share their mean rank (fractional ranking), so the
  scores of a group always average 0.5. A rank reward is invariant to any increasing transform of the base score
  (its scale and drift over training do not matter), the motivation of rank-based rewards for preference models.
* :class:`PairwisePreference`: the expected win rate of each image against the others of its group under a
  Bradley–Terry model on the base score (Bradley & Terry 1952, Biometrika 39, eq. 1):
  ``P(i ≻ j) = sigmoid((s_i − s_j) / τ)``, ``reward_i = mean_{j ≠ i} P(i ≻ j)`` in (0, 1). As τ → 0 it is the hard
  win rate (ties count ½) that pairwise-preference GRPO uses as its reward (Pref-GRPO, Wang et al.,
  arXiv 2508.20751, Sec. 3.2); ``temperature=0`` selects it.

A NaN base score (not applicable) stays NaN and takes no part in the others' ranks or comparisons; a group with a
single valid score gets 0.5. ``pickscore_rank`` is :class:`GroupRank` over PickScore.
"""

from __future__ import annotations

import torch

from flowgrpo.rewards.base import BaseReward, modalities_of
from flowgrpo.rewards.registry import load_reward


class _OverBase(BaseReward):
    """A group-wise reward over a point-wise ``base`` reward (a registered name or 'module:attr')."""

    group_wise = True

    def __init__(self, base: str, base_kwargs: dict | None = None) -> None:
        self.base, self.base_origin = load_reward(base, **(base_kwargs or {}))
        if getattr(self.base, "group_wise", False):
            raise ValueError(f"base reward {base!r} is itself group-wise; give a point-wise reward")
        self.name = f"{self.base.name}_{self.suffix}"
        self.modalities = modalities_of(self.base)  # images or videos, as the base scores them

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.base.setup(device)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        s = torch.as_tensor(self.base(images, prompts, metadata), dtype=torch.float64).cpu()
        out = torch.full(s.shape, float("nan"), dtype=torch.float64)
        valid = ~torch.isnan(s)
        if int(valid.sum()) == 1:
            out[valid] = 0.5
        elif bool(valid.any()):
            out[valid] = self.relative(s[valid])
        return out.float()

    def relative(self, s: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GroupRank(_OverBase):
    """Rank within the group mapped to [0, 1] (module docstring).

    Args:
        base: a point-wise reward: registered name or 'module:attr'.
        base_kwargs: its keyword arguments.

    Calling it: the G images of one prompt (3, H, W each, float in [0, 1]) → (G,) float32 in [0, 1].
    """

    suffix = "rank"

    def relative(self, s: torch.Tensor) -> torch.Tensor:
        below = (s[None, :] < s[:, None]).sum(1).double()  # scores strictly below each one
        ties = (s[None, :] == s[:, None]).sum(1).double()  # including itself
        rank = below + (ties + 1) / 2  # 1-based mean rank of the tie block
        return (rank - 1) / (len(s) - 1)


class PairwisePreference(_OverBase):
    """Bradley–Terry expected win rate within the group (module docstring).

    Args:
        base: a point-wise reward: registered name or 'module:attr'.
        base_kwargs: its keyword arguments.
        temperature: τ > 0 in the base score's units, or 0 for the hard win rate (ties ½).

    Raises:
        ValueError: a negative temperature.
    """

    suffix = "preference"

    def __init__(self, base: str, base_kwargs: dict | None = None, temperature: float = 1.0) -> None:
        if not float(temperature) >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        self.temperature = float(temperature)
        super().__init__(base, base_kwargs)

    def relative(self, s: torch.Tensor) -> torch.Tensor:
        diff = s[:, None] - s[None, :]  # (G, G): s_i − s_j
        if self.temperature > 0:
            p = torch.sigmoid(diff / self.temperature)
        else:
            p = (diff > 0).double() + 0.5 * (diff == 0).double()
        n = len(s)
        return (p.sum(1) - p.diagonal()) / (n - 1)


def pickscore_rank(**pickscore_kwargs) -> GroupRank:
    """``pickscore_rank``: :class:`GroupRank` over PickScore (keyword arguments go to ``PickScoreReward``)."""
    return GroupRank("flowgrpo_rewards.pickscore:PickScoreReward", pickscore_kwargs)
