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

from tests.training.objective_runs import assert_two_processes_equal_one
from tests.training.test_path_runs import _teacher
from tests.training.test_sharding import _config as sharding_config
from tests.training.test_sharding import _free_port, _in_process, _ok, _torchrun

pytestmark = pytest.mark.slow

# each objective's settings, its trained rows of the 8 samples (DRaFT-LV: 2 copies each; DRaFT-K: one; OPD:
# int(3 * 0.99) = 2 steps each) and the figures compared besides the gradient norm
OBJECTIVES = {"refl": ({"name": "refl", "variant": "draft_lv", "lv_samples": 2}, 16, ("objective/reward",)),
              "refl_k": ({"name": "refl", "variant": "draft_k", "k": 2}, 8, ("objective/reward",)),
              "opd": ({"name": "opd"}, 16, ("objective/teacher_gap",))}


def _config(root: Path, tiny: Path, name: str, objective: dict) -> Path:
    """test_sharding.py's run with 4 prompts of a digit x G = 2 (each process two whole groups), micro-batches of one
    group, the digits reward, and the clip range back at its default (the path objectives refuse another)."""
    prompts = root / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}", "digit": {d}}}\n' for p, d in
                               (("a red cube", 1), ("a blue ball", 4), ("a green tree", 7), ("a red ball", 9))))
    return sharding_config(root, tiny, name, objective=objective, algo={"clip_range": 1e-4},
                           train={"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 2},
                           rewards=[{"name": "digit_correctness"}], data={"train_prompts": str(prompts)})


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
    _, rows, figures = OBJECTIVES[name]
    assert_two_processes_equal_one(runs / f"{name}_one", runs / f"{name}_two",
                                   rollout_keys=("reward_total", "group_ids", "initial_latents"), rows=rows,
                                   figures=("objective/loss", *figures))
