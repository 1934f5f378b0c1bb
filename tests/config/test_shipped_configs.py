"""Every shipped config is valid: schema, registered names, reward kwargs; none loads weights. A model that cannot
be reached fails fast naming the model id."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_unreachable_model_fails_at_once_naming_it():
    """No local folder, not cached: offline it fails without touching the network; with an unreachable hub (a
    closed port on loopback stands in for it) after one connection attempt, not after the hub client's retries."""
    code = ("import logging\nlogging.basicConfig(level=logging.WARNING)\n"
            "from flowgrpo.models import load_model\n"
            "try:\n    load_model('black-forest-labs/FLUX.1-dev')\n"
            "except ValueError as e:\n    print('ERR', e)\n")
    for offline, why in (("1", "HF_HUB_OFFLINE is set"), ("0", "cannot be reached from this machine")):
        env = {**os.environ, "HF_HUB_OFFLINE": offline, "HF_ENDPOINT": "http://127.0.0.1:9",
               "HF_HUB_CACHE": "/nonexistent-flowgrpo-test-cache"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert "ERR cannot read model 'black-forest-labs/FLUX.1-dev'" in proc.stdout, proc.stderr[-2000:]
        assert why in proc.stdout and "hf download black-forest-labs/FLUX.1-dev" in proc.stdout
        assert "Retrying" not in proc.stderr, proc.stderr[-2000:]
