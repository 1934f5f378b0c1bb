"""The shipped configs of the newer model families run on their tiny random pipelines: their LoRA targets name
modules of the model's transformer, and the editing config trains one epoch through the real trainer, writing
before/after images beside their source images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import tiny_folder
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here

REPO = Path(__file__).resolve().parents[2]
CONFIG_OF = {"qwenimage": "qwenimage", "zimage": "zimage", "flux2_klein": "flux2_klein", "flux2": "flux2",
             "kontext": "kontext", "qwenimage_edit_plus": "qwenimage_edit_plus"}


@pytest.mark.parametrize("name", sorted(CONFIG_OF))
def test_config_lora_targets_exist_in_the_transformer(name, tmp_path_factory):
    import diffusers

    cfg = load_config(REPO / "configs" / f"{CONFIG_OF[name]}.yaml")
    folder = tiny_folder(CASES[name], tmp_path_factory)
    index = json.loads((folder / "transformer" / "config.json").read_text())
    transformer = getattr(diffusers, index["_class_name"]).from_pretrained(folder / "transformer")
    names = [n for n, _ in transformer.named_modules()]
    for target in cfg.model.lora_target_modules:
        assert any(n == target or n.endswith("." + target) for n in names), (name, target)


def test_kontext_config_trains_an_epoch_and_shows_sources(tmp_path_factory, tmp_path):
    """configs/kontext.yaml with the tiny Kontext folder, small batches and a rewards override (the real ones
    need checkpoints): one epoch, exact on-policy ratio, and before_after.png with the source row."""
    from PIL import Image

    from flowgrpo.config import build_config
    from flowgrpo.runner import run
    from flowgrpo.testing.rewards import default_images

    folder = tiny_folder(CASES["kontext"], tmp_path_factory)
    (tmp_path / "src").mkdir()
    lines = []
    for i, img in enumerate(default_images(2, 64, 64, torch.Generator().manual_seed(3))):
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(tmp_path / "src" / f"{i}.png")
        lines.append(json.dumps({"prompt": ["make the cube red", "add two dogs"][i], "image": f"src/{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    raw = load_config(REPO / "configs" / "kontext.yaml").model_dump()
    raw.pop("rewards")
    cfg = build_config(raw, [
        f"model.pretrained={folder}", "model.height=64", "model.width=64", "model.max_sequence_length=32",
        "model.dtype=float32", "model.gradient_checkpointing=false", "train.num_epochs=1", "train.group_size=2",
        "train.prompts_per_epoch=2", "train.rollout_batch_size=2", "sampling.num_steps=3", "eval_sampling.num_steps=2",
        "train.ema_decay=null", "rewards=[{name: jpeg_compressibility}]", f"data.train_prompts={tmp_path}/edits.jsonl",
        f"data.eval_prompts={tmp_path}/edits.jsonl", "data.eval_num_prompts=2", f"output_dir={out}",
        "logging.progress=false", "logging.trackers=[]",
    ])
    run(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["policy/logprob_mismatch_max"] == 0.0
    assert (out / "before_after.png").is_file() and (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
