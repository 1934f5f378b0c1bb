"""A tiny name → strategy registry: unknown names fail listing the valid ones and the closest match."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Registry(Generic[T]):
    """Maps names to strategies (functions or classes). ``what`` names the kind of thing in error messages."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def alias(self, alias: str, name: str) -> None:
        """Accept ``alias`` (a common name of the strategy, e.g. ``grpo``) wherever ``name`` is: :meth:`get` and
        :meth:`canonical` resolve it. Raises ValueError for an alias that is a registered name or another alias."""
        if alias in self._items or alias in self._aliases:
            raise ValueError(f"{self.what} alias {alias!r} is already a name or an alias")
        self._aliases[alias] = name

    def canonical(self, name: str) -> str:
        """The registered name ``name`` stands for: the name an alias points to, else ``name`` itself."""
        return self._aliases.get(name, name)

    def aliases(self) -> dict[str, str]:
        """Every alias → the registered name it stands for."""
        return dict(self._aliases)

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin's or a test's own registration). Raises KeyError for an unknown name."""
        self.get(name)
        del self._items[name]

    def get(self, name: str) -> T:
        try:
            return self._items[self.canonical(name)]
        except KeyError:
            also = "".join(f", {a!r} = {n!r}" for a, n in sorted(self._aliases.items()))
            raise KeyError(
                f"unknown {self.what} {name!r}; choose one of {sorted(self._items)}{also}"
                f"{did_you_mean(name, [*self._items, *self._aliases])}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
