"""Specification of the house rules that a machine can check over the library's source (docs/design.md): every
function of ``flowgrpo/`` and ``rewards/flowgrpo_rewards/`` fits a screen, 60 lines from its ``def`` line to its last
line (decorators not counted), except the declarative tables named in ``LONG_TABLES`` with their reason.

The source is read with :mod:`ast` (the span is ``end_lineno − lineno + 1`` of each ``FunctionDef`` and
``AsyncFunctionDef``, nested ones and methods included), never imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowgrpo", "rewards/flowgrpo_rewards")
MAX_LINES = 60

# "path:qualified name" → why it may run past a screen. Only declarative tables (a literal that lists data, each
# line one entry) belong here; logic is split into named helpers instead.
LONG_TABLES: dict[str, str] = {}


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines) of each function of ``source`` whose ``def`` line through its last line spans more than
    ``limit`` lines, in source order; nested names are joined with dots (``Class.method``, ``outer.inner``)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                span = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and span > limit:
                    found.append((name, span))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_checker_measures_def_to_last_line_of_functions_methods_and_nested_ones():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))  # def line + 59 body lines = 60: fits
    fits = f"def fits():\n{body}\n"
    over = f"def over():\n{body}\n    return x0\n"  # 61
    method = "class C:\n    @staticmethod\n    def m():\n" + "\n".join(f"        y{i} = {i}" for i in range(60)) + "\n"
    nested = "async def outer():\n    def inner():\n" + "\n".join(f"        z{i} = {i}" for i in range(59)) + "\n"
    found = long_functions(fits + over + method + nested)
    assert found == [("over", 61), ("C.m", 61), ("outer", 61)]  # outer.inner: 60, fits


def test_every_library_function_fits_a_screen_outside_the_declarative_tables():
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert files, f"no sources found under {ROOT}"
    long = {f"{p.relative_to(ROOT).as_posix()}:{name}": span for p in files
            for name, span in long_functions(p.read_text(encoding="utf-8"))}
    unlisted = {where: span for where, span in long.items() if where not in LONG_TABLES}
    assert not unlisted, (f"functions over {MAX_LINES} lines (split them into named helpers; only a declarative "
                          f"table may be listed in LONG_TABLES with its reason): {unlisted}")
    unexplained = sorted(where for where, why in LONG_TABLES.items() if not why.strip())
    assert not unexplained, f"LONG_TABLES entries without a reason: {unexplained}"
    stale = sorted(set(LONG_TABLES) - set(long))
    assert not stale, f"LONG_TABLES lists functions that fit a screen now (or are gone): {stale}"

