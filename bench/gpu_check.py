"""The GPU check at real size (run through ``bench/gpu_check.sh``; never part of CI except ``--dry-run``).

    python bench/gpu_check.py [--model flux] [--out DIR] [--parts a b c d e f g] [--dry-run]

Builds a random pipeline of the real architecture directly in GPU memory (FLUX.1-dev: 19 double + 38 single
blocks, width 3072, 11.9 B transformer parameters; 1-layer CLIP and T5 encoders with the real output widths 768 /
4096; the real FLUX VAE), bf16, 512², and measures:

(a) SDE rollout with log-probs vs ``FluxPipeline.__call__`` (B = 4, T = 16; target ≤ 1.05×);
(b) LoRA r64/α128 update vs the bare forward + backward of the same transitions, with and without gradient
    checkpointing (B = 4, T = 8; target ≤ 1.05×);
(c) first-update log-prob mismatch in bf16: the rollout's layout (must be 0.0), train micro-batch 2, recompute
    (must be 0.0);
(d) peak memory of each phase (in every part's figures);
(e) model FLOP utilisation of rollout and update: transformer FLOPs per call from its config over the elapsed
    time, against the GPU's dense bf16 peak;
(f) the CLI main job, 2 epochs of ``configs/flux_chunk.yaml`` on a saved 4 + 8-block full-width folder;
(g) the same run under ``configs/accelerate/fsdp.yaml`` with one process.

Each part runs on its own; a failure is recorded in the JSON and the next part runs. ``--dry-run`` runs the same
code at toy sizes on the CPU (parts a–f; CI runs it). ``--model`` picks a builder from :data:`MODELS`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DENSE_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}  # vendor data sheets, dense


@dataclass(frozen=True)
class Size:
    """Model and workload size of one run of the check."""

    layers: int
    single_layers: int
    heads: int
    head_dim: int
    clip_width: int
    t5_width: int
    vae_channels: tuple[int, ...]
    vae_layers: int
    resolution: int
    text_tokens: int
    rollout_steps: int
    update_steps: int
    batch: int


FULL = Size(19, 38, 24, 128, 768, 4096, (128, 256, 512, 512), 2, 512, 512, 16, 8, 4)
TOY = Size(1, 1, 2, 16, 32, 32, (8, 8, 8, 8), 1, 64, 16, 2, 2, 4)


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """FLUX.1's rotary split (16, 56, 56) of its 128-wide heads; the same proportions for toy heads."""
    return (16, 56, 56) if head_dim == 128 else (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)


def build_flux(size: Size, device: torch.device, dtype: torch.dtype, *, layers: int | None = None,
               single_layers: int | None = None):
    """A random FLUX.1-architecture pipeline, constructed directly on ``device`` in ``dtype``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from flowgrpo.models.tiny import build_text_encoders

    clip_tok, clip, t5_tok, t5 = build_text_encoders(t5_max_length=size.text_tokens, clip_width=size.clip_width,
                                                     t5_width=size.t5_width)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            transformer = FluxTransformer2DModel(
                patch_size=1, in_channels=64, num_layers=layers or size.layers,
                num_single_layers=single_layers or size.single_layers, attention_head_dim=size.head_dim,
                num_attention_heads=size.heads, joint_attention_dim=size.t5_width,
                pooled_projection_dim=size.clip_width, guidance_embeds=True,
                axes_dims_rope=_rope_axes(size.head_dim),
            )
            for m in transformer.modules():  # random weights with std 0.02 keep the activations finite
                if isinstance(m, torch.nn.Linear):
                    torch.nn.init.normal_(m.weight, std=0.02)
            vae = AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=size.vae_channels,
                layers_per_block=size.vae_layers, norm_num_groups=min(32, size.vae_channels[0] // 2),
                sample_size=size.resolution, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False,
            )
    finally:
        torch.set_default_dtype(default)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip.to(device, dtype), tokenizer=clip_tok,
                        text_encoder_2=t5.to(device, dtype), tokenizer_2=t5_tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_flops(pipe, height: int, width: int, text_tokens: int) -> float:
    """Forward FLOPs of one transformer call per sample: the matrix multiplies of every block, 2·(12·d²·S + 2·S²·d)
    for S = image + text tokens (q, k, v, out and a 4× MLP: 12·d² per token; QKᵀ and AV: 2·S²·d), embedders
    and norms left out (under 1 %)."""
    c = pipe.transformer.config
    d = c.num_attention_heads * c.attention_head_dim
    s = (height // 16) * (width // 16) + text_tokens
    return (c.num_layers + c.num_single_layers) * 2 * (12 * d * d * s + 2 * s * s * d)


def flux_adapter(pipe, size: Size):
    from flowgrpo.models.flux import FluxAdapter

    return FluxAdapter(pipe, height=size.resolution, width=size.resolution, max_sequence_length=size.text_tokens)


@dataclass(frozen=True)
class ModelEntry:
    """How the check builds one model family: ``build(size, device, dtype, layers=, single_layers=)`` → a
    diffusers pipeline of random weights; ``adapter(pipe, size)`` → its flowgrpo adapter; ``flops(pipe, height,
    width, text_tokens)`` → forward FLOPs of one transformer call per sample."""

    build: Callable
    adapter: Callable
    flops: Callable


MODELS = {"flux": ModelEntry(build_flux, flux_adapter, flux_flops)}  # a new adapter family adds its entry here


class Check:
    """Runs the parts, keeping each part's figures or error, and writes them after every part."""

    def __init__(self, args) -> None:
        self.args = args
        self.dev = torch.device("cpu" if args.dry_run else "cuda")
        self.size = TOY if args.dry_run else FULL
        self.dtype = torch.float32 if args.dry_run else torch.bfloat16
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict = {"model": args.model, "dry_run": args.dry_run, "device": self._device_name(),
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        self._adapter = None

    def _device_name(self) -> str:
        return torch.cuda.get_device_name() if self.dev.type == "cuda" else "cpu"

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, repeats: int = 2) -> float:
        fn()
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.dev.type == "cuda" else None

    def reset_peak(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def mfu(self, flops: float, seconds: float) -> float | None:
        name = self.results["device"]
        peak = next((v for k, v in DENSE_BF16_PEAK.items() if k in name), None)
        return flops / seconds / peak if peak else None

    @property
    def adapter(self):
        if self._adapter is None:
            entry = MODELS[self.args.model]
            self._adapter = entry.adapter(entry.build(self.size, self.dev, self.dtype), self.size)
        return self._adapter

    def run(self, parts: list[str]) -> None:
        for p in parts:
            start = time.perf_counter()
            try:
                self.results[p] = PARTS[p](self)
            except Exception as err:  # noqa: BLE001 - one part's failure must not lose the others' figures
                self.results[p] = {"error": f"{type(err).__name__}: {err}"[:2000], "trace": traceback.format_exc()}
            self.results[p]["seconds"] = round(time.perf_counter() - start, 1)
            (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1))
        table = format_table(self.results)
        (self.out / "gpu_check.md").write_text(table + "\n")
        print(table)  # noqa: T201 - the script's result table


def _prompts(n: int) -> list[str]:
    return [f"a photo of object number {i} on a table" for i in range(n)]


def part_a(c: Check) -> dict:
    """(a) rollout with log-probs vs FluxPipeline.__call__."""
    from flowgrpo.sampling.rollout import RolloutRequest, SamplerSettings, rollout

    a, s = c.adapter, c.size
    b, t = s.batch, s.rollout_steps
    ps = _prompts(b)
    settings = SamplerSettings(num_steps=t, guidance_scale=3.5, sde_kind="flow_sde", noise_level=0.7)

    request = RolloutRequest(ps, [{}] * b, torch.arange(b), torch.zeros(b, dtype=torch.long), settings=settings,
                             batch_size=b, seed=0, epoch=0)

    def ours():
        rollout(a, request, torch.ones(t, dtype=torch.bool))

    def theirs():
        with torch.no_grad(), a.attention():
            a.pipe(ps, height=s.resolution, width=s.resolution, num_inference_steps=t, guidance_scale=3.5,
                   output_type="pt", max_sequence_length=s.text_tokens, generator=torch.Generator().manual_seed(0))

    c.reset_peak()
    t_ours = c.timed(ours)
    peak = c.peak_gib()
    t_theirs = c.timed(theirs)
    flops = MODELS[c.args.model].flops(a.pipe, s.resolution, s.resolution, s.text_tokens) * b * t
    return {"rollout_s": t_ours, "pipeline_s": t_theirs, "ratio": t_ours / t_theirs, "batch": b, "steps": t,
            "image_steps_per_s": b * t / t_ours, "peak_gib": peak, "mfu": c.mfu(flops, t_ours)}


def _trainer(c: Check, gradient_checkpointing: bool, train_batch: int, recompute: bool = False):
    from accelerate import Accelerator

    from flowgrpo.algo.chunkers import build_chunker
    from flowgrpo.config import build_config
    from flowgrpo.data.prompts import PromptSet
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.rewards.compose import ComposedReward
    from flowgrpo.trainer import Trainer

    a, s = c.adapter, c.size
    b = s.batch
    cfg = build_config({
        "model": {"pretrained": "unused", "finetune": "lora", "lora_rank": 64, "lora_alpha": 128},
        "sampling": {"num_steps": s.update_steps},
        "train": {"prompts_per_epoch": b // 2, "group_size": 2, "rollout_batch_size": b,
                  "train_batch_size": train_batch},
        "algo": {"recompute_old_log_probs": recompute},
        "rewards": [{"name": "jpeg_compressibility"}], "logging": {"progress": False},
    })
    if not hasattr(a, "_lora_params"):
        a._lora_params = setup_trainable(a, finetune="lora", rank=64, alpha=128,
                                         target_modules=cfg.model.lora_target_modules, need_reference=False)
        for p in a._lora_params:
            p.data = p.data.float()
    if gradient_checkpointing:
        a.transformer.enable_gradient_checkpointing()
    else:
        a.transformer.disable_gradient_checkpointing()

    class _Zero:
        def setup(self, device):
            pass

        def __call__(self, images, prompts, metadata):
            return torch.zeros(len(prompts))

    return Trainer(cfg, adapter=a, params=a._lora_params, rewards=ComposedReward({"zero": _Zero()}, {"zero": 1.0}),
                   eval_rewards=None, chunker=build_chunker(cfg.chunker),
                   prompts=PromptSet(_prompts(b), [{}] * b, "gpu_check"), eval_prompts=None,
                   accelerator=Accelerator(cpu=c.dev.type == "cpu"))


def _rollout_for(c: Check, trainer):
    from flowgrpo.records import Advantages
    from flowgrpo.sampling.rollout import RolloutRequest, rollout

    s, b = c.size, c.size.batch
    request = RolloutRequest(_prompts(b), [{}] * b, torch.arange(b), torch.zeros(b, dtype=torch.long),
                             settings=trainer.settings, batch_size=b, seed=0, epoch=0)
    traj = rollout(c.adapter, request, torch.ones(s.update_steps, dtype=torch.bool))
    adv = Advantages(values=torch.linspace(-1, 1, b), train_mask=torch.ones(b, dtype=torch.bool),
                     zero_spread_frac=0.0, nan_frac=0.0)
    return traj, adv, trainer.chunker.plan(traj, 0, torch.Generator().manual_seed(0))


def _update_vs_bare(c: Check, gc: bool) -> dict:
    trainer = _trainer(c, gc, c.size.batch)
    traj, adv, plan = _rollout_for(c, trainer)
    a = c.adapter

    def update():
        trainer.update_phase(traj, adv, plan, traj.log_probs)

    def bare():
        for (step,) in plan.chunks:
            x = traj.latents[:, step].to(c.dev)
            sigma = traj.sigmas[step].expand(len(x)).to(c.dev)
            with a.attention():
                a.velocity(x, sigma, traj.embeds, 3.5).square().mean().backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    c.reset_peak()
    t_upd = c.timed(update)
    peak = c.peak_gib()
    t_bare = c.timed(bare)
    n = traj.batch_size * len(plan.chunks)
    # forward + input-gradient backward ≈ 2 forwards (LoRA weight gradients are negligible)
    per_call = MODELS[c.args.model].flops(a.pipe, c.size.resolution, c.size.resolution, c.size.text_tokens)
    flops = 2 * per_call * n
    return {"update_s": t_upd, "bare_s": t_bare, "ratio": t_upd / t_bare, "transitions": n,
            "transitions_per_s": n / t_upd, "peak_gib": peak, "mfu": c.mfu(flops, t_upd)}


def part_b(c: Check) -> dict:
    """(b) LoRA update vs bare forward + backward of the same transitions, without and with checkpointing."""
    out = {"plain": _update_vs_bare(c, False), "checkpointing": _update_vs_bare(c, True)}
    c.adapter.transformer.disable_gradient_checkpointing()
    return out


def part_c(c: Check) -> dict:
    """(c) first-update mismatch (bf16): rollout layout, micro-batch 2, recompute."""
    out = {}
    for name, tb, rec in (("matched", c.size.batch, False), ("micro_batch_2", 2, False), ("recompute", 2, True)):
        trainer = _trainer(c, False, tb, recompute=rec)
        traj, adv, plan = _rollout_for(c, trainer)
        old = trainer.recompute_old_log_probs(traj, plan) if rec else traj.log_probs
        c.reset_peak()
        m = trainer.update_phase(traj, adv, plan, old)
        out[name] = {"mismatch": m["policy/logprob_mismatch_max"], "ratio_mean": m.get("policy/ratio_mean"),
                     "peak_gib": c.peak_gib()}
    return out


def part_d(c: Check) -> dict:
    """(d) peak memory per phase, collected from the other parts."""
    r = c.results
    return {"rollout_gib": r.get("a", {}).get("peak_gib"),
            "update_gib": r.get("b", {}).get("plain", {}).get("peak_gib"),
            "update_checkpointing_gib": r.get("b", {}).get("checkpointing", {}).get("peak_gib")}


def part_e(c: Check) -> dict:
    """(e) model FLOP utilisation, from parts a and b."""
    r = c.results
    return {"rollout_mfu": r.get("a", {}).get("mfu"), "update_mfu": r.get("b", {}).get("plain", {}).get("mfu"),
            "peak_flops": next((v for k, v in DENSE_BF16_PEAK.items() if k in r["device"]), None)}


def _cli(c: Check, name: str, launcher: list[str]) -> dict:
    folder = c.out / "reduced_flux"
    if not (folder / "model_index.json").exists():
        pipe = MODELS[c.args.model].build(c.size, c.dev, c.dtype, layers=min(4, c.size.layers),
                                          single_layers=min(8, c.size.single_layers))
        pipe.save_pretrained(folder)
        del pipe
        if c.dev.type == "cuda":
            torch.cuda.empty_cache()
    res = c.size.resolution
    over = [f"model.pretrained={folder}", "model.finetune=lora", f"model.height={res}", f"model.width={res}",
            f"model.max_sequence_length={c.size.text_tokens}", "train.num_epochs=2", "train.prompts_per_epoch=2",
            "train.group_size=4", "train.rollout_batch_size=4", "train.train_batch_size=4",
            "train.optimizer_steps_per_epoch=1", "rewards=[{name: jpeg_compressibility}]", "eval_rewards=[]",
            "data.train_prompts=t2i_compbench", "data.eval_prompts=null", "logging.progress=false",
            "logging.trackers=[]", f"output_dir={c.out / name}", "logging.overwrite=true"]
    if c.args.dry_run:
        over += ["model.dtype=float32", "sampling.num_steps=3", "chunker.chunk_sizes=[1,1]",
                 "eval_sampling.num_steps=2"]
    cmd = [*launcher, str(REPO / "flowgrpo" / "train.py"), str(REPO / "configs" / "flux_chunk.yaml"), *over]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-1500:]}")
    recs = [json.loads(line) for line in (c.out / name / "metrics.jsonl").read_text().splitlines()]
    keys = ("policy/logprob_mismatch_max", "memory/update_peak_gb", "memory/rollout_peak_gb", "timing/update",
            "timing/rollout")
    return {"epochs": [{k: r.get(k) for k in keys} for r in recs]}


def part_f(c: Check) -> dict:
    """(f) the CLI main job (one process)."""
    return _cli(c, "cli", [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
                + (["--cpu"] if c.args.dry_run else []))


def part_g(c: Check) -> dict:
    """(g) the CLI main job under FSDP (one process)."""
    if c.dev.type != "cuda":
        return {"skipped": "FSDP needs CUDA"}
    return _cli(c, "cli_fsdp", [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                str(REPO / "configs" / "accelerate" / "fsdp.yaml"), "--num_processes", "1"])


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f, "g": part_g}


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def format_table(r: dict) -> str:
    """A Markdown table of the figures (errors shown in place)."""
    rows = [f"GPU check: {r['model']} on {r['device']} (torch {r['torch']}, {r['date']}"
            f"{', DRY RUN at toy size' if r['dry_run'] else ''})", "", "| part | figure | value |", "|---|---|---|"]

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if k == "trace":
                continue
            if isinstance(v, dict):
                walk(f"{prefix} {k}", v)
            elif isinstance(v, list):
                for i, e in enumerate(v):
                    walk(f"{prefix} {k}[{i}]", e)
            else:
                rows.append(f"| {prefix.split()[0]} | {' '.join(prefix.split()[1:] + [k])} | {_fmt(v)} |")

    for p in PARTS:
        if p in r:
            walk(p, r[p])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux", choices=sorted(MODELS))
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "flowgrpo_gpu_check"))
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (what CI runs)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.exit(2, "error: no CUDA device; use --dry-run for the CPU check at toy sizes\n")
    sys.path.insert(0, str(REPO))
    from flowgrpo.runner import quiet_libraries

    quiet_libraries()
    Check(args).run(args.parts)


if __name__ == "__main__":
    main()
