"""The embedded default learns: a short GRPO run on the digits task raises the independent judge's strict
correctness by a stated margin.

The base model is the cached pretrained digits pipeline (``ensure_digits_model``: built once, about 2 minutes,
into ``$FLOWGRPO_CACHE``). The run is deterministic for its seed on a given machine; the margin (+0.06 on the
default's 1000 ODE evaluation images, 100 per digit) is below the gain the full default shows in its first 10
epochs (+0.155 and +0.200 on RL seeds 0 and 1, bench/learning.py), so the test fails when learning breaks, not
when rounding changes.

It also checks that no digit collapsed: every digit's diversity stays at least ``MIN_RATIO`` of the same digit's
real diversity (``diversity_min_ratio_after``), the bar the README's main job must clear. The run is the shipped
default (E-GRPO's chunker, capped reward, KL to the base) cut to its first 12 epochs.
"""

from __future__ import annotations

import json

import pytest
import yaml

from flowgrpo.config import build_config

MARGIN = 0.06
MIN_RATIO = 0.6


@pytest.mark.slow
def test_short_grpo_run_raises_judge_correctness(tmp_path):
    from flowgrpo.runner import DEFAULT_CONFIG, run

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg = build_config(data, [
        f"output_dir={tmp_path / 'run'}", "train.num_epochs=12", "logging.progress=false", "train.seed=0",
    ])
    summary = run(cfg)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    before, after = summary["correctness_before"], summary["correctness_after"]
    assert after >= before + MARGIN, (before, after)
    assert summary["diversity_after"] >= 0.5 * summary["diversity_real"]
    per_digit = [summary[f"digit_{d}_diversity_after"] / summary[f"digit_{d}_diversity_real"] for d in range(10)]
    assert summary["diversity_min_ratio_after"] >= MIN_RATIO, per_digit
    assert min(per_digit) == pytest.approx(summary["diversity_min_ratio_after"])
    for png in ("reward_curve.png", "before_after.png", "samples_latest.png"):
        assert (tmp_path / "run" / png).stat().st_size > 1000
