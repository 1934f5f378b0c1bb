"""Context parallelism (``parallel.context_degree``): two CPU processes under gloo split every transformer call's
tokens (diffusers' Ulysses attention, FSDP2 over the flattened (shard, context) ranks) and train as one process
does, to float32 rounding: the rollout's log-probabilities, the update's loss terms and gradient norm, and the
weights, EMA and KL reference after an epoch of full fine-tuning; the first update stays exactly on-policy. And the
one-line refusals: a family without a ``_cp_plan`` (SD3), token counts the degree does not divide, a world size it
does not divide.

The one-process run is made in this process; the two-process one by ``torchrun --nproc_per_node 2``
(``tests/training/sharded_train.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.training.test_distributed import _free_port
from tests.training.test_sharding import _assert_same_update, _base, _ckpt, _config, _in_process, _ok, _torchrun

pytestmark = pytest.mark.slow

FULL = {"model": {"finetune": "full"}, "algo": {"kl_beta": 0.1},
        "train": {"lr": 0.1, "adam_eps": 0.1, "ema_decay": 0.5}, "logging": {"save_every": 1}}
CONTEXT = {"sharding": "fsdp2", "context_degree": 2, "context_attention": "ulysses"}
ROUNDING = 1e-5  # float32 rounding of a few dozen operations, relative to each tensor's scale


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("context")
    one = _config(root, tiny_flux_dir, "one", **FULL)
    two = _config(root, tiny_flux_dir, "two", **FULL, parallel=CONTEXT)
    _in_process(one)
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], [two]))
    return root


def _records(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / a.double().abs().max().clamp(min=1e-30))


def test_context_parallel_epoch_equals_one_process(runs, tiny_flux_dir):
    one, two = runs / "one", runs / "two"
    ra, rb = (load_file(r / "rollouts" / "epoch_0.safetensors") for r in (one, two))
    for key in ("group_ids", "initial_latents"):  # the context group sampled the one-process batch
        assert torch.equal(ra[key], rb[key]), key
    assert ra["log_probs"].shape == rb["log_probs"].shape == (6, 3)
    assert _close(ra["log_probs"], rb["log_probs"]) < ROUNDING
    assert _close(ra["advantages"], rb["advantages"]) < ROUNDING
    ma, mb = _records(one), _records(two)
    assert mb["policy/logprob_mismatch_max"] == 0.0  # rollout and update share the split forward
    assert mb["policy/pairs"] == ma["policy/pairs"]  # each pair counted once, not once per context rank
    for key in ("policy/grad_norm", "policy/ratio_mean", "policy/approx_kl", "policy/clipfrac"):
        assert abs(ma[key] - mb[key]) <= ROUNDING * max(abs(ma[key]), 1e-6), (key, ma[key], mb[key])
    base = _base(tiny_flux_dir)
    _assert_same_update(_ckpt(one, 0), _ckpt(two, 0), base, "weights after epoch 0", rtol=ROUNDING)
