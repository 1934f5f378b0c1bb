"""What the objectives' end-to-end tests share (test_forward_runs.py, test_prefs_runs.py, test_path_runs.py and their
two-process counterparts test_*_sharding.py): a one-epoch config, a save–kill–resume against the uninterrupted run,
and a two-process epoch against one process. (Their one thread per test is tests/tiny_runs.py's ``_one_thread``; the
tiny SD3.5 pipeline is the ``tiny_sd3_dir`` fixture of tests/training/conftest.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowgrpo.checkpoints.save_load import whole_tensors
from flowgrpo.config import build_config
from flowgrpo.writing.metrics import read_metrics
from tests.training.test_sharding import RTOL, _records


def assert_resume_equals_whole(tmp_path: Path, config: Callable[..., object], *,
                               files: Iterable[str] = ("trainable.safetensors",),
                               moved: str = "trainable.safetensors",
                               figures: Iterable[str] = ("objective/loss",)) -> None:
    """Two epochs in one go (``whole``, saved after each) against one epoch (``first``) and a run resuming its
    checkpoint (``resumed``): the epoch-1 checkpoints' ``files`` and the optimizer's ``exp_avg`` equal to the bit, the
    last records' ``figures`` equal; the ``moved`` file moved in epoch 1 (else the test has no power).

    ``config(out, **sections)`` builds the run's config with output folder ``tmp_path / out`` and the sections merged.
    """
    from flowgrpo.runner import run

    run(config("whole", train={"num_epochs": 2}, logging={"save_every": 1}))
    run(config("first"))  # stops after epoch 0 (its final checkpoint)
    first = tmp_path / "first" / "checkpoints" / "epoch_0"
    run(config("resumed", train={"num_epochs": 2, "resume_from": str(first)}))
    whole, resumed = tmp_path / "whole" / "checkpoints" / "epoch_1", tmp_path / "resumed" / "checkpoints" / "epoch_1"
    for f in files:
        a, b = load_file(whole / f), load_file(resumed / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
    start, end = load_file(first / moved), load_file(whole / moved)
    assert any(not torch.equal(start[k], end[k]) for k in end)  # epoch 1 moved it: the test has power
    oa = torch.load(whole / "optimizer.pt", weights_only=True)["state"]
    ob = torch.load(resumed / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(oa[k]["exp_avg"], ob[k]["exp_avg"]) for k in oa)
    ra, rb = (read_metrics(tmp_path / d / "metrics.jsonl")[-1] for d in ("whole", "resumed"))
    for key in figures:
        assert ra[key] == rb[key], (key, ra[key], rb[key])


def assert_two_processes_equal_one(one: Path, two: Path, *, rollout_keys: Iterable[str], every_rollout: bool = False,
                                   parts: Iterable[str] = ("trainable",), rows: float | None = None,
                                   figures: Iterable[str] = ("objective/loss",)) -> None:
    """The first epoch of run folder ``two`` (two processes) equals that of ``one`` (one process): the saved rollouts'
    ``rollout_keys`` bit for bit (all of them and the same keys with ``every_rollout``); each checkpoint part of
    ``parts`` (whole, whatever the checkpoint's form) within :data:`~tests.training.test_sharding.RTOL` of each
    tensor's size, the update having moved a LoRA B weight (else the test has no power); the records' trained rows
    equal (and equal to ``rows`` when given, else > 0); the gradient norm and ``figures`` within 1e-5 relative."""
    ta, tb = (load_file(r / "rollouts" / "epoch_0.safetensors") for r in (one, two))
    for key in rollout_keys:
        assert torch.equal(ta[key], tb[key]), key
    if every_rollout:
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])]
    ckpt = "checkpoints/epoch_0"
    for f in parts:
        a, b = whole_tensors(one / ckpt)[f], whole_tensors(two / ckpt)[f]
        assert a.keys() == b.keys()
        moved = 0
        for k in a:
            scale = a[k].abs().max().clamp(min=1e-12)
            assert float((a[k] - b[k]).abs().max() / scale) < RTOL, (f, k)
            moved += int("lora_B" in k and float(a[k].abs().max()) > 0)
        assert f != "trainable" or moved, "the update moved no LoRA weight: the test has no power"
    ra, rb = _records(one)[0], _records(two)[0]
    assert ra["objective/rows"] == rb["objective/rows"]
    assert ra["objective/rows"] == rows if rows is not None else ra["objective/rows"] > 0
    for key in ("policy/grad_norm", *figures):
        assert abs(ra[key] - rb[key]) <= 1e-5 * abs(ra[key]) + 1e-7, (key, ra[key], rb[key])


def tiny_config(output_dir: Path, model_dir: Path, objective: dict, train_prompts: Path, *updates: dict):
    """:func:`tiny_run`, validated (:func:`flowgrpo.config.build_config`)."""
    return build_config(tiny_run(output_dir, model_dir, objective, train_prompts, *updates))


def tiny_run(output_dir: Path, model_dir: Path, objective: dict, train_prompts: Path, *updates: dict) -> dict:
    """The config sections of a one-epoch run of ``objective`` on a tiny pipeline (``model_dir``): 32×32 images,
    T = 3 sampling steps at guidance 3 (2 at evaluation), 2 prompts × G = 2 in micro-batches of 2, 2 optimizer steps,
    the JPEG reward; each of ``updates`` ({section: settings}) merged in turn into its sections (a dict into the
    section's dict, anything else replacing it)."""
    cfg = {
        "output_dir": str(output_dir),
        "model": {"pretrained": str(model_dir), "max_sequence_length": 12, "height": 32, "width": 32},
        "sampling": {"num_steps": 3, "guidance_scale": 3.0},
        "eval_sampling": {"num_steps": 2},
        "objective": objective,
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 2,
                  "optimizer_steps_per_epoch": 2, "lr": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(train_prompts), "eval_num_prompts": 2},
        "logging": {"progress": False},
    }
    for update in updates:
        for key, value in update.items():
            cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg
