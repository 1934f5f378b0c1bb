"""The config's ``--help`` rows: every field's dotted key, default and description; a strategy section lists
every registered strategy's settings, each marked with the strategies that have it."""

from __future__ import annotations

from pydantic import BaseModel

from flowgrpo.algo.chunkers import CHUNKERS, ChunkerConfig
from flowgrpo.algo.filters import GROUP_FILTERS, GroupFilterConfig
from flowgrpo.algo.objectives import OBJECTIVES, ObjectiveConfig
from flowgrpo.algo.policy_losses import POLICY_LOSSES, PolicyLossConfig
from flowgrpo.config.schema import AlgoConfig, Config
from flowgrpo.settings import strategy_rows

#: the strategy sections of the schema: (model, field) -> (registry, settings base)
STRATEGIES = {(Config, "objective"): (OBJECTIVES, ObjectiveConfig), (Config, "chunker"): (CHUNKERS, ChunkerConfig),
              (AlgoConfig, "policy_loss"): (POLICY_LOSSES, PolicyLossConfig),
              (AlgoConfig, "group_filter"): (GROUP_FILTERS, GroupFilterConfig)}


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field, for ``--help``."""
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if (model, name) in STRATEGIES:
            rows += strategy_rows(prefix + name, *STRATEGIES[model, name])
            continue
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe_fields(ann, prefix + name + ".")
            continue
        default = f.default_factory() if f.default_factory is not None else f.default
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump() for d in default]
        rows.append((prefix + name, repr(default), f.description or ""))
    return rows
