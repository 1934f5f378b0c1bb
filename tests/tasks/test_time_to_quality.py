"""Time to quality (flowgrpo.tasks.digits.report.time_to_quality): the epochs and RL seconds at the first
evaluation with judge correctness >= 0.97 and every digit >= r of its real diversity, in the summary (through the
digit_judge reward's summary_figures), the end-of-run report and the learning bench. Every metric stream is made by
hand; the expected epochs and seconds are counted here from the stream's construction."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "learning.py"


def stream(evals: dict[int, tuple[float, float]], epochs: int = 20) -> list[dict]:
    """``epochs`` epoch records, each rollout 1.5 s + update 2.0 s + plots 0.5 s (4 s of RL), and at the 0-based
    epochs of ``evals`` an evaluation (judge, min ratio) taking 10 s (not RL time)."""
    records = []
    for e in range(epochs):
        r = {"epoch": e, "timing/rollout": 1.5, "timing/update": 2.0, "timing/plots": 0.5}
        if e in evals:
            r.update({"timing/eval": 10.0, "eval/correctness": evals[e][0], "eval/diversity_min_ratio": evals[e][1]})
        records.append(r)
    return records


# judge 0.97 from epoch 12 (record 11) on, but some digit at 0.59 of its real diversity until epoch 15 (record 14);
# 0.7 of it only at epoch 18 (record 17)
EVALS = {2: (0.80, 0.90), 5: (0.95, 0.80), 8: (0.969, 0.75), 11: (0.97, 0.59), 14: (0.99, 0.60),
         17: (0.98, 0.71)}
SUMMARY = {"epochs": 20, "correctness_after": 0.99, "diversity_min_ratio_after": 0.75}


def test_the_judge_alone_is_not_quality_every_digit_must_reach_the_ratio_too():
    from flowgrpo.tasks.digits.report import time_to_quality

    records = stream(EVALS)
    assert time_to_quality(records, SUMMARY, 0.6) == (15, pytest.approx(15 * 4.0))  # not 12: a digit at 0.59
    assert time_to_quality(records, SUMMARY, 0.7) == (18, pytest.approx(18 * 4.0))  # 0.60 and 0.59 are not 0.7
    # records in another order count the same (by epoch)
    assert time_to_quality(records[::-1], SUMMARY, 0.6) == (15, pytest.approx(60.0))


def test_the_final_evaluation_counts_at_the_last_epoch_and_none_when_never():
    from flowgrpo.tasks.digits.report import time_to_quality

    records = stream({4: (0.99, 0.5), 9: (0.96, 0.9)})
    assert time_to_quality(records, SUMMARY, 0.7) == (20, pytest.approx(80.0))  # the final one: 0.99, 0.75
    low = {**SUMMARY, "diversity_min_ratio_after": 0.65}
    assert time_to_quality(records, low, 0.7) == (None, None)
    nan = {**SUMMARY, "diversity_min_ratio_after": float("nan")}  # diversity not measured: not reached
    assert time_to_quality(records, nan, 0.6) == (None, None)
    assert time_to_quality([], {"epochs": 3}, 0.6) == (None, None)  # no evaluation at all


def test_an_evaluation_too_small_for_the_ratio_records_no_time_to_quality():
    """With 20 images a digit the smallest of ten diversity ratios is off by several hundredths, too coarse to
    tell r = 0.6 from 0.7: an evaluation of fewer than 50 a digit reaches nothing, and a run whose final
    evaluation is that small records why instead of figures (the report prints it)."""
    from flowgrpo.tasks.digits.report import quality_figures, time_to_quality
    from flowgrpo.training.report import format_report

    records = stream(EVALS)
    for r in records:
        if "eval/correctness" in r:
            r["eval/digit_images_min"] = 49.0 if r["epoch"] == 14 else 50.0  # the r = 0.6 evaluation: 49 a digit
    assert time_to_quality(records, SUMMARY, 0.6) == (18, pytest.approx(72.0))  # not 15: too few images there
    small = {**SUMMARY, "digit_images_min_after": 20.0}
    figures = quality_figures(stream(EVALS), small)
    assert not any(k.endswith("_epoch") for k in figures)
    assert "scored 20 images of some digit, fewer than 50" in figures["quality_skipped"]
    text = format_report({**small, **figures})
    assert any(ln.strip().startswith("time to quality: not measured: the evaluation scored 20 images")
               for ln in text.splitlines())
    assert "r = 0.6:" not in text
    enough = quality_figures(stream(EVALS), {**SUMMARY, "digit_images_min_after": 100.0})
    assert enough["quality_0.6_epoch"] == 15 and "quality_skipped" not in enough


def test_the_judge_counts_the_fewest_images_of_a_digit():
    from flowgrpo_rewards.digits_judge import DigitJudge

    images = torch.rand(23, 3, 32, 32)
    labels = [d for d in range(10) for _ in range(2)] + [3, 3, 7]  # two of every digit, four of 3, three of 7
    out = DigitJudge().batch_metrics(images, [""] * 23, [{"digit": d} for d in labels])
    assert out["digit_images_min"] == 2.0
    out = DigitJudge().batch_metrics(images[:19], [""] * 19, [{"digit": d} for d in labels[:19]])  # one 9
    assert out["digit_images_min"] == 1.0


def test_summary_and_report_carry_time_to_quality():
    from flowgrpo_rewards.digits_judge import DigitJudge

    from flowgrpo.training.report import format_report, summary_figures

    class Composed:  # what summary_figures reads of a ComposedReward
        rewards = {"digit_judge": DigitJudge()}

    records = stream(EVALS)
    figures = summary_figures([Composed(), None], SUMMARY, records)
    assert figures["quality_0.6_epoch"] == 15 and figures["quality_0.6_rl_seconds"] == pytest.approx(60.0)
    assert figures["quality_0.7_epoch"] == 18 and figures["quality_0.7_rl_seconds"] == pytest.approx(72.0)
    text = format_report({**SUMMARY, **figures, "quality_0.7_epoch": None, "quality_0.7_rl_seconds": None})
    lines = [ln.strip() for ln in text.splitlines()]
    assert any(ln.startswith("time to quality (judge correctness >= 0.97") for ln in lines)
    assert "r = 0.6: epoch 15, 60.0 s of RL" in lines
    assert "r = 0.7: not reached" in lines
    assert "<r>" not in text  # the heading and the lines name the ratio r (a fresh-eyes run saw a literal <r>)


def test_the_learning_bench_has_time_to_quality_columns(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_learning_ttq", BENCH)
    learning = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = learning  # registered before it runs, as importlib's recipe does (its dataclasses need it)
    spec.loader.exec_module(learning)
    results = []
    for seed, evals in enumerate([EVALS, {11: (0.98, 0.65)}, {}]):  # 0.6 at 15, 12, the final one (20)
        folder = tmp_path / f"s{seed}"
        folder.mkdir()
        summary = {**SUMMARY, "diversity_min_ratio_after": 0.62 if seed == 2 else 0.75, "diversity_real": 36.0,
                   **{f"digit_{d}_diversity_real": 30.0 for d in range(10)},
                   **{f"digit_{d}_diversity_after": 24.0 for d in range(10)}}
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in stream(evals)) + "\n")
        results.append({"row": "default", "seed": seed, "overrides": [], **learning.seed_figures(folder)})
    assert [r["quality_0.6_epoch"] for r in results] == [15, 12, 20]
    assert [r["quality_0.7_epoch"] for r in results] == [18, 20, None]  # seed 2 ends at 0.62
    (row,) = learning.aggregate(results)
    assert row["quality_0.6"] == "16 (12–20); 63 (48–80) s"  # (15 + 12 + 20) / 3 = 15.7 epochs, 4 s each
    assert row["quality_0.7"] == "19 (18–20); 76 (72–80) s; 2/3 seeds"
    header, _, line = learning.markdown([row]).splitlines()
    assert "time to judge >= 0.97 with every digit >= 0.6: epoch; RL s" in header
    assert "| 16 (12–20); 63 (48–80) s |" in line
