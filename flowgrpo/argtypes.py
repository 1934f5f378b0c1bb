"""argparse types that check a command-line number at the boundary, so a bad value is argparse's one-line usage
error naming the option, the value and the allowed range (never a traceback later)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_in(low: int, high: int | None = None, meaning: str = "") -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in [low, high] (``high`` None: no upper bound).

    ``meaning`` is appended to the allowed range in the message (e.g. ``"0: one per prompt"``).
    Raises ``argparse.ArgumentTypeError`` (argparse prints it with the option's name and exits 2)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    if meaning:
        allowed += f" ({meaning})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: {allowed}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: {allowed}")
        return value

    parse.__name__ = "int"  # argparse names the type in some messages
    return parse
