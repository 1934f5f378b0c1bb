"""argparse types that check a command-line number at the boundary, so a bad value is argparse's one-line usage
error naming the option, the value and the allowed range (never a traceback later)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE`` on stderr, exit status 2,
    without the usage block argparse prints before it (``--help`` still shows the usage). Subparsers made by
    ``add_subparsers`` are of this class too (argparse's default ``parser_class`` is the parent's class)."""

    def error(self, message: str) -> NoReturn:
        """Write ``PROG: error: MESSAGE`` (newlines in ``message`` joined with "; ") and exit 2."""
        line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
        sys.stderr.write(f"{self.prog}: error: {line}\n")
        sys.stderr.flush()
        sys.exit(2)


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


def float_at_least(low: float, meaning: str = "") -> Callable[[str], float]:
    """An argparse ``type`` accepting finite numbers >= ``low`` (``meaning`` appended to the allowed range).
    Raises ``argparse.ArgumentTypeError`` (argparse prints it with the option's name and exits 2)."""
    allowed = f"a number >= {low}" + (f" ({meaning})" if meaning else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
        if not value >= low or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: {allowed}")
        return value

    parse.__name__ = "float"
    return parse
