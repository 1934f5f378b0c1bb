"""What a researcher sees: tensorboard events, sample grid and reward curve PNGs, summary, and `flowgrpo sample`
reproducing the run's evaluation images."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowgrpo.config import build_config
from flowgrpo.writing.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_epoch_run_writes_tracker_events_pictures_and_reproducible_eval(tmp_path, tiny_flux_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowgrpo.runner import run

    prompts = tmp_path / "train.txt"
    prompts.write_text("a red cube\na blue ball\n")
    held_out = tmp_path / "eval.txt"
    held_out.write_text("a green tree\na yellow car\na purple hat\n")
    out = tmp_path / "run"
    cfg = build_config({
        "output_dir": str(out),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32},
        "sampling": {"num_steps": 3},
        "eval_sampling": {"num_steps": 4, "guidance_scale": 2.0},
        "train": {"num_epochs": 2, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4, "lr": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "eval_rewards": [{"name": "jpeg_compressibility"}],
        "data": {"train_prompts": str(prompts), "eval_prompts": str(held_out), "eval_num_prompts": 4},
        "logging": {"progress": False, "trackers": ["tensorboard"], "eval_every": 1},
    })
    run(cfg)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [0, 1]
    assert "eval/jpeg_compressibility/mean" in records[0]  # evaluated during training, not optimised
    for key in ("reward/jpeg_incompressibility/mean", "policy/clipfrac", "timing/rollout", "timing/update",
                "rollout/x0_norm", "rollout/x0_norm_max"):
        assert key in records[1]
    events = list(out.rglob("events.out.tfevents.*"))
    assert events, "no tensorboard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    logged = acc.Scalars("reward/jpeg_incompressibility/mean")
    assert [e.step for e in logged] == [0, 1]
    assert [e.value for e in logged] == pytest.approx([r["reward/jpeg_incompressibility/mean"] for r in records])
    for png in ("samples_latest.png", "reward_curve.png", "before_after.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, png
    summary = json.loads((out / "summary.json").read_text())
    assert "jpeg_compressibility_mean_before" in summary and "jpeg_incompressibility_mean_after" in summary

    sample_dir = tmp_path / "sampled"
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "sample", "--run", str(out), "--out",
                           str(sample_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = torch.load(sample_dir / "images.pt")
    theirs = torch.load(out / "eval_images_after.pt")
    assert ours.shape == theirs.shape == (4, 3, 32, 32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert len(list(sample_dir.glob("*.png"))) == 5  # four images and the grid
