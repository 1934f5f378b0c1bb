"""SRPO (``objective: {name: srpo}``) end to end: an epoch through ``flowgrpo train`` on the tiny FLUX and SD3.5
pipelines, a save–kill–resume equal to the uninterrupted run, and an epoch on two CPU processes (DDP, gloo) equal
to one process (the harnesses of tests/training/objective_runs.py and test_sharding.py).

The reward is HPSv2 on a tiny random open_clip model (rewards/flowgrpo_rewards/tiny_models.py): it reads the prompt
(``text_conditioned``) and is differentiable, as SRPO's relative reward needs; its scores mean nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here
from tests.training.objective_runs import assert_resume_equals_whole, assert_two_processes_equal_one, tiny_run
from tests.training.test_sharding import _config as sharding_config
from tests.training.test_sharding import _free_port, _in_process, _ok, _torchrun

pytestmark = pytest.mark.slow


def _hps(root: Path) -> list[dict]:
    """The rewards section: HPSv2 on a tiny open_clip checkpoint saved under ``root``."""
    from flowgrpo_rewards import tiny_models as tm

    path = root / "hps" / "HPS_v2.1_compressed.pt"
    if not path.exists():
        tm.save_tiny_hps_checkpoint(path, seed=3)
    return [{"name": "hpsv2", "kwargs": {"checkpoint": str(path.parent), "architecture": tm.TINY_OPEN_CLIP}}]


def _sections(tmp_path: Path, model_dir: Path, objective: dict, out: str = "run", **sections) -> dict:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    return tiny_run(tmp_path / out, model_dir, objective, prompts,
                    {"rewards": _hps(tmp_path), "logging": {"save_rollout_stats": True}}, sections)


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_srpo_trains_an_epoch_through_the_command(tmp_path, tiny_flux_dir, tiny_sd3_dir, model):
    """``flowgrpo train CONFIG`` with ``objective: {name: srpo}``: 4 samples x 2 branches = 8 rows, one transformer
    call each and its recompute in the backward; the LoRA moved."""
    from flowgrpo.cli import main as cli_main

    folder = tiny_flux_dir if model == "flux" else tiny_sd3_dir
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_sections(tmp_path, folder, {"name": "srpo"})))
    cli_main(["train", str(path), "train.seed=3"])
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["objective/rows"] == 8 and rec["policy/grad_norm"] > 0
    # the rollout: T = 3 Euler calls for each of 2 micro-batches of 2 (SD3's CFG, guidance 3, doubles the rows)
    assert rec["rollout/transformer_calls"] == 6
    # the update: 2 branches x 2 micro-batches x (forward + checkpoint recompute); training guidance 1: no CFG
    assert rec["update/transformer_calls"] == 8 and rec["update/transformer_rows"] == 16
    assert 0 < rec["objective/sigma_in"] < 1 and "objective/reward_positive" in rec
    weights = load_file(tmp_path / "run" / "checkpoints" / "epoch_0" / "trainable.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())


def test_save_kill_resume_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir):
    """Two epochs in one go against one epoch, saved, and a run resuming it: the same weights and optimizer state to
    the bit (each micro-batch's mid is seeded by the epoch and the micro-batch; the phrases follow the restored
    optimizer step count)."""
    from flowgrpo.config import build_config

    assert_resume_equals_whole(tmp_path, lambda out, **s: build_config(
        _sections(tmp_path, tiny_flux_dir, {"name": "srpo"}, out, **s)))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("srpo_sharding")
    prompts = root / "p.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\na red ball\n")
    paths = {n: sharding_config(root, tiny_flux_dir, n, objective={"name": "srpo"}, algo={"clip_range": 1e-4},
                                train={"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 2},
                                rewards=_hps(root), data={"train_prompts": str(prompts)})
             for n in ("one", "two")}
    _in_process(paths["one"])
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], [paths["two"]]))
    return root


def test_a_two_process_epoch_equals_one_process(two_runs):
    """8 samples x 2 branches = 16 rows; the rollouts bit for bit, the update within the harness's tolerance."""
    assert_two_processes_equal_one(two_runs / "one", two_runs / "two",
                                   rollout_keys=("reward_total", "group_ids", "initial_latents"), rows=16,
                                   figures=("objective/loss", "objective/reward"))


@pytest.mark.parametrize("case", ["initial", "fresh", "host_latents"])
def test_an_epoch_keeps_each_tensor_on_one_device(tmp_path, tiny_flux_dir, monkeypatch, case):
    """The real trainer's epoch with the model on the fake accelerator of tests/training/fake_device.py (an operation
    mixing accelerator and host tensors fails as on CUDA): the rollout's initial noise as the prior, a fresh prior
    drawn on the host, and the rollout's latents kept on the host (``train.latents_on_cpu``); the checkpointed call
    is checked again when the backward recomputes it."""
    from flowgrpo.config import build_config
    from tests.training.test_devices import _run_on_fake_accelerator

    objective = {"name": "srpo", **({"noise": "fresh"} if case == "fresh" else {})}
    cfg = build_config(_sections(tmp_path, tiny_flux_dir, objective,
                                 train={"train_batch_size": 1, "latents_on_cpu": case == "host_latents"}))
    mode = _run_on_fake_accelerator(monkeypatch, cfg)
    assert mode.syncs and mode.update_reads  # the mode was active through the update
