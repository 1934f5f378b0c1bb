"""Every shipped config is valid: schema, registered names, reward kwargs; none loads weights. The shipped launch
config silences accelerate's warning; a config whose prompts are a built file names the command that builds it."""

from __future__ import annotations

import io
import logging
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


# --------------------------------------------------------------------------------- launch defaults and prompt files
def test_shipped_launch_defaults_silence_accelerates_warning():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger().addHandler(handler)
    try:
        args = launch_command_parser().parse_args(
            ["--config_file", str(REPO / "configs" / "accelerate" / "default.yaml"), "flowgrpo/train.py"])
        args, _, _ = _validate_launch_command(args)
    finally:
        logging.getLogger().removeHandler(handler)
    assert "were not passed" not in buf.getvalue()
    assert args.num_processes == 1 and args.mixed_precision == "no"


def test_configs_name_the_command_that_builds_their_prompt_files():
    import yaml

    for path in sorted((REPO / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        train = (data.get("data") or {}).get("train_prompts", "")
        if train.startswith("data/"):
            text = path.read_text()
            # a builder command, or (editing sets with source images, which no public set ships) the file's format
            assert "flowgrpo prompts" in text or "geneval.prompts" in text or "# Prompt file: JSONL" in text, path
