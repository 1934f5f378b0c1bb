"""Every shipped config is valid: schema, registered names, reward kwargs; none loads weights. A model that cannot
be reached fails fast naming the model id."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.algo.advantages import ESTIMATORS
from flowgrpo.algo.chunkers import CHUNKERS
from flowgrpo.config import load_config
from flowgrpo.rewards.registry import load_reward
from flowgrpo.sampling.sde import SDE_KINDS

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_expected_configs_ship():
    names = {p.stem for p in CONFIGS}
    assert {"digits", "tiny_jpeg", "flux_grpo", "flux_chunk", "flux_mix", "flux_egrpo", "sd35_grpo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_is_valid_and_names_registered_strategies(path):
    cfg = load_config(path)
    assert cfg.chunker.name in CHUNKERS
    assert cfg.sampling.sde_kind in SDE_KINDS
    assert cfg.algo.advantage in ESTIMATORS
    for spec in cfg.rewards + cfg.eval_rewards:
        reward, origin = load_reward(spec.name, **spec.kwargs)  # constructs: checks kwargs, loads no weights
        assert origin.distribution is not None
        assert callable(reward)
