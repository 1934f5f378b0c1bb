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

from tests.training.objective_runs import assert_two_processes_equal_one
from tests.training.test_sharding import SHARDED, _config, _free_port, _in_process, _ok, _torchrun

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
    # the weights and the old copy, whole whatever the checkpoint's form
    assert_two_processes_equal_one(runs / f"{name}_one", runs / f"{name}_two",
                                   rollout_keys=("reward_total", "advantages", "group_ids", "initial_latents"),
                                   parts=("trainable", "objective"))
