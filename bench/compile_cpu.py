"""``model.compile: regional`` on the CPU: exactness through the trainer, FSDP2 and shape changes (a table; never a
test). Row (g) of ``bench/speed.py`` (``--parts g``) runs it.

    python bench/compile_cpu.py [--rows lora fsdp2 shapes] [--out DIR] [--backend inductor]

Rows, each a real training run (``flowgrpo.runner.run``; ``fsdp2`` under ``torchrun --nproc_per_node 2``, gloo) of
the tiny random FLUX model with LoRA (32², T = 3, 2 prompts × 2 samples), recompute mode on:

* ``lora``: one process; the first update's ``policy/logprob_mismatch_max`` (0.0 expected: the old log-probs come
  from the update's own training graph), ``compile/graphs`` and ``compile/seconds`` per epoch;
* ``fsdp2``: the same on two processes with ``parallel.sharding: fsdp2`` (the blocks compiled before
  ``fully_shard``, flowgrpo.compile);
* ``shapes``: four epochs with an evaluation every two (3 held-out prompts in batches of 2: a last batch of 1, in
  eval mode: new shapes and a new mode beside the rollout's): the graphs compiled per epoch, to see that the new
  shapes compile once (automatic dynamic shapes) and later epochs compile nothing, with one warning.

Prints one line per row: the per-epoch compiled graphs, compile seconds, the mismatch, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _config(root: Path, tiny: Path, name: str, backend: str, **extra) -> Path:
    import yaml

    (root / "p.txt").write_text("a red cube\na blue ball\nthe digit three\n")
    data = {
        "output_dir": str(root / name),
        "model": {"pretrained": str(tiny), "max_sequence_length": 16, "height": 32, "width": 32,
                  "compile": {"name": "regional", "backend": backend}},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": extra.pop("epochs", 2), "prompts_per_epoch": 2, "group_size": 2,
                  "rollout_batch_size": extra.pop("rollout_batch_size", 2), "train_batch_size": 2, "lr": 1e-2},
        "objective": {"recompute_old_log_probs": True},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(root / "p.txt")},
        "logging": {"progress": False},
        **extra,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _report(name: str, out: Path, seconds: float) -> dict:
    from flowgrpo.writing.metrics import read_metrics

    recs = read_metrics(out / "metrics.jsonl")
    row = {"row": name, "seconds": round(seconds, 1),
           "graphs": [r.get("compile/graphs") for r in recs],
           "compile_seconds": [round(r.get("compile/seconds", float("nan")), 1) for r in recs],
           "mismatch": [r.get("policy/logprob_mismatch_max") for r in recs]}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["lora", "fsdp2", "shapes"], choices=["lora", "fsdp2", "shapes"])
    parser.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    args = parser.parse_args(argv)
    from flowgrpo.models.tiny import build_tiny_flux
    from flowgrpo.writing.outputs import claim_for_command

    root = Path(args.out or tempfile.mkdtemp(prefix="compile_cpu_"))
    claim_for_command(parser, root, "compile bench", "--out")  # flowgrpo's write rule (flowgrpo.writing.outputs)
    tiny = root / "tiny_flux"
    if not (tiny / "model_index.json").exists():
        build_tiny_flux(tiny)
    rows = []
    path = os.pathsep.join([str(REPO), str(REPO / "rewards"), os.environ.get("PYTHONPATH", "")])
    # ACCELERATE_USE_CPU: accelerate's process group on gloo (the CPU), as tests/training/test_sharding.py
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": path}
    for name in args.rows:
        if name == "fsdp2":
            cfg = _config(root, tiny, name, args.backend, parallel={"sharding": "fsdp2", "text_encoders": "offload"})
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "flowgrpo/train.py",
                   str(cfg)]
        elif name == "shapes":
            cfg = _config(root, tiny, name, args.backend, epochs=4,
                          logging={"progress": False, "eval_every": 2},
                          eval_sampling={"num_steps": 3}, data={"train_prompts": str(root / "p.txt"),
                                                                "eval_prompts": str(root / "p.txt")})
            cmd = [sys.executable, "flowgrpo/train.py", str(cfg)]
        else:
            cfg = _config(root, tiny, name, args.backend)
            cmd = [sys.executable, "flowgrpo/train.py", str(cfg)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name}: failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            continue
        warned = [line for line in proc.stderr.splitlines() if "model.compile" in line]
        row = _report(name, root / name, time.perf_counter() - t0)
        row["log"] = warned
        for line in warned:
            print(f"  {line[-240:]}", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
