"""GRPO on the digits task for a fixed budget, one row per chunker, SDE kind and estimator (a table; never a test).

    python bench/learning.py [--epochs 60] [--seed 0 1 2] [--rows per_step sapo gfpo ...] [--json PATH]

Every row starts from the same pretrained base model (``flowgrpo/configs/digits.yaml``) and changes only the
settings named in its row. Correctness is the independent judge's strict correctness on 200 seeded ODE images
(20 per digit), before and after; diversity is intra-digit diversity (real digits: about 26). "calls/epoch" and
"rows/epoch" count transformer forwards during the rollout (E-GRPO's shared prefix shows here).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

ROWS: dict[str, list[str]] = {
    "per_step": [],
    "chunk": ["chunker.name=chunk", "chunker.min_chunk_size=2"],
    "chunk_fixed": ["chunker.name=chunk", "chunker.chunk_sizes=[2,2,4]"],
    "trajectory": ["chunker.name=trajectory"],
    "window": ["chunker.name=window", "chunker.window_size=4", "chunker.window_shift_every=20"],
    "entropy_merge": ["chunker.name=entropy_merge", "chunker.entropy_threshold=0.9", "chunker.sde_fraction=0.5",
                      "train.prompts_per_epoch=8", "train.rollout_batch_size=16", "train.train_batch_size=8"],
    "dance_sde": ["sampling.sde_kind=dance_sde", "sampling.noise_level=0.7"],
    "cps": ["sampling.sde_kind=cps", "sampling.noise_level=0.8", "chunker.drop_last_step=true"],
    "dr_grpo": ["algo.advantage=dr_grpo"],
    "rloo": ["algo.advantage=rloo"],
    "grpo_global_std": ["algo.global_std=true"],
    # policy losses (flowgrpo.algo.losses) beside the clipped default; SAPO's temperature ~1/clip_range, since
    # flow-model ratios move ~1e-4 from 1 (the paper's 1.0/1.05 are for LLM token ratios)
    "sapo": ["algo.policy_loss=sapo", "algo.sapo_tau_pos=5000", "algo.sapo_tau_neg=5250"],
    "dual_clip": ["algo.policy_loss=dual_clip", "algo.dual_clip_c=3"],
    "grpo_guard": ["algo.policy_loss=grpo_guard"],
    # GFPO: draw G' = 16 per prompt, keep the 8 of largest reward spread (PODS max-variance selection)
    "gfpo": ["train.group_size=16", "algo.group_filter.name=gfpo", "algo.group_filter.keep=8",
             "algo.group_filter.select=max_spread"],
}


def run_row(name: str, overrides: list[str], epochs: int, seed: int, out_root: Path) -> dict:
    from flowgrpo.config import build_config
    from flowgrpo.metrics import read_metrics
    from flowgrpo.train import DEFAULT_CONFIG, run

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg = build_config(data, [*overrides, f"train.num_epochs={epochs}", f"train.seed={seed}",
                              f"output_dir={out_root / name}", "logging.progress=false"])
    start = time.perf_counter()
    summary = run(cfg)
    wall = time.perf_counter() - start
    recs = read_metrics(out_root / name / "metrics.jsonl")
    return {
        "row": name, "overrides": overrides, "epochs": epochs, "seed": seed,
        "correctness_before": summary.get("correctness_before"), "correctness_after": summary.get("correctness_after"),
        "diversity_after": summary.get("diversity_after"), "diversity_real": summary.get("diversity_real"),
        "wall_s": wall, "calls_per_epoch": recs[-1].get("rollout/transformer_calls"),
        "rows_per_epoch": recs[-1].get("rollout/transformer_rows"),
        "trajectories_per_epoch": recs[-1].get("rollout/trajectories"),
        "extra_sample_frac": recs[-1].get("filter/extra_sample_frac", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="RL seeds (one row per seed)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides applied to every row before its own (e.g. a smaller budget)")
    args = parser.parse_args()
    out_root = Path(args.out or tempfile.mkdtemp(prefix="flowgrpo_learning_"))
    results = []
    header = ("| row | seed | settings | judge correctness before → after | diversity after (real) | wall | "
              "calls/epoch | rows/epoch | extra samples |\n|---|---|---|---|---|---|---|---|---|")
    print(header, flush=True)
    for name in args.rows:
        for seed in args.seed:
            r = run_row(name, [*args.set, *ROWS[name]], args.epochs, seed, out_root / f"seed{seed}")
            results.append(r)
            print(f"| {name} | {seed} | {' '.join(ROWS[name]) or 'digits.yaml'} | {r['correctness_before']:.3f} → "
                  f"{r['correctness_after']:.3f} | {r['diversity_after']:.1f} ({r['diversity_real']:.1f}) | "
                  f"{r['wall_s'] / 60:.1f} min | {r['calls_per_epoch']} | {r['rows_per_epoch']} | "
                  f"{r['extra_sample_frac']:.0%} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
