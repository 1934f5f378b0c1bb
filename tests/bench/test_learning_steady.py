"""bench/learning.py's steady-state columns on hand-written records (no training): the smallest min per-digit
diversity ratio over the evaluations after 60 epochs or more, and whether each is at judge >= 0.97 with every digit
>= 0.7 of its real diversity."""

from __future__ import annotations

import pytest

from tests.bench.test_learning import learning  # noqa: F401 - the module fixture


def _records(evals: dict[int, tuple[float, float]]) -> list[dict]:
    """Epoch records 0..89; ``evals`` maps a 1-based epoch to (judge correctness, min ratio) of its evaluation."""
    out = []
    for e in range(90):
        r = {"epoch": e}
        if e + 1 in evals:
            r["eval/correctness"], r["eval/diversity_min_ratio"] = evals[e + 1]
        out.append(r)
    return out


def test_steady_state_reads_the_evaluations_from_epoch_60(learning):  # noqa: F811
    summary = {"epochs": 90, "correctness_after": 0.99, "diversity_min_ratio_after": 0.72}
    # epoch 55's dip does not count; 60, 70, 80 and the final one do
    recs = _records({55: (0.90, 0.40), 60: (0.98, 0.75), 70: (0.975, 0.71), 80: (0.99, 0.80)})
    assert learning.steady_state(recs, summary) == (pytest.approx(0.71), True)
    recs = _records({60: (0.98, 0.75), 70: (0.965, 0.80)})  # one evaluation under the judge bar
    assert learning.steady_state(recs, summary) == (pytest.approx(0.72), False)
    recs = _records({60: (0.98, 0.69)})  # one under the diversity bar
    assert learning.steady_state(recs, summary) == (pytest.approx(0.69), False)
    # a run of 50 epochs has no evaluation that late
    assert learning.steady_state(_records({50: (0.99, 0.9)})[:50], {"epochs": 50, "correctness_after": 0.99,
                                                                     "diversity_min_ratio_after": 0.9}) == (None, None)
    # a 60-epoch run: its final evaluation counts
    assert learning.steady_state([], {"epochs": 60, "correctness_after": 0.97,
                                      "diversity_min_ratio_after": 0.7}) == (pytest.approx(0.7), True)
