"""Finding reward plugins: the ``flowgrpo.rewards`` entry-point group, or an explicit ``module:attr``.

Plugins are imported lazily, only when a config names them, so a broken plugin never affects runs that do not use
it. Two distributions registering the same name is an error naming both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from flowgrpo.registry import did_you_mean

GROUP = "flowgrpo.rewards"


class RewardLoadError(RuntimeError):
    """A reward that cannot be found, is registered twice, or fails to import."""


@dataclass(frozen=True)
class RewardOrigin:
    """Where a reward came from, recorded in the run folder: entry-point name, target, distribution, version."""

    name: str
    target: str
    distribution: str | None
    version: str | None


def _dist_of(ep: EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)


def registered_rewards() -> dict[str, EntryPoint]:
    """Name → entry point of every installed reward plugin. Raises :class:`RewardLoadError` on a duplicate name."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            a, b = _dist_of(found[ep.name])[0], _dist_of(ep)[0]
            raise RewardLoadError(
                f"reward {ep.name!r} is registered twice: by {a} ({found[ep.name].value}) and by {b} ({ep.value})"
            )
        found[ep.name] = ep
    return found


def resolve_reward_factory(name: str):
    """The class/factory for ``name`` and its :class:`RewardOrigin`, importing only that plugin.

    Raises:
        RewardLoadError: unknown name (lists registered ones and the closest match), or an import failure.
    """
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as err:
            raise RewardLoadError(f"cannot import reward {name!r}: {err}") from err
        top = module.split(".")[0]
        try:
            from importlib.metadata import packages_distributions, version

            dists = packages_distributions().get(top, [])
            dist = dists[0] if dists else None
            return obj, RewardOrigin(name, name, dist, version(dist) if dist else None)
        except Exception:  # noqa: BLE001 - provenance is best effort for ad-hoc modules
            return obj, RewardOrigin(name, name, None, None)
    eps = registered_rewards()
    if name not in eps:
        raise RewardLoadError(
            f"unknown reward {name!r}; registered in {GROUP!r}: {sorted(eps)}{did_you_mean(name, eps)}. "
            "A reward may also be named as 'module:attr'."
        )
    ep = eps[name]
    try:
        obj = ep.load()
    except Exception as err:
        raise RewardLoadError(f"reward {name!r} ({ep.value}) failed to import: {err}") from err
    dist, ver = _dist_of(ep)
    return obj, RewardOrigin(name, ep.value, dist, ver)


def load_reward(name: str, **kwargs):
    """Construct the reward ``name`` with ``kwargs`` (no weights are loaded until ``setup``)."""
    factory, origin = resolve_reward_factory(name)
    try:
        reward = factory(**kwargs)
    except TypeError as err:
        raise RewardLoadError(f"reward {name!r} rejected its kwargs {kwargs}: {err}") from err
    if not callable(reward) or not hasattr(reward, "setup"):
        raise RewardLoadError(f"reward {name!r} built a {type(reward).__name__} without setup() and __call__()")
    return reward, origin
