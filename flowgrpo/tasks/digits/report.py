"""The digits task's per-digit report: judge correctness and diversity before and after, each digit's diversity
against the real digits', and a mark on a digit that collapsed toward one prototype — the console table and the
panels under ``before_after.png`` (a :class:`~flowgrpo.records.GroupTable`, handed to the report by the
``digit_judge`` reward's ``report_table``) — and the run's time to quality (:func:`time_to_quality`, handed to the
summary by the reward's ``summary_figures``)."""

from __future__ import annotations

from flowgrpo.records import GroupTable

COLLAPSE_RATIO = 0.6  # a digit less varied than this fraction of the same digit's real digits is flagged
QUALITY_JUDGE = 0.97  # time to quality: judge correctness at least this ...
QUALITY_RATIOS = (0.6, 0.7)  # ... with every digit's diversity at least this fraction of its real digits'
JUDGE_KEY = "eval/correctness"  # a periodic evaluation record's judge correctness (the digit_judge reward's)
RATIO_KEY = "eval/diversity_min_ratio"  # ... and its smallest per-digit diversity ratio
IMAGES_KEY = "eval/digit_images_min"  # ... and the fewest images of any digit it was measured on
#: time to quality needs at least this many images of every digit in an evaluation. A digit's diversity ratio
#: from 20 images is off by ~0.03 (configs/digits.yaml); as a mean over the images' pairs its error shrinks as
#: 1/sqrt(n), and the figure is the smallest of ten such ratios, biased low by ~1.5 of their errors (the expected
#: largest of ten standard normals is 1.54): ~0.046 at 20 images a digit, ~0.03 at 50, under a third of the 0.1
#: between the bars r = 0.6 and 0.7 (QUALITY_RATIOS). A smaller evaluation records no time to quality
#: (``quality_skipped`` says why); the embedded default evaluates 100 a digit.
MIN_IMAGES_PER_DIGIT = 50
EXCLUDED_PHASES = ("eval",)  # timing/<phase> not counted as RL seconds: the periodic evaluation
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


def rl_seconds(records: list[dict]) -> float:
    """RL seconds of epoch records (``metrics.jsonl``): the sum of their ``timing/<phase>`` seconds, the phases of
    :data:`EXCLUDED_PHASES` (periodic evaluation) left out."""
    return sum(v for r in records for k, v in r.items()
               if k.startswith("timing/") and k.removeprefix("timing/") not in EXCLUDED_PHASES and v is not None)


def time_to_quality(records: list[dict], summary: dict, min_ratio: float,
                    judge: float = QUALITY_JUDGE) -> tuple[int | None, float | None]:
    """(epochs, RL seconds) at the run's first evaluation with judge correctness >= ``judge`` and every digit's
    diversity >= ``min_ratio`` of its real digits' (``diversity_min_ratio`` >= ``min_ratio``), or (None, None)
    if no evaluation reached both.

    The evaluations, in order: the periodic ones (a ``metrics.jsonl`` record of 0-based ``epoch`` e with
    :data:`JUDGE_KEY` counts as e + 1 epochs done, its RL seconds :func:`rl_seconds` of the records up to e), then
    the final one (``summary["correctness_after"]`` and ``["diversity_min_ratio_after"]``: ``summary["epochs"]``
    epochs, the RL seconds of every record). A missing or NaN figure does not reach, nor does an evaluation of
    fewer than :data:`MIN_IMAGES_PER_DIGIT` images of some digit (:data:`IMAGES_KEY`; a record written before
    that count was recorded is taken as it is)."""
    ordered = sorted(records, key=lambda r: r["epoch"])
    seconds = 0.0
    for r in ordered:
        seconds += rl_seconds([r])
        if _reaches(r.get(JUDGE_KEY), r.get(RATIO_KEY), r.get(IMAGES_KEY), judge, min_ratio):
            return r["epoch"] + 1, seconds
    if _reaches(summary.get("correctness_after"), summary.get("diversity_min_ratio_after"),
                summary.get("digit_images_min_after"), judge, min_ratio):
        return summary["epochs"], seconds
    return None, None


def _reaches(correct, ratio, images, judge: float, min_ratio: float) -> bool:
    if images is not None and images < MIN_IMAGES_PER_DIGIT:
        return False
    return correct is not None and ratio is not None and correct >= judge and ratio >= min_ratio  # NaN: False


def quality_figures(records: list[dict], summary: dict) -> dict[str, int | float | str | None]:
    """The summary's time-to-quality figures (:func:`time_to_quality` at judge :data:`QUALITY_JUDGE`, for each
    ratio r of :data:`QUALITY_RATIOS`): ``quality_<r>_epoch`` and ``quality_<r>_rl_seconds`` (None: not reached),
    e.g. ``quality_0.6_epoch``, and ``quality_bar``, what r means (the report's heading). When the final
    evaluation scored fewer than :data:`MIN_IMAGES_PER_DIGIT` images of some digit, no figure but
    ``quality_skipped``, why (the report prints it in place of the figures)."""
    out: dict[str, int | float | str | None] = {
        "quality_bar": f"judge correctness >= {QUALITY_JUDGE} with every digit's diversity >= r of its real digits', "
                       "at the first periodic or final evaluation that reaches it"}
    images = summary.get("digit_images_min_after")
    if images is not None and images < MIN_IMAGES_PER_DIGIT:
        out["quality_skipped"] = (f"not measured: the evaluation scored {images:.0f} images of some digit, fewer "
                                  f"than {MIN_IMAGES_PER_DIGIT}, too few for a digit's diversity ratio to tell "
                                  f"r = {' from '.join(str(r) for r in QUALITY_RATIOS)}; set data.eval_num_prompts "
                                  f">= {10 * MIN_IMAGES_PER_DIGIT}")
        return out
    for ratio in QUALITY_RATIOS:
        epoch, seconds = time_to_quality(records, summary, ratio)
        out[f"quality_{ratio}_epoch"], out[f"quality_{ratio}_rl_seconds"] = epoch, seconds
    return out
