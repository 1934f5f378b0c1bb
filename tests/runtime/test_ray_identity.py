"""``runtime.engine: ray`` with ``max_staleness: 0`` and one rollout worker trains bit for bit the run the training
process samples itself (``runtime.engine: torchrun``): every metric but the timings, process memory and the engine's
own ``runtime/…`` figures, the rollouts' saved tensors and the final weights, tensor by tensor; and Ray leaves no
process behind (docs/async.md)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.config import load_config
from flowgrpo.runner import DEFAULT_CONFIG, run
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse: one torch thread (the worker takes the same)

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
#: what differs between two identical runs on different engines: wall-clock times, this process's memory peaks
#: (Ray's client threads live in it) and the Ray engine's own figures
VOLATILE = ("timing/", "throughput/", "memory/", "runtime/")


def _train(config_file, out: Path, engine: str, *overrides: str) -> Path:
    run(load_config(config_file, [f"output_dir={out}", f"runtime.engine={engine}", "logging.progress=false",
                                  "logging.save_rollout_stats=true", *overrides]))
    return out


def _records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def _no_ray_left() -> None:
    """No raylet or gcs_server (a local Ray instance's daemons) among this process's descendants once the run
    has returned (they are given time to exit, not to finish any work)."""
    kids = [p for p in psutil.Process().children(recursive=True)
            if any(n in p.name() for n in ("raylet", "gcs_server"))]
    _, alive = psutil.wait_procs(kids, timeout=60)
    assert not alive, [p.name() for p in alive]


def _compare(torch_run: Path, ray_run: Path, epochs: int, weights: str) -> None:
    a, b = _records(torch_run), _records(ray_run)
    assert len(a) == len(b) == epochs
    assert a == b
    for e in range(epochs):
        _same_tensors(load_file(torch_run / "rollouts" / f"epoch_{e}.safetensors"),
                      load_file(ray_run / "rollouts" / f"epoch_{e}.safetensors"))
    _same_tensors(load_file(torch_run / weights), load_file(ray_run / weights))
    ray_records = [json.loads(line) for line in (ray_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["runtime/lag"] for r in ray_records] == [0.0] * epochs  # every group sampled by the trained policy
    assert all(r["runtime/sync_bytes"] > 0 for r in ray_records)  # weights sent before every epoch's rollout


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_tiny_flux_ray_equals_torchrun(tmp_path, finetune):
    small = ["train.num_epochs=3", "train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=4",
             "data.eval_num_prompts=2", f"model.finetune={finetune}"]
    config = REPO / "configs" / "tiny_jpeg.yaml"
    plain = _train(config, tmp_path / "torchrun", "torchrun", *small)
    on_ray = _train(config, tmp_path / "ray", "ray", *small)
    _no_ray_left()
    _compare(plain, on_ray, 3, "checkpoints/epoch_2/trainable.safetensors")
    # what is sent is the trained parameters alone (LoRA: the adapter, not the frozen base), float32
    trained = load_file(on_ray / "checkpoints" / "epoch_2" / "trainable.safetensors")
    assert (finetune == "lora") == all("lora" in k for k in trained)
    sent = {json.loads(line)["runtime/sync_bytes"] for line in (on_ray / "metrics.jsonl").read_text().splitlines()}
    assert sent == {float(sum(t.numel() * t.element_size() for t in trained.values()))}


#: an epoch of B = 2 prompts x 4 samples (the configs' 64-128): what is compared is every tensor of it, not its size
SMALL = ["train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=8", "data.eval_num_prompts=4"]
#: each config's micro-batches and optimizer steps at that size, in the config's own shape: DPO 2 pairs in one
#: micro-batch; DMD2 its 8 iterations an epoch (the generator steps every 5th: at iterations 0, 5, 10, 15), one
#: sample each; every other config 2 micro-batches of 4 (the default's E-GRPO: 24 trajectories, 6 of them)
TRAIN_BATCH = {"digits_dpo": 2, "digits_dmd2": 1}


@pytest.mark.slow
def test_digits_ray_equals_torchrun(tmp_path):
    small = ["train.num_epochs=3", *SMALL, "train.train_batch_size=4"]
    plain = _train(DEFAULT_CONFIG, tmp_path / "torchrun", "torchrun", *small)
    on_ray = _train(DEFAULT_CONFIG, tmp_path / "ray", "ray", *small)
    _no_ray_left()
    _compare(plain, on_ray, 3, "transformer/diffusion_pytorch_model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["digits_nft", "digits_awm", "digits_dgpo", "digits_dpo", "digits_opd",
                                    "digits_dmd2", "digits_srpo", "digits_chunk", "digits_mix", "digits_cps"])
def test_each_objective_and_chunker_on_ray_equals_torchrun(tmp_path, config, digits_teacher):
    """Every objective that trains from its own rollouts (DiffusionNFT samples with its old copy: the weights sent
    are the ones it swaps in; OPD's teacher stays in the training process), and the SDE-ratio objective with other
    chunkers, two epochs."""
    small = ["train.num_epochs=2", *SMALL, f"train.train_batch_size={TRAIN_BATCH.get(config, 4)}"]
    if config == "digits_opd":
        small.append(f"objective.teacher={digits_teacher}")
    path = REPO / "configs" / f"{config}.yaml"
    plain = _train(path, tmp_path / "torchrun", "torchrun", *small)
    on_ray = _train(path, tmp_path / "ray", "ray", *small)
    _no_ray_left()
    _compare(plain, on_ray, 2, "checkpoints/epoch_1/trainable.safetensors")


@pytest.fixture
def digits_teacher() -> Path:
    """A teacher for ``digits_opd.yaml``: the digits base model's pipeline folder (cached by the digits runs)."""
    from flowgrpo.tasks.digits.model import ensure_digits_model

    return ensure_digits_model(progress=False)


def _torchrun(out: Path, engine: str, *overrides: str) -> Path:
    """Two CPU processes (gloo) through ``torchrun``; rank 0 drives Ray."""
    import os
    import subprocess
    import sys

    from tests.training.test_distributed import _free_port

    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           "flowgrpo/train.py", str(REPO / "configs" / "tiny_jpeg.yaml"), f"output_dir={out}",
           f"runtime.engine={engine}", "logging.progress=false", "logging.save_rollout_stats=true", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


SHARDED = ["train.num_epochs=2", "train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=2",
           "data.eval_num_prompts=2", "parallel.sharding=fsdp2"]


@pytest.fixture(scope="module")
def sharded_torchrun(tmp_path_factory) -> Path:
    """The two-process torchrun run that both sharded Ray cases are compared with, run once a session: under xdist
    in the session's folder above the workers' own, the first worker to need it runs it (``build_once``: the
    other waits on its lock and reads the same folder)."""
    import os

    from flowgrpo.builds.cache_folder import build_once

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return build_once(base / "ray_identity_sharded_torchrun", lambda tmp: _torchrun(tmp, "torchrun", *SHARDED),
                      is_complete=lambda p: (p / "transformer" / "diffusion_pytorch_model.safetensors").is_file())


@pytest.mark.slow
@pytest.mark.parametrize("reward_workers", [0, 1])
def test_two_sharded_processes_on_ray_equal_torchrun(tmp_path, reward_workers, sharded_torchrun):
    """FSDP2 over two processes through ``flowgrpo/train.py`` under torchrun: each rank's request is its own share,
    rank 0 gathers the whole weights from the shards for the sync and hands every rank its record (and, with a
    reward worker, its share's scores)."""
    on_ray = _torchrun(tmp_path / "ray", "ray", *SHARDED, f"runtime.reward_workers={reward_workers}")
    _compare(sharded_torchrun, on_ray, 2, "transformer/diffusion_pytorch_model.safetensors")
