"""Two CPU processes (gloo, torchrun) give the same advantages and the same parameter update as one process
with the same global batch; so do two processes whose model lives on a fake accelerator behind an NCCL-like
process group that refuses host tensors (``tests/training/fake_device_train.py``): every collective gets its tensors
on the device the backend needs, and no operation mixes devices.

Tolerance: the gathered rewards and advantages are computed from bit-identical samples (every noise is seeded
by (seed, epoch, prompt, sample), never by rank) and must be equal exactly. The parameter update sums the same
per-pair gradients in a different order (per rank, then DDP's all-reduce average), so float32 rounding differs:
we allow 1e-6 relative to the update's size (a few ulps of accumulated rounding; a wrong normalisation, e.g.
dividing by the local instead of the global pair count, is off by a factor of 2).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, tiny_flux_dir: Path, name: str) -> Path:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\n")
    cfg = {
        "output_dir": str(tmp_path / name),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "lora_rank": 4},
        "sampling": {"num_steps": 3},
        # P = 3 prompts x G = 2: with 2 ranks the middle group spans both processes
        # a huge Adam epsilon makes the first update proportional to the gradient (plain Adam's first step is
        # lr·sign(g), blind to a wrong loss normalisation)
        "train": {"num_epochs": 1, "prompts_per_epoch": 3, "group_size": 2, "rollout_batch_size": 3,
                  "lr": 1.0, "adam_eps": 1.0e3, "weight_decay": 0.0},
        "algo": {"clip_range": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        # 3 evaluation images: 2 on rank 0, 1 (and a padding repeat) on rank 1
        "data": {"train_prompts": str(prompts), "eval_num_prompts": 3},
        "logging": {"progress": False, "save_rollout_stats": True},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cmd: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tiny_flux_dir):
    one = _config(tmp_path, tiny_flux_dir, "one")
    two = _config(tmp_path, tiny_flux_dir, "two")
    fake = _config(tmp_path, tiny_flux_dir, "fake")
    _run([sys.executable, "flowgrpo/train.py", str(one)], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
          "flowgrpo/train.py", str(two)], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
          "tests/training/fake_device_train.py", str(fake)], tmp_path)
    a = load_file(tmp_path / "one" / "rollouts" / "epoch_0.safetensors")
    for name in ("two", "fake"):
        _compare(tmp_path, a, name)
        _same_evaluation(tmp_path / "one", tmp_path / name)


def _compare(tmp_path: Path, a: dict, name: str) -> None:
    b = load_file(tmp_path / name / "rollouts" / "epoch_0.safetensors")
    for key in ("reward_total", "advantages", "group_ids", "initial_latents"):
        assert torch.equal(a[key], b[key]), key
    assert a["group_ids"].tolist() == [0, 0, 1, 1, 2, 2] or len(set(a["group_ids"].tolist())) == 3
    init = b["initial_latents"].flatten(1)
    assert len({tuple(row.tolist()) for row in init}) == init.shape[0]  # pairwise distinct noises
    # a group spanning ranks is normalised as one group: zero mean within each group
    for g in b["group_ids"].unique():
        assert abs(float(b["advantages"][b["group_ids"] == g].sum())) < 1e-5
    base = load_file(_lora(tmp_path / "one"))
    other = load_file(_lora(tmp_path / name))
    assert base.keys() == other.keys()
    for k in base:
        scale = base[k].abs().max().clamp(min=1e-12)
        assert float((base[k] - other[k]).abs().max() / scale) < 1e-6, k


def _jpeg_kb(images: torch.Tensor) -> torch.Tensor:
    from flowgrpo_rewards.jpeg import jpeg_size_kb

    return jpeg_size_kb(images)


def _same_evaluation(one: Path, two: Path, n: int = 3, score=_jpeg_kb) -> None:
    """The "before" evaluation (the base weights) of a run on 2 processes, each data rank sampling its share of
    the ``n`` images in its own batches (:meth:`flowgrpo.training.evaluation.Evaluation.evaluate`), equals one
    process's: the images, whole and in order, to float32 rounding of another batch layout (1e-5 of the [0, 1]
    range), and each run's figure is ``score`` (the run's one reward, recomputed here) averaged over its own
    ``n`` images, so the figures differ only through that rounding. (The JPEG size steps by bytes: a rounding-level
    change of one 8-bit pixel moves it by 1e-3 kB, so two runs' JPEG figures are not compared to each other.)"""
    ia, ib = (torch.load(r / "eval_images_before.pt", weights_only=True) for r in (one, two))
    assert ia.shape == ib.shape and ia.shape[0] == n
    assert float((ia - ib).abs().max()) < 1e-5
    ma, mb = (json.loads((r / "eval_before.json").read_text())["metrics"] for r in (one, two))
    assert ma.keys() == mb.keys() and len(ma) == 1
    (key,) = ma
    for got, images in ((ma, ia), (mb, ib)):
        assert got[key] == pytest.approx(float(score(images).mean()), rel=1e-6), (key, got[key])


def _free_port() -> str:
    with socket.socket() as s:  # other test runs on this machine may hold a fixed port
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _lora(run: Path) -> Path:
    return run / "lora" / "pytorch_lora_weights.safetensors"
