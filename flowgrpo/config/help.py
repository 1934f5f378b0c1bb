"""The config's ``--help`` rows: every field's dotted key, default and description; a strategy section lists
every registered strategy's settings, each marked with the strategies that read it. The lists of what is registered
(strategies, a registered field's names, the model families, the embedded prompt sets) are read when the help is
shown, so that they name every built-in and every plugin."""

from __future__ import annotations

from pydantic import BaseModel

from flowgrpo.algo.chunkers import CHUNKERS, ChunkerConfig
from flowgrpo.algo.filters import GROUP_FILTERS, GroupFilterConfig
from flowgrpo.algo.objectives import OBJECTIVES, ObjectiveConfig
from flowgrpo.algo.policy_losses import POLICY_LOSSES, PolicyLossConfig
from flowgrpo.config.schema import STRATEGY_SECTIONS, AlgoConfig, Config
from flowgrpo.settings import registered_names, strategy_rows, with_names

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
        text = f.description or ""
        if prefix + name in DERIVED:
            text = f"{text}: {DERIVED[prefix + name]()}"
        rows.append((prefix + name, repr(default), with_names(text, registered_names(f))))
    return rows


def _model_families() -> str:
    """The pipeline classes with an adapter and the embedded models, as registered now."""
    from flowgrpo.models import ADAPTERS, EMBEDDED_MODELS

    return f"pipeline classes {', '.join(ADAPTERS.names())}; embedded models {', '.join(sorted(EMBEDDED_MODELS))}"


def _prompt_sets() -> str:
    """The embedded prompt sets."""
    from flowgrpo.data.prompts import EMBEDDED

    return f"embedded sets {', '.join(sorted(EMBEDDED))}"


#: descriptions completed when ``--help`` is shown, from what is registered then: dotted key -> the list's text
DERIVED = {"model.pretrained": _model_families, "data.train_prompts": _prompt_sets, "data.eval_prompts": _prompt_sets}


def not_read(config, keys) -> dict[str, str]:
    """For the validated run ``config``: of the dotted ``keys`` (the ``--help`` rows), those of a strategy section
    that its chosen strategy does not have, or has but declares ``unread``: key -> ``"not read by objective
    'refl'"`` (the value shown in place of another strategy's default)."""
    out = {}
    for prefix in STRATEGY_SECTIONS:
        section = config
        for part in prefix.split("."):
            section = getattr(section, part)
        cls = type(section)
        for key in keys:
            if key.startswith(prefix + ".") and key != prefix + ".name":
                field = key[len(prefix) + 1:]
                if field not in cls.model_fields or field in getattr(cls, "unread", {}):
                    out[key] = f"not read by {prefix} {section.name!r}"
    return out
