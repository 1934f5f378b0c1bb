"""The cost and the gain of Ray rollout workers (docs/async.md): one config trained with ``runtime.engine`` torchrun,
ray at ``max_staleness`` 0 and ray at ``max_staleness`` 1, each in its own process through the CLI, and per run the
wall time of its epochs (the sum of each epoch's ``timing/…`` phases), the rollout phase's share (on Ray: the wait
for the worker), the weights sent per sync and its seconds, and the last epoch's reward.

    python bench/async_ray.py [CONFIG.yaml] [--epochs 6] [--threads 1] [--out results.json] [key=value ...]

What it measures depends on the machine: on a CPU box the worker and the trainer share the cores, so staleness 1
can only gain where the rollout and the update leave cores idle (``--threads 1`` on two cores); the identity of the
staleness-0 run to the torchrun run is the tests' (tests/runtime/test_ray_identity.py), not this script's.
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

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"torchrun": ["runtime.engine=torchrun"],
            "ray, staleness 0": ["runtime.engine=ray"],
            "ray, staleness 1": ["runtime.engine=ray", "runtime.max_staleness=1"]}


def _run(config: str | None, overrides: list[str], out: Path, threads: int) -> dict:
    """Train one variant in its own process; returns its figures."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "flowgrpo.cli", "train", *([config] if config else []), f"output_dir={out}",
           "logging.progress=false", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epoch_s = [sum(v for k, v in r.items() if k.startswith("timing/") and v is not None) for r in records]
    later = records[1:] or records  # the first epoch holds the workers' start
    return {"command_s": wall, "epochs_s": sum(epoch_s), "epoch_s_after_first": sum(epoch_s[1:]) / max(len(later), 1),
            "rollout_s_after_first": sum(r["timing/rollout"] for r in later) / len(later),
            "update_s_after_first": sum(r["timing/update"] for r in later) / len(later),
            "sync_bytes": max((r.get("runtime/sync_bytes", 0.0) for r in records), default=0.0),
            "sync_s_after_first": sum(r.get("runtime/sync_seconds", 0.0) for r in later) / len(later),
            "lags": [r.get("runtime/lag") for r in records],
            "last_reward": records[-1].get("reward/total/mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="training config (omit for the embedded digits default)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every variant")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (and worker)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in VARIANTS.items():
            out = Path(tmp) / name.replace(" ", "_").replace(",", "")
            results[name] = _run(args.config, [f"train.num_epochs={args.epochs}", *args.overrides, *extra], out,
                                 args.threads)
    print(f"{'variant':<18} {'command s':>9} {'epoch s':>8} {'rollout s':>9} {'update s':>8} {'sync MB':>8} "  # noqa: T201
          f"{'sync s':>7} {'reward':>7}")
    for name, r in results.items():
        print(f"{name:<18} {r['command_s']:9.1f} {r['epoch_s_after_first']:8.2f} {r['rollout_s_after_first']:9.2f} "  # noqa: T201
              f"{r['update_s_after_first']:8.2f} {r['sync_bytes'] / 1e6:8.2f} {r['sync_s_after_first']:7.3f} "
              f"{r['last_reward']:7.4f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
