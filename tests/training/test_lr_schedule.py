"""The learning-rate schedule over the epochs (``train.lr_schedule``): values derived by hand, the warmup's factor
multiplied in, a resumed run's rate, and the refusal of a knob the schedule does not read."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator

from flowgrpo import parallel
from flowgrpo.config import ConfigError, build_config
from flowgrpo.training.optim import Optimization, epoch_lr_factor

# cosine from 1 to m = 0.1 over N = 4 epochs, by hand: 0.1 + 0.9 * (1 + cos(pi * e / 4)) / 2
COSINE_4 = [1.0, 0.1 + 0.9 * (2 + math.sqrt(2)) / 4, 0.55, 0.1 + 0.9 * (2 - math.sqrt(2)) / 4]


def test_epoch_factors_by_hand():
    assert [epoch_lr_factor(e, 4, "cosine", 0.1) for e in range(4)] == pytest.approx(COSINE_4)
    assert COSINE_4[1] == pytest.approx(0.868198, abs=1e-6)
    assert [epoch_lr_factor(e, 3, "cosine") for e in range(3)] == pytest.approx([1.0, 0.75, 0.25])
    assert [epoch_lr_factor(e, 4, "constant") for e in range(4)] == [1.0] * 4
    with pytest.raises(ValueError, match="train.lr_schedule='linear' is not a schedule"):
        epoch_lr_factor(0, 4, "linear")


class _Adapter:
    def __init__(self):
        self.transformer = torch.nn.Linear(2, 1)


def _optim(monkeypatch, *overrides):
    config = build_config({"train": {"lr": 0.01, "num_epochs": 4}}, list(overrides))
    adapter = _Adapter()
    monkeypatch.setattr(parallel, "prepare_model", lambda adapter, accelerator, config: adapter.transformer)
    return Optimization(config, adapter=adapter, accelerator=Accelerator(cpu=True))


def _rates(optim, epochs, steps_per_epoch):
    """The rate each optimizer step of each epoch applies (read from the optimizer before its step)."""
    seen = []
    for epoch in epochs:
        optim.begin_epoch(epoch)
        for _ in range(steps_per_epoch):
            seen.append(optim.optimizer.param_groups[0]["lr"])
            optim.model.weight.grad = torch.ones_like(optim.model.weight)
            optim.step(epoch)
            optim.zero_grad()
    return seen


def test_the_optimizer_applies_warmup_times_the_epoch_factor(monkeypatch):
    optim = _optim(monkeypatch, "train.lr_schedule=cosine", "train.lr_min_ratio=0.1", "train.warmup_steps=3")
    warm = [1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1]  # min(1, (step + 1) / 3) of steps 0..7
    expected = [0.01 * warm[2 * e + k] * COSINE_4[e] for e in range(4) for k in range(2)]
    assert _rates(optim, range(4), 2) == pytest.approx(expected)


def test_constant_schedule_keeps_the_rate(monkeypatch):
    assert _rates(_optim(monkeypatch), range(4), 2) == pytest.approx([0.01] * 8)


def test_a_resumed_optimizer_takes_the_epochs_rate(monkeypatch):
    """A checkpoint restores the step count (the warmup's); the epoch's factor is set again at the epoch's start."""
    optim = _optim(monkeypatch, "train.lr_schedule=cosine", "train.lr_min_ratio=0.1")
    state = optim.lr_scheduler.state_dict()
    _rates(optim, range(2), 2)
    resumed = _optim(monkeypatch, "train.lr_schedule=cosine", "train.lr_min_ratio=0.1")
    resumed.lr_scheduler.load_state_dict({**state, "last_epoch": 4})
    assert _rates(resumed, [2, 3], 1) == pytest.approx([0.01 * COSINE_4[2], 0.01 * COSINE_4[3]])


def test_min_ratio_without_the_cosine_schedule_is_refused():
    with pytest.raises(ConfigError, match="train.lr_min_ratio=0.1 is read only by train.lr_schedule=cosine"):
        build_config({}, ["train.lr_min_ratio=0.1"])
    # the fix it names works by override alone (a file's cosine with its floor switched to constant)
    with pytest.raises(ConfigError, match="set train.lr_min_ratio=0 "):
        build_config({"train": {"lr_schedule": "cosine", "lr_min_ratio": 0.1}}, ["train.lr_schedule=constant"])
    cfg = build_config({"train": {"lr_schedule": "cosine", "lr_min_ratio": 0.1}},
                       ["train.lr_schedule=constant", "train.lr_min_ratio=0"])
    assert (cfg.train.lr_schedule, cfg.train.lr_min_ratio) == ("constant", 0.0)
