"""Short runs on the tiny FLUX pipeline for the tests that go through the real entry points
(``flowgrpo.runner.run``, ``flowgrpo/train.py``, the ``flowgrpo`` CLI): a config of two epochs on three prompts
(``_cfg``), the same as command-line overrides (``_tiny_overrides``), and the rollouts a run saved (``_rollouts``);
``_one_thread``, a fixture that runs a test on one thread (autouse in a module that imports it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.config import build_config


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads on a shared 2-core machine (and a run's rounding is its threads')."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(tmp_path: Path, tiny_flux_dir: Path, name: str = "run", *, prompts=("a red cube", "a blue ball",
         "a green tree"), overrides=(), **sections) -> object:
    path = tmp_path / f"{name}_prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    data = {
        "output_dir": str(tmp_path / name),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "lora_rank": 4},
        "sampling": {"num_steps": 2},
        "eval_sampling": {"num_steps": 2},
        "train": {"num_epochs": 2, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4, "lr": 1e-2},
        "algo": {"clip_range": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(path), "eval_prompts": str(path), "eval_num_prompts": 2},
        "logging": {"progress": False, "save_rollout_stats": True},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return build_config(data, list(overrides))


def _rollouts(run: Path, epoch: int) -> dict:
    return load_file(run / "rollouts" / f"epoch_{epoch}.safetensors")


def _tiny_overrides(tmp_path: Path, tiny_flux_dir: Path) -> list[str]:
    (tmp_path / "p.txt").write_text("a red cube\na blue ball\n")
    return [f"model.pretrained={tiny_flux_dir}", "model.height=32", "model.width=32", "sampling.num_steps=2",
            "eval_sampling.num_steps=2", "objective.chunker={name: per_step}", "train.prompts_per_epoch=2",
            "train.group_size=2",
            "train.rollout_batch_size=4", "train.train_batch_size=4", "train.optimizer_steps_per_epoch=1",
            "rewards=[{name: jpeg_compressibility}]",
            "eval_rewards=[]", f"data.train_prompts={tmp_path / 'p.txt'}", f"data.eval_prompts={tmp_path / 'p.txt'}",
            "data.eval_num_prompts=2", "logging.progress=false"]
