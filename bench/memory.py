"""Peak memory of rollout and update, at two resolutions, with and without gradient checkpointing and with
latents kept on the CPU between phases (a table; never a test).

    python bench/memory.py [--json PATH]
    python bench/memory.py --plan [--json PATH]   # per-GPU bytes of the real models, computed (bench/memory_plan.py)

``--plan`` allocates nothing: FLUX.1-dev, SD3.5-Medium, Qwen-Image and Wan2.2 A14B built on the meta device, LoRA /
full fine-tuning on 1 / 8 / 16 GPUs with and without gradient checkpointing, then every shipped config of a
planned model at 1 to 64 GPUs; the computation is ``flowgrpo.memory_plan.estimate`` (``flowgrpo plan CONFIG --gpus N``
for one config), the tables ``bench/memory_plan.py``.

Each cell runs in a fresh subprocess so peaks do not leak between settings. On a CUDA machine the figure is
``torch.cuda.max_memory_allocated`` of the phase; on a CPU machine it is the process's peak resident set
(``ru_maxrss``) after the phase, which includes the Python and library baseline (shown in its own column).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, tempfile, torch
from pathlib import Path
from flowgrpo.models.quiet import quiet_libraries
quiet_libraries()
size, ckpt, on_cpu = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
cuda = torch.cuda.is_available()
dev = "cuda" if cuda else "cpu"
from flowgrpo.models import load_model
from flowgrpo.models.lora import setup_trainable
from flowgrpo.models.tiny import build_tiny_flux
from flowgrpo.sampling.rollout import RolloutRequest, rollout
from flowgrpo.config import SamplingConfig
from flowgrpo.algo.policy_losses import clipped_surrogate
from flowgrpo.sampling.sde import sde_step
torch.manual_seed(0)
folder = build_tiny_flux(Path(tempfile.mkdtemp()) / "tiny", sample_size=size)
adapter = load_model(str(folder), max_sequence_length=32, height=size, width=size)
adapter.pipe.to(dev)
params = setup_trainable(adapter, finetune="lora", rank=8, alpha=16, target_modules=["to_q", "to_k", "to_v"],
                         need_reference=False, gradient_checkpointing=ckpt)
def peak():
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak()
b, t = 16, 8
s = SamplingConfig(num_steps=t, guidance_scale=3.5)
traj = rollout(adapter, ["a cat"] * b, [{}] * b, torch.arange(b) // 4, torch.arange(b) % 4, settings=s,
               sde_steps=torch.ones(t, dtype=torch.bool), batch_size=b, seed=0, epoch=0, latents_on_cpu=on_cpu)
roll = peak()
if cuda:
    torch.cuda.reset_peak_memory_stats()
adapter.transformer.train()
for step in range(t):
    x = traj.latents[:, step].to(dev)
    v = adapter.velocity(x, traj.sigmas[step].expand(b).to(dev), traj.embeds, 3.5)
    out = sde_step(x, v, traj.sigmas[step].item(), traj.sigmas[step + 1].item(),
                   next_latents=traj.latents[:, step + 1].to(dev))
    old = traj.log_probs[:, step:step + 1].to(dev)
    terms = clipped_surrogate(out.log_prob[:, None], old, torch.randn(b, device=dev), clip_low=1e-4, clip_high=1e-4)
    terms.loss.mean().backward()
upd = peak()
print(json.dumps({"baseline_mb": base, "rollout_mb": roll, "update_mb": upd}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--plan", action="store_true", help="the computed per-GPU plan of the real models")
    args = parser.parse_args()
    if args.plan:
        _print_plan(args.json)
        return
    rows = []
    print("| image | grad. checkpointing | latents on CPU | baseline MB | rollout peak MB | update peak MB |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        for ckpt in (0, 1):
            for on_cpu in (0, 1):
                out = subprocess.run([sys.executable, "-c", CHILD, str(size), str(ckpt), str(on_cpu)],
                                     capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append({"size": size, "checkpointing": bool(ckpt), "latents_on_cpu": bool(on_cpu), **r})
                print(f"| {size}² | {'yes' if ckpt else 'no'} | {'yes' if on_cpu else 'no'} | "
                      f"{r['baseline_mb']:.0f} | {r['rollout_mb']:.0f} | {r['update_mb']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _print_plan(json_path: str | None) -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory_plan

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    reference, shipped = memory_plan.reference_table(), memory_plan.config_table(configs)
    host = memory_plan.host_table(configs)
    print(f"per-GPU GiB, reference workload ({memory_plan.reference_workload.__doc__.split(': ', 1)[1].strip()})")
    print(reference)
    print("\nper-GPU GiB of the shipped configs")
    print(shipped)
    print("\nhost GiB per rank (rank 0 / each other rank) of the shipped configs on 8 GPUs, as shipped")
    print(host)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"reference": reference, "configs": shipped, "host": host}, f, indent=1)


if __name__ == "__main__":
    main()
