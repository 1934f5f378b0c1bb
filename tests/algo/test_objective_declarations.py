"""What each objective declares, and what the loop and the config checks make of it: the low-signal warning
(``algo.min_learning_frac``, metric ``adv/low_signal``) only for an objective that trains on the group advantages."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.algo.objectives import OBJECTIVES
from flowgrpo.records import Advantages
from flowgrpo.training.loop import Trainer

#: written here from each objective's loss, not read from the code: whose update the advantages drive
ON_ADVANTAGES = {"sde_ratio", "nft", "awm", "dgpo", "dpo"}  # dpo: pairs chosen by the advantages
NOT_ON_ADVANTAGES = {"sft", "dpo_offline", "refl", "opd"}  # a dataset, the reward's gradient, a teacher


def test_every_builtin_objective_declares_whether_it_trains_on_advantages():
    builtins = [n for n in OBJECTIVES if n in ON_ADVANTAGES | NOT_ON_ADVANTAGES]
    assert set(builtins) == ON_ADVANTAGES | NOT_ON_ADVANTAGES  # a new built-in is sorted into one of the two
    for name in builtins:
        assert OBJECTIVES.get(name).trains_on_advantages is (name in ON_ADVANTAGES), name


class _Metrics:
    def __init__(self) -> None:
        self.logged: dict = {}

    def log(self, values: dict) -> None:
        self.logged.update(values)


@pytest.mark.parametrize("name", sorted(ON_ADVANTAGES | NOT_ON_ADVANTAGES))
def test_low_signal_is_warned_and_logged_only_for_objectives_on_advantages(name, caplog):
    """Every group of equal rewards (sft draws each record G times): learning_frac 0 < min_learning_frac 0.1."""
    adv = Advantages(values=torch.zeros(8), train_mask=torch.ones(8, dtype=torch.bool), zero_spread_frac=1.0,
                     nan_frac=0.0, learning_frac=0.0)
    trainer = SimpleNamespace(objective=OBJECTIVES.get(name), metrics=_Metrics(), main=True,
                              _low_signal_warned=False,
                              cfg=SimpleNamespace(algo=SimpleNamespace(min_learning_frac=0.1)))
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        for epoch in range(3):
            Trainer._warn_low_signal(trainer, epoch, adv)
    warned = [r for r in caplog.records if "carry a learning signal" in r.getMessage()]
    if name in ON_ADVANTAGES:
        assert trainer.metrics.logged == {"adv/low_signal": 1.0} and len(warned) == 1
    else:
        assert trainer.metrics.logged == {} and warned == []
