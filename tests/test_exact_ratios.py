"""The on-policy importance ratio through the real trainer: `policy/logprob_mismatch_max` is exactly 0 when the
training batch has the rollout's layout (float32 and bf16 models, SDE arithmetic in float32), nonzero in float32
when it does not, and 0 again in recompute mode. Also: shared-noise groups start from identical latents.

On this CPU a training micro-batch of 2 instead of the rollout's 4 changes the matrix-multiply blocking and
leaves a mismatch of about 1e-7 (docs/design.md, "Exactness"); a different BLAS may round differently, but not to 0
on every row and step.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import build_config
from flowgrpo.metrics import read_metrics


def _run(tmp_path, tiny_flux_dir, name, **over):
    from flowgrpo.runner import run

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    size = over.pop("size", 32)
    data = {
        "output_dir": str(tmp_path / name),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": size, "width": size,
                  "dtype": over.pop("dtype", "float32")},
        "sampling": {"num_steps": 3, "same_noise_in_group": over.pop("same_noise", False)},
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4,
                  "train_batch_size": over.pop("train_batch_size", 4), "lr": 1e-2},
        "algo": {"recompute_old_log_probs": over.pop("recompute", False)},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts)},
        "logging": {"progress": False, "save_rollout_stats": True},
    }
    run(build_config(data))
    return read_metrics(tmp_path / name / "metrics.jsonl")[0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matched_layout_is_exact(tmp_path, tiny_flux_dir, dtype):
    rec = _run(tmp_path, tiny_flux_dir, f"matched_{dtype}", dtype=dtype)
    assert rec["policy/logprob_mismatch_max"] == 0.0
    assert rec["policy/ratio_mean"] == 1.0


@pytest.mark.slow
def test_mismatched_layout_shows_and_recompute_removes_it(tmp_path, tiny_flux_dir):
    # at 32² the velocity's layout differences (~1e-7) fall below the float32 resolution of the log-prob (a mean
    # over the latent dims); at 128² (64 image tokens) they show on this CPU
    off = _run(tmp_path, tiny_flux_dir, "mismatched", train_batch_size=2, size=128)
    assert 0.0 < off["policy/logprob_mismatch_max"] < 1e-4
    fixed = _run(tmp_path, tiny_flux_dir, "recomputed", train_batch_size=2, recompute=True, size=128)
    assert fixed["policy/logprob_mismatch_max"] == 0.0


@pytest.mark.slow
def test_shared_noise_groups_start_from_identical_latents(tmp_path, tiny_flux_dir):
    from safetensors.torch import load_file

    _run(tmp_path, tiny_flux_dir, "shared", same_noise=True)
    stats = load_file(tmp_path / "shared" / "rollouts" / "epoch_0.safetensors")
    init, groups = stats["initial_latents"], stats["group_ids"]
    for g in groups.unique():
        rows = init[groups == g]
        assert all(torch.equal(rows[0], r) for r in rows[1:])
    assert not torch.equal(init[groups == groups[0]][0], init[groups != groups[0]][0])
