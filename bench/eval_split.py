"""The held-out evaluation split over processes (issue 53, item 4): its wall time on 2 CPU processes (gloo) against
1, through the training command (``flowgrpo.runner.main``, one tiny epoch), and whether the figures agree:

    python bench/eval_split.py OUT_DIR [--images 16] [--size 64] [--steps 8]

Each run evaluates the set before and after its epoch. Each process times its calls of
:meth:`~flowgrpo.training.evaluation.Evaluation.evaluate` (this script's ``--worker`` mode wraps it, then runs
``flowgrpo.runner.main``): wall seconds and the process's CPU seconds (``time.process_time``, all its threads),
written to ``<run>/eval_times_<rank>.json``. Every process runs with ``OMP_NUM_THREADS`` threads as the row says
(1 process with 2 threads uses the same 2 cores as 2 processes with 1). Prints one markdown row per run: the
evaluations' wall and CPU seconds (the largest over the processes), the wall time's ratio to the 1-process
1-thread run, and the largest difference of the "before" figures and images from it. On a loaded machine the wall
time depends on the cores the others leave; the CPU seconds of one process are its share of the work.
A random tiny FLUX (``flowgrpo.models.tiny``) samples ``--images`` images of
``--size`` pixels in ``--steps`` ODE steps, in batches of 4; the reward is the JPEG size. On a machine other engineers
load, the times move with their load: run the rows back to back and read the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _config(out: Path, name: str, flux: Path, args) -> Path:
    prompts = out / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\na white cat\n")
    cfg = {"output_dir": str(out / name),
           "model": {"pretrained": str(flux), "max_sequence_length": 16, "height": args.size, "width": args.size,
                     "lora_rank": 4},
           "sampling": {"num_steps": 2}, "eval_sampling": {"num_steps": args.steps},
           "train": {"num_epochs": 1, "prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 4},
           "rewards": [{"name": "jpeg_incompressibility"}],
           "data": {"train_prompts": str(prompts), "eval_num_prompts": args.images},
           "logging": {"progress": False, "plot_every": 0, "overwrite": True}}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(config: Path, processes: int, threads: int) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": f"{REPO}:{REPO}/rewards"}
    launch = [] if processes == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                                        "--master_port", _port()]
    proc = subprocess.run([sys.executable, *launch, str(Path(__file__).resolve()), "--worker", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])


def _worker(config: str) -> None:
    """Run the training command on ``config`` with each evaluation timed (the module docstring)."""
    import time

    from flowgrpo import runner
    from flowgrpo.distributed import dist
    from flowgrpo.training.evaluation import Evaluation

    evaluate, times = Evaluation.evaluate, []

    def timed(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        out = evaluate(self, *args, **kwargs)
        times.append([time.perf_counter() - wall, time.process_time() - cpu])
        Path(self.cfg.output_dir, f"eval_times_{dist.rank()}.json").write_text(json.dumps(times))
        return out

    Evaluation.evaluate = timed
    runner.main([config])


def _times(run: Path) -> tuple[float, float]:
    """The evaluations' wall and CPU seconds, summed over the calls, the largest over the processes."""
    per = [json.loads(f.read_text()) for f in sorted(run.glob("eval_times_*.json"))]
    return max(sum(t[0] for t in p) for p in per), max(sum(t[1] for t in p) for p in per)


def _gap(base: Path, run: Path) -> tuple[float, float]:
    """Largest relative difference of the "before" figures, and largest absolute difference of the images."""
    fa, fb = (json.loads((r / "eval_before.json").read_text())["metrics"] for r in (base, run))
    ia, ib = (torch.load(r / "eval_images_before.pt", weights_only=True) for r in (base, run))
    figures = max(abs(fa[k] - fb[k]) / max(abs(fa[k]), 1e-12) for k in fa)
    return figures, float((ia - ib).abs().max())


def main(argv: list[str] | None = None) -> None:
    from flowgrpo.models.tiny import build_tiny_flux

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    flux = args.out / "flux" if (args.out / "flux").exists() else build_tiny_flux(args.out / "flux")
    rows = []
    for name, processes, threads in (("p1_t1", 1, 1), ("p2_t1", 2, 1), ("p1_t2", 1, 2)):
        _run(_config(args.out, name, flux, args), processes, threads)
        rows.append((name, processes, threads, *_times(args.out / name)))
    base = rows[0][3]
    print(f"| processes | threads each | evaluation wall s ({args.images} images x 2) | CPU s per process "
          "| wall vs 1 process, 1 thread | before figures, max rel. diff | images, max abs. diff |")
    print("|---|---|---|---|---|---|---|")
    for name, processes, threads, wall, cpu in rows:
        figures, images = _gap(args.out / "p1_t1", args.out / name)
        print(f"| {processes} | {threads} | {wall:.1f} | {cpu:.1f} | {wall / base:.2f} | {figures:.1e} "
              f"| {images:.1e} |")

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        main()
