"""Reading a run's config: ``load_config(path, overrides)`` reads a YAML file (``base:`` files first), applies
dotted ``key=value`` overrides (values parsed as YAML, so ``train.lr=1e-4`` is a float), validates every field
against the schema (:mod:`flowgrpo.config.schema`), and raises :class:`ConfigError` with the offending key, what
is allowed, and the closest valid key for a typo.
"""

from __future__ import annotations

import copy
import difflib
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from flowgrpo.algo.filters import GROUP_FILTERS, GroupFilterConfig
from flowgrpo.algo.objectives import OBJECTIVES, ObjectiveConfig, SdeRatioConfig, objective_config_class
from flowgrpo.algo.policy_losses import loss_config_class
from flowgrpo.config.schema import Config
from flowgrpo.strategies.settings import ConfigError, settings_class


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of the schema; the fields of list items appear under the list's name."""
    keys = []
    for name, f in model.model_fields.items():
        keys.append(prefix + name)
        for ann in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                keys += _valid_keys(ann, prefix + name + ".")
                break
    return keys


#: names other trainers (trl, diffusers scripts, Flow-GRPO, DanceGRPO) give to our keys: leaf -> our leaf
ALIASES = {
    "learning_rate": "lr", "lr_rate": "lr", "epochs": "num_epochs", "num_train_epochs": "num_epochs",
    "max_epochs": "num_epochs", "num_generations": "group_size", "num_images_per_prompt": "group_size",
    "group": "group_size", "batch_size": "rollout_batch_size", "sample_batch_size": "rollout_batch_size",
    "per_device_train_batch_size": "train_batch_size", "num_inference_steps": "num_steps",
    "sample_steps": "num_steps", "steps": "num_steps", "eta": "noise_level", "noise": "noise_level",
    "cfg": "guidance_scale", "cfg_scale": "guidance_scale", "guidance": "guidance_scale", "beta": "kl_beta",
    "kl_coef": "kl_beta", "kl": "kl_beta", "clip_epsilon": "clip_range", "epsilon": "clip_range",
    "clip_eps": "clip_range", "lora_r": "lora_rank", "rank": "lora_rank", "alpha": "lora_alpha",
    "model": "pretrained", "pretrained_model_name_or_path": "pretrained", "model_name": "pretrained",
    "resume": "resume_from", "resume_from_checkpoint": "resume_from", "output": "output_dir",
    "logdir": "output_dir", "save_dir": "output_dir", "grad_clip": "max_grad_norm", "clip_grad_norm": "max_grad_norm",
    "mixed_precision": "dtype", "precision": "dtype", "prompts": "train_prompts", "prompt_file": "train_prompts",
    "resolution": "height", "image_size": "height", "report_to": "trackers", "tracker": "trackers",
}


def _suggest(parent: str, leaf: str, valid: list[str]) -> str:
    """The closest valid dotted key for an unknown ``parent.leaf``: a known alias, a typo of a key of the same
    section, or the same leaf in another section."""
    prefix = parent + "." if parent else ""
    same = [k for k in valid if k.startswith(prefix) and "." not in k[len(prefix):]]
    target = ALIASES.get(leaf.lower())
    for name in ([target] if target else []) + [leaf]:
        if prefix + name in same:
            return prefix + name if name != leaf else ""
        elsewhere = [k for k in valid if k.rsplit(".", 1)[-1] == name]
        if elsewhere:
            return elsewhere[0]
    close = difflib.get_close_matches(prefix + leaf, same, n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in valid], n=1, cutoff=0.6)
    return next((k for k in valid if close and k.rsplit(".", 1)[-1] == close[0]), "")


def _strategy_keys() -> list[str]:
    """Every registered objective's settings as dotted ``objective.*`` keys (a strategy section's keys are its
    strategies', not its base model's), for suggestions."""
    return sorted({f"objective.{k}" for n in OBJECTIVES for k in objective_config_class(n).model_fields})


def _moved_section(key: str) -> bool:
    """Whether ``key`` is a section of earlier versions whose keys all moved (``algo``: :data:`MOVES`)."""
    return "." not in key and any(old.startswith(key + ".") for old in MOVES)


def _moved_section_keys(section: str, given: dict) -> list[str]:
    """One line per key left in a moved section (a key the moves do not know, a typo of one: ``algo.clip_rnage``),
    naming the closest moved key's new home."""
    lines = []
    for leaf in given:
        close = difflib.get_close_matches(f"{section}.{leaf}", list(MOVES), n=1, cutoff=0.6)
        hint = f"; did you mean {MOVES[close[0]]!r}?" if close else ""
        lines.append(f"unknown config key '{section}.{leaf}': the {section} section's keys moved (docs/configs.md: "
                     f"where each setting lives){hint}")
    return lines


def _tuple_length(loc: tuple) -> int | None:
    """The number of items of the fixed-length tuple field at ``loc`` (a pydantic error's location in
    :class:`Config`, list indices skipped), or None when the field is not one (or not found in the schema)."""
    model: Any = Config
    annotation = None
    for part in [p for p in loc if not isinstance(p, int)]:
        fields = getattr(model, "model_fields", None)
        if not isinstance(fields, dict) or part not in fields:
            return None
        annotation = fields[part].annotation
        model = next((a for a in (annotation, *typing.get_args(annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is not tuple or not args or Ellipsis in args:
        return None
    return len(args)


def _tuple_count_line(e: dict) -> str | None:
    """The line for a fixed-length tuple field given too few or too many values (``train.adam_betas=[0.9]``:
    pydantic says "train.adam_betas.1: Field required"), naming how many it needs; None for other errors."""
    loc = tuple(e["loc"])
    if e["type"] == "missing" and loc and isinstance(loc[-1], int):
        loc = loc[:-1]
    elif e["type"] != "too_long":
        return None
    count = _tuple_length(loc)
    if count is None:
        return None
    return (f"config field {'.'.join(str(p) for p in loc)!r}: needs exactly {count} values, a list like "
            f"[{', '.join('abcdefgh'[:count])}] (got {e.get('input')!r})")


def _format_error(err: ValidationError) -> str:
    """One line (problems joined with "; ") for the schema's ``err``: each field, what is wrong, what was given."""
    lines = []
    valid = _valid_keys(Config) + _strategy_keys()
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden" and _moved_section(loc) and isinstance(e.get("input"), dict):
            lines.extend(_moved_section_keys(loc, e["input"]))
        elif e["type"] == "extra_forbidden":  # locations of list items carry their index: rewards.0.wieght
            leaf = str(e["loc"][-1])
            parent = ".".join(str(p) for p in e["loc"][:-1] if not isinstance(p, int))
            close = _suggest(parent, leaf, valid)
            if close and close.startswith(parent + ".") and "." not in close[len(parent) + 1:]:
                close = ".".join(str(p) for p in e["loc"][:-1]) + close[len(parent):]  # keep the item's index
            hint = f"; did you mean {close!r}?" if close else ""
            lines.append(f"unknown config key {loc!r}{hint}")
        elif _tuple_count_line(e):
            lines.append(_tuple_count_line(e))
        elif e["type"] == "value_error":
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"config field {loc!r}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(dict.fromkeys(lines))  # said once each


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping; the message names the key and both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently: a
    repeated ``train:`` section would drop the whole first one)."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in first:
                raise DuplicateKeyError(f"line {key_node.start_mark.line + 1}: the key {key!r} is given twice (first "
                                        f"on line {first[key]}); give each key once")
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """YAML ``text`` parsed safely. Raises :class:`DuplicateKeyError` for a key given twice in one mapping, and
    ``yaml.YAMLError`` for text that does not parse."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_error_line(path: str | Path, err: yaml.YAMLError) -> str:
    """One line for YAML that does not parse: ``<file>:<line>:<col>: <the problem> (<its context>)`` (1-based, as
    editors count; PyYAML's marks are 0-based) and, for a tab, the way out (YAML indents with spaces only)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    context = getattr(err, "context", None)
    text = f"{where}: not valid YAML: {problem}" + (f" ({' '.join(str(context).split())})" if context else "")
    if "'\\t'" in problem or "\t" in problem:
        text += "; YAML indents with spaces only: replace the tab with spaces"
    return text


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b.c=value'`` → (['a', 'b', 'c'], YAML-parsed value). Raises :class:`ConfigError` without ``=``."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like dotted.key=value")
    key, value = text.split("=", 1)
    if not key.strip() or any(not part.strip() for part in key.split(".")):
        raise ConfigError(f"override {text!r} has no key (or an empty part of one) before '='; it must look like "
                          f"dotted.key=value, e.g. train.lr=1e-4")
    try:
        parsed = load_yaml(value) if value.strip() else ""
    except DuplicateKeyError as err:
        raise ConfigError(f"override {text!r}: {str(err).split(': ', 1)[1]}") from None
    except yaml.YAMLError as err:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({str(err).splitlines()[0]}); quote the whole "
            f"override for the shell, e.g. '{key}=[{{name: x}}]'"
        ) from None
    return key.strip().split("."), parsed


#: renamed top-level sections: old key -> new key (the old one still works, with a warning)
RENAMED_SECTIONS = {"grouper": "chunker"}


def _renamed(key: str, where: str) -> str:
    new = RENAMED_SECTIONS.get(key)
    if new is None:
        return key
    warnings.warn(f"{where}: the config section {key!r} is now called {new!r}; the old name will be removed",
                  FutureWarning, stacklevel=3)
    return new


#: the strategy sections: a plain name stands for ``{name: ...}`` (also when an override sets one of its keys)
STRATEGY_SECTIONS = ("objective", "objective.chunker", "objective.policy_loss", "group_filter", "advantage")

#: knobs of the flat ``algo`` section of earlier versions that moved into a policy loss's own section: old ``algo``
#: key -> (owning policy loss, its key there)
MOVED_KEYS = {"sapo_tau_pos": ("sapo", "tau_pos"), "sapo_tau_neg": ("sapo", "tau_neg"),
              "dual_clip_c": ("dual_clip", "c")}

#: keys of earlier versions and where each lives now (each knob has one home): old dotted key -> new dotted key; a
#: key moved into ``objective.`` is a setting of the SDE-ratio objective, read by no other
MOVES = {
    "chunker.timestep_fraction": "objective.timestep_fraction",  # before its section: the objective's own knob
    **{f"algo.{k}": f"objective.{k}" for k in ("clip_range", "clip_range_low", "clip_range_high", "kl_beta",
                                               "kl_form", "recompute_old_log_probs", "policy_loss")},
    "chunker": "objective.chunker",
    "algo.advantage": "advantage.name", "algo.advantage_clip": "advantage.clip",
    **{f"algo.{k}": f"advantage.{k}" for k in ("global_std", "multi_reward", "drop_zero_spread_groups",
                                               "min_learning_frac", "std_ddof", "std_eps")},
    "algo.group_filter": "group_filter",
}


def _strategy_name(section, default: str) -> str:
    return section if isinstance(section, str) else (section or {}).get("name", default)


def _move_loss_knobs(algo: dict, moved: list[str], overridden: frozenset[str] = frozenset()) -> None:
    """The flat ``algo.sapo_tau_pos`` / ``sapo_tau_neg`` / ``dual_clip_c`` of configs written before the policy
    loss had its own section: moved into ``algo.policy_loss`` (then to its home, :data:`MOVES`; noted in
    ``moved``) when their loss is the chosen one, dropped at their default when a config file gives them (a saved
    config of that layout lists every key), else refused naming their loss: always when an override sets them
    (``overridden``: the dotted keys the overrides set; the user asked for a knob the chosen loss does not read)."""
    for old in [k for k in MOVED_KEYS if k in algo]:
        owner, key = MOVED_KEYS[old]
        value = algo.pop(old)
        chosen = _strategy_name(algo.get("policy_loss"), "clipped")
        if chosen == owner:
            moved.append(f"algo.{old} moved to objective.policy_loss.{key}")
            section = algo.get("policy_loss")
            section = {"name": chosen} if isinstance(section, str) else dict(section or {})
            if key in section:
                raise ConfigError(f"config has both algo.{old} and its new key objective.policy_loss.{key}; keep "
                                  f"only objective.policy_loss.{key}")
            algo["policy_loss"] = {**section, key: value}
        elif value != loss_config_class(owner).model_fields[key].default or f"algo.{old}" in overridden:
            raise ConfigError(f"algo.{old}={value!r} is read only by objective.policy_loss={owner}, but "
                              f"objective.policy_loss is {chosen!r}: remove the setting or choose {owner} (its key is "
                              f"now objective.policy_loss.{key})")


def _drop_unread_filter_defaults(data: dict, overridden: frozenset[str] = frozenset()) -> None:
    """Keys of ``group_filter`` that only other filters read, at those filters' default and not set by an
    override (``overridden``, dotted keys): dropped (configs written before each filter had its own settings list
    every key of every filter); an override's is left for the schema to refuse."""
    section = data.get("group_filter")
    if not isinstance(section, dict) or section.get("name", "none") not in GROUP_FILTERS:
        return  # the schema names an unknown filter
    own = settings_class(GROUP_FILTERS, section.get("name", "none"), GroupFilterConfig).model_fields
    models = [settings_class(GROUP_FILTERS, n, GroupFilterConfig).model_fields for n in GROUP_FILTERS]
    for key in [k for k in section if k not in own]:
        defaults = [fields[key].default for fields in models if key in fields]
        old = {f"group_filter.{key}", f"algo.group_filter.{key}"}
        if defaults and all(section[key] == d for d in defaults) and not old & overridden:
            del section[key]


def _pop(data: dict, dotted: str):
    """Remove and return ``data``'s value at the dotted key; an emptied parent section is removed too."""
    *parents, leaf = dotted.split(".")
    node = data
    for p in parents:
        node = node[p]
    value = node.pop(leaf)
    if parents and not node:
        _pop(data, ".".join(parents))
    return value


def _has(data: dict, dotted: str) -> bool:
    node = data
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def _objective_name(data: dict) -> str:
    """The objective ``data`` selects (canonical; an unknown name as given, for the schema to refuse)."""
    name = _strategy_name(data.get("objective"), ObjectiveConfig.model_fields["name"].default)
    return OBJECTIVES.canonical(name) if isinstance(name, str) else name


def _reads(objective: str, key: str) -> bool:
    """Whether ``objective`` reads the SDE-ratio objective's setting ``key`` (its settings are an
    :class:`SdeRatioConfig`: the built-in's or a plugin's subclass)."""
    try:
        cls = objective_config_class(objective)
    except (KeyError, TypeError):
        return True  # an unknown objective: the schema refuses it
    return issubclass(cls, SdeRatioConfig) and key in cls.model_fields


def _at_default(key: str, value) -> bool:
    """Whether ``value`` is the SDE-ratio objective's default for its setting ``key`` (a strategy section: the
    default strategy with its defaults), as an old resolved config of another objective lists it."""
    default = SdeRatioConfig.model_fields[key].get_default(call_default_factory=True)
    try:
        return getattr(SdeRatioConfig.model_validate({key: value}), key) == default
    except ValidationError:
        return False


def _place(data: dict, new: str, value, old: str, given: str) -> None:
    """Put ``value`` (the old key's) at ``new`` in ``data``: a section is merged with a section already there, a
    plain value set where there is none. Where both are there, the one an override set wins (``given``: "old",
    "whole" (an override set ``new`` itself: it replaces the old value), "new" (it set keys of the ``new``
    section: merged key by key, its keys winning) or "" for neither); raises :class:`ConfigError` when a
    config file gives both a plain value's keys."""
    *parents, leaf = new.split(".")
    node = data
    for i, p in enumerate(parents):
        node = _descend(node, p, ".".join(parents[: i + 1]), new)
    if given == "whole":  # an override set the new key itself: its value replaces the file's old one
        return
    here = node.get(leaf)
    if isinstance(here, str) and new in STRATEGY_SECTIONS:
        here = {"name": here}
    if isinstance(value, str) and new in STRATEGY_SECTIONS and isinstance(here, dict):
        value = {"name": value}
    if isinstance(here, dict) and isinstance(value, dict):
        value = _deep_merge(value, here) if given == "new" else _deep_merge(here, value)
    elif leaf in node and given != "old":
        if given == "new":
            return
        raise ConfigError(f"config has both {old} and its new key {new}; keep only {new}")
    node[leaf] = value


def _move_keys(data: dict, moved: list[str], overridden: frozenset[str]) -> None:
    """Bring every key of :data:`MOVES` in ``data`` to its home, noting each in ``moved``. A key whose home is the
    SDE-ratio objective's section, given with another objective: dropped when a config file gives it at its
    default (an old run folder's resolved config lists every key), else refused in one line."""
    objective = _objective_name(data)
    for old, new in MOVES.items():
        if not _has(data, old):
            continue
        value = _pop(data, old)
        given = "whole" if new in overridden else next(
            (which for which, key in (("old", old), ("new", new))
             if key in overridden or any(k.startswith(key + ".") for k in overridden)), "")
        if new.startswith("objective."):
            key = new.split(".", 1)[1]
            if not _reads(objective, key):
                if given == "old" or not _at_default(key, value):
                    raise ConfigError(f"{old}={value!r} moved to {new}, a setting of objective sde_ratio, but "
                                      f"objective.name is {objective!r}, which does not read it: remove the setting")
                continue
        _place(data, new, value, old, given)
        moved.append(f"{old} moved to {new}")


def _legacy(data: dict, overridden: frozenset[str] = frozenset(), *, quiet: bool = False) -> None:
    """Bring keys of configs written by earlier versions to the schema's places (:data:`MOVED_KEYS`, then
    :data:`MOVES`, the all-filters ``group_filter`` section), with one ``FutureWarning`` line naming every move
    (none when ``quiet``); renamed sections are handled by :func:`build_config`. ``overridden``: the dotted keys
    the command's overrides set (never dropped as an old file's defaults)."""
    moved: list[str] = []
    algo = data.get("algo")
    if isinstance(algo, dict):
        _move_loss_knobs(algo, moved, overridden)
    _move_keys(data, moved, overridden)
    if data.get("algo") == {}:  # every key of the old section moved (or dropped)
        del data["algo"]
    _drop_unread_filter_defaults(data, overridden)
    if moved and not quiet:  # issued here (stacklevel 1): Python shows a line once however often a command reads
        warnings.warn("config keys of an earlier version read at their new places (write them there; the old "
                      f"keys will be removed): {'; '.join(moved)}", FutureWarning, stacklevel=1)


def upgraded(data: dict) -> dict:
    """A copy of the config dict ``data`` (a run folder's saved ``config.yaml``, say) with the keys of earlier
    versions at their new places (:func:`_legacy`, no warning): the form a config of this version has.
    Raises :class:`ConfigError` as :func:`_legacy`."""
    data = copy.deepcopy(data)
    for old in [k for k in data if k in RENAMED_SECTIONS]:
        data.setdefault(RENAMED_SECTIONS[old], data.pop(old))
    _legacy(data, quiet=True)
    return data


def _descend(node: dict, key: str, path: str, text: str) -> dict:
    """The section ``node[key]`` an override walks into (created when absent; a strategy's plain name becomes
    ``{name: ...}``). Raises :class:`ConfigError` when it is a plain value."""
    child = node.setdefault(key, {})
    if isinstance(child, str) and path in STRATEGY_SECTIONS:
        child = node[key] = {"name": child}
    if not isinstance(child, dict):
        raise ConfigError(f"override {text!r}: {key!r} is not a section")
    return child


def build_config(data: dict | None = None, overrides: list[str] = (), *, strategy_checks: bool = True) -> Config:
    """Validate a config dict after applying dotted overrides. Raises :class:`ConfigError`. ``strategy_checks``
    False leaves out each strategy's checks against the other sections, for ``--help`` alone, which shows what they
    refuse (:func:`flowgrpo.config.help.help_config`); a run never builds a config so.

    Renamed sections (:data:`RENAMED_SECTIONS`) are accepted under their old name with a ``FutureWarning``, and
    the keys of earlier versions are brought to their new places (:func:`_legacy`)."""
    data = copy.deepcopy(data or {})
    for old in [k for k in data if k in RENAMED_SECTIONS]:
        new = _renamed(old, "config")
        if new in data:
            raise ConfigError(f"config has both {old!r} and its new name {new!r}; keep only {new!r}")
        data[new] = data.pop(old)
    overridden = set()
    for text in overrides:
        path, value = parse_override(text)
        path[0] = _renamed(path[0], f"override {text!r}")
        overridden.add(".".join(path))
        node = data
        for i, p in enumerate(path[:-1]):
            node = _descend(node, p, ".".join(path[: i + 1]), text)
        node[path[-1]] = value
    _legacy(data, frozenset(overridden))
    try:
        return Config.model_validate(data, context={"strategy_checks": strategy_checks})
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def _deep_merge(base: dict, over: dict, prefix: str = "") -> dict:
    """``over`` merged into ``base`` key by key (sections recursively; lists and values replace). A strategy
    section (:data:`STRATEGY_SECTIONS`) of ``over`` that names another strategy than ``base``'s replaces it whole:
    the base's strategy's settings are not the new one's."""
    out = dict(base)
    for k, v in over.items():
        key, here = prefix + k, out.get(k)
        if isinstance(v, dict) and isinstance(here, dict) and not _switches(key, here, v):
            out[k] = _deep_merge(here, v, key + ".")
        else:
            out[k] = v
    return out


def _switches(key: str, base: dict, over: dict) -> bool:
    """Whether the strategy section ``key`` of ``over`` names another strategy than ``base``'s (a missing name is
    the kind's default; an alias stands for its name)."""
    if key not in STRATEGY_SECTIONS or "name" not in over:
        return False
    if key == "objective":
        default = ObjectiveConfig.model_fields["name"].default
        return OBJECTIVES.canonical(str(over["name"])) != OBJECTIVES.canonical(str(base.get("name", default)))
    return "name" in base and over["name"] != base["name"]


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict. A top-level ``base: OTHER.yaml`` (relative to the file) is read first and this
    file's keys are merged over it (sections merge key by key; lists and values replace). Raises
    :class:`ConfigError` for a missing file or a directory, an empty file, YAML that does not parse or gives a key
    twice in one mapping, a non-mapping, or a cycle of bases."""
    p = Path(path).resolve()
    if p.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the path of a .yaml file in it")
    if not p.is_file():
        hint = "" if p.suffix in (".yaml", ".yml") else (
            "; a config file ends in .yaml, and an override is dotted.key=value (e.g. train.num_epochs=20)")
        raise ConfigError(f"config file {str(path)!r} does not exist{hint}")
    if p in _seen:
        raise ConfigError(f"config file {str(p)!r} is its own base (cycle {[str(x) for x in _seen]})")
    try:
        data = load_yaml(p.read_text())
    except DuplicateKeyError as err:
        raise ConfigError(f"config file {str(path)!r}, {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error_line(path, err)) from None
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; to run the embedded default give no config file, "
                          "or write {} in it")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"config file {str(path)!r}: 'base' must be a file name, got {base!r}")
        target = p.parent / base
        if not target.is_file():
            where = "is a directory" if target.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r}: its base {base!r} ({str(target)!r}) {where}; 'base' names a "
                              "YAML file relative to the file that names it")
        data = _deep_merge(read_yaml(target, (*_seen, p)), data)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = (), *, strategy_checks: bool = True) -> Config:
    """Read YAML ``path`` (or the defaults when None), apply overrides, validate (``strategy_checks``: see
    :func:`build_config`). Raises :class:`ConfigError`."""
    return build_config(read_yaml(path) if path is not None else {}, overrides, strategy_checks=strategy_checks)
