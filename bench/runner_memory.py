"""Peak host memory (resident set) of each rank of a real run, through the training command itself
(``flowgrpo/train.py`` under ``torchrun``, gloo, CPU): a table, never a test.

    python bench/runner_memory.py [--procs 2] [--finetune full] [--dtype float32] [--small] [--json PATH]

The model is a FLUX-architecture transformer of 326 MB in float32 (2 double-stream and 4 single-stream blocks,
12 heads of 64, ``axes_dims_rope`` (16, 24, 24); ``--small``: 2 heads of 16, for a dry run), written once as a
diffusers folder with the tiny text encoders and VAE. The run is one epoch of full fine-tuning under
``parallel.sharding: fsdp2`` with a KL reference and an EMA (``--finetune lora``: LoRA), 4 prompts × 2 samples.

The workers are sampled from outside every 0.2 s: the processes whose environment holds ``RANK=`` (torchrun's
workers), their ``VmRSS`` read from ``/proc/PID/status``. **start-up** is every sample until the run logs its
evaluation before training (model loaded, sharded, reference filled, rewards placed), **run** the whole run. On
CPU the device is host memory, so the figures hold what a GPU would hold too; what differs between ranks is what
one rank alone holds (before the streamed start-up: the whole transformer read by rank 0 and sent to the others).
The workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps freed tensors in its heap after the
first large free, and the figures would show its cache).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIG = {"num_layers": 2, "num_single_layers": 4, "attention_head_dim": 64, "num_attention_heads": 12,
       "axes_dims_rope": (16, 24, 24)}
SMALL = {"num_layers": 2, "num_single_layers": 4}
START_DONE = "eval (before)"  # the line that ends the start-up


def _workers(launcher: int) -> dict[int, int]:
    """{global rank: pid} of the torchrun workers under ``launcher`` (their environment holds RANK=)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            status = (d / "status").read_text()
        except OSError:
            continue
        ranks = [e for e in env if e.startswith(b"RANK=")]
        if ranks and f"\nPPid:\t{launcher}\n" in status:
            out[int(ranks[0][5:])] = int(d.name)
    return out


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _config(root: Path, model: Path, finetune: str, dtype: str) -> Path:
    prompts = root / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\na cat\n")
    cfg = {"output_dir": str(root / "run"),
           "model": {"pretrained": str(model), "max_sequence_length": 16, "height": 32, "width": 32,
                     "finetune": finetune, "dtype": dtype},
           "sampling": {"num_steps": 3}, "eval_sampling": {"num_steps": 2},
           "train": {"num_epochs": 1, "prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 2,
                     "train_batch_size": 2, "lr": 1e-5, "ema_decay": 0.9},
           "objective": {"kl_beta": 0.01, "clip_range": 1e-2},
           "parallel": {"sharding": "fsdp2"},
           "rewards": [{"name": "jpeg_incompressibility"}],
           "data": {"train_prompts": str(prompts), "eval_num_prompts": 2},
           "logging": {"progress": False}}
    if finetune != "full":  # LoRA (the default) of rank 4; full fine-tuning reads no LoRA setting
        cfg["model"].pop("finetune")
        cfg["model"]["lora_rank"] = 4
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def measure(procs: int, finetune: str, dtype: str, small: bool, root: Path) -> dict:
    """Run once; returns {"ranks": {rank: {"start_mb", "run_mb"}}, "model_mb", "seconds"}."""
    from flowgrpo.models.tiny import build_tiny_flux

    model = build_tiny_flux(root / "model", transformer_kwargs=SMALL if small else BIG)
    weights = sum(f.stat().st_size for f in (model / "transformer").glob("*.safetensors")) / 1e6
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", port,
           "flowgrpo/train.py", str(_config(root, model, finetune, dtype))]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = {"started": False, "lines": []}

    def read() -> None:
        for line in proc.stdout:
            state["lines"].append(line)
            if START_DONE in line:
                state["started"] = True

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start: dict[int, float] = {}
    run: dict[int, float] = {}
    while proc.poll() is None:
        for rank, pid in _workers(proc.pid).items():
            mb = _rss_mb(pid)
            run[rank] = max(run.get(rank, 0.0), mb)
            if not state["started"]:
                start[rank] = max(start.get(rank, 0.0), mb)
        time.sleep(0.2)
    reader.join()
    if proc.returncode != 0:
        raise SystemExit("the run failed:\n" + "".join(state["lines"][-40:]))
    ranks = {r: {"start_mb": round(start.get(r, 0.0), 1), "run_mb": round(run[r], 1)} for r in sorted(run)}
    return {"ranks": ranks, "model_mb": round(weights, 1), "seconds": round(time.perf_counter() - t0, 1)}


def render(result: dict, procs: int, finetune: str, dtype: str) -> str:
    lines = [f"{procs} processes, {finetune} fine-tuning ({dtype}), transformer {result['model_mb']} MB on disk; "
             f"{result['seconds']} s", "", "| rank | start-up peak (MB) | run peak (MB) |", "|---|---|---|"]
    for r, v in result["ranks"].items():
        lines.append(f"| {r} | {v['start_mb']} | {v['run_mb']} |")
    starts = [v["start_mb"] for v in result["ranks"].values()]
    if starts and min(starts) > 0:
        lines.append(f"\nstart-up spread across ranks: {100 * (max(starts) - min(starts)) / min(starts):.1f} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--finetune", choices=("full", "lora"), default="full")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--small", action="store_true", help="a tiny transformer (a dry run)")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="runner_memory_") as tmp:
        result = measure(args.procs, args.finetune, args.dtype, args.small, Path(tmp))
    print(render(result, args.procs, args.finetune, args.dtype))  # noqa: T201 - the bench's table
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
