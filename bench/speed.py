"""Speed of flowgrpo's own machinery against the bare diffusers/torch work it wraps (a table; never a test).

    python bench/speed.py [--json PATH] [--repeats 5] [--parts a b c d] [--stat median|min]

Rows (a) and (b) time flowgrpo's side and the reference in alternation and report the statistic of the per-pair
ratios, so a slow spell of a shared machine falls on both sides.

(a) an SDE rollout recording log-probs and decoding vs ``FluxPipeline.__call__`` (same model, prompts, steps,
    batch, resolution; target ≤ 1.05×);
(b) one policy update vs the bare forward + backward of the same trained transitions (target ≤ 1.15×);
(c) epoch time as G and as T double (expect linear growth);
(d) E-GRPO's update with each shared anchor forwarded once per (prompt, branch step) group vs once per sample
    (the same trajectory and plan; the chunker's ``shares_inputs`` switched off for the "before" figure);
(e) the forward-process update (DiffusionNFT: B samples × int(0.99·T) σ's, an old-copy and a reference pass per
    row) vs the bare forwards and backward of the same (x₀, σ, ε) draws (``bench/forward_speed.py``; target ≤ 1.15×);
(f) the forward-process rollout (euler, no log-probs) with ``sampling.cache`` = first_block at ``--cache-threshold``
    vs uncached: time, the fraction of steps whose remaining blocks were skipped, and the largest pixel difference
    of the decoded images (threshold 0: skips nothing, difference exactly 0);
(g) ``model.compile=regional`` through the trainer (``bench/compile_cpu.py``): the recompute-mode mismatch (0.0),
    the graphs compiled and compile seconds per epoch, on one process, on two under FSDP2, and with new shapes
    (run only when named in ``--parts``: compile speed-ups are measured on a GPU, ``bench/gpu_check.sh`` part l).
All on the tiny random FLUX model, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

D_SIZE = 256  # row (d)'s image size in pixels
STAT = {"median": statistics.median, "min": min}  # min: the least disturbed repeat on a busy machine (as timeit)
_stat = statistics.median


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _stat(times)


def _paired_seconds(ours, reference, repeats: int) -> tuple[float, float, float]:
    """(ours, reference, ratio): the two timed in alternation, so that a slow spell of a shared machine falls on
    both; the ratio is the statistic of the per-pair ratios (steadier than a ratio of two separate runs)."""
    ours(), reference()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((ours, a), (reference, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return _stat(a), _stat(b), _stat([x / y for x, y in zip(a, b, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--parts", nargs="+", default=["a", "b", "c", "d", "e", "f"],
                        choices=["a", "b", "c", "d", "e", "f", "g"], help="which rows to measure (g: only when "
                        "named; inductor compiles take minutes on a CPU)")
    parser.add_argument("--cache-threshold", type=float, default=0.2, help="row (f): first_block's threshold")
    parser.add_argument("--stat", choices=sorted(STAT), default="median", help="statistic of the repeats")
    args = parser.parse_args()
    global _stat
    _stat = STAT[args.stat]
    nan = float("nan")

    from flowgrpo.config import SamplingConfig, build_config
    from flowgrpo.models import load_model
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.models.quiet import quiet_libraries
    from flowgrpo.models.tiny import build_tiny_flux
    from flowgrpo.sampling.rollout import RolloutRequest, rollout

    quiet_libraries()
    torch.manual_seed(0)
    folder = build_tiny_flux(Path(tempfile.mkdtemp()) / "tiny")
    adapter = load_model(str(folder), max_sequence_length=32, height=64, width=64)
    pipe = adapter.pipe
    b, t = args.batch, args.steps
    prompts = [f"a photo of object {i}" for i in range(b)]
    settings = SamplingConfig(num_steps=t, guidance_scale=3.5, sde_kind="flow_sde", noise_level=0.7)

    def ours():
        rollout(adapter, RolloutRequest(prompts, [{}] * b, torch.arange(b), torch.zeros(b, dtype=torch.long),
                settings=settings, batch_size=b, seed=0, epoch=0), torch.ones(t, dtype=torch.bool))

    def theirs():
        with torch.no_grad():
            pipe(prompts, height=64, width=64, num_inference_steps=t, guidance_scale=3.5, output_type="pt",
                 max_sequence_length=32, generator=torch.Generator().manual_seed(0))

    pipe.set_progress_bar_config(disable=True)
    a_ours, a_theirs, a_ratio = _paired_seconds(ours, theirs, args.repeats) if "a" in args.parts else (nan,) * 3

    # (b) one update (the trainer's chunk_forward + clipped surrogate + backward + step) vs bare fwd+bwd
    from accelerate import Accelerator

    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.records import Advantages
    from flowgrpo.rewards.compose import ComposedReward
    from flowgrpo.training.loop import Trainer
    from flowgrpo.training.update import run_update

    cfg = build_config({"model": {"pretrained": str(folder)}, "sampling": {"num_steps": t},
                        "train": {"prompts_per_epoch": b // 2, "group_size": 2, "rollout_batch_size": b},
                        "rewards": [{"name": "jpeg_compressibility"}], "logging": {"progress": False}})

    class _NoReward:
        name = "none"

        def setup(self, device):
            pass

        def __call__(self, images, prompts, metadata):
            return torch.zeros(len(prompts))

    from flowgrpo.data.prompts import PromptSet

    def make_trainer(adapter, config=cfg) -> Trainer:
        """A LoRA trainer of ``adapter`` with row (b)'s settings (or ``config``'s) and a reward never called."""
        setup_trainable(adapter, finetune="lora", rank=8, alpha=16, target_modules=config.model.lora_target_modules,
                        need_reference=False)
        return Trainer(config, adapter=adapter,
                       rewards=ComposedReward({"none": _NoReward()}, {"none": 1}), eval_rewards=None,
                       objective=build_objective(config), prompts=PromptSet(prompts, [{}] * b, "bench"),
                       eval_prompts=None, accelerator=Accelerator(cpu=True))

    trainer = make_trainer(adapter)
    traj = rollout(adapter, RolloutRequest(prompts, [{}] * b, torch.arange(b), torch.zeros(b, dtype=torch.long),
            settings=settings, batch_size=b, seed=0, epoch=0), torch.ones(t, dtype=torch.bool))
    adv = Advantages(values=torch.randn(b), train_mask=torch.ones(b, dtype=torch.bool), zero_spread_frac=0.0,
                     nan_frac=0.0, learning_frac=1.0)
    objective = trainer.objective
    plan = objective.chunker.plan(traj, 0, torch.Generator().manual_seed(0))

    def update_of(tr, traj_, adv_, plan_):
        """The objective's update of a given plan, its schedule included (as a training epoch's)."""
        run_update(tr.objective, tr.adapter, tr.optim, tr.objective.work(traj_, adv_, plan_, 0),
                   inner_epochs=tr.cfg.train.inner_epochs, progress=False)

    def update():
        update_of(trainer, traj, adv, plan)

    def bare():
        for (step,) in plan.chunks:
            x = traj.latents[:, step]
            v = adapter.velocity(x, traj.sigmas[step].expand(b), traj.embeds, 3.5)
            v.square().mean().backward()
        trainer.optim.optimizer.step()
        trainer.optim.zero_grad()

    b_ours, b_bare, b_ratio = _paired_seconds(update, bare, args.repeats) if "b" in args.parts else (nan,) * 3

    # (c) epoch scaling: rollout + update for G and T doubled
    def epoch_time(g: int, steps: int) -> float:
        s = SamplingConfig(num_steps=steps, guidance_scale=3.5, sde_kind="flow_sde", noise_level=0.7)
        n = 4 * g
        ps = [prompts[i % b] for i in range(n)]

        def run():
            tr = rollout(adapter, RolloutRequest(ps, [{}] * n, torch.arange(n) // g, torch.arange(n) % g,
                    settings=s, batch_size=g, seed=0, epoch=0), torch.ones(steps, dtype=torch.bool))
            pl = objective.chunker.plan(tr, 0, torch.Generator().manual_seed(0))
            a = Advantages(values=torch.randn(n), train_mask=torch.ones(n, dtype=torch.bool), zero_spread_frac=0.0,
                           nan_frac=0.0, learning_frac=1.0)
            trainer.cfg.train.train_batch_size = g
            update_of(trainer, tr, a, pl)

        return _median_seconds(run, max(1, args.repeats // 2))

    base_g, base_t = 4, 4
    e0, eg, et = ((epoch_time(base_g, base_t), epoch_time(2 * base_g, base_t), epoch_time(base_g, 2 * base_t))
                  if "c" in args.parts else (nan, nan, nan))
    # (d) E-GRPO: the G rows of a (prompt, branch step) group jump from one anchor; the update forwards it once
    def egrpo_update_times() -> tuple[float, float]:
        """At 256² (256 image tokens), where a transformer call's cost grows with its rows on this CPU (at 64² a
        tiny call costs the same for 2 rows as for 8, and the dedupe has nothing to save)."""
        from flowgrpo.algo.chunkers import build_chunker, chunker_settings

        g = 4
        big = load_model(str(folder), max_sequence_length=32, height=D_SIZE, width=D_SIZE)
        em_trainer = make_trainer(big)
        em = build_chunker(chunker_settings("entropy_merge", merge_steps=[0, 1, 2, 4], merge_lengths=[1, 1, 2, 3]))
        em_prompts = [prompts[i // g] for i in range(b)]  # b // g prompts, G samples each
        em_traj = em.rollout(big, RolloutRequest(em_prompts, [{}] * b, torch.arange(b) // g, torch.arange(b) % g,
                             settings=settings, batch_size=b, seed=0, epoch=0))
        n = em_traj.batch_size
        em_plan = em.plan(em_traj, 0, torch.Generator().manual_seed(0))
        em_adv = Advantages(values=torch.randn(n), train_mask=torch.ones(n, dtype=torch.bool), zero_spread_frac=0.0,
                            nan_frac=0.0, learning_frac=1.0)
        em_trainer.objective.chunker, em_trainer.cfg.train.train_batch_size = em, b

        def run():
            update_of(em_trainer, em_traj, em_adv, em_plan)

        once = _median_seconds(run, args.repeats)
        type(em).shares_inputs = False  # every row forwarded, as before the dedupe
        try:
            each = _median_seconds(run, args.repeats)
        finally:
            type(em).shares_inputs = True
        return once, each

    d_once, d_each = egrpo_update_times() if "d" in args.parts else (nan, nan)

    # (e) the forward-process update vs the bare work of its (x0, sigma, eps) draws
    def forward_update_times() -> tuple[float, float, float, int]:
        from forward_speed import update_and_bare

        fcfg = build_config({"model": {"pretrained": str(folder)}, "sampling": {"num_steps": t},
                             "objective": {"name": "nft"},
                             "train": {"prompts_per_epoch": b // 2, "group_size": 2, "rollout_batch_size": b},
                             "rewards": [{"name": "jpeg_compressibility"}], "logging": {"progress": False}})
        fa = load_model(str(folder), max_sequence_length=32, height=64, width=64)
        ft = make_trainer(fa, fcfg)
        request = RolloutRequest(prompts, [{}] * b, torch.arange(b) // 2, torch.arange(b) % 2,
                                 settings=SamplingConfig(num_steps=t, guidance_scale=3.5), batch_size=b, seed=0,
                                 epoch=0)
        samples = ft.objective.rollout(fa, request)
        fadv = Advantages(values=torch.randn(b), train_mask=torch.ones(b, dtype=torch.bool), zero_spread_frac=0.0,
                          nan_frac=0.0, learning_frac=1.0)
        upd, bare_fn, rows = update_and_bare(ft, samples, fadv)
        return (*_paired_seconds(upd, bare_fn, args.repeats), rows)

    e_ours, e_bare, e_ratio, e_rows = forward_update_times() if "e" in args.parts else (nan, nan, nan, 0)
    # (f) the forward-process rollout with a first-block feature cache vs without
    def cached_rollout_times() -> tuple[float, float, float, float, float]:
        from flowgrpo.sampling.config import FeatureCacheConfig
        from flowgrpo.sampling.final_rollout import solver_rollout

        request = RolloutRequest(prompts, [{}] * b, torch.arange(b) // 2, torch.arange(b) % 2,
                                 settings=SamplingConfig(num_steps=t, guidance_scale=3.5), batch_size=b, seed=0,
                                 epoch=0)
        grid = adapter.sigmas(t)
        cache = FeatureCacheConfig(name="first_block", kwargs={"threshold": args.cache_threshold})

        def run(c):
            return solver_rollout(adapter, request, solver="euler", sigmas=grid, cache=c)

        tail = []  # the last block's output projection runs only at the steps the cache computes
        handle = adapter.transformer.single_transformer_blocks[-1].proj_out.register_forward_hook(
            lambda *a: tail.append(1))
        try:
            cached_images = run(cache).images
        finally:
            handle.remove()
        skipped = 1 - len(tail) / t
        diff = float((cached_images - run(None).images).abs().max())
        return (*_paired_seconds(lambda: run(cache), lambda: run(None), args.repeats), skipped, diff)

    f_cached, f_plain, f_ratio, f_skipped, f_diff = (cached_rollout_times() if "f" in args.parts
                                                     else (nan,) * 5)
    figures = {
        "a_rollout_s": a_ours, "a_pipeline_s": a_theirs, "a_ratio": a_ratio,
        "b_update_s": b_ours, "b_bare_s": b_bare, "b_ratio": b_ratio,
        "c_epoch_s": e0, "c_epoch_2G_s": eg, "c_epoch_2T_s": et, "c_ratio_2G": eg / e0, "c_ratio_2T": et / e0,
        "d_egrpo_update_shared_s": d_once, "d_egrpo_update_per_row_s": d_each, "d_ratio": d_once / d_each,
        "e_forward_update_s": e_ours, "e_forward_bare_s": e_bare, "e_ratio": e_ratio, "e_rows": e_rows,
        "f_cached_rollout_s": f_cached, "f_rollout_s": f_plain, "f_ratio": f_ratio, "f_skipped_frac": f_skipped,
        "f_max_pixel_diff": f_diff, "f_threshold": args.cache_threshold,
        "batch": b, "steps": t, "threads": torch.get_num_threads(),
    }
    lines = [
        "| measure | flowgrpo | reference | ratio | target |",
        "|---|---|---|---|---|",
        f"| (a) SDE rollout + log-probs + decode vs FluxPipeline.__call__ (B={b}, T={t}, 64²) | {a_ours*1e3:.0f} ms | "
        f"{a_theirs*1e3:.0f} ms | {a_ratio:.2f}× | ≤ 1.05× |",
        f"| (b) policy update vs bare forward+backward of the same {b}×{t} transitions | {b_ours*1e3:.0f} ms | "
        f"{b_bare*1e3:.0f} ms | {b_ratio:.2f}× | ≤ 1.15× |",
        f"| (c) epoch, G {base_g}→{2*base_g} (4 prompts, T={base_t}) | {eg:.2f} s | {e0:.2f} s | {eg/e0:.2f}× | ≈ 2× |",
        f"| (c) epoch, T {base_t}→{2*base_t} (4 prompts, G={base_g}) | {et:.2f} s | {e0:.2f} s | {et/e0:.2f}× | ≈ 2× |",
        f"| (d) E-GRPO update, shared anchor forwarded once vs per sample ({b} samples × 4 branch steps, G=4, "
        f"{D_SIZE}²) | "
        f"{d_once*1e3:.0f} ms | {d_each*1e3:.0f} ms | {d_once/d_each:.2f}× | < 1× |",
        f"| (e) DiffusionNFT update vs bare forwards + backward of the same {e_rows} (x0, sigma, eps) rows (B={b}, "
        f"T={t}: old-copy and reference passes, 64²) | {e_ours*1e3:.0f} ms | {e_bare*1e3:.0f} ms | {e_ratio:.2f}× | "
        "≤ 1.15× |",
        f"| (f) forward-process rollout (euler, B={b}, T={t}, 64²) with first_block cache (threshold "
        f"{args.cache_threshold:g}: {f_skipped:.0%} of steps skipped, max pixel diff {f_diff:.3g}) vs uncached | "
        f"{f_cached*1e3:.0f} ms | {f_plain*1e3:.0f} ms | {f_ratio:.2f}× | < 1× |",
    ]
    print("\n".join(lines))
    if "g" in args.parts:  # model.compile=regional through the trainer: one process, FSDP2 on two, shape changes
        from compile_cpu import main as compile_rows

        figures["g_compile"] = compile_rows([])
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
