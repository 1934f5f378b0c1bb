"""The preference, supervised and path objectives keep each tensor on one device: the real trainer runs an epoch of
each (online ``dpo``'s pair masks, ``dpo_offline`` and ``sft``'s dataset tensors, ``refl``'s rewards and their
differentiable path in its three variants, ``opd``'s teacher and its inputs) with the model on the fake accelerator of
:mod:`tests.training.fake_device`, where an operation mixing accelerator and host tensors fails as on CUDA; the
checkpointed steps of ReFL / DRaFT are checked again when the backward recomputes them.

In this process the rollout's latents stay on the model's device; one ``torchrun --nproc_per_node 2`` of
``tests/training/fake_device_train.py`` (an NCCL-like process group whose collectives refuse host tensors) runs the
five objectives in turn with the latents on the host (``train.latents_on_cpu``), so every sample tensor crosses to the
device at the update's boundary and every collective of the plan and the statistics gets device tensors."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from flowgrpo.config import build_config
from tests.training.objective_runs import tiny_run
from tests.training.test_devices import _run_on_fake_accelerator
from tests.training.test_distributed import _free_port, _run
from tests.training.test_path_runs import _teacher
from tests.training.test_prefs_runs import write_datasets

PROMPTS = ("a red cube", "a blue ball", "a green tree", "a red ball")
OBJECTIVES = {
    "dpo": {"name": "dpo", "beta_dpo": 50.0, "num_train_timesteps": 2, "pairs": "all"},
    "dpo_offline": {"name": "dpo_offline", "beta_dpo": 50.0, "num_train_timesteps": 2},
    "sft": {"name": "sft", "num_train_timesteps": 2, "kl_beta": 0.1},
    "refl_lv": {"name": "refl", "variant": "draft_lv", "lv_samples": 2},
    "refl_k": {"name": "refl", "variant": "draft_k", "k": 2},
    "refl": {"name": "refl", "variant": "refl", "refl_last_steps": 2},
    "opd": {"name": "opd", "noise_level": 0.5},  # flow_sde steps and the KL's std
    "opd_ode": {"name": "opd"},  # Euler steps
}
IN_PROCESS = ("dpo", "dpo_offline", "sft", "refl_lv", "refl_k", "refl", "opd")
TWO_PROCESSES = ("dpo", "dpo_offline", "sft", "refl", "opd_ode")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_flux_dir):
    """The datasets of test_prefs_runs.py, the moved-weights teacher of test_path_runs.py and the prompt files."""
    root = tmp_path_factory.mktemp("devices_inputs")
    write_datasets(root)
    _teacher(root, tiny_flux_dir)
    (root / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    (root / "p.jsonl").write_text("".join(f'{{"prompt": "{p}", "digit": {d}}}\n' for p, d in zip(PROMPTS, (3, 7, 1, 4),
                                                                                              strict=True)))
    return root


def _sections(out, tiny_flux_dir, inputs, name: str, **train) -> dict:
    o = dict(OBJECTIVES[name])
    path = o["name"] in ("refl", "opd")
    prompts = inputs / ("p.jsonl" if path else "p.txt")
    if o["name"] == "opd":
        o["teacher"] = str(inputs / "teacher")
    train_prompts = {"dpo_offline": inputs / "pairs.jsonl", "sft": inputs / "items.jsonl"}.get(o["name"], prompts)
    return tiny_run(out, tiny_flux_dir, o, train_prompts, {
        "train": {"train_batch_size": 1, "ema_decay": 0.9, **train},
        "rewards": [{"name": "digit_correctness" if path else "jpeg_incompressibility"}],
        "data": {"eval_prompts": str(prompts)}, "logging": {"save_rollout_stats": True}})


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_PROCESS)
def test_objective_epoch_keeps_each_tensor_on_one_device(tmp_path, tiny_flux_dir, inputs, monkeypatch, name):
    cfg = build_config(_sections(tmp_path / name, tiny_flux_dir, inputs, name))
    mode = _run_on_fake_accelerator(monkeypatch, cfg)
    assert mode.syncs and mode.update_reads  # the mode was active through the update


@pytest.mark.slow
def test_two_processes_with_host_latents_keep_each_tensor_on_one_device(tmp_path, tiny_flux_dir, inputs):
    # 4 prompts (or dataset records) x G = 2: each process two whole groups (DPO's pairs never span processes)
    configs = []
    for name in TWO_PROCESSES:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_sections(tmp_path / name, tiny_flux_dir, inputs, name, prompts_per_epoch=4,
                                                 latents_on_cpu=True)))
        configs.append(str(path))
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
          "tests/training/fake_device_train.py", *configs], tmp_path)
    for name in TWO_PROCESSES:
        assert (tmp_path / name / "checkpoints" / "epoch_0").is_dir(), name


def test_the_teacher_is_loaded_onto_the_models_device(tmp_path, tiny_flux_dir, monkeypatch):
    """The harness above puts the teacher on the accelerator (it is built before training, outside the mode); this
    is what makes that true: :func:`~flowgrpo.algo.objectives.opd.load_teacher` moves it to ``adapter.device``
    (here a device the teacher's files cannot be on)."""
    from flowgrpo.algo.objectives.opd import load_teacher
    from flowgrpo.models import load_model

    adapter = load_model(str(tiny_flux_dir), max_sequence_length=12, height=32, width=32)
    adapter.transformer.save_pretrained(tmp_path / "teacher" / "transformer")
    monkeypatch.setattr(type(adapter), "device", property(lambda self: torch.device("meta")))
    teacher = load_teacher(str(tmp_path / "teacher"), adapter, None)
    assert {p.device for p in teacher.parameters()} == {torch.device("meta")}
