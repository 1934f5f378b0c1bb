"""Sharded training (``parallel.sharding: fsdp2``) on two CPU processes (gloo) equals one process with the same
global batch; checkpoints move between process counts; final weights are the files a one-process run writes;
each process holds a shard of the policy and of the reference; two nodes of one process each know which of
them is the main process; uneven work per process does not stall the collectives.

One module fixture runs everything once, so the processes start three times in all: in this process the one-process
runs; one ``torchrun --nproc_per_node 2`` (``tests/training/sharded_train.py``, several runs in the same processes);
one pair of torchrun agents ``--nnodes 2 --node_rank 0/1`` on 127.0.0.1, one process each (static rendezvous).

Tolerance (as in ``tests/training/test_distributed.py``): samples, rewards and advantages are bit-identical (every
noise is seeded by (seed, epoch, prompt, sample), never by rank); gradients sum in another order (per shard, then the
reduce-scatter average), so an update differs in float32 rounding: 1e-6 relative to the update's size. A huge Adam
epsilon makes the update proportional to the gradient (plain Adam's first step is lr·sign(g), blind to a wrong
normalisation, e.g. a gradient summed instead of averaged over the processes, off by a factor of 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.training.test_distributed import _free_port, _same_evaluation

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-6
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.slow


def _config(root: Path, tiny: Path, name: str, **sections) -> Path:
    """A tiny run: P = 3 prompts x G = 2 (with 2 processes the middle group spans both), T = 3."""
    prompts = root / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\n")
    cfg = {
        "output_dir": str(root / name),
        "model": {"pretrained": str(tiny), "max_sequence_length": 16, "height": 32, "width": 32, "lora_rank": 4},
        "sampling": {"num_steps": 3},
        "eval_sampling": {"num_steps": 2},
        "train": {"num_epochs": 1, "prompts_per_epoch": 3, "group_size": 2, "rollout_batch_size": 3,
                  "lr": 1.0, "adam_eps": 1.0e3, "weight_decay": 0.0},
        "algo": {"clip_range": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts), "eval_num_prompts": 2},
        "logging": {"progress": False, "save_rollout_stats": True},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    if cfg["model"].get("finetune") == "full":  # no adapter: a LoRA rank would be refused (not read)
        cfg["model"].pop("lora_rank")
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _full(**train) -> dict:
    """Full fine-tuning with KL to a frozen reference and EMA; two epochs, a checkpoint after each."""
    return {"model": {"finetune": "full"}, "algo": {"kl_beta": 0.1},
            "train": {"num_epochs": 2, "lr": 0.1, "adam_eps": 0.1, "ema_decay": 0.5, **train},
            "logging": {"save_every": 1}}


BF16 = {"model": {"finetune": "full"}, "train": {"lr": 1e-5, "adam_eps": 1e-8, "rollout_batch_size": 3}}
SHARDED = {"sharding": "fsdp2", "text_encoders": "offload"}


def _in_process(path: Path) -> None:
    from flowgrpo import runner
    from flowgrpo.config import load_config
    from tests.training.sharded_train import write_report

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses (OMP_NUM_THREADS=1): the same kernels' rounding
    try:
        config = load_config(path)
        runner.run(config)
        write_report(Path(config.output_dir), runner._TRAINER)
    finally:
        torch.set_num_threads(before)


def _torchrun(args: list[str], configs: list[Path], timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "tests/training/sharded_train.py", *map(str, configs)]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def _two_nodes(config: Path) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
         "tests/training/sharded_train.py", str(config)],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    out = []
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    return out


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("sharding")
    c = {name: _config(root, tiny_flux_dir, name, **sections) for name, sections in {
        "one_lora": {},
        "two_lora": {"parallel": SHARDED},
        "nodes_lora": {"parallel": SHARDED},
        # 3 evaluation images: under FSDP2 rank 1 samples 1 and a padding repeat (the same calls as rank 0)
        "one_full": {**_full(), "data": {"eval_num_prompts": 3}},
        "two_full": {**_full(), "data": {"eval_num_prompts": 3}, "parallel": SHARDED},
        # a resume keeps its run's evaluation (another one is refused): 3 images, as the runs they resume
        "two_resumed": {**_full(resume_from=str(root / "one_full" / "checkpoints" / "epoch_0")),
                        "data": {"eval_num_prompts": 3}, "parallel": {**SHARDED, "reference": "cpu_offload"}},
        "one_resumed": {**_full(resume_from=str(root / "two_full" / "checkpoints" / "epoch_0")),
                        "data": {"eval_num_prompts": 3}},
        "one_fp32": BF16,
        "one_bf16": {**BF16, "model": {"finetune": "full", "dtype": "bfloat16"}},
        "one_bf16_sharded": {**BF16, "model": {"finetune": "full", "dtype": "bfloat16"},
                             "parallel": {"sharding": "fsdp2"}},  # one process: a one-process group
        "two_bf16": {**BF16, "model": {"finetune": "full", "dtype": "bfloat16"}, "parallel": {"sharding": "fsdp2"}},
        # a random half of the steps per sample: each process packs its own number of transformer calls
        "two_uneven": {"sampling": {"num_steps": 4}, "train": {"seed": 3},
                       "chunker": {"name": "per_step", "timestep_fraction": 0.5, "step_selection": "random"},
                       "parallel": {"sharding": "fsdp2"}},
    }.items()}
    for name in ("one_lora", "one_full", "one_fp32", "one_bf16", "one_bf16_sharded"):
        _in_process(c[name])
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()],
                  [c[n] for n in ("two_lora", "two_full", "two_resumed", "two_bf16", "two_uneven")]))
    _in_process(c["one_resumed"])
    nodes = _two_nodes(c["nodes_lora"])
    for proc in nodes:
        _ok(proc)
    (root / "nodes_output.json").write_text(json.dumps([p.stdout + p.stderr for p in nodes]))
    return root


def _weights(run: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(run / name)


def _assert_same_update(a: dict, b: dict, start: dict, what: str) -> None:
    """``a`` and ``b`` (whole weights after the same update from ``start``) agree to RTOL of each tensor's values;
    the comparison has power: most tensors moved by over 100·RTOL of their values (a gradient off by a factor of
    2, or a tensor not updated, would put them 50·RTOL apart or more)."""
    assert a.keys() == b.keys() == start.keys(), what
    power = 0
    for k in a:
        scale = a[k].double().abs().max().clamp(min=1e-30)
        gap = float((a[k].double() - b[k].double()).abs().max() / scale)
        assert gap < RTOL, (what, k, gap)
        power += int(float((a[k].double() - start[k].double()).abs().max() / scale) > 1e2 * RTOL)
    assert power > len(a) // 2, (what, power, len(a))


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _base(tiny_flux_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")


def _ckpt(run: Path, epoch: int, name: str = "trainable") -> dict:
    """A part of a checkpoint, whole, whatever its form (a sharded run's is one file per process)."""
    from flowgrpo.checkpoints.save_load import whole_tensors

    return whole_tensors(run / "checkpoints" / f"epoch_{epoch}")[name]


def test_sharded_lora_epoch_equals_one_process(runs):
    one, two = runs / "one_lora", runs / "two_lora"
    for key in ("reward_total", "advantages", "group_ids", "initial_latents"):
        assert torch.equal(load_file(one / "rollouts" / "epoch_0.safetensors")[key],
                           load_file(two / "rollouts" / "epoch_0.safetensors")[key]), key
    a = load_file(one / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(two / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # lora_B starts at zero: it is the update itself
        scale = a[k].abs().max().clamp(min=1e-12)
        assert float((a[k] - b[k]).abs().max() / scale) < RTOL, k
    # the clipping norm of DTensor gradients is the global norm, as one process computes it
    ga, gb = _records(one)[0]["policy/grad_norm"], _records(two)[0]["policy/grad_norm"]
    assert abs(ga - gb) <= RTOL * ga


def test_sharded_full_epoch_equals_one_process(runs, tiny_flux_dir):
    one, two = runs / "one_full", runs / "two_full"
    base = _base(tiny_flux_dir)
    _assert_same_update(_ckpt(one, 0), _ckpt(two, 0), base, "weights after epoch 0")
    oa, ob = _ckpt(one, 0, "optimizer"), _ckpt(two, 0, "optimizer")
    assert set(oa["state"]) == set(ob["state"]) == set(base)  # keyed by parameter name
    order = list(oa["state"])  # the trained parameters' order: the EMA's index
    _assert_same_update(_ckpt(one, 0, "ema"), _ckpt(two, 0, "ema"),
                        {f"ema.{i}": base[k] for i, k in enumerate(order)}, "EMA after epoch 0")
    for k in oa["state"]:
        for m in ("exp_avg", "exp_avg_sq"):
            x, y = oa["state"][k][m], ob["state"][k][m]
            assert float((x - y).abs().max() / x.abs().max().clamp(min=1e-30)) < RTOL, (k, m)
    ra, rb = _records(one)[0], _records(two)[0]
    assert rb["policy/logprob_mismatch_max"] == 0.0  # the sharded rollout and update share one forward
    assert abs(ra["policy/grad_norm"] - rb["policy/grad_norm"]) <= RTOL * ra["policy/grad_norm"]
    assert ra["policy/kl_ref"] == rb["policy/kl_ref"] == 0.0  # on-policy: the sharded reference is the base


def test_evaluation_split_over_sharded_ranks_equals_one_process(runs):
    """Each process samples its share of the evaluation set (LoRA: 2 images, 1 each; full fine-tuning: 3, the
    second share padded so the FSDP2 collectives stay paired) and the figures equal one process's."""
    _same_evaluation(runs / "one_lora", runs / "two_lora", 2)
    _same_evaluation(runs / "one_full", runs / "two_full", 3)


def test_checkpoints_resume_with_another_process_count(runs):
    """Each run resumes the other's epoch-0 checkpoint and trains epoch 1 as the uninterrupted run did."""
    for resumed, continuous in (("two_resumed", "one_full"), ("one_resumed", "two_full")):
        start = _ckpt(runs / continuous, 0)
        _assert_same_update(_ckpt(runs / resumed, 1), _ckpt(runs / continuous, 1), start, f"{resumed} epoch 1")
        assert [r["epoch"] for r in _records(runs / resumed)] == [1]
        ra, rc = _records(runs / resumed)[0], _records(runs / continuous)[1]
        assert ra["reward/total/mean"] == rc["reward/total/mean"]  # epoch 1's rollout from the loaded weights
        assert abs(ra["policy/kl_ref"] - rc["policy/kl_ref"]) <= 1e-5 * rc["policy/kl_ref"]


def test_final_weights_are_the_files_one_process_writes(runs):
    for one, two, folder in (("one_full", "two_full", "transformer"), ("one_lora", "two_lora", "lora")):
        a, b = runs / one / folder, runs / two / folder
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        for f in a.glob("*.safetensors"):
            x, y = load_file(f), load_file(b / f.name)
            assert x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape for k in x)
    cfg_a = json.loads((runs / "one_full" / "transformer" / "config.json").read_text())
    assert cfg_a == json.loads((runs / "two_full" / "transformer" / "config.json").read_text())
    from diffusers import FluxTransformer2DModel

    loaded = FluxTransformer2DModel.from_pretrained(runs / "two_full" / "transformer")
    final = _ckpt(runs / "two_full", 1)  # the trained weights, not the EMA's
    ema = _ckpt(runs / "two_full", 1, "ema")
    names = [name for name, _ in loaded.named_parameters()]
    for i, (name, p) in enumerate(loaded.named_parameters()):  # the folder holds the EMA weights (train.ema_decay)
        assert torch.equal(p.detach(), ema[f"ema.{i}"]), name
    assert any(not torch.equal(ema[f"ema.{i}"], final[name]) for i, name in enumerate(names))


def test_each_process_holds_a_shard_of_policy_and_reference(runs):
    for run in ("two_full", "two_lora"):
        reports = [json.loads((runs / run / f"process_{r}.json").read_text()) for r in (0, 1)]
        for r in reports:
            assert r["optimizer_trains_model"]  # the wrapped module's parameters, not those taken before
            local, whole = r["transformer"]
            assert local <= whole // 2 + whole // 20, (run, r["transformer"])
        assert sum(r["transformer"][0] for r in reports) == reports[0]["transformer"][1]
    ref = [json.loads((runs / "two_full" / f"process_{r}.json").read_text())["reference"] for r in (0, 1)]
    assert sum(local for local, _ in ref) == ref[0][1] and max(local for local, _ in ref) < ref[0][1]


def test_weights_are_read_once_and_the_reference_is_never_a_whole_copy(runs):
    """At start no process of a full fine-tune reads the whole transformer: each builds it on the meta device and
    reads its own shards from the files (their values are the files': the sharded epoch equals one process's, in
    ``test_sharded_full_epoch_equals_one_process``); with LoRA the main process alone reads it (it initialises the
    adapter) and the other receives its shards. The full fine-tune's reference is built on the meta device on every
    process and filled from its own policy shards (equal to the base: the on-policy KL to it is 0)."""
    for run, reference, read in (("two_full", True, ["empty", "empty"]), ("two_lora", None, ["read", "empty"]),
                                 ("two_bf16", None, ["empty", "empty"])):
        loaded = [json.loads((runs / run / f"process_{r}.json").read_text())["loaded"] for r in (0, 1)]
        assert [x["transformer"] for x in loaded] == read, run
        assert [x["reference_on_meta"] for x in loaded] == [reference, reference], run


def test_two_nodes_know_their_global_rank(runs):
    """Each node's only process has local rank 0: the main process (it writes, logs and reports) is global rank 0
    alone, and the seeds, sample shares and collectives follow the global rank (the run equals the one-node run)."""
    reports = [json.loads((runs / "nodes_lora" / f"process_{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["local_rank"], r["main"]) for r in reports] == [(0, 0, True), (1, 0, False)]
    assert [r["epoch"] for r in _records(runs / "nodes_lora")] == [0]  # one writer of each record
    node0, node1 = json.loads((runs / "nodes_output.json").read_text())
    assert "epoch 1/1 " in node0 and "epoch 1/1 " not in node1  # the epoch line, from the main process only
    for f in ("rollouts/epoch_0.safetensors", "lora/pytorch_lora_weights.safetensors"):
        a, b = load_file(runs / "two_lora" / f), load_file(runs / "nodes_lora" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_uneven_work_per_process_runs_and_stays_on_policy(runs):
    packs = [json.loads((runs / "two_uneven" / f"process_{r}.json").read_text())["packs"] for r in (0, 1)]
    assert packs[0] != packs[1]  # the test has power: the processes had different numbers of forwards
    rec = _records(runs / "two_uneven")[0]
    assert rec["policy/logprob_mismatch_max"] == 0.0 and rec["policy/pairs"] > 0


def test_bf16_full_fine_tuning_moves_every_weight_as_float32_does(runs, tiny_flux_dir):
    """float32 master weights: a bfloat16 run's update is not rounded away (it was for 96 % of the weights when
    the trained parameters themselves were bfloat16); unsharded (autocast) and sharded (mixed precision) on one
    process and on two."""
    base = _base(tiny_flux_dir)

    def moved(run: str, dtype: torch.dtype) -> tuple[float, float]:
        w = _ckpt(runs / run, 0)
        assert all(v.dtype == torch.float32 for v in w.values()), run  # the masters
        delta = [w[k].double() - base[k].to(dtype).double() for k in w]
        n = sum(d.numel() for d in delta)
        return sum(int((d != 0).sum()) for d in delta) / n, sum(float(d.abs().sum()) for d in delta)

    frac32, size32 = moved("one_fp32", torch.float32)
    assert frac32 > 0.99
    for run in ("one_bf16", "one_bf16_sharded", "two_bf16"):
        frac, size = moved(run, torch.bfloat16)
        assert frac > 0.99 and abs(size / size32 - 1) < 0.1, (run, frac, size, size32)
    for run in ("one_bf16", "two_bf16"):  # the final folder in model.dtype
        weights = load_file(runs / run / "transformer" / "diffusion_pytorch_model.safetensors")
        assert {v.dtype for v in weights.values()} == {torch.bfloat16}, run
    for run in ("one_bf16_sharded", "two_bf16"):  # the mixed-precision forward is the same in rollout and update
        assert _records(runs / run)[0]["policy/logprob_mismatch_max"] == 0.0, run


def test_memory_plan_counts_what_each_process_holds(runs, tiny_flux_dir):
    """``flowgrpo.memory_plan.estimate``'s byte rules against the tensors a run holds: float32 weights, Adam's two
    moments, the reference and the EMA, whole on one process and divided among the processes under FSDP2."""
    from flowgrpo.memory_plan.estimate import Workload, plan
    from flowgrpo.memory_plan.families import Sizes

    n = sum(v.numel() for v in _base(tiny_flux_dir).values())
    sizes = Sizes(transformer=n, largest_block=0, blocks=0, lora=0, encoders=0, vae=0)
    for run, gpus in (("one_full", 1), ("two_full", 2)):
        w = Workload(family="flux", finetune="full", dtype="float32", height=32, width=32, frames=1,
                     max_sequence_length=16, train_rows=3, rollout_rows=3, samples=6, steps=3,
                     gradient_checkpointing=False, reference_copy=True, ema=True,
                     sharding="fsdp2" if gpus > 1 else "none")
        expected = plan(w, gpus, s=sizes).device
        expected["weights"] += expected["masters"]  # a run reports its frozen and trained weights together
        held = [json.loads((runs / run / f"process_{r}.json").read_text())["bytes"] for r in range(gpus)]
        for part in ("weights", "optimizer", "reference", "ema"):
            assert sum(h[part] for h in held) == round(expected[part] * gpus), (run, part)
            assert max(h[part] for h in held) <= 1.05 * expected[part], (run, part)
