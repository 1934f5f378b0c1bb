"""One epoch of each preference / supervised objective (online ``dpo``, ``dpo_offline``, ``sft``) on two CPU
processes (gloo, DDP) equals one process with the same global batch.

The harness is tests/training/test_sharding.py's (one ``torchrun --nproc_per_node 2`` of
``tests/training/sharded_train.py`` running the three configs in turn; the one-process runs in this process). Each
process holds whole groups (online DPO: the pair slots of its groups; the dataset objectives: its dataset records,
from test_prefs_runs.py's hand-written sets); every (σ, ε) draw is seeded by (group, slot) or the sample, never the
rank; the step's loss is the mean over the rows of both processes. Samples (or dataset records), rewards and
advantages are bit-identical; the update agrees to 1e-6 of its size (gradients sum in another order), with a huge
Adam epsilon that makes it proportional to the gradient: a loss normalised per process, or a draw keyed by the local
slot, would be off by far more."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.training.objective_runs import assert_two_processes_equal_one
from tests.training.test_prefs_runs import write_datasets
from tests.training.test_sharding import _config, _free_port, _in_process, _ok, _torchrun

pytestmark = pytest.mark.slow

# the objective's figures compared (besides objective/rows and the gradient norm)
DPO_FIGURES = ("objective/loss", "objective/implicit_acc", "objective/err_chosen", "objective/err_rejected")
FIGURES = {"dpo": DPO_FIGURES, "dpo_offline": DPO_FIGURES,
           "sft": ("objective/loss", "objective/fm_loss")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("prefs_sharding")
    (root / "data").mkdir()
    data = write_datasets(root / "data")
    # P = 4 prompts (online) or dataset records x G = 2: each process two whole groups; every pair of a group
    # (online: one slot for G = 2); the dataset objectives read the 4 records of pairs.jsonl / items.jsonl
    train = {"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 1}
    algo = {"clip_range": 1e-4}  # the default of the objectives that read no clip range
    sections = {
        "dpo": {"train": train, "algo": algo,
                "objective": {"name": "dpo", "beta_dpo": 50.0, "num_train_timesteps": 2}},
        "dpo_offline": {"train": train, "algo": algo, "data": {"train_prompts": str(data / "pairs.jsonl")},
                        "objective": {"name": "dpo_offline", "beta_dpo": 50.0, "num_train_timesteps": 2}},
        "sft": {"train": train, "algo": algo, "data": {"train_prompts": str(data / "items.jsonl")},
                "objective": {"name": "sft", "num_train_timesteps": 2}},
    }
    for name, s in sections.items():
        _in_process(_config(root, tiny_flux_dir, f"{name}_one", **s))
    two = [_config(root, tiny_flux_dir, f"{name}_two", **s) for name, s in sections.items()]
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], two))
    return root


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_a_two_process_epoch_equals_one_process(runs, name):
    one, two = runs / f"{name}_one", runs / f"{name}_two"
    keys = ("reward_total", "advantages", "group_ids", "initial_latents")
    present = load_file(one / "rollouts" / "epoch_0.safetensors").keys()
    assert_two_processes_equal_one(one, two, rollout_keys=[k for k in keys if k in present or name == "dpo"],
                                   every_rollout=True, figures=FIGURES[name])
