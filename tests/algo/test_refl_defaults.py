"""ReFL's defaults as its release, its margin against the rewards' ranges, and the warning when nothing trains
(issue 57, flowgrpo/algo/objectives/reward_backprop.py).

The expected values are written from the sources, not from the objective's code:

* THUDM/ImageReward ``ImageReward/ReFL.py`` line 70: ``--grad_scale`` default 1e-3 (``scripts/train_refl.sh``
  line 12: ``--grad_scale 0.001``); lines 755–756: ``loss = F.relu(-rewards+2)``, ``loss.mean() * grad_scale``.
* DRaFT (arXiv 2309.17400, Algorithm 1): the loss is −R, no scale.
* The declared score ranges: a probability in [0, 1] (digits), PickScore about 18–24 (its module docstring, after the
  PickScore README), the aesthetic predictor's 4–7, CLIP score ``openai`` 15–35.

The gradient checks reuse the float64 hand-written losses of ``tests/algo/test_path_objectives.py`` (the linear
velocity model, the linear differentiable reward whose scores lie in about (−1.5, 1)).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from flowgrpo.algo.objectives import build_objective
from flowgrpo.algo.objectives.reward_backprop import refl_margin_problem
from flowgrpo.config import build_config
from flowgrpo.rewards.compose import ComposedReward
from tests.algo.test_path_objectives import _expected_refl, _run

REPO = Path(__file__).resolve().parents[2]
LOGGER = "flowgrpo.algo.objectives.reward_backprop"
SDE_DEFAULTS = {"algo": {"clip_range": 1e-4, "kl_beta": 0.0}}


def _close(got, want):
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        g = torch.tensor(g, dtype=torch.float64)
        assert float(w.abs().max()) > 0
        assert torch.allclose(g, w, rtol=2e-5, atol=1e-12), (g, w)


# --------------------------------------------------------------------------------------------- the loss scale
@pytest.mark.parametrize("variant, want", [("refl", 1e-3), ("draft_k", 1.0), ("draft_lv", 1.0)])
def test_each_variant_defaults_to_its_sources_scale_and_an_explicit_scale_wins(variant, want):
    o = build_config({"objective": {"name": "refl", "variant": variant}, **SDE_DEFAULTS}).objective
    assert o.reward_scale is None and o.scale() == want
    o = build_config({"objective": {"name": "refl", "variant": variant, "reward_scale": 0.25}, **SDE_DEFAULTS})
    assert o.objective.scale() == 0.25


def test_refl_trains_with_the_releases_grad_scale_by_default():
    """variant refl with no reward_scale and no refl_margin: the gradient of 1e-3·relu(2 − R) (the release's
    grad_scale and margin), not of 1.0·relu(2 − R) (the scale before issue 57)."""
    obj, adapter, optim, samples, work, draws, metrics = _run({"name": "refl", "variant": "refl",
                                                                "refl_last_steps": 2})
    _close(optim.grads, _expected_refl("refl", optim, samples, draws, scale=1e-3, margin=2.0))
    # every row of the linear reward (about −1.5 … 1) is inside the margin 2: loss = 1e-3·(2 − R) on average
    assert metrics["objective/active"] == 1.0
    assert metrics["objective/loss"] == pytest.approx(1e-3 * (2.0 - metrics["objective/reward"]), rel=1e-5)


# ------------------------------------------------------------------------------------------------- the margin
class Ranged:
    """A reward declaring ``typical_range`` (nothing else is read by the margin check)."""

    differentiable = True

    def __init__(self, lo, hi) -> None:
        self.typical_range = (lo, hi)


def _composed(*parts):
    rewards = {f"r{i}": Ranged(lo, hi) for i, (lo, hi, _) in enumerate(parts)}
    return ComposedReward(rewards, {f"r{i}": w for i, (_, _, w) in enumerate(parts)})


def test_a_margin_below_every_score_is_refused_and_one_inside_the_range_is_not():
    pick = _composed((18.0, 24.0, 1.0))  # PickScore's scale
    line = refl_margin_problem(2.0, pick)
    assert line is not None and "\n" not in line
    assert line.startswith("objective.refl_margin=2 is at or below every score the optimised reward takes "
                           "(r0 ≈ [18, 24]: R ≈ [18, 24])")
    assert "set objective.refl_margin above 18 (e.g. 24" in line
    assert refl_margin_problem(18.0, pick) is not None  # at the bottom: relu(18 − R) = 0 for R ≥ 18
    assert refl_margin_problem(18.5, pick) is None
    assert refl_margin_problem(2.0, _composed((0.0, 1.0, 1.0))) is None  # a probability: 2 − p > 0 always


def test_the_composed_range_follows_the_weights():
    # R = 2·a + (−1)·b, a in [1, 3], b in [0, 4]: R ≥ 2·1 − 4 = −2, R ≤ 2·3 − 0 = 6
    comp = _composed((1.0, 3.0, 2.0), (0.0, 4.0, -1.0))
    assert refl_margin_problem(-2.0, comp) is not None and "R ≈ [-2, 6]" in refl_margin_problem(-2.0, comp)
    assert refl_margin_problem(-1.9, comp) is None
    # a zero weight is a logged metric: its range does not count
    assert refl_margin_problem(2.0, _composed((18.0, 24.0, 1.0), (-100.0, 100.0, 0.0))) is not None
    # a reward that declares no range: nothing can be concluded (the update's warning remains)
    comp = _composed((18.0, 24.0, 1.0))
    comp.rewards["r0"].typical_range = None
    assert refl_margin_problem(2.0, comp) is None


def test_a_malformed_range_is_refused_naming_the_reward():
    comp = _composed((18.0, 24.0, 1.0))
    comp.rewards["r0"].typical_range = (24.0, 18.0)
    with pytest.raises(ValueError, match="reward 'r0': typical_range must be finite with lo < hi"):
        refl_margin_problem(2.0, comp)


@pytest.mark.parametrize("spec, refused", [
    ({"name": "pickscore"}, True),  # about 18–24
    ({"name": "pickscore", "kwargs": {"divisor": 26}}, False),  # Flow-GRPO's: about 0.69–0.92, below 2
    ({"name": "aesthetic"}, True),  # 4–7
    ({"name": "clip_score"}, True),  # openai: 15–35
    ({"name": "clip_score", "kwargs": {"variant": "flowgrpo"}}, False),  # 0.5–1.2
    ({"name": "hpsv2"}, False),  # 0.2–0.35
    ({"name": "digit_correctness"}, False),  # a probability
    ({"name": "digit_correctness", "kwargs": {"cap": 0.8}}, False),
])
def test_the_built_in_rewards_ranges_decide_the_releases_margin(spec, refused):
    """The release's margin 2 against each differentiable built-in reward, constructed (no weights load)."""
    from flowgrpo.preflight import build_rewards

    cfg = build_config({"objective": {"name": "refl", "variant": "refl"}, "rewards": [spec], **SDE_DEFAULTS})
    rewards, _ = build_rewards(cfg.rewards)
    obj = build_objective(cfg)
    if refused:
        with pytest.raises(ValueError, match=r"objective.refl_margin=2 is at or below every score"):
            obj.check_rewards(rewards)
    else:
        obj.check_rewards(rewards)
    # DRaFT has no margin: never refused
    build_objective(build_config({"objective": {"name": "refl", "variant": "draft_k"}, "rewards": [spec],
                                  **SDE_DEFAULTS})).check_rewards(rewards)


def test_a_stand_in_model_declares_no_range():
    """A reward built on another architecture (the tests' tiny CLIP models) has another scale: no range."""
    from flowgrpo_rewards.pickscore import PickScoreReward

    assert PickScoreReward().typical_range == (18.0, 24.0)
    assert PickScoreReward(architecture={"vision_config": {}}).typical_range is None


def test_the_margin_is_refused_through_the_command_before_any_model_loads(tmp_path, capsys):
    """``flowgrpo train`` with variant refl over the aesthetic reward (scores 4–7): one line, exit 2, nothing
    written (the refusal comes before the model and the reward weights load)."""
    from flowgrpo.cli import main as cli_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["train", str(REPO / "configs" / "digits_refl.yaml"), "objective.variant=refl",
                  "objective.refl_last_steps=4", "rewards=[{name: aesthetic}]", f"output_dir={tmp_path / 'run'}",
                  "logging.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "objective.refl_margin=2 is at or below every score the optimised reward takes (aesthetic ≈ [4, 7]" \
        in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------ the warning
def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_an_update_in_which_no_row_is_inside_the_margin_is_warned_once(caplog):
    """Margin −10 under the linear reward (about −1.5 … 1): every relu term is 0, the gradient is 0; one line."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        obj, adapter, optim, samples, work, draws, metrics = _run({"name": "refl", "variant": "refl",
                                                                    "refl_last_steps": 2, "refl_margin": -10.0})
    assert metrics["objective/active"] == 0.0
    assert all(all(g == 0 for g in grads) for grads in optim.grads)
    (msg,) = _warnings(caplog)
    assert msg.startswith("objective refl: no sample was inside the margin in this update (every reward >= "
                          "objective.refl_margin=-10; mean ")
    # a second such update: not warned again
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        obj.update_metrics(adapter, work, _Stats(active=0.0))
    assert len(_warnings(caplog)) == 1


def test_an_update_with_some_rows_inside_the_margin_is_not_warned(caplog):
    """Margin 0: the rows scoring below 0 train (both kinds occur), no warning; the share is logged."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        *_, metrics = _run({"name": "refl", "variant": "refl", "refl_last_steps": 2, "refl_margin": 0.0})
    assert 0.0 < metrics["objective/active"] < 1.0
    assert _warnings(caplog) == []


def test_draft_is_never_warned(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        *_, metrics = _run({"name": "refl", "variant": "draft_k", "k": 1})
    assert "objective/active" not in metrics and _warnings(caplog) == []


class _Stats:
    """What the forward family's metrics read of its statistics: ``metrics()`` (one process here)."""

    def __init__(self, **means) -> None:
        self.means = means

    def metrics(self):
        return {"objective/rows": 8.0, **{f"objective/{k}": v for k, v in self.means.items()}}
