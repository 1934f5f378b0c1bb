"""Weighted composition of several rewards into one :class:`~flowgrpo.records.Rewards` record.

NaN semantics (docs/design.md, "Advantages and loss"): a NaN component means "not applicable to this sample";
the composed reward is the weighted mean of the components present,
``Σ_present w_i·r_i / Σ_present w_i``; a sample with no component
present has a NaN composed reward, which the advantage estimator leaves out of its group's statistics. With one
reward of weight w the composed reward is that reward itself.
"""

from __future__ import annotations

import logging

import torch

from flowgrpo.records import Rewards
from flowgrpo.rewards.base import is_group_wise, score_groups

logger = logging.getLogger(__name__)


def compose_rewards(components: dict[str, torch.Tensor], weights: dict[str, float]) -> Rewards:
    """Compose (B,) component scores with ``weights``. Raises ValueError on mismatched names or shapes."""
    if set(components) != set(weights):
        raise ValueError(f"reward components {sorted(components)} and weights {sorted(weights)} differ")
    shapes = {k: tuple(v.shape) for k, v in components.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"every reward must return a (B,) tensor, got shapes {shapes}")
    num = None
    den = None
    for name, r in components.items():
        r = r.detach().float().cpu()
        present = ~torch.isnan(r)
        w = float(weights[name])
        term = torch.where(present, w * r, torch.zeros_like(r))
        wt = present.float() * w
        num = term if num is None else num + term
        den = wt if den is None else den + wt
    total = torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.nan)
    comps = {k: v.detach().float().cpu() for k, v in components.items()}
    return Rewards(components=comps, weights=dict(weights), total=total)


class ComposedReward:
    """Several rewards with weights; calls each and composes.

    Args:
        rewards: name → reward object (the :class:`~flowgrpo.rewards.base.Reward` protocol).
        weights: name → weight.
    """

    def __init__(self, rewards: dict, weights: dict[str, float]) -> None:
        self.rewards = rewards
        self.weights = weights

    def setup(self, device: torch.device) -> None:
        for r in self.rewards.values():
            r.setup(device)

    @property
    def group_wise(self) -> list[str]:
        """Names of the components that score whole groups."""
        return [k for k, r in self.rewards.items() if is_group_wise(r)]

    def score_components(self, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                         group_ids: torch.Tensor | None = None):
        """name → (B,) float32 scores of every component; ``group_ids`` (B,) is needed when a component is
        group-wise. Raises ValueError for bad shapes, infinite scores or missing group ids."""
        if self.group_wise and group_ids is None:
            raise ValueError(f"rewards {self.group_wise} score whole groups: pass group_ids")
        out = {}
        for name, reward in self.rewards.items():
            raw = score_groups(reward, images, prompts, metadata, group_ids) if is_group_wise(reward) else \
                reward(images, prompts, metadata)
            scores = torch.as_tensor(raw, dtype=torch.float32).cpu()
            if scores.shape != (images.shape[0],):
                raise ValueError(
                    f"reward {name!r} returned shape {tuple(scores.shape)}, expected ({images.shape[0]},)"
                )
            if bool(torch.isinf(scores).any()):
                raise ValueError(f"reward {name!r} returned an infinite score: {scores.tolist()} (NaN means "
                                 "'not applicable'; an infinite reward has no meaning)")
            out[name] = scores
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                 group_ids: torch.Tensor | None = None) -> Rewards:
        return compose_rewards(self.score_components(images, prompts, metadata, group_ids), self.weights)
