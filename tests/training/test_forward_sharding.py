"""One epoch of each forward-process objective on two CPU processes (gloo) equals one process with the same global
batch: DiffusionNFT and AWM under DDP, DGPO with its transformer sharded (FSDP2), its group sums all-reduced.

The harness is tests/training/test_sharding.py's (one ``torchrun --nproc_per_node 2`` of
``tests/training/sharded_train.py`` running the three configs in turn; the one-process runs in this process). As there:
samples, rewards, advantages and every (σ, ε) draw are bit-identical (each draw is seeded by the sample, the global
micro-batch or the epoch, never the rank); gradients sum in another order, so the update agrees to 1e-6 of its size,
with a huge Adam epsilon that makes it proportional to the gradient (a loss normalised per process instead of over all
of them, or a draw keyed by the local micro-batch, would be off by far more). DGPO's group sums are all-reduced as the
release does; with every group whole on one process (its rule) the other processes add zeros, so they equal the local
sums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.checkpoint import whole_tensors
from tests.training.test_sharding import RTOL, SHARDED, _config, _free_port, _in_process, _ok, _records, _torchrun

pytestmark = pytest.mark.slow

RUNS = {
    "nft": {"objective": {"name": "nft"}},
    # 6 steps: AWM's two strata of grid steps 1..5 ({1, 2}, {3, 4}) are random draws (on 3 steps both are step 1)
    "awm": {"objective": {"name": "awm", "train_timesteps": 2}, "sampling": {"num_steps": 6}},
    "dgpo": {"objective": {"name": "dgpo", "trunc_steps": 1, "num_train_timesteps": 2, "clip_range": 1e-6},
             "parallel": SHARDED},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("forward_sharding")
    # P = 4 prompts x G = 2: each process holds two whole groups (DGPO's rule), micro-batches of one group;
    # the SDE-ratio clip range of the harness back at its default (the objectives refuse it)
    train = {"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 2}
    configs = {f"{n}_{w}": _config(root, tiny_flux_dir, f"{n}_{w}", train=train, algo={"clip_range": 1e-4}, **s)
               for n, s in RUNS.items() for w in ("one", "two")}
    for name in RUNS:
        _in_process(configs[f"{name}_one"])
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], [configs[f"{n}_two"] for n in RUNS]))
    return root


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_two_process_epoch_equals_one_process(runs, name):
    one, two = runs / f"{name}_one", runs / f"{name}_two"
    for key in ("reward_total", "advantages", "group_ids", "initial_latents"):
        assert torch.equal(load_file(one / "rollouts" / "epoch_0.safetensors")[key],
                           load_file(two / "rollouts" / "epoch_0.safetensors")[key]), key
    ckpt = "checkpoints/epoch_0"
    for f in ("trainable", "objective"):  # the weights and the old copy, whole whatever the checkpoint's form
        a, b = whole_tensors(one / ckpt)[f], whole_tensors(two / ckpt)[f]
        assert a.keys() == b.keys()
        moved = 0
        for k in a:
            scale = a[k].abs().max().clamp(min=1e-12)
            assert float((a[k] - b[k]).abs().max() / scale) < RTOL, (f, k)
            moved += int("lora_B" in k and float(a[k].abs().max()) > 0)
        assert f != "trainable" or moved, "the update moved no LoRA weight: the test has no power"
    ra, rb = _records(one)[0], _records(two)[0]
    assert ra["objective/rows"] == rb["objective/rows"] > 0
    for key in ("policy/grad_norm", "objective/loss"):
        assert abs(ra[key] - rb[key]) <= 1e-5 * abs(ra[key]) + 1e-7, (key, ra[key], rb[key])
