"""The gain of asynchronous training on Ray (docs/async.md) with a slow, IO-bound reward: one config trained with
``runtime.engine`` torchrun (synchronous), ray at ``max_staleness`` 0, ray at ``max_staleness`` 1, and ray at
``max_staleness`` 1 with one reward worker, each in its own process through the CLI, against the same reward: the
config's own rewards served over HTTP by this process (the project's reward server,
:func:`flowgrpo.rewards.server.create_app`) behind a latency added here, the stand-in of a remote judge. Prints per
run the wall time of an epoch (the sum of its ``timing/…`` phases but the evaluation, plots and saves: after the
first epoch, which holds the workers' start), its rollout, reward and update phases, the reward worker's wait, the
last epoch's reward, and the ratio of the synchronous epoch to each one.

    python bench/async_ray.py [CONFIG.yaml] [key=value ...] [--epochs 6] [--threads 1] [--reward-latency auto]
                              [--variants torchrun "ray, staleness 1"] [--out results.json]

``--reward-latency``: the reward's latency per epoch in seconds, spread over the epoch's images (each request
sleeps its share, so the sum over an epoch is the figure however the rollout batches its images); ``auto``: the
rollout plus update time of one synchronous epoch, measured first by a two-epoch torchrun run with no latency
(the case where staleness 1 ideally halves the epoch: synchronous R + L + U with L = R + U, against (R + L + U) / 2
when epoch e + 1's rollout and reward overlap epoch e's reward and update).

What it measures depends on the machine: on a CPU box the workers and the trainer share the cores, so the overlap
gains only where the rollout and the update leave cores idle (``--threads 1`` on two cores); the identity of the
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
            "ray, staleness 1": ["runtime.engine=ray", "runtime.max_staleness=1"],
            "ray, staleness 1, reward worker": ["runtime.engine=ray", "runtime.max_staleness=1",
                                                "runtime.reward_workers=1"]}
NOT_EPOCH = ("timing/eval", "timing/plots", "timing/save")  # phases that are not the epoch's training


class SlowJudge:
    """The config's rewards (composed, their weighted total) behind a latency of ``per_image_s`` seconds an image,
    slept before scoring: an IO-bound remote judge's stand-in (the sleep holds no core)."""

    def __init__(self, composed, per_image_s: float = 0.0) -> None:
        self.composed = composed
        self.per_image_s = per_image_s

    def setup(self, device) -> None:
        self.composed.setup(device)

    def __call__(self, images, prompts, metadata):
        time.sleep(self.per_image_s * len(images))
        return self.composed(images, prompts, metadata).total


def _run(config: str | None, overrides: list[str], out: Path, threads: int) -> dict:
    """Train one variant in its own process; returns its figures."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "flowgrpo.cli", "train", *([config] if config else []), f"output_dir={out}",
           "logging.progress=false", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = records[1:] or records  # the first epoch holds the workers' start

    def mean(key: str) -> float:
        return sum(r.get(key) or 0.0 for r in later) / len(later)

    epoch_s = [sum(v for k, v in r.items() if k.startswith("timing/") and k not in NOT_EPOCH and v is not None)
               for r in later]
    return {"command_s": wall, "epoch_s": sum(epoch_s) / len(epoch_s), "rollout_s": mean("timing/rollout"),
            "reward_s": mean("timing/reward"), "update_s": mean("timing/update"),
            "reward_wait_s": mean("runtime/reward_wait_seconds"), "worker_reward_s": mean("runtime/reward_seconds"),
            "worker_rollout_s": mean("runtime/worker_seconds"), "records_wait_s": mean("runtime/wait_seconds"),
            "sync_bytes": max((r.get("runtime/sync_bytes", 0.0) for r in records), default=0.0),
            "lags": [r.get("runtime/lag") for r in records], "trajectories": later[-1]["rollout/trajectories"],
            "last_reward": records[-1].get("reward/total/mean")}


def _judge(config: str | None, overrides: list[str]) -> SlowJudge:
    """The config's rewards (with ``overrides``) built as the trainer builds them, behind no latency yet."""
    from flowgrpo.config import load_config
    from flowgrpo.preflight import build_rewards
    from flowgrpo.runner import DEFAULT_CONFIG

    composed, _ = build_rewards(load_config(config or DEFAULT_CONFIG, overrides).rewards)
    if composed.group_wise:
        raise SystemExit(f"the rewards {composed.group_wise} score whole groups: served per request they cannot")
    return SlowJudge(composed)


def _calibrate(config: str | None, overrides: list[str], tmp: Path, threads: int) -> tuple[float, int]:
    """(seconds of one synchronous epoch's rollout plus update, images an epoch's rollout scores): a two-epoch
    torchrun run with the reward served without latency, its second epoch."""
    r = _run(config, ["train.num_epochs=2", *overrides, *VARIANTS["torchrun"]], tmp / "calibration", threads)
    print(f"calibration (torchrun, no latency): rollout {r['rollout_s']:.2f} s, reward {r['reward_s']:.2f} s, "  # noqa: T201
          f"update {r['update_s']:.2f} s, {r['trajectories']:.0f} images an epoch", flush=True)
    return r["rollout_s"] + r["update_s"], int(r["trajectories"])


def _table(results: dict, latency: float) -> str:
    base = results.get("torchrun", {}).get("epoch_s")
    rows = [f"reward latency {latency:.2f} s an epoch",
            f"{'variant':<32} {'command s':>9} {'epoch s':>8} {'rollout s':>9} {'reward s':>8} {'update s':>8} "
            f"{'sample s':>8} {'score s':>7} {'wait s':>7} {'reward':>7} {'sync/this':>9}"]
    for name, r in results.items():
        ratio = f"{base / r['epoch_s']:9.2f}" if base else f"{'-':>9}"
        rows.append(f"{name:<32} {r['command_s']:9.1f} {r['epoch_s']:8.2f} {r['rollout_s']:9.2f} "
                    f"{r['reward_s']:8.2f} {r['update_s']:8.2f} {r['worker_rollout_s']:8.2f} "
                    f"{r['worker_reward_s']:7.2f} {r['reward_wait_s']:7.2f} "
                    f"{r['last_reward'] or float('nan'):7.4f} {ratio}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="training config (omit for the embedded digits default)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every variant")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (and workers)")
    parser.add_argument("--reward-latency", default="auto",
                        help="the reward's latency per epoch in seconds, or auto (module docstring)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    import torch

    from flowgrpo.rewards.server import ServerThread, create_app

    torch.set_num_threads(args.threads)  # the served rewards' own scoring, in this process
    judge = _judge(args.config, args.overrides)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, \
            ServerThread(create_app(judge, reward_name="slow_judge")) as server:
        served = [*args.overrides, f"rewards=[{{name: remote, kwargs: {{url: '{server.url}'}}}}]"]
        measured, images = _calibrate(args.config, served, Path(tmp), args.threads)
        latency = measured if args.reward_latency == "auto" else float(args.reward_latency)
        judge.per_image_s = latency / images
        for name in args.variants:
            out = Path(tmp) / name.replace(" ", "_").replace(",", "")
            results[name] = _run(args.config, [f"train.num_epochs={args.epochs}", *served, *VARIANTS[name]], out,
                                 args.threads)
            print(f"{name}: epoch {results[name]['epoch_s']:.2f} s", flush=True)  # noqa: T201
    print(_table(results, latency))  # noqa: T201
    if args.out:
        args.out.write_text(json.dumps({"reward_latency_s": latency, "variants": results}, indent=1))


if __name__ == "__main__":
    main()
