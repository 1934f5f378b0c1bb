"""A strategy registered from outside the package trains without any trainer edit.

This module plays the third party: it registers a chunking strategy (with its own settings section) on import,
and the run selects it by name in the config.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from pydantic import Field

from flowgrpo.algo.chunkers import CHUNKERS, BaseChunker, ChunkerConfig, make_plan, trainable_steps
from flowgrpo.config import ConfigError, build_config


class EveryOtherConfig(ChunkerConfig):
    name: Literal["every_other_test"] = "every_other_test"
    offset: int = Field(0, ge=0, le=1, description="train steps offset, offset + 2, …")


@CHUNKERS.register("every_other_test")
class EveryOther(BaseChunker):
    """Train every other stochastic transition, each with its own ratio."""

    Config = EveryOtherConfig

    def plan(self, traj, epoch, generator):
        steps = trainable_steps(traj)[self.cfg.offset :: 2]
        return make_plan([(t,) for t in steps], torch.ones(traj.batch_size, len(steps), dtype=torch.bool))


def test_its_settings_are_validated_by_the_run_config():
    cfg = build_config({"chunker": {"name": "every_other_test", "offset": 1}})
    assert isinstance(cfg.objective.chunker, EveryOtherConfig) and cfg.objective.chunker.offset == 1
    with pytest.raises(ConfigError,
                       match="'objective.chunker.ofset' for chunker 'every_other_test'.*did you mean 'offset'"):
        build_config({"chunker": {"name": "every_other_test", "ofset": 1}})


def test_an_outside_chunker_trains_one_epoch(tiny_flux_dir, tmp_path):
    from flowgrpo.runner import run

    cfg = build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 32, "height": 64, "width": 64,
                  "lora_rank": 4, "lora_alpha": 8},
        "sampling": {"num_steps": 4, "guidance_scale": 3.5},
        "eval_sampling": {"num_steps": 2},
        "chunker": {"name": "every_other_test", "offset": 1},
        "train": {"num_epochs": 1, "prompts_per_epoch": 1, "group_size": 2, "rollout_batch_size": 2, "lr": 1e-3},
        "rewards": [{"name": "jpeg_compressibility"}],
        "data": {"train_prompts": "t2i_compbench"},
        "logging": {"progress": False},
    })
    run(cfg)
    rec = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["plan/chunks"] == 2  # steps 1 and 3 of 4
    assert rec["policy/pairs"] == 4  # 2 samples × 2 chunks
    assert rec["policy/logprob_mismatch_max"] == 0.0
