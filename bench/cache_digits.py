"""Feature caches on the digits DiffusionNFT rollout (a table; never a test).

    python bench/cache_digits.py [--cache 'first_block={"threshold": 0.6}' ...] [--steps 8]

The rollout of ``configs/digits_nft.yaml`` (64 samples, ``--steps`` steps of DPM-Solver++(2M), 8 by default as the
config's ``sampling.num_steps``, micro-batches of 32) with
``sampling.cache`` first_block at several thresholds and taylor_seer at a few intervals, against the uncached
rollout: steps whose last block ran, the largest and mean pixel difference of the decoded images, and the median
of three paired time ratios. The learning row (judge and diversity after a cached run) is ``bench/learning.py``
with ``--set 'sampling.cache={name: …, kwargs: {…}}'``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flowgrpo.config import SamplingConfig, load_config
from flowgrpo.models import load_model_from_config
from flowgrpo.models.quiet import quiet_libraries
from flowgrpo.sampling.config import FeatureCacheConfig
from flowgrpo.sampling.final_rollout import solver_rollout
from flowgrpo.sampling.rollout import RolloutRequest

CACHES = [("first_block", {"threshold": th}) for th in (0.0, 0.1, 0.2, 0.4)] + [
    ("taylor_seer", {"cache_interval": 2, "disable_cache_before_step": 2}),
    ("taylor_seer", {"cache_interval": 3, "disable_cache_before_step": 2}),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", action="append", default=[], metavar="NAME=JSON",
                        help="a cache to measure instead of the default list, e.g. 'first_block={\"threshold\": 0.6}'")
    parser.add_argument("--steps", type=int, default=8, help="sampling steps of both rollouts (>= 2; default 8)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    caches = [(c.split("=", 1)[0], json.loads(c.split("=", 1)[1])) for c in args.cache] or CACHES
    quiet_libraries()
    cfg = load_config("configs/digits_nft.yaml")
    adapter = load_model_from_config(cfg.model)
    b = 64
    prompts = [f"the digit {i % 10}" for i in range(b)]
    request = RolloutRequest(prompts, [{}] * b, torch.arange(b) // 8, torch.arange(b) % 8,
                             settings=SamplingConfig(num_steps=args.steps, guidance_scale=1.0), batch_size=32, seed=0,
                             epoch=0)
    grid = adapter.sigmas(args.steps)
    tail = []  # the last block's output projection: it runs only where the cache computes the remaining blocks
    adapter.transformer.single_transformer_blocks[-1].proj_out.register_forward_hook(lambda *a: tail.append(1))

    def run(cache):
        return solver_rollout(adapter, request, solver="dpmpp_2m", sigmas=grid, cache=cache)

    base = run(None).images
    full = len(tail)
    print("| cache | last block ran | max pixel diff | mean pixel diff | time ratio |\n|---|---|---|---|---|")
    for name, kwargs in caches:
        cache = FeatureCacheConfig(name=name, kwargs=kwargs)
        tail.clear()
        images = run(cache).images
        ran = len(tail)
        ratios = []
        for _ in range(3):
            t0 = time.perf_counter()
            run(None)
            t1 = time.perf_counter()
            run(cache)
            ratios.append((time.perf_counter() - t1) / (t1 - t0))
        diff = (images - base).abs()
        print(f"| {name} {kwargs} | {ran}/{full} | {float(diff.max()):.4f} | {float(diff.mean()):.4f} | "
              f"{sorted(ratios)[1]:.2f}× |")


if __name__ == "__main__":
    main()
