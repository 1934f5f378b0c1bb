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


def _format_error(err: ValidationError) -> str:
    lines = []
    valid = _valid_keys(Config)
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":  # locations of list items carry their index: rewards.0.wieght
            leaf = str(e["loc"][-1])
            parent = ".".join(str(p) for p in e["loc"][:-1] if not isinstance(p, int))
            close = _suggest(parent, leaf, valid)
            if close and close.startswith(parent + ".") and "." not in close[len(parent) + 1:]:
                close = ".".join(str(p) for p in e["loc"][:-1]) + close[len(parent):]  # keep the item's index
            hint = f"; did you mean {close!r}?" if close else ""
            lines.append(f"unknown config key {loc!r}{hint}")
        elif e["type"] == "value_error":
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"config field {loc!r}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


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
STRATEGY_SECTIONS = ("chunker", "objective", "algo.policy_loss", "algo.group_filter")

#: knobs that moved into a strategy section: old ``algo`` key -> (owning policy loss, its key there)
MOVED_KEYS = {"sapo_tau_pos": ("sapo", "tau_pos"), "sapo_tau_neg": ("sapo", "tau_neg"),
              "dual_clip_c": ("dual_clip", "c")}


def _strategy_name(section, default: str) -> str:
    return section if isinstance(section, str) else (section or {}).get("name", default)


def _move_loss_knobs(algo: dict, overridden: frozenset[str] = frozenset()) -> None:
    """The flat ``algo.sapo_tau_pos`` / ``sapo_tau_neg`` / ``dual_clip_c`` of configs written before the policy
    loss had its own section: moved into ``algo.policy_loss`` (with a ``FutureWarning``) when their loss is the
    chosen one, dropped at their default when a config file gives them (a saved config of that layout lists every
    key), else refused naming their loss: always when an override sets them (``overridden``: the dotted keys the
    overrides set; the user asked for a knob the chosen loss does not read)."""
    for old in [k for k in MOVED_KEYS if k in algo]:
        owner, key = MOVED_KEYS[old]
        value = algo.pop(old)
        chosen = _strategy_name(algo.get("policy_loss"), "clipped")
        if chosen == owner:
            warnings.warn(f"algo.{old} is now algo.policy_loss.{key}; the old key will be removed", FutureWarning,
                          stacklevel=4)
            section = algo.get("policy_loss")
            section = {"name": chosen} if isinstance(section, str) else dict(section or {})
            if key in section:
                raise ConfigError(f"config has both algo.{old} and its new key algo.policy_loss.{key}; keep only "
                                  f"algo.policy_loss.{key}")
            algo["policy_loss"] = {**section, key: value}
        elif value != loss_config_class(owner).model_fields[key].default or f"algo.{old}" in overridden:
            raise ConfigError(f"algo.{old}={value!r} is read only by algo.policy_loss={owner}, but algo.policy_loss "
                              f"is {chosen!r}: remove the setting or choose {owner} (its key is now "
                              f"algo.policy_loss.{key})")


def _drop_unread_filter_defaults(algo: dict, overridden: frozenset[str] = frozenset()) -> None:
    """Keys of ``algo.group_filter`` that only other filters read, at those filters' default and not set by an
    override (``overridden``, dotted keys): dropped (configs written before each filter had its own settings list
    every key of every filter); an override's is left for the schema to refuse."""
    section = algo.get("group_filter")
    if not isinstance(section, dict) or section.get("name", "none") not in GROUP_FILTERS:
        return  # the schema names an unknown filter
    own = settings_class(GROUP_FILTERS, section.get("name", "none"), GroupFilterConfig).model_fields
    models = [settings_class(GROUP_FILTERS, n, GroupFilterConfig).model_fields for n in GROUP_FILTERS]
    for key in [k for k in section if k not in own]:
        defaults = [fields[key].default for fields in models if key in fields]
        if defaults and all(section[key] == d for d in defaults) and f"algo.group_filter.{key}" not in overridden:
            del section[key]


def _legacy(data: dict, overridden: frozenset[str] = frozenset()) -> None:
    """Bring keys of configs written by earlier versions to the schema's places (:data:`MOVED_KEYS`, the
    all-filters ``group_filter`` section); renamed sections are handled by :func:`build_config`. ``overridden``:
    the dotted keys the command's overrides set (never dropped as an old file's defaults)."""
    algo = data.get("algo")
    if isinstance(algo, dict):
        _move_loss_knobs(algo, overridden)
        _drop_unread_filter_defaults(algo, overridden)


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


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
