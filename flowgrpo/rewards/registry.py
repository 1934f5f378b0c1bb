"""Finding reward plugins: the ``flowgrpo.rewards`` entry-point group, or an explicit ``module:attr``.

Plugins are imported lazily, only when a config names them, so a plugin that fails to import never affects runs
that do not use it (the pattern of lm-eval-harness's registry and pluggy). Listing the group reads installed
metadata only; it imports nothing.

Two *distributions* registering the same name is an error naming both packages and versions. It is raised when
that name is asked for (a clash between two plugins a run does not use does not stop the run) and by
:func:`registered_rewards`, which lists the whole group. The same distribution seen twice (one package visible on
two ``sys.path`` entries) is not a clash.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from flowgrpo.strategies.registry import did_you_mean

logger = logging.getLogger(__name__)

GROUP = "flowgrpo.rewards"


class RewardLoadError(RuntimeError):
    """A reward that cannot be found, is registered twice, fails to import, or rejects its kwargs."""


@dataclass(frozen=True)
class RewardOrigin:
    """Where a reward came from, recorded in the run folder (``rewards.json``).

    Attributes:
        name: the name the config used (an entry-point name or ``module:attr``).
        target: the ``module:attr`` that was imported.
        distribution: the installed distribution that provides it (None for a module that is not installed).
        version: that distribution's version (None likewise).
    """

    name: str
    target: str
    distribution: str | None
    version: str | None


def _dist_of(ep: EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)


def _describe(ep: EntryPoint) -> str:
    dist, ver = _dist_of(ep)
    return f"{dist or '<unknown distribution>'} {ver or ''}".rstrip() + f" ({ep.value})"


def _scan() -> dict[str, list[EntryPoint]]:
    """Name → the entry points registering it, one per distinct distribution. Imports nothing."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        same = found.setdefault(ep.name, [])
        if any(_dist_of(e)[0] == _dist_of(ep)[0] and e.value == ep.value for e in same):
            continue  # one distribution visible twice on sys.path
        same.append(ep)
    return found


def _clash_error(name: str, eps: list[EntryPoint]) -> RewardLoadError:
    who = " and by ".join(_describe(e) for e in eps)
    return RewardLoadError(
        f"reward {name!r} is registered twice in {GROUP!r}: by {who}; uninstall one of them, or name the one "
        "you want as 'module:attr' in the config"
    )


def registered_rewards() -> dict[str, EntryPoint]:
    """Name → entry point of every installed reward plugin; nothing is imported.

    Raises:
        RewardLoadError: two distributions register the same name (the message names both).
    """
    out: dict[str, EntryPoint] = {}
    for name, eps in _scan().items():
        if len(eps) > 1:
            raise _clash_error(name, eps)
        out[name] = eps[0]
    return out


def _resolve_module_attr(name: str):
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise RewardLoadError(f"reward {name!r} is not a valid 'module:attr' (both parts are needed)")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as err:  # an import-time failure of any kind is reported with the name asked for
        raise RewardLoadError(f"cannot import reward {name!r}: {type(err).__name__}: {err}") from err
    dist = ver = None
    try:  # provenance is best effort for ad-hoc modules (a local file belongs to no distribution)
        from importlib.metadata import packages_distributions, version

        dists = packages_distributions().get(module.split(".")[0], [])
        if dists:
            dist, ver = dists[0], version(dists[0])
    except Exception as err:  # noqa: BLE001
        logger.debug("no distribution found for %s: %s", name, err)
    return obj, RewardOrigin(name, name, dist, ver)


def weighted_reward_factories(specs) -> list[tuple]:
    """``(spec, factory)`` for each reward of non-zero weight in ``specs`` (the run's
    :class:`~flowgrpo.config.RewardSpec` list) whose name resolves, importing only those plugins: what a check of
    the rewards' declarations reads before anything is constructed (a name that does not resolve is left to the
    reward check)."""
    out = []
    for spec in specs:
        if spec.weight == 0:
            continue
        try:
            out.append((spec, resolve_reward_factory(spec.name)[0]))
        except RewardLoadError:
            continue
    return out


def resolve_reward_factory(name: str):
    """The class/factory for ``name`` and its :class:`RewardOrigin`, importing only that plugin.

    ``name`` is an entry-point name of the ``flowgrpo.rewards`` group, or ``module:attr`` (``attr`` may be dotted).

    Raises:
        RewardLoadError: unknown name (the message lists the registered names and the closest match), a name
            registered by two distributions (naming both), or an import failure of that plugin.
    """
    if not isinstance(name, str) or not name:
        raise RewardLoadError(f"a reward name must be a non-empty string, got {name!r}")
    if ":" in name:
        return _check_factory(name, *_resolve_module_attr(name))
    found = _scan()
    if name not in found:
        raise RewardLoadError(
            f"unknown reward {name!r}; registered in {GROUP!r}: {sorted(found)}{did_you_mean(name, found)}. "
            "A reward may also be named as 'module:attr'."
        )
    if len(found[name]) > 1:
        raise _clash_error(name, found[name])
    ep = found[name][0]
    try:
        obj = ep.load()
    except Exception as err:
        raise RewardLoadError(
            f"reward {name!r} from {_describe(ep)} failed to import: {type(err).__name__}: {err}"
        ) from err
    dist, ver = _dist_of(ep)
    return _check_factory(name, obj, RewardOrigin(name, ep.value, dist, ver))


_CONTRACT = ("a reward is a class, or a factory called with the config's kwargs, that builds an object with "
             "setup(device) and __call__(images, prompts, metadata) (see docs/rewards.md)")


def _check_factory(name: str, obj, origin: RewardOrigin):
    """``(obj, origin)`` when ``obj`` can build a reward; a :class:`RewardLoadError` naming what it is otherwise:
    not callable, or a plain scoring function (a required ``images`` / ``prompts`` parameter) given in place of
    a factory."""
    if not callable(obj):
        raise RewardLoadError(f"reward {name!r} is a {type(obj).__name__} ({obj!r}), not a class or factory: "
                              f"{_CONTRACT}")
    if inspect.isfunction(obj):
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            params = []
        scoring = [p.name for p in params if p.name in ("images", "prompts") and p.default is p.empty]
        if scoring:
            raise RewardLoadError(f"reward {name!r} is a scoring function (it takes {scoring}), not a factory: "
                                  f"{_CONTRACT}")
    return obj, origin


def check_reward_kwargs(name: str, kwargs: dict, where: str) -> None:
    """Check ``kwargs`` against the signature of reward ``name``'s factory without calling it (no weights load):
    an unknown keyword is named with the ones allowed and the closest (``did you mean 'quality'?``), a bad set
    of them (a required one missing) with the factory's own words; ``where`` names the setting in the message
    (``"rewards[].kwargs"``, ``"--kwargs"``). A factory without a readable signature, or taking ``**kwargs``,
    is left to its own call. Raises :class:`RewardLoadError` (also for an unknown ``name``)."""
    factory, _ = resolve_reward_factory(name)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C factory: its own call checks the kwargs
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    allowed = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in allowed:
            raise RewardLoadError(f"reward {name!r} has no keyword argument {key!r} ({where}); "
                                  f"it accepts {allowed}{did_you_mean(key, allowed)}")
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        raise RewardLoadError(f"reward {name!r}: {err} ({where}); it accepts {allowed}") from None


def load_reward(name: str, **kwargs):
    """Construct the reward ``name`` with ``kwargs``; no weights are loaded until its ``setup(device)``.

    Returns:
        (reward, :class:`RewardOrigin`).

    Raises:
        RewardLoadError: see :func:`resolve_reward_factory`; also when the factory rejects ``kwargs`` (a
            ``TypeError``) or builds an object without ``setup()`` and ``__call__()``.
        ValueError: a kwarg value the reward itself rejects.
    """
    factory, origin = resolve_reward_factory(name)
    try:
        reward = factory(**kwargs)
    except TypeError as err:
        raise RewardLoadError(f"reward {name!r} rejected its kwargs {kwargs}: {err}") from err
    missing = [m for m, ok in (("setup(device)", callable(getattr(reward, "setup", None))),
                               ("__call__(images, prompts, metadata)", callable(reward))) if not ok]
    if missing:
        raise RewardLoadError(f"reward {name!r} built a {type(reward).__name__} without {' and '.join(missing)}; "
                              "a reward has both (setup may do nothing)")
    return reward, origin
