"""What each rank holds on its device, counted through the real entry point (``flowgrpo.runner.main``, the path of
``flowgrpo/train.py``) under ``torchrun`` on CPU: no rank's device peak exceeds another's by more than one block and
its optimizer state (:mod:`tests.training.device_ledger`, ``tests/training/ledger_train.py``).

The faults this catches: the runner kept the list of the original, unsharded parameters of a full fine-tune under
FSDP2 for the whole run, so the main process held the whole model beside its shards (on a GPU, FSDP2 moves them to
the device before sharding: ≈ 47.6 GB more on rank 0 for FLUX.1-dev); and a bfloat16 full fine-tune with a KL
reference crashed on two processes (the processes that built the transformer empty built their reference in
float32, the main process in bfloat16). The model has 12 blocks, so one block and its AdamW moments (3 × a block) is
a quarter of the model: a whole model held by one rank is far outside the bound.

The memory plan (``flowgrpo.memory_plan.estimate``) is checked against the ledger: what a rank of the float32 run still
holds on its
device after training equals the plan's resident parts (float32 masters, AdamW's moments, the reference and the EMA
in shards, the VAE and text encoders whole) within 10 % (measured: 0.02 %).

Every process of a full fine-tune under FSDP2 reads its own shards from the weight files (the transformer is built
empty everywhere); that the values are the files' is checked where two processes are compared with one
(``tests/training/test_sharding.py``, ``tests/training/test_context_parallel.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.training.test_distributed import _free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.slow

FULL = {"model": {"finetune": "full"}, "algo": {"kl_beta": 0.01}}
WAN22 = {"model": {"finetune": "full", "num_frames": 5, "pretrained": None}, "algo": {"kl_beta": 0.01},
         "sampling": {"num_steps": 3, "guidance_scale": 4.0}, "eval_sampling": {"num_steps": 3},
         "parallel": {"sharding": "fsdp2", "experts": "shard"},
         "rewards": [{"name": "video_frames", "kwargs": {"base": "jpeg_incompressibility"}}]}
RUNS2 = {  # two processes, in the same processes one after the other
    "full_fp32": {**FULL, "train": {"ema_decay": 0.9}},
    "full_bf16": {**FULL, "model": {"finetune": "full", "dtype": "bfloat16"}},
    "lora": {"model": {"finetune": "lora", "lora_rank": 4}},
    "context": {**FULL, "parallel": {"sharding": "fsdp2", "context_degree": 2, "context_attention": "ulysses"}},
    "wan22_experts": WAN22,
}
#: the components each rank builds empty (and then reads its own shards of, or receives them: LoRA)
EMPTY = {"lora": [[], ["transformer"]], "wan22_experts": [["transformer", "transformer_2"]] * 2}
RUNS4 = {"hsdp": {**FULL, "model": {"finetune": "full", "dtype": "bfloat16"},
                  "parallel": {"sharding": "fsdp2", "replicate": 2}}}


def _config(root: Path, model: Path, name: str, sections: dict) -> Path:
    prompts = root / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\na cat\n")
    cfg = {
        "output_dir": str(root / name),
        "model": {"pretrained": str(model), "max_sequence_length": 16, "height": 32, "width": 32},
        "sampling": {"num_steps": 3}, "eval_sampling": {"num_steps": 2},
        "train": {"num_epochs": 1, "prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 2,
                  "train_batch_size": 2, "lr": 1e-4},
        "algo": {"clip_range": 1e-2},
        "parallel": {"sharding": "fsdp2"},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts), "eval_num_prompts": 2},
        "logging": {"progress": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    if cfg["model"]["pretrained"] is None:  # the Wan2.2 A14B run: its own two-expert pipeline
        cfg["model"]["pretrained"] = str(root / "wan22")
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _torchrun(n: int, configs: list[Path], root: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", _free_port(),
           "tests/training/ledger_train.py", *map(str, configs)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + _first_rank_view(proc.stderr)[-8000:]


def _first_rank_view(stderr: str) -> str:
    """The launcher's error output without the other ranks' prefixed lines: where one rank crashes (a gloo abort)
    the others' "connection closed" traces would push its own message out of the failure's tail."""
    return "\n".join(line for line in stderr.splitlines()
                     if not line.startswith("[rank") or line.startswith("[rank0]"))


def _ledgers(tmp_path_factory, runs: dict, n: int) -> dict[str, list[dict]]:
    """Run ``runs`` in one ``torchrun`` of ``n`` processes; {run: every rank's ledger}, and ``"model"``: the FLUX
    model's folder."""
    from flowgrpo.models.random_pipelines import build_random_pipeline
    from flowgrpo.models.tiny import build_tiny_flux

    root = tmp_path_factory.mktemp("ledger")
    model = build_tiny_flux(root / "flux12", transformer_kwargs={
        "num_layers": 2, "num_single_layers": 10, "attention_head_dim": 16, "num_attention_heads": 4})
    if any(v.get("parallel", {}).get("experts") == "shard" for v in runs.values()):
        build_random_pipeline("wan22", root / "wan22", transformer_kwargs={"num_layers": 6})
    _torchrun(n, [_config(root, model, k, v) for k, v in runs.items()], root)
    out = {name: [json.loads((root / name / f"ledger_{r}.json").read_text()) for r in range(n)] for name in runs}
    return {**out, "model": model}


def _check(name: str, ranks: list[dict]) -> None:
    """No rank's device peak, nor what it holds in any phase, exceeds another's by more than one block and its two
    AdamW moments."""
    sizes = ranks[0]
    assert sizes["sharded"]
    bound = 3 * sizes["block_bytes"]
    peaks = [r["peak"] for r in ranks]
    assert min(peaks) > sizes["model_bytes"] // len(ranks)  # the ledger counts the shards at least
    assert max(peaks) - min(peaks) <= bound, (name, peaks, bound, [r["stages"] for r in ranks])
    for stage in ranks[0]["stages"]:  # load, shard, fit, end
        held = [r["stages"][stage] for r in ranks]
        assert max(held) - min(held) <= bound, (name, stage, held, bound)


# one test per torchrun: a module fixture shared by several tests would run once per xdist worker
def _planned_resident(model: Path, gpus: int) -> float:
    """What ``flowgrpo.memory_plan.estimate`` says each rank of the ``full_fp32`` run keeps on its device after
    training (bytes):
    the float32 masters, AdamW's two moments, the reference and the EMA, each a 1/gpus shard, and the VAE and text
    encoders whole, from the parameter counts of the model's own modules."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    from flowgrpo.memory_plan.estimate import Workload, plan
    from flowgrpo.memory_plan.families import Sizes

    def count(cls, sub):
        return sum(p.numel() for p in cls.from_pretrained(model, subfolder=sub).parameters())

    sizes = Sizes(transformer=count(FluxTransformer2DModel, "transformer"), largest_block=0, blocks=0, lora=0,
                  encoders=count(CLIPTextModel, "text_encoder") + count(T5EncoderModel, "text_encoder_2"),
                  vae=count(AutoencoderKL, "vae"))
    w = Workload(family="flux", finetune="full", dtype="float32", height=32, width=32, frames=1,
                 max_sequence_length=16, train_rows=2, rollout_rows=2, samples=8, steps=3,
                 gradient_checkpointing=False, reference_copy=True, ema=True, sharding="fsdp2")
    device = plan(w, gpus, s=sizes).device
    return sum(device[k] for k in ("weights", "masters", "optimizer", "reference", "ema", "text_encoders", "vae"))


def test_two_processes_hold_alike_on_their_devices(tmp_path_factory):
    ledgers = _ledgers(tmp_path_factory, RUNS2, 2)
    model = ledgers.pop("model")
    for name, ranks in ledgers.items():
        _check(name, ranks)
        # no rank reads the whole transformer (full fine-tuning), nor the untrained expert it shards
        assert [r["built_empty"] for r in ranks] == EMPTY.get(name, [["transformer"]] * 2), name
    # the memory plan's resident parts against what each rank still holds after training, within 10 %
    planned = _planned_resident(model, 2)
    for r in ledgers["full_fp32"]:
        assert abs(r["end"] - planned) <= 0.1 * planned, (r["end"], planned)


def test_four_processes_hold_alike_on_their_devices(tmp_path_factory):
    ledgers = _ledgers(tmp_path_factory, RUNS4, 4)
    ledgers.pop("model")
    for name, ranks in ledgers.items():
        _check(name, ranks)
        assert [r["built_empty"] for r in ranks] == [["transformer"]] * 4, name
