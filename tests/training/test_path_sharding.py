"""One epoch of each path objective (ReFL / DRaFT-LV and DRaFT-K, ``objective.name=refl``; on-policy distillation,
``opd``, with test_path_runs.py's moved-weights teacher) on two CPU processes (DDP, gloo) equals one process with the
same global batch.

The harness is tests/training/test_sharding.py's (one ``torchrun --nproc_per_node 2`` of
``tests/training/sharded_train.py`` running the three configs in turn; the one-process runs in this process).
Samples, rewards and every re-noising or step draw are bit-identical (seeded by the sample, never the rank); the
gradients sum in another order, so the update agrees to 1e-6 of its size with a huge Adam epsilon that makes it
proportional to the gradient (a loss normalised per process instead of over both, or a draw keyed by the rank, would
be off by far more)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.training.test_path_runs import _teacher
from tests.training.test_sharding import RTOL, _free_port, _in_process, _ok, _records, _torchrun

pytestmark = pytest.mark.slow

# each objective's settings, its trained rows of the 8 samples (DRaFT-LV: 2 copies each; DRaFT-K: one; OPD:
# int(3 * 0.99) = 2 steps each) and the figures compared besides the gradient norm
OBJECTIVES = {"refl": ({"name": "refl", "variant": "draft_lv", "lv_samples": 2}, 16, ("objective/reward",)),
              "refl_k": ({"name": "refl", "variant": "draft_k", "k": 2}, 8, ("objective/reward",)),
              "opd": ({"name": "opd"}, 16, ("objective/teacher_gap",))}


def _config(root: Path, tiny: Path, name: str, objective: dict) -> Path:
    prompts = root / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}", "digit": {d}}}\n' for p, d in
                               (("a red cube", 1), ("a blue ball", 4), ("a green tree", 7), ("a red ball", 9))))
    cfg = {
        "output_dir": str(root / name),
        "model": {"pretrained": str(tiny), "max_sequence_length": 16, "height": 32, "width": 32, "lora_rank": 4},
        "sampling": {"num_steps": 3},
        "eval_sampling": {"num_steps": 2},
        "objective": objective,
        "train": {"num_epochs": 1, "prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 2,
                  "train_batch_size": 2, "lr": 1.0, "adam_eps": 1.0e3, "weight_decay": 0.0},
        "rewards": [{"name": "digit_correctness"}],
        "data": {"train_prompts": str(prompts), "eval_num_prompts": 2},
        "logging": {"progress": False, "save_rollout_stats": True},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("path_sharding")
    teacher = str(_teacher(root, tiny_flux_dir))
    objectives = {n: {**o, **({"teacher": teacher} if o["name"] == "opd" else {})}
                  for n, (o, _, _) in OBJECTIVES.items()}
    for name, o in objectives.items():
        _in_process(_config(root, tiny_flux_dir, f"{name}_one", o))
    two = [_config(root, tiny_flux_dir, f"{name}_two", o) for name, o in objectives.items()]
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], two))
    return root


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_two_process_epoch_equals_one_process(runs, name):
    one, two = runs / f"{name}_one", runs / f"{name}_two"
    for key in ("reward_total", "group_ids", "initial_latents"):
        assert torch.equal(load_file(one / "rollouts" / "epoch_0.safetensors")[key],
                           load_file(two / "rollouts" / "epoch_0.safetensors")[key]), key
    a = load_file(one / "checkpoints" / "epoch_0" / "trainable.safetensors")
    b = load_file(two / "checkpoints" / "epoch_0" / "trainable.safetensors")
    assert a.keys() == b.keys()
    moved = 0
    for k in a:
        scale = a[k].abs().max().clamp(min=1e-12)
        assert float((a[k] - b[k]).abs().max() / scale) < RTOL, k
        moved += int("lora_B" in k and float(a[k].abs().max()) > 0)
    assert moved, "the update moved no LoRA weight: the test has no power"
    _, rows, figures = OBJECTIVES[name]
    ra, rb = _records(one)[0], _records(two)[0]
    assert ra["objective/rows"] == rb["objective/rows"] == rows
    for key in ("policy/grad_norm", "objective/loss", *figures):
        assert abs(ra[key] - rb[key]) <= 1e-5 * abs(ra[key]) + 1e-7, (key, ra[key], rb[key])
