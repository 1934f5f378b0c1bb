"""Peak host memory (resident set) per process at start, save and resume of a sharded full fine-tune, on 1, 2 and 4
CPU processes (torchrun, gloo): a table, never a test.

    python bench/host_memory.py [--procs 1 2 4] [--width 512] [--json PATH]

The model is the tiny FLUX architecture widened to 512 (8 heads of 64; 2 double-stream and 4 single-stream blocks:
36.4 M parameters, 145 MB in float32), written once as a diffusers folder (``--width 64``: one head, the CI's dry
run, ``tests/bench/test_benches.py``). Each process count runs in fresh
processes, each doing what a ``parallel.sharding=fsdp2`` run does (``flowgrpo.parallel.prepare_model``,
``flowgrpo.checkpoints.save_load``):

* **start**: the main process loads the transformer (``from_pretrained``), the others build it on the meta device
  (``flowgrpo.models.empty``); the frozen reference of a full fine-tune with KL is a copy of its structure on the
  meta device; both are sharded, the main process sends every process its shards of the weights, each process
  fills its reference shards from its own weights; AdamW takes one step (its two moments made) and an EMA is kept;
* **save**: ``save_checkpoint`` (each process writes its own shards of weights, optimizer state and EMA);
* **resume**: everything built again as at start, then ``load_checkpoint`` of that checkpoint (each process reads
  the parts of the files its shards need).

The figure of each phase is the process's peak resident set during it (``VmHWM`` of ``/proc/self/status``, reset
between phases by writing 5 to ``/proc/self/clear_refs``), so it includes the Python, torch and diffusers baseline
(measured after the imports of every module the phases use, its own column) and what the process still holds
from earlier phases (its shards).
The workers run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc's allocator otherwise raises that threshold after the
first large free and keeps later freed tensors in its heap, so the figures would show what the allocator caches
rather than what the program holds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAD, DOUBLE, SINGLE = 64, 2, 4


def _status_mb(*fields: str) -> tuple[float, ...]:
    """``fields`` of ``/proc/self/status`` (``VmHWM``: the peak resident set since the last reset; ``VmRSS``: the
    resident set now), MB, from one read: the kernel reports the peak as at least the resident set of the same read,
    while two reads let the resident set grow in between (a peak a few KiB below the later resident set)."""
    values = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    missing = [f for f in fields if f not in values]
    if missing:
        raise RuntimeError(f"no {', '.join(missing)} in /proc/self/status (Linux only)")
    return tuple(int(values[f].split()[0]) / 1024 for f in fields)


def _hwm_mb() -> float:
    """Peak resident set since the last reset, MB (``VmHWM``)."""
    return _status_mb("VmHWM")[0]


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def build_model(folder: Path, width: int = 512) -> Path:
    """The widened tiny FLUX transformer as a diffusers folder (``model_index.json`` naming it, ``transformer/``):
    ``width`` / 64 heads of 64."""
    import torch
    from diffusers import FluxTransformer2DModel

    if (folder / "transformer" / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=DOUBLE, num_single_layers=SINGLE,
                                attention_head_dim=HEAD, num_attention_heads=width // HEAD, joint_attention_dim=64,
                                pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 24, 24))
    tr.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    return folder


def _build(folder: Path):
    """The sharded policy, its reference, AdamW (stepped once) and the EMA, as a sharded run makes them."""
    from types import SimpleNamespace

    import torch
    from diffusers import FluxTransformer2DModel

    from flowgrpo import parallel
    from flowgrpo.config import ModelConfig, ParallelConfig
    from flowgrpo.distributed import dist
    from flowgrpo.models.empty import empty_components
    from flowgrpo.models.lora import structure_copy
    from flowgrpo.training.ema import EMA

    device = torch.device("cpu")
    if dist.rank() == 0:
        tr = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    else:
        tr = empty_components(str(folder), ["transformer"])["transformer"]
    tr.requires_grad_(True)
    adapter = SimpleNamespace(transformer=tr, frozen_reference=structure_copy(tr).requires_grad_(False).eval())
    config = SimpleNamespace(
        parallel=ParallelConfig(sharding="fsdp2", reshard_after_forward=True, reference="device"),
        model=ModelConfig(pretrained=str(folder), finetune="full", dtype="float32"))
    model = parallel.prepare_model(adapter, SimpleNamespace(device=device), config)
    params = parallel.trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, adapter, opt, sched, EMA(params, 0.9)


def worker(folder: Path, out: Path) -> None:
    import gc

    # every module the phases use, imported before the baseline is measured
    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401
    from diffusers import FluxTransformer2DModel  # noqa: F401

    from flowgrpo import parallel  # noqa: F401
    from flowgrpo.checkpoints.save_load import load_checkpoint, save_checkpoint
    from flowgrpo.data.prompts import GroupSampler
    from flowgrpo.distributed import dist

    torch.distributed.init_process_group("gloo")
    figures = {"baseline": _hwm_mb()}
    _reset_hwm()
    t0 = time.perf_counter()
    model, adapter, opt, sched, ema = _build(folder)
    figures["start"], figures["held"] = _status_mb("VmHWM", "VmRSS")
    _reset_hwm()
    ckpt = out / "checkpoints"
    save_checkpoint(ckpt, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=GroupSampler(4, 2, 0), ema=ema)
    figures["save"] = _hwm_mb()
    del model, adapter, opt, sched, ema
    gc.collect()
    model, adapter, opt, sched, ema = _build(folder)
    _reset_hwm()
    load_checkpoint(ckpt, model=model, optimizer=opt, lr_scheduler=sched, sampler=GroupSampler(4, 2, 0), ema=ema)
    figures["resume"] = _hwm_mb()
    figures["seconds"] = time.perf_counter() - t0
    (out / f"rank_{dist.rank()}.json").write_text(json.dumps(figures))
    dist.end_worker()


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run(procs: int, folder: Path, root: Path) -> list[dict]:
    out = root / f"procs_{procs}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
           _free_port(), __file__, "--worker", str(folder), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{procs} process(es) failed:\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(procs)]


def _cell(ranks: list[dict], phase: str) -> str:
    main, rest = ranks[0][phase], [r[phase] for r in ranks[1:]]
    return f"{main:.0f}" + (f" / {max(rest):.0f}" if rest else "")


def table(results: dict[int, list[dict]], params: int) -> str:
    lines = [f"model: widened tiny FLUX transformer, {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB "
             "float32); full fine-tuning with a reference, AdamW and EMA",
             "peak resident set per process, MB (main process / largest other process); baseline: after the "
             "imports; held: after start (the shards a process keeps)",
             "", "| processes | baseline | start | held | save | resume |", "|---|---|---|---|---|---|"]
    for n, ranks in results.items():
        cells = [_cell(ranks, phase) for phase in ("baseline", "start", "held", "save", "resume")]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=512, help="the transformer's width, a multiple of 64")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import torch

    root = Path(tempfile.mkdtemp(prefix="host_memory_"))
    if args.width < HEAD or args.width % HEAD:
        parser.error(f"--width {args.width}: a positive multiple of {HEAD} (heads of {HEAD})")
    folder = build_model(root / "model", args.width)
    params = sum(t.numel() for t in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        folder / "transformer" / "diffusion_pytorch_model.safetensors").values())
    t0 = time.perf_counter()
    results = {n: run(n, folder, root) for n in args.procs}
    print(table(results, params))
    print(f"\n{time.perf_counter() - t0:.0f} s; torch {torch.__version__}; {os.cpu_count()} CPU cores")
    if args.json:
        args.json.write_text(json.dumps({str(n): r for n, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
