"""The settings base every config section and every strategy's settings model derive from, and its helpers.

:class:`Section` refuses unknown keys, validates assignments and never takes a boolean for an integer. A
*strategy section* (``objective:``, ``objective.chunker:``, ``objective.policy_loss:``, ``group_filter:``) is
validated by :func:`strategy_settings` against the settings model of the strategy its ``name`` selects, so a knob
of another strategy is an error naming its owner. This module imports nothing of flowgrpo above the registry.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from flowgrpo.strategies.registry import Registry, did_you_mean


def _takes_int(ann) -> bool:
    """Whether a field annotation admits an integer but not a boolean: ``int``, ``int | None``, ``Literal[0, 1]``."""
    if ann is int:
        return True
    args = typing.get_args(ann)
    if typing.get_origin(ann) is Literal:
        return any(type(a) is int for a in args) and not any(isinstance(a, bool) for a in args)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return bool not in args and any(_takes_int(a) for a in args)
    return False


def _takes_float(ann) -> bool:
    """Whether a field annotation admits a float but not a boolean: ``float``, ``float | None``."""
    if ann is float:
        return True
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return bool not in args and any(_takes_float(a) for a in args)
    return False


def _takes_only_bool(ann) -> bool:
    """Whether a field annotation is a boolean and nothing else but None: ``bool``, ``bool | None``."""
    if ann is bool:
        return True
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = typing.get_args(ann)
        return bool in args and all(a is bool or a is type(None) for a in args)
    return False


def _bool_for_int(ann, value, takes=_takes_int) -> bool:
    """Whether ``value`` puts a boolean where ``ann`` wants an integer (``takes``: :func:`_takes_float` for a
    float): the value itself, or an item of a list or tuple field (``list[int]``, ``tuple[float, float]``)."""
    if isinstance(value, bool):
        return takes(ann)
    if not isinstance(value, list | tuple):
        return False
    options = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
    items = [a for o in options if typing.get_origin(o) in (list, tuple, set, frozenset) for a in typing.get_args(o)]
    return any(_bool_for_int(a, v, takes) for a in items for v in value)


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, a boolean is never taken for an
    integer or a float (pydantic's lax mode would read ``true`` as 1 and 1.0), and a boolean field takes only
    ``true`` or ``false`` (lax mode would read 1, 1.0, "yes" or "on" as true)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_int(cls, value, info):
        """Raises ``PydanticCustomError`` (type ``bool_not_int`` or ``bool_not_float``, located at the field) for a
        boolean given to an integer or float field (or as an item of a list or tuple of them), and (type
        ``bool_needed``) for anything but a boolean (or None where allowed) given to a boolean field; every other
        value passes unchanged."""
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is not None and _takes_only_bool(field.annotation) and not (value is None or isinstance(value, bool)):
            raise PydanticCustomError("bool_needed", "true or false is needed")
        if field is not None and _bool_for_int(field.annotation, value):
            raise PydanticCustomError("bool_not_int", "an integer is needed, got a boolean; write the number itself")
        if field is not None and _bool_for_int(field.annotation, value, _takes_float):
            raise PydanticCustomError("bool_not_float", "a number is needed, got a boolean; write the number itself")
        return value


@dataclasses.dataclass(frozen=True)
class RegisteredIn:
    """Field metadata of a :func:`registered_name` field: the registry its values come from (``--help`` lists the
    names registered when it is shown, :func:`registered_names`)."""

    registry: Registry


def registered_names(field) -> list[str] | None:
    """The names registered now in the registry of a :func:`registered_name` field (a pydantic ``FieldInfo``),
    else None."""
    marks = [m for m in field.metadata if isinstance(m, RegisteredIn)]
    return marks[0].registry.names() if marks else None


def with_names(text: str, names: list[str] | None) -> str:
    """A ``--help`` description followed by the names a registry holds now (unchanged without names)."""
    return f"{text} (registered: {', '.join(names)})" if names else text


def registered_name(registry: Registry, key: str):
    """A ``str`` field type whose value must be registered in ``registry`` when validated (plugins register
    before the config is built); otherwise a ValueError naming ``key`` with the registry's own message (valid
    names, the closest). The field carries :class:`RegisteredIn` (``--help`` lists the registered names)."""

    def check(name: str) -> str:
        try:
            registry.get(name)
        except KeyError as err:
            raise ValueError(f"{key}: {err.args[0]}") from None
        return registry.canonical(name)

    return Annotated[str, AfterValidator(check), RegisteredIn(registry)]


def settings_class(registry: Registry, name: str, base: type[Section]) -> type[Section]:
    """The settings model of the strategy registered as ``name``: its ``Config`` attribute, else ``base`` (a
    plugin strategy without knobs). Raises ``KeyError`` listing the registered names."""
    return getattr(registry.get(name), "Config", base)


def strategy_settings(value, *, prefix: str, registry: Registry, base: type[Section]) -> Section:
    """Validate a strategy section: ``value`` is a plain strategy name (shorthand for ``{name: value}``) or a
    mapping whose ``name`` (default: ``base``'s) selects the settings model (:func:`settings_class`); an alias of
    the registry (:meth:`~flowgrpo.strategies.registry.Registry.alias`) is replaced by the name it stands for.

    Args:
        prefix: the section's dotted key (``objective.chunker``, ``group_filter``), for messages.
        registry: the strategies; ``registry.what`` names the kind in messages.
        base: the settings every strategy of the kind has (its ``name`` field's default is the default strategy).

    Raises:
        ValueError: an unknown strategy (listing the registered ones); every key of another strategy (naming the
            strategies that read it and how to switch) and every unknown key (its closest key), one line each.
    """
    if isinstance(value, BaseModel):
        return value
    if not isinstance(value, str | dict):
        raise ValueError(f"{prefix}={value!r}: a {registry.what} section is a name or a mapping with a 'name' "
                         f"(registered: {', '.join(registry.names())}); a section cannot be removed, only replaced")
    section = {"name": value} if isinstance(value, str) else dict(value)
    name = section.get("name", base.model_fields["name"].default)
    if isinstance(name, str) and name != registry.canonical(name):  # a common name (``grpo``): the registered one
        name = section["name"] = registry.canonical(name)
    try:
        settings = settings_class(registry, name, base)
    except KeyError as err:
        raise ValueError(f"{prefix}.name: {err.args[0]}") from None
    foreign = [_foreign_key(prefix, key, section[key], name, settings, registry, base)
               for key in section if key not in settings.model_fields]
    refuse(foreign, f"{prefix} {name!r} has settings of other strategies")
    return settings.model_validate(section)


def _foreign_key(prefix: str, key: str, value, name: str, settings: type[Section], registry: Registry,
                 base: type[Section]) -> str:
    """Why ``key`` cannot be in the section of strategy ``name``: it is the knob of other strategies (those whose
    settings have it and do not declare it ``unread``), or a typo."""
    owners = [n for n in registry if key in settings_class(registry, n, base).model_fields
              and key not in getattr(settings_class(registry, n, base), "unread", {})]
    if not owners:
        close = did_you_mean(key, settings.model_fields).replace(" (", "; ").rstrip(")")
        return (f"unknown config key '{prefix}.{key}' for {registry.what} {name!r} (its keys: "
                f"{sorted(settings.model_fields)}){close}")
    them = " / ".join(owners)
    example = f"{{name: {owners[0]}, {key}: {json.dumps(value, default=str)}}}"
    return (f"{prefix}.{key}={value!r} is read only by {prefix}.name={them}, but {prefix}.name is {name!r}: remove "
            f"the setting, or switch to {them} by replacing the whole section, e.g. the override "
            f"'{prefix}={example}' (a config that extends another merges its sections key by key over the base's: "
            f"there a plain name, '{prefix}: {owners[0]}', replaces the base's section)")


def _settings_block(annotation) -> bool:
    """Whether a strategy's field is a block of plain settings (a :class:`Section` without a ``name``: not a nested
    strategy section such as ``objective.chunker``, which ``--help`` expands by its own registry)."""
    return isinstance(annotation, type) and issubclass(annotation, Section) and "name" not in annotation.model_fields


def strategy_rows(prefix: str, registry: Registry, base: type[Section]) -> list[tuple[str, str, str]]:
    """``--help`` rows (dotted key, default, description) of a strategy section: every registered strategy's
    settings (a key several have: the default strategy's field, else the first's), each key marked with the
    strategies that have it (``name`` shows the default strategy and lists the
    registered ones; a :func:`registered_name` field lists its registry's names)."""
    owners: dict[str, list[str]] = {}
    fields = {}
    for strategy in registry:
        settings = settings_class(registry, strategy, base)
        for key, f in settings.model_fields.items():
            if key not in getattr(settings, "unread", {}):  # a field the strategy has but never reads
                owners.setdefault(key, []).append(strategy)
            fields.setdefault(key, f)
    if base.model_fields["name"].default in registry:  # a shared field shows the default strategy's default
        fields.update((k, f) for k, f in settings_class(registry, base.model_fields["name"].default,
                                                        base).model_fields.items() if k in fields)
    rows = []
    for key, f in fields.items():
        where = "" if key == "name" else f"[{', '.join(owners.get(key, []))}] "
        if _settings_block(f.annotation):  # a block of plain settings (DMD2's gan): a row for each of them
            rows += [(f"{prefix}.{key}.{k}", repr(sub.get_default(call_default_factory=True)), where + (
                sub.description or "")) for k, sub in f.annotation.model_fields.items()]
            continue
        default = repr(base.model_fields["name"].default) if key == "name" else repr(f.default)
        text = f.description or (base.model_fields[key].description if key in base.model_fields else "") or ""
        names = registry.names() if key == "name" else registered_names(f)
        rows.append((f"{prefix}.{key}", default, where + with_names(text, names)))
    return rows


def refuse(problems: list[str], what: str) -> None:
    """Raise one ``ValueError`` for every problem of a config at once, so that it is fixed in one go: the problem's
    own line when there is one, else ``what`` and the count, then one line each; nothing when ``problems`` is
    empty."""
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{what}: {len(problems)} settings to change, one a line:\n"
                         + "\n".join(f"  - {p}" for p in problems))


class ConfigError(ValueError):
    """A configuration that cannot run: unknown key, wrong type, or impossible combination (also exported as
    ``flowgrpo.config.ConfigError``; defined here, below every layer that raises it)."""


def save_config(config: BaseModel, path: str | Path) -> None:
    """Write resolved settings (a run's config: every field, defaults included) as YAML."""
    from flowgrpo.writing.outputs import write_text_file

    write_text_file(path, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def flat_dict(d: dict, prefix: str = "") -> dict:
    """A nested dict (a dumped config) as ``{"dotted.key": value}``; dicts are flattened, other values kept."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
