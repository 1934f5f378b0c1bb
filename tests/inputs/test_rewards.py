"""Odd and bad rewards, each through the real entry point: None (not applicable) and negative weights, infinite
scores, a constant reward (no learning signal), scores that are not numbers, a ``module:attr`` that cannot build a
reward, a reward that cannot score the prompts it is given, and digits left out of the digit judge's diversity
figures."""

from __future__ import annotations

import logging

import pytest
import torch

from flowgrpo.config import build_config
from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _cfg, _rollouts, _tiny_overrides

MOD = __name__  # the stub rewards below are loaded by 'module:attr'


class Scripted:
    """A reward whose scores come from ``fn(prompt, index_in_batch)``; returns a list (None allowed)."""

    name = "scripted"

    def __init__(self, kind: str = "const") -> None:
        self.kind = kind

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        mean = images.mean(dim=(1, 2, 3)).tolist()
        if self.kind == "const":  # every sample equal: every group has zero spread
            return [1.0] * len(prompts)
        if self.kind == "none_for_cube":  # not applicable to cube prompts
            return [None if "cube" in p else m for p, m in zip(prompts, mean, strict=True)]
        if self.kind == "inf_for_ball":
            return [float("inf") if "ball" in p else m for p, m in zip(prompts, mean, strict=True)]
        return mean


def scoring_function(images, prompts, metadata):
    """What a new user writes first: a scoring function, where a reward class (or factory) is expected."""
    return [0.0] * len(prompts)


NOT_A_REWARD = 3


class Verdicts:
    """A reward that answers in words (a plausible plugin mistake): not numbers."""

    name = "verdicts"

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        return ["good"] * len(prompts)


class OutOfMemory:
    """A reward whose model does not fit the device: scoring raises CUDA's out-of-memory error."""

    name = "oom"

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")


class RefusesPrompts:
    """A reward that refuses the prompts it is given only when scoring (it has no ``check_prompts`` hook)."""

    name = "refuses"

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        raise ValueError("refuses needs metadata field 'colour'")


# ----------------------------------------------------------------------------------------------------------- scores


@pytest.mark.slow
def test_none_is_nan_counted_and_a_negative_weight_is_a_penalty(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    cfg = _cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 1, "prompts_per_epoch": 3, "rollout_batch_size": 2},
               rewards=[{"name": f"{MOD}:Scripted", "kwargs": {"kind": "none_for_cube"}},
                        {"name": "jpeg_incompressibility", "weight": -0.5}])
    run(cfg)
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    stats = _rollouts(tmp_path / "run", 0)
    cube = torch.isnan(stats["reward/Scripted"])
    assert int(cube.sum()) == 2 and rec["reward/Scripted/nan_frac"] == pytest.approx(2 / 6)
    # weighted sum over the components present: the cube samples are −0.5·kB alone
    expected = torch.where(cube, 0.0, stats["reward/Scripted"].nan_to_num()) - 0.5 * stats[
        "reward/jpeg_incompressibility"]
    torch.testing.assert_close(stats["reward_total"], expected)


@pytest.mark.slow
def test_an_infinite_score_stops_the_run_naming_the_reward_before_advantages(tmp_path, tiny_flux_dir, monkeypatch):
    import flowgrpo.algo.objectives.base as trainer_mod
    from flowgrpo.rewards.compose import RewardError
    from flowgrpo.runner import run

    called = []
    monkeypatch.setattr(trainer_mod, "compute_advantages", lambda *a, **k: called.append(1))
    cfg = _cfg(tmp_path, tiny_flux_dir, rewards=[{"name": f"{MOD}:Scripted", "kwargs": {"kind": "inf_for_ball"}}])
    with pytest.raises(RewardError, match=r"reward 'Scripted' returned an infinite score.*'a blue ball'"):
        run(cfg)
    assert not called


@pytest.mark.slow
def test_zero_spread_warns_and_no_unmeasured_policy_statistic(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    cfg = _cfg(tmp_path, tiny_flux_dir, rewards=[{"name": f"{MOD}:Scripted", "kwargs": {"kind": "const"}}],
               algo={"drop_zero_spread_groups": True})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        run(cfg)
    warned = [r.getMessage() for r in caplog.records if "carry a learning signal" in r.getMessage()]
    assert len(warned) == 1 and "train.group_size" in warned[0]  # once, with what to change
    assert warned[0].startswith("epoch 1: only 0.0% of the samples")  # numbered as the epoch lines ("epoch 1/N")
    for rec in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        assert rec["adv/low_signal"] == 1.0 and rec["adv/learning_frac"] == 0.0
        assert not [k for k in rec if k.startswith("policy/")], rec  # nothing trained, nothing measured


def test_gdpo_takes_the_compositions_weights_a_negative_one_a_penalty():
    from flowgrpo.algo.advantages import compute_advantages
    from flowgrpo.rewards.compose import compose_rewards

    # one group of 2: quality (1, 0), penalty (1, 0), weights 1 and −2. Each component normalised in the group:
    # ±k with k = 0.5/(0.5 + 1e-4) for both; weighted sum [k − 2k, −k + 2k] = [−k, k]; over the batch mean 0,
    # population std k: A = [−k, k]/(k + 1e-4). The sample better on quality but penalised twice as much loses.
    rewards = compose_rewards({"quality": torch.tensor([1.0, 0.0]), "penalty": torch.tensor([1.0, 0.0])},
                              {"quality": 1.0, "penalty": -2.0})
    assert rewards.total.tolist() == [-1.0, 0.0]  # the weighted sum, 1·1 − 2·1
    adv = compute_advantages(rewards, torch.tensor([0, 0]), multi_reward="gdpo").values
    k = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-k / (k + 1e-4), k / (k + 1e-4)]))


def test_a_reward_returning_words_is_one_line_naming_it_not_a_traceback(tmp_path, tiny_flux_dir, capsys):
    from flowgrpo.train import main

    (tmp_path / "p.txt").write_text("a red cube\na blue ball\n")
    with pytest.raises(SystemExit) as info:
        main([f"model.pretrained={tiny_flux_dir}", "model.height=32", "model.width=32", "sampling.num_steps=2",
              "eval_sampling.num_steps=2", "objective.chunker={name: per_step}", "train.num_epochs=1",
              "train.prompts_per_epoch=2", "train.group_size=2", "train.rollout_batch_size=4",
              "train.train_batch_size=4", "train.optimizer_steps_per_epoch=1",
              f"rewards=[{{name: '{MOD}:Verdicts'}}]", "eval_rewards=[]", f"data.train_prompts={tmp_path / 'p.txt'}",
              f"data.eval_prompts={tmp_path / 'p.txt'}",
              "data.eval_num_prompts=2", "logging.progress=false", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "error: reward 'Verdicts' returned list ['good', 'good'], which is not numbers")


def test_a_reward_out_of_device_memory_is_one_line_with_what_to_change(tmp_path, tiny_flux_dir, capsys):
    """Before: a reward raising CUDA out-of-memory gave a traceback with no hint (issue 54). Now one line naming the
    reward and the settings that make it fit."""
    from flowgrpo.train import main

    with pytest.raises(SystemExit) as info:
        main([*_tiny_overrides(tmp_path, tiny_flux_dir), f"rewards=[{{name: '{MOD}:OutOfMemory'}}]", "eval_rewards=[]",
              "train.num_epochs=1", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: reward 'OutOfMemory' ran out of device memory on a batch of ")
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in line and "parallel.reward_models=offload" in line


def test_out_of_device_memory_in_the_run_is_one_line_with_what_to_change(tmp_path, tiny_flux_dir, capsys,
                                                                        monkeypatch):
    """The rollout or the update out of memory: one line naming the stage and the settings to change."""
    import flowgrpo.training.loop as loop
    from flowgrpo.train import main

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(loop.Trainer, "rollout_phase", oom)
    with pytest.raises(SystemExit) as info:
        main([*_tiny_overrides(tmp_path, tiny_flux_dir), "train.num_epochs=1", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: out of device memory (epochs, epoch 1): CUDA out of memory. Tried to allocate")
    assert "train.rollout_batch_size" in line


# --------------------------------------------------------- rewards that cannot be built or cannot score the prompts


@pytest.mark.parametrize("attr, needle", [
    ("scoring_function", r"is a scoring function \(it takes \['images', 'prompts'\]\), not a factory: a reward is a "
                         r"class, or a factory"),
    ("NOT_A_REWARD", r"is a int \(3\), not a class or factory"),
])
def test_a_module_attr_that_cannot_build_a_reward_is_named_before_any_model_loads(tmp_path, monkeypatch, attr,
                                                                                  needle):
    """Before: 'missing a required argument: images (rewards[].kwargs)' and "'int' object is not callable"."""
    import flowgrpo.models as models
    from flowgrpo.runner import run

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the rewards were checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    cfg = build_config(None, [f"rewards=[{{name: '{MOD}:{attr}'}}]", f"output_dir={tmp_path / 'r'}"])
    with pytest.raises(Exception, match=rf"reward '{MOD}:{attr}' {needle}") as info:
        run(cfg)
    assert not isinstance(info.value, AssertionError)


def test_a_rewards_value_error_on_bad_input_is_one_line(tmp_path, tiny_flux_dir, capsys):
    """Before: the default's ``digit_judge`` kept with plain-text prompts died in the first evaluation with a
    traceback, although its ValueError names the missing metadata field (the reward contract's bad input). Now
    the digits rewards check the prompt sets before the model loads (their ``check_prompts`` hook), and a reward
    without the hook that raises ValueError on a batch is still one line."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load before the prompt sets are checked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "load_model_from_config", no_model)
        with pytest.raises(SystemExit) as info:
            main([*_tiny_overrides(tmp_path, tiny_flux_dir), "eval_rewards=[{name: digit_judge}]",
                  "train.num_epochs=1", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"error: reward 'digit_judge' cannot score the evaluation prompts ({tmp_path / 'p.txt'}): digit_judge "
        "needs metadata['digit']")
    with pytest.raises(SystemExit) as info:
        main([*_tiny_overrides(tmp_path, tiny_flux_dir), f"eval_rewards=[{{name: '{MOD}:RefusesPrompts'}}]",
              "train.num_epochs=1", f"output_dir={tmp_path / 'run2'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: reward 'RefusesPrompts' failed on a batch of 2: ValueError: "
                                                   "refuses needs metadata field 'colour'")


# ------------------------------------------------------------------------- digits left out of the judge's diversity


def _judge_metrics(labels, caplog):
    import numpy as np
    from flowgrpo_rewards.digits_judge import DigitJudge

    from flowgrpo.tasks.digits.data import digits_to_images, load_digit_split

    x, y = load_digit_split("all")
    idx = [int(np.flatnonzero(y == d)[k]) for k, d in enumerate(labels)]
    images = digits_to_images(torch.from_numpy(x[idx]).double())
    with caplog.at_level(logging.WARNING, logger="flowgrpo_rewards.digits_judge"):
        return DigitJudge().batch_metrics(images, [""] * len(labels), [{"digit": d} for d in labels])


def test_the_judge_names_digits_left_out_of_diversity(caplog):
    labels = [d for d in range(10) for _ in range(2 if d < 5 else 1)]  # eval_num_prompts=15
    out = _judge_metrics(labels, caplog)
    assert "leave out digits [5, 6, 7, 8, 9] (one image: [5, 6, 7, 8, 9])" in caplog.text
    assert "multiple of 10 with at least 2 per digit" in caplog.text
    assert out["diversity"] == out["diversity"]  # still measured over digits 0-4


def test_the_judge_names_absent_digits_too(caplog):
    _judge_metrics([0, 0, 1, 1, 2], caplog)
    assert "one image: [2], no image: [3, 4, 5, 6, 7, 8, 9]" in caplog.text


def test_the_judge_is_quiet_with_two_images_of_every_digit_and_keeps_the_none_warning(caplog):
    _judge_metrics([d for d in range(10) for _ in range(2)], caplog)
    assert "digit_judge" not in caplog.text
    caplog.clear()
    out = _judge_metrics(list(range(10)), caplog)
    assert "no digit has two samples" in caplog.text and "leave out" not in caplog.text
    assert out["diversity"] != out["diversity"]  # NaN
