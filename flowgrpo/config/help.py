"""The config's ``--help`` rows: every field's dotted key, default and description; a strategy section lists
every registered strategy's settings, each marked with the strategies that read it. The lists of what is registered
(strategies, a registered field's names, the model families, the embedded prompt sets) are read when the help is
shown, so that they name every built-in and every plugin."""

from __future__ import annotations

from pydantic import BaseModel

from flowgrpo.algo.objectives.sde_ratio import NESTED_SECTIONS
from flowgrpo.config.loading import ConfigError, load_config
from flowgrpo.config.schema import STRATEGY_SECTIONS, Config, strategy_problems
from flowgrpo.strategies.settings import flat_dict, registered_names, strategy_rows, with_names

#: the strategy sections of the schema: (model, field) -> (registry, settings base)
STRATEGIES = {(Config, key): value for key, value in STRATEGY_SECTIONS.items()}
#: every strategy section by its dotted key, the SDE-ratio objective's own (``objective.chunker``, …) included
ALL_SECTIONS = {**STRATEGY_SECTIONS, **NESTED_SECTIONS}


def _strategy_rows(prefix: str) -> list[tuple[str, str, str]]:
    """The ``--help`` rows of the strategy section ``prefix`` (of :data:`ALL_SECTIONS`), a strategy section inside
    it (``objective.chunker``) replaced by its own strategies' rows."""
    rows = []
    for row in strategy_rows(prefix, *ALL_SECTIONS[prefix]):
        rows += _strategy_rows(row[0]) if row[0] in ALL_SECTIONS else [row]
    return rows


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field, for ``--help``."""
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if (model, name) in STRATEGIES:
            rows += _strategy_rows(prefix + name)
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
    for prefix in ALL_SECTIONS:
        parent, _, leaf = prefix.rpartition(".")
        holder = _section_of(config, parent + ".x")[0] if parent else config
        section = getattr(holder, leaf, None)
        if section is None:  # a strategy section of a strategy not chosen: its parent's marks cover it
            continue
        cls = type(section)
        for key in keys:
            if key.startswith(prefix + ".") and key != prefix + ".name":
                field = key[len(prefix) + 1:].split(".")[0]
                if f"{prefix}.{field}" in ALL_SECTIONS and field in cls.model_fields:
                    continue  # a strategy section of its own, marked by its own strategy
                if field not in cls.model_fields or field in getattr(cls, "unread", {}):
                    out[key] = f"not read by {prefix} {section.name!r}"
    return out


def help_config(path, overrides) -> tuple[Config, list[tuple[str, list[str]]]]:
    """The config ``--help`` shows for YAML ``path`` and ``overrides``, and what its strategies refuse in it
    (:func:`~flowgrpo.config.schema.strategy_problems`; empty for a config that runs). A config whose only faults
    are those refusals (``objective=nft`` over a config with an SDE-ratio setting, say) is shown with its own
    values, the refused ones marked (:func:`refused`), not replaced by the schema's defaults. Raises
    :class:`~flowgrpo.config.ConfigError` for any other fault."""
    try:
        return load_config(path, overrides), []
    except ConfigError as err:
        config = load_config(path, overrides, strategy_checks=False)  # raises the other faults
        problems = strategy_problems(config)
        if not problems:  # pragma: no cover - a refusal that strategy_problems does not reproduce
            raise err
        return config, problems


def refused(config, problems: list[tuple[str, list[str]]], keys) -> dict[str, str]:
    """Of the dotted ``keys`` (the ``--help`` rows), those a problem line of ``problems`` names (it starts with
    ``key=``, or with a strategy section's name for each key its chosen strategy has): key -> ``"REFUSED: 0.0003
    (objective 'nft' accepts 0.0001)"``, the config's value and, for a plain setting, the value the refusing strategy
    accepts (the field's default: every such refusal is of a setting moved from it)."""
    lines = [(what.split(" cannot run")[0], line) for what, ps in problems for line in ps]
    values = flat_dict(config.model_dump(mode="json"))
    out = {}
    for key in keys:
        for who, line in lines:
            section = max((p for p in ALL_SECTIONS if key.startswith(p + ".")), key=len, default=None)
            if line.startswith(f"{key}="):
                owner, field = _section_of(config, key)
                default = type(owner).model_fields[field].default
                out[key] = f"REFUSED: {values.get(key)!r} ({who} accepts {default!r})"
            elif section is not None and line.startswith(f"{section} ") and key in values:
                out[key] = f"REFUSED: {values[key]!r} ({who} refuses the {section} section)"
            else:
                continue
            break
    return out


def _section_of(config, key: str):
    """(the settings model holding dotted ``key`` in ``config``, its field name)."""
    *parts, field = key.split(".")
    owner = config
    for part in parts:
        owner = getattr(owner, part)
    return owner, field
