"""One epoch of online DPO on two CPU processes (gloo, DDP) equals one process with the same global batch.

The harness is tests/training/test_sharding.py's (one ``torchrun --nproc_per_node 2`` of
``tests/training/sharded_train.py``; the one-process run in this process). Each process holds whole groups and
fills the same number of pair slots; every (σ, ε) draw is seeded by (group, slot), never the rank; the step's loss
is the mean over the pairs of both processes. Samples, rewards and advantages are bit-identical; the update agrees
to 1e-6 of its size (gradients sum in another order), with a huge Adam epsilon that makes it proportional to the
gradient: a loss normalised per process, or a draw keyed by the local slot, would be off by far more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.checkpoint import whole_tensors
from tests.training.test_sharding import RTOL, _config, _free_port, _in_process, _ok, _records, _torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("prefs_sharding")
    # P = 4 prompts x G = 2: each process two whole groups; every pair of a group (all: one slot for G = 2)
    sections = {"train": {"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 1},
                "algo": {"clip_range": 1e-4}, "objective": {"name": "dpo", "beta_dpo": 50.0, "num_train_timesteps": 2}}
    one, two = (_config(root, tiny_flux_dir, f"dpo_{w}", **sections) for w in ("one", "two"))
    _in_process(one)
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], [two]))
    return root


def test_a_two_process_dpo_epoch_equals_one_process(runs):
    one, two = runs / "dpo_one", runs / "dpo_two"
    for key in ("reward_total", "advantages", "group_ids", "initial_latents"):
        assert torch.equal(load_file(one / "rollouts" / "epoch_0.safetensors")[key],
                           load_file(two / "rollouts" / "epoch_0.safetensors")[key]), key
    a, b = (whole_tensors(r / "checkpoints" / "epoch_0")["trainable"] for r in (one, two))
    assert a.keys() == b.keys()
    moved = 0
    for k in a:
        scale = a[k].abs().max().clamp(min=1e-12)
        assert float((a[k] - b[k]).abs().max() / scale) < RTOL, k
        moved += int("lora_B" in k and float(a[k].abs().max()) > 0)
    assert moved, "the update moved no LoRA weight: the test has no power"
    ra, rb = _records(one)[0], _records(two)[0]
    assert ra["objective/rows"] == rb["objective/rows"] > 0
    for key in ("policy/grad_norm", "objective/loss", "objective/implicit_acc"):
        assert abs(ra[key] - rb[key]) <= 1e-5 * abs(ra[key]) + 1e-7, (key, ra[key], rb[key])
