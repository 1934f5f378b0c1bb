"""Part (k) of the GPU check, one process per GPU under torchrun (``bench/gpu_check.py`` launches it):

    torchrun --nproc_per_node N bench/gpu_check_multi.py --out FILE [--dry-run]

1. an HSDP / FSDP2 step: the FLUX.1 body (full width, 2 + 4 blocks; toy size in a dry run) fine-tuned in full,
   float32 master weights computing in bf16, sharded by ``flowgrpo.parallel.shard`` over flowgrpo's device mesh
   (``parallel.replicate`` 2 when N ≥ 4 and even, else 1: replicate × shard = 2 × N/2 or 1 × N), AdamW; the
   median step time, the peak memory, and the largest difference between the replicas' weights after the steps
   (0 when HSDP keeps them equal);
2. a context-parallel forward and backward: the same body whole on every rank, diffusers'
   ``enable_parallelism(ContextParallelConfig(ulysses_degree=N))``, against the unsplit forward and backward of
   the same inputs on each rank: the largest output difference, the largest gradient difference after the
   gradients are summed over the ranks, and both times.

``--dry-run``: gloo on the CPU at toy size (the caller runs 2 processes); diffusers resolves the context-parallel
device from the accelerator, so on the CPU the process reports the CPU as its accelerator with one device.
Rank 0 writes the figures to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _inputs(size, dev, dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = (size.resolution // 16) ** 2
    return {"hidden_states": torch.randn(1, n, 64, generator=g).to(dev, dtype),
            "encoder_hidden_states": torch.randn(1, size.text_tokens, size.t5_width, generator=g).to(dev, dtype),
            "pooled_projections": torch.randn(1, size.clip_width, generator=g).to(dev, dtype),
            "timestep": torch.full((1,), 0.5, device=dev), "guidance": torch.full((1,), 3.5, device=dev),
            "img_ids": torch.zeros(n, 3, device=dev), "txt_ids": torch.zeros(size.text_tokens, 3, device=dev)}


def _body(size, dev, dtype):
    from gpu_check import build_flux

    pipe = build_flux(size, dev, dtype, layers=min(2, size.layers), single_layers=min(4, size.single_layers))
    return pipe.transformer


def hsdp_step(size, dev, dry: bool, steps: int = 3) -> dict:
    from types import SimpleNamespace

    from flowgrpo.parallel import device_mesh, shard

    world = torch_dist.get_world_size()
    replicate = 2 if world >= 4 and world % 2 == 0 else 1
    mesh = device_mesh(dev, SimpleNamespace(replicate=replicate, context_degree=1))  # flowgrpo's (replicate, shard,
    # context) mesh; shard() takes FSDP2's HSDP mesh from it
    compute = torch.float32 if dry else torch.bfloat16
    model = _body(size, torch.device("cpu"), torch.float32)  # float32 masters, each block moved as it is sharded
    model = shard(model, mesh=mesh, param_dtype=compute, reshard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = _inputs(size, dev, compute, seed=torch_dist.get_rank())  # each rank its own samples
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        _sync(dev)
        start = time.perf_counter()
        model(**x).sample.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        _sync(dev)
        times.append(time.perf_counter() - start)
    # the replicas must hold the same shards: the elementwise max and min over the replicate dimension agree
    group = mesh["replicate"].get_group()
    spread = 0.0
    for p in model.parameters():
        local = p.to_local().detach().float()
        hi, lo = local.clone(), local.clone()
        torch_dist.all_reduce(hi, torch_dist.ReduceOp.MAX, group=group)
        torch_dist.all_reduce(lo, torch_dist.ReduceOp.MIN, group=group)
        spread = max(spread, float((hi - lo).abs().max()) if local.numel() else 0.0)
    return {"mesh": f"{replicate}x{world // replicate}", "step_s": statistics.median(times[1:] or times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
            "replica_max_diff": spread}


def context_parallel(size, dev, dry: bool) -> dict:
    from diffusers import ContextParallelConfig

    world = torch_dist.get_world_size()
    dtype = torch.float32 if dry else torch.bfloat16
    torch.manual_seed(0)
    whole = _body(size, dev, dtype)
    split = copy.deepcopy(whole)
    x = _inputs(size, dev, dtype, seed=1)

    def run(model):
        _sync(dev)
        start = time.perf_counter()
        out = model(**x, return_dict=False)[0]  # the context-parallel output plan gathers a tensor, not a dataclass
        out.float().square().mean().backward()
        _sync(dev)
        return out.detach(), time.perf_counter() - start

    ref, t_whole = run(whole)
    split.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    out, t_split = run(split)
    grad_diff = 0.0
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        if q.grad is None:
            continue
        g = q.grad.detach().clone()
        torch_dist.all_reduce(g)  # each rank's gradient covers its part of the tokens
        grad_diff = max(grad_diff, float((g.float() - p.grad.float()).abs().max()))
    return {"degree": world, "output_max_diff": float((out.float() - ref.float()).abs().max()),
            "grad_max_diff": grad_diff, "whole_s": t_whole, "context_parallel_s": t_split}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    from gpu_check import FULL, TOY

    from flowgrpo.distributed.dist import end_worker

    if args.dry_run:
        dev = torch.device("cpu")
        torch_dist.init_process_group("gloo")
        # diffusers takes the context-parallel device from the accelerator (rank % device count): the CPU, one
        torch._C._get_accelerator = lambda: torch.device("cpu")
        torch.accelerator.device_count = lambda: 1
    else:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        torch_dist.init_process_group("nccl", device_id=dev)
    size = TOY if args.dry_run else FULL
    out: dict = {"world": torch_dist.get_world_size()}
    for name, fn in (("hsdp", hsdp_step), ("context_parallel", context_parallel)):
        try:
            out[name] = fn(size, dev, args.dry_run)
        except Exception as err:  # noqa: BLE001 - one check's failure must not lose the other's figures
            out[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    if torch_dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    end_worker()  # not the interpreter's teardown: gloo subgroups the meshes keep can abort it (see end_worker)


if __name__ == "__main__":
    main()
