"""The digits task's per-digit report: judge correctness and diversity before and after, each digit's diversity
against the real digits', and a mark on a digit that collapsed toward one prototype — the console table and the
panels under ``before_after.png`` (a :class:`~flowgrpo.records.GroupTable`, handed to the report by the
``digit_judge`` reward's ``report_table``)."""

from __future__ import annotations

from flowgrpo.records import GroupTable

COLLAPSE_RATIO = 0.6  # a digit less varied than this fraction of the same digit's real digits is flagged
_FIGURES = ("correctness_before", "correctness_after", "diversity_before", "diversity_after", "diversity_real")
COLUMNS = (("digit", ">5"), ("correct before", ">14.3f"), ("after", ">5.3f"), ("diversity before", ">16.1f"),
           ("after", ">5.1f"), ("real", ">5.1f"), ("after/real", ">10.3f"))


def per_digit_rows(summary: dict) -> list[dict[str, float | None]]:
    """Per-digit figures of a digits summary, one dict per digit 0–9 found (``digit``, ``correctness_before``,
    ``correctness_after``, ``diversity_before``, ``diversity_after``, ``diversity_real``, ``ratio_after`` =
    diversity_after / diversity_real, ``collapsed`` = ratio_after < :data:`COLLAPSE_RATIO`); empty for other
    tasks."""
    rows = []
    for d in range(10):
        real = summary.get(f"digit_{d}_diversity_real")
        if real is None:
            continue
        div_after = summary.get(f"digit_{d}_diversity_after")
        rows.append({
            "digit": d, "correctness_before": summary.get(f"digit_{d}_correctness_before"),
            "correctness_after": summary.get(f"digit_{d}_correctness_after"),
            "diversity_before": summary.get(f"digit_{d}_diversity_before"), "diversity_after": div_after,
            "diversity_real": real, "ratio_after": None if div_after is None or not real else div_after / real,
        })
        rows[-1]["collapsed"] = rows[-1]["ratio_after"] is not None and rows[-1]["ratio_after"] < COLLAPSE_RATIO
    return rows


def _panel(r: dict) -> str:
    """The text under digit ``r``'s column of ``before_after.png``: correctness and diversity before → after and
    the diversity ratio to real digits, marked ``collapsed``."""

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    flag = " collapsed" if r["collapsed"] else ""
    return (f"digit {r['digit']}\ncorrect {f(r['correctness_before'], '.2f')}→{f(r['correctness_after'], '.2f')}"
            f"\ndiversity {f(r['diversity_before'], '.0f')}→{f(r['diversity_after'], '.0f')}"
            f"\n{f(r['ratio_after'], '.3f')}× real{flag}")


def digit_table(summary: dict) -> GroupTable | None:
    """The per-digit :class:`~flowgrpo.records.GroupTable` of a digits summary (:func:`per_digit_rows`), or None
    when the summary has no per-digit figures."""
    rows = per_digit_rows(summary)
    if not rows:
        return None
    keys = frozenset(f"digit_{r['digit']}_{k}" for r in rows for k in _FIGURES) & frozenset(summary)
    return GroupTable(
        columns=COLUMNS,
        rows=tuple((r["digit"], r["correctness_before"], r["correctness_after"], r["diversity_before"],
                    r["diversity_after"], r["diversity_real"], r["ratio_after"]) for r in rows),
        notes=tuple("<- collapsed" if r["collapsed"] else "" for r in rows),
        panels=tuple(_panel(r) for r in rows), alerts=tuple(r["collapsed"] for r in rows), keys=keys)
