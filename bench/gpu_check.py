"""The GPU check at real size (run through ``bench/gpu_check.sh``; never part of CI except ``--dry-run``).

    python bench/gpu_check.py [--model flux] [--out DIR] [--parts a b c d e f g h] [--dry-run]

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
(g) the same job fine-tuning every weight under FSDP2 (``parallel.sharding=fsdp2``: float32 master weights,
    bf16 compute, a KL reference sharded like the policy, text encoders offloaded), one process; and the same on
    2 processes (``configs/accelerate/fsdp.yaml``) where 2 GPUs or more are present (``--dry-run``: one process;
    two sharded CPU processes are ``tests/training/test_sharding.py``'s);
(h) the forward-process update (DiffusionNFT: an old-copy and a reference pass per (sample, σ) row) vs the bare
    forwards + backward of the same (x₀, σ, ε) draws (B = 4, T = 8: 28 rows; ``bench/forward_speed.py``);
(i) sharded save and resume on one process: the FSDP2 state of the FLUX.1 body at full width (2 + 4 blocks,
    float32 masters and AdamW moments) through ``torch.distributed.checkpoint``, seconds and GB/s each way;
(j) the offload cost: a full fine-tuning step of the same body with FSDP2's ``CPUOffloadPolicy`` vs without;
(k) several GPUs (when 2 or more are visible): torchrun over all of them runs ``bench/gpu_check_multi.py``, an
    HSDP step (replicate × shard mesh) and a context-parallel (Ulysses) forward and backward against the unsplit
    one; a dry run runs it on 2 CPU processes;
(l) ``model.compile=regional`` against eager: the rollout of (a) and the update of (b) (targets ≤ 0.75× and
    ≤ 0.8×), the first (compiling) call of each, and the compiled first-update mismatch (recompute mode: 0.0;
    the dry run compiles with aot_eager);
(m) the cached DiffusionNFT rollout (``sampling.cache`` first_block) against uncached: time ratio and pixel
    differences;
(n) one epoch at verl-omni's Qwen-Image OCR LoRA configuration (this GPU's share of 32 prompts × 16 images over
    4 GPUs, 512², LoRA r64, the full 60-block Qwen-Image with random weights, a zero reward): images/GPU/s beside
    verl-omni's 0.305;
(o) Ray (docs/async.md): a ``max_staleness: 1`` run of configs/tiny_jpeg.yaml, the rollout worker on a GPU (two
    GPUs: the trainer on GPU 0, the worker on GPU 1 under a Ray head started for it; one GPU: shared), with
    bench/async_ray.py's figures (epoch, rollout and update seconds, the wait, the worker's sampling, the sync).

Each part runs on its own; a failure is recorded in the JSON and the next part runs. ``--dry-run`` runs the same
code at toy sizes on the CPU (every part; CI runs it).

``--model`` picks a family from :data:`MODELS` (every adapter of ``flowgrpo.models.random_pipelines``). Other families
than
FLUX.1 load the zoo's tiny pipeline (:func:`flowgrpo.models.random_pipelines.build_random_pipeline`, a few MB on disk)
through ``load_model`` and replace its transformer by one of the released width and heads built directly on the GPU in
bf16 (:data:`BODIES`: full depth up to 12 B parameters, reduced depth above; FLOPs and activation memory per
block scale linearly with depth); part (a) calls the family's own pipeline with its conformance-case settings
(editing families on a generated source image); FLOPs per velocity evaluation are counted once by
``torch.utils.flop_counter`` on the device; (f)/(g) train ``configs/<family>.yaml`` on a saved folder of the
same width and a few blocks. Video families (Wan2.1, Wan2.2 A14B with both experts, Wan2.2 TI2V-5B,
HunyuanVideo-1.5) make :data:`VIDEO_FRAMES`-frame videos at the check's resolution and train their release config
(``_CONFIGS``) with an image reward over every frame.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import shutil
import socket
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
    """How the check builds one model family.

    ``load(check)`` → its flowgrpo adapter on the check's device; ``flops(check)`` → forward FLOPs of one velocity
    evaluation per sample (every transformer call of it: true CFG counts two); ``cli_folder(check, folder)``
    writes the reduced-depth pipeline folder of parts (f) and (g); ``config``: the training config of (f) and
    (g); ``body``: the transformer body measured, in words (in the JSON)."""

    load: Callable
    flops: Callable
    cli_folder: Callable
    config: str
    body: str


def _flux_load(c) -> object:
    return flux_adapter(build_flux(c.size, c.dev, c.dtype), c.size)


def _flux_flops(c) -> float:
    return flux_flops(c.adapter.pipe, c.size.resolution, c.size.resolution, c.size.text_tokens)


def _flux_cli_folder(c, folder: Path) -> None:
    pipe = build_flux(c.size, c.dev, c.dtype, layers=min(4, c.size.layers), single_layers=min(8, c.size.single_layers))
    pipe.save_pretrained(folder)


#: The transformer body measured per non-FLUX family at real size: the released width and heads
#: (``random_pipelines.REAL_SIZE``); the depth reduced where the released model is over 12 B parameters, so that
#: the LoRA update without checkpointing fits one 139 GiB GPU (FLOPs and activation memory per block scale linearly in
#: depth; Qwen-Image-Edit-Plus's 5 k-token sequences under true CFG halve it again); text encoders and VAE stay the
#: zoo's tiny ones (they run once per prompt or image, not once per step). FLUX.2 [klein] 4B has no zoo entry:
#: 5 + 20 blocks of 24 heads × 128 (public re-implementations; 3.85 B parameters built, the release says 4 B).
#: Values: ``(overrides for parts a-e, overrides for the saved folder of f/g, words)``.
_KLEIN_4B = {"num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128, "num_attention_heads": 24,
             "axes_dims_rope": (32, 32, 32, 32), "timestep_guidance_channels": 256}
BODIES: dict[str, tuple[dict, dict, str]] = {
    "sd3": ({}, {"num_layers": 4, "dual_attention_layers": (0, 1)}, "SD3.5 Medium body, full depth (24 blocks)"),
    "qwenimage": ({"num_layers": 30}, {"num_layers": 4}, "Qwen-Image width, 30 of 60 blocks"),
    # the source's 1024² area adds 4096 tokens to the 1024 target ones, and true CFG runs two calls: half depth again
    "qwenimage_edit_plus": ({"num_layers": 15}, {"num_layers": 4}, "Qwen-Image width, 15 of 60 blocks"),
    "zimage": ({}, {"n_layers": 4}, "Z-Image body, full depth (30 + 2 + 2 refiner layers)"),
    "flux2": ({"num_layers": 2, "num_single_layers": 12}, {"num_layers": 1, "num_single_layers": 2},
              "FLUX.2 [dev] width, 2 + 12 of 8 + 48 blocks"),
    "flux2_klein": ({}, {"num_layers": 1, "num_single_layers": 4},
                    "FLUX.2 [klein] 4B body, full depth (5 + 20 blocks, 24 heads of 128)"),
    "kontext": ({}, {"num_layers": 4, "num_single_layers": 8}, "FLUX.1 body, full depth (19 + 38 blocks)"),
    # modular pipelines (modular_model_index.json): the constructors' defaults of diffusers 0.42.1
    "flux3": ({}, {"num_layers": 1, "num_single_layers": 4},
              "FLUX.3 body, full depth (5 + 5 + 5 per-mode and 28 single blocks, 24 heads of 128)"),
    "qwenimage21": ({}, {"num_layers": 4}, "Qwen-Image 2.1 body, full depth (32 blocks, 32 heads of 128)"),
    # video families: frames of VIDEO_FRAMES at the check's resolution; Wan2.2 A14B's two 14 B experts each cut
    "wan21": ({}, {"num_layers": 4}, "Wan2.1-T2V-1.3B body, full depth (30 blocks)"),
    "wan22": ({"num_layers": 12}, {"num_layers": 2}, "Wan2.2-T2V-A14B width, 12 of 40 blocks in each expert"),
    "wan22_ti2v": ({}, {"num_layers": 4}, "Wan2.2-TI2V-5B body, full depth (30 blocks)"),
    "hunyuan_video15": ({}, {"num_layers": 4}, "HunyuanVideo-1.5 body, full depth (54 blocks)"),
}
_CONFIGS = {"sd3": "sd35_grpo.yaml", "wan21": "wan21_t2v_1.3b_dance.yaml", "wan22": "wan21_t2v_1.3b_dance.yaml",
            "wan22_ti2v": "wan22_5b_dance.yaml", "hunyuan_video15": "wan21_t2v_1.3b_dance.yaml"}
#: Frames of a video family's videos at real size (17 = 5 latent frames; 4k + 1 for every family).
VIDEO_FRAMES = 17


def _frames(c) -> int | None:
    """F of the check's videos (the conformance case's at toy size), None for an image family."""
    if not c.case.num_frames:
        return None
    return c.case.num_frames if c.args.dry_run else VIDEO_FRAMES


def _real_kwargs(name: str, cli: bool) -> dict:
    from flowgrpo.models.random_pipelines import REAL_SIZE

    base = _KLEIN_4B if name == "flux2_klein" else REAL_SIZE[name]
    return {**base, **BODIES[name][1 if cli else 0]}


def _zoo_transformer(c, name: str, tiny, *, cli: bool = False):
    """The family's transformer rebuilt from the tiny one's configuration with the real body (``BODIES``),
    constructed directly on the check's device in its dtype; at toy size (dry run) the tiny configuration itself."""
    kwargs = {} if c.args.dry_run else _real_kwargs(name, cli)
    default = torch.get_default_dtype()
    torch.set_default_dtype(c.dtype)
    try:
        with torch.device(c.dev):
            torch.manual_seed(0)
            big = type(tiny).from_config({**tiny.config, **kwargs})
            for pname, p in big.named_parameters():
                if "pad_token" in pname:  # Z-Image's padding tokens are torch.empty in its constructor
                    torch.nn.init.normal_(p)
            for m in big.modules():  # random weights with std 0.02 keep the activations finite
                if isinstance(m, torch.nn.Linear):
                    torch.nn.init.normal_(m.weight, std=0.02)
    finally:
        torch.set_default_dtype(default)
    return big


def _has_index(folder: Path) -> bool:
    """Whether ``folder`` holds a saved pipeline (a regular or a modular one)."""
    return (folder / "model_index.json").exists() or (folder / "modular_model_index.json").exists()


def _set_component(pipe, **modules) -> None:
    """Replace pipeline components: ``update_components`` of a modular pipeline, else ``register_modules``."""
    (getattr(pipe, "update_components", None) or pipe.register_modules)(**modules)


def _tiny_folder(c, name: str) -> Path:
    """The family's zoo pipeline (tiny transformer, encoders and VAE; a few MB) built once per output folder."""
    from flowgrpo.models.random_pipelines import build_random_pipeline

    folder = c.out / f"tiny_{name}"
    if not _has_index(folder):
        build_random_pipeline(name, folder, sample_size=c.size.resolution)
    return folder


def _zoo_load(name: str, c):
    """``load_model`` of the tiny zoo folder, moved to the device, its transformer replaced by the real body."""
    from flowgrpo.models import load_model

    a = load_model(str(_tiny_folder(c, name)), dtype="float32" if c.args.dry_run else "bfloat16",
                   height=c.size.resolution, width=c.size.resolution, max_sequence_length=c.size.text_tokens,
                   num_frames=_frames(c))
    big = _zoo_transformer(c, name, a.pipe.transformer)
    a.pipe.to(c.dev)
    _set_component(a.pipe, transformer=big)
    a.transformer = a.forward_module = big
    if getattr(a.pipe, "transformer_2", None) is not None:  # Wan2.2's second expert: the same body, frozen
        second = _zoo_transformer(c, name, a.pipe.transformer_2).requires_grad_(False)
        _set_component(a.pipe, transformer_2=second)
        a.experts = {"transformer": big, "transformer_2": second}
    return a


def _zoo_flops(c) -> float:
    """One velocity evaluation of one sample counted by ``torch.utils.flop_counter`` (math attention kernel, which
    the counter sees on every device), on the check's device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from flowgrpo.sampling.rollout import encode_rows

    a = c.adapter
    x = a.initial_latents(1, [torch.Generator().manual_seed(0)]).to(c.dev)
    embeds = encode_rows(a, _prompts(1), c.metadata(1))
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        a.velocity(x, torch.full((1,), 0.5, device=c.dev), embeds, c.case.guidance_scale)
    return float(counter.get_total_flops())


def _zoo_cli_folder(name: str, c, folder: Path) -> None:
    """The tiny zoo folder with its transformer replaced by the reduced-depth, full-width body saved in bf16."""
    import shutil

    import diffusers

    shutil.copytree(_tiny_folder(c, name), folder, dirs_exist_ok=True)
    for part in ("transformer", "transformer_2"):  # transformer_2: Wan2.2's second expert
        if not (folder / part / "config.json").exists():
            continue
        cls = json.loads((folder / part / "config.json").read_text())["_class_name"]
        tiny = getattr(diffusers, cls).from_pretrained(folder / part)
        big = _zoo_transformer(c, name, tiny, cli=True)
        shutil.rmtree(folder / part)
        big.save_pretrained(folder / part)


def _zoo_entry(name: str) -> ModelEntry:
    return ModelEntry(functools.partial(_zoo_load, name), _zoo_flops, functools.partial(_zoo_cli_folder, name),
                      _CONFIGS.get(name, f"{name}.yaml"), BODIES[name][2])


MODELS = {"flux": ModelEntry(_flux_load, _flux_flops, _flux_cli_folder, "flux_chunk.yaml",
                             "FLUX.1-dev body, full depth (19 + 38 blocks)"),
          **{name: _zoo_entry(name) for name in BODIES}}  # a new adapter family adds its entry here


class Check:
    """Runs the parts, keeping each part's figures or error, and writes them after every part."""

    def __init__(self, args) -> None:
        from flowgrpo.models.random_pipelines import CASES

        self.args = args
        self.dev = torch.device("cpu" if args.dry_run else "cuda")
        self.case = CASES[args.model]
        self.size = TOY if args.dry_run else FULL
        if args.dry_run and args.model != "flux":  # the zoo's tiny size and text length of the family
            self.size = dataclasses.replace(TOY, resolution=self.case.size,
                                            text_tokens=self.case.max_sequence_length)
        self.dtype = torch.float32 if args.dry_run else torch.bfloat16
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict = {"model": args.model, "body": MODELS[args.model].body, "dry_run": args.dry_run,
                              "device": self._device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        self._adapter = None
        self._flops = None
        self._source = None

    @property
    def editing(self) -> bool:
        return self.case.condition is not None

    def metadata(self, n: int) -> list[dict]:
        """n prompt metadata dicts: for an editing family each names the check's source image (one random PNG at
        the output size, written once), else empty."""
        if not self.editing:
            return [{} for _ in range(n)]
        if self._source is None:
            from PIL import Image

            from flowgrpo.testing.rewards import default_images

            r = self.size.resolution
            img = default_images(1, r, r, torch.Generator().manual_seed(0))[0]
            self._source = self.out / "source.png"
            Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(self._source)
        return [{"images": [str(self._source)]} for _ in range(n)]

    @property
    def flops(self) -> float:
        """Forward FLOPs of one velocity evaluation per sample (computed once)."""
        if self._flops is None:
            self._flops = MODELS[self.args.model].flops(self)
        return self._flops

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
            self._adapter = MODELS[self.args.model].load(self)
        return self._adapter

    def run(self, parts: list[str]) -> None:
        # the case's pipeline-module constants are scaled to its tiny model: set them at toy size only
        patches = self.case.module_patches if self.args.dry_run else {}
        saved = {}
        for target, value in patches.items():
            module, attr = target.split(":")
            saved[target] = getattr(importlib.import_module(module), attr)
            setattr(importlib.import_module(module), attr, value)
        try:
            self._run(parts)
        finally:
            for target, value in saved.items():
                module, attr = target.split(":")
                setattr(importlib.import_module(module), attr, value)

    def _run(self, parts: list[str]) -> None:
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


def _pipeline_kwargs(c: Check, n: int) -> dict:
    """The conformance case's ``__call__`` settings for n prompts at the check's size and text length."""
    kw = dict(c.case.call_kwargs(c.case.guidance_scale))
    if "max_sequence_length" in kw:
        kw["max_sequence_length"] = c.size.text_tokens
    if isinstance(kw.get("negative_prompt"), list):
        kw["negative_prompt"] = [" "] * n
    if "max_area" in kw:
        kw["max_area"] = c.size.resolution ** 2
    if "num_frames" in kw:
        kw["num_frames"] = _frames(c)
    return kw


def part_a(c: Check) -> dict:
    """(a) rollout with log-probs vs the family's own ``Pipeline.__call__`` (the conformance case's settings)."""
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.rollout import RolloutRequest, load_condition_images, rollout

    a, s = c.adapter, c.size
    b, t = s.batch, s.rollout_steps
    ps, meta = _prompts(b), c.metadata(b)
    settings = SamplingConfig(num_steps=t, guidance_scale=c.case.guidance_scale, sde_kind="flow_sde",
                               noise_level=0.7)
    request = RolloutRequest(ps, meta, torch.arange(b), torch.zeros(b, dtype=torch.long), settings=settings,
                             batch_size=b, seed=0, epoch=0)
    n = c.case.pipeline_batch_size or b  # Qwen-Image-Edit-Plus's pipeline takes one prompt per call

    def ours():
        rollout(a, request, torch.ones(t, dtype=torch.bool))

    def theirs():
        for start in range(0, b, n):
            rows = range(start, min(b, start + n))
            extra = {} if not c.editing else c.case.condition([load_condition_images(meta[i]["images"])
                                                               for i in rows])
            if c.case.pipeline_setup is not None:  # HunyuanVideo-1.5: the CFG scale lives in its guider
                c.case.pipeline_setup(a.pipe, c.case.guidance_scale)
            modular = hasattr(a.pipe, "update_components")  # blocks taking one prompt a call get it as a string
            prompt = ps[rows[0]] if modular and len(rows) == 1 else [ps[i] for i in rows]
            with torch.no_grad(), a.attention():
                a.pipe(prompt=prompt, height=s.resolution, width=s.resolution,
                       num_inference_steps=t, output_type="pt",
                       generator=[torch.Generator().manual_seed(i) for i in rows],
                       **({"output": "images"} if modular else {}), **_pipeline_kwargs(c, len(rows)), **extra)

    c.reset_peak()
    t_ours = c.timed(ours)
    peak = c.peak_gib()
    t_theirs = c.timed(theirs)
    flops = c.flops * b * t
    return {"rollout_s": t_ours, "pipeline_s": t_theirs, "ratio": t_ours / t_theirs, "batch": b, "steps": t,
            "pipeline_batch": n, "image_steps_per_s": b * t / t_ours, "peak_gib": peak,
            "flops_per_velocity": flops / (b * t), "mfu": c.mfu(flops, t_ours)}


def _trainer(c: Check, gradient_checkpointing: bool, train_batch: int, recompute: bool = False,
             objective: dict | None = None):
    from accelerate import Accelerator

    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config import build_config
    from flowgrpo.data.prompts import PromptSet
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.rewards.compose import ComposedReward
    from flowgrpo.training.loop import Trainer

    a, s = c.adapter, c.size
    b = s.batch
    cfg = build_config({
        "model": {"pretrained": "unused", "finetune": "lora", "lora_rank": 64, "lora_alpha": 128},
        "sampling": {"num_steps": s.update_steps, "guidance_scale": c.case.guidance_scale},
        "train": {"prompts_per_epoch": b // 2, "group_size": 2, "rollout_batch_size": b,
                  "train_batch_size": train_batch},
        "objective": objective or {"recompute_old_log_probs": recompute},
        "rewards": [{"name": "jpeg_compressibility"}], "logging": {"progress": False},
    })
    if not hasattr(a, "_lora_params"):
        a._lora_params = setup_trainable(a, finetune="lora", rank=64, alpha=128,
                                         target_modules=list(c.case.lora_target_modules), need_reference=False)
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

    return Trainer(cfg, adapter=a, rewards=ComposedReward({"zero": _Zero()}, {"zero": 1.0}),
                   eval_rewards=None, objective=build_objective(cfg),
                   prompts=PromptSet(_prompts(b), c.metadata(b), "gpu_check"), eval_prompts=None,
                   accelerator=Accelerator(cpu=c.dev.type == "cpu"))


def _rollout_for(c: Check, trainer):
    from flowgrpo.records import Advantages
    from flowgrpo.sampling.rollout import RolloutRequest, rollout

    s, b = c.size, c.size.batch
    request = RolloutRequest(_prompts(b), c.metadata(b), torch.arange(b), torch.zeros(b, dtype=torch.long),
                             settings=trainer.settings, batch_size=b, seed=0, epoch=0)
    traj = rollout(c.adapter, request, torch.ones(s.update_steps, dtype=torch.bool))
    adv = Advantages(values=torch.linspace(-1, 1, b), train_mask=torch.ones(b, dtype=torch.bool),
                     zero_spread_frac=0.0, nan_frac=0.0, learning_frac=1.0)
    return traj, adv, trainer.objective.chunker.plan(traj, 0, torch.Generator().manual_seed(0))


def _update(trainer, work) -> dict:
    """The objective's update of ``work`` (the trainer's optimizer step), its metrics."""
    from flowgrpo.training.update import run_update

    return run_update(trainer.objective, trainer.adapter, trainer.optim, work,
                      inner_epochs=trainer.cfg.train.inner_epochs, progress=False)


def _update_vs_bare(c: Check, gc: bool) -> dict:
    trainer = _trainer(c, gc, c.size.batch)
    traj, adv, plan = _rollout_for(c, trainer)
    a = c.adapter

    def update():
        _update(trainer, trainer.objective.work(traj, adv, plan, 0))

    def bare():
        for (step,) in plan.chunks:
            x = traj.latents[:, step].to(c.dev)
            sigma = traj.sigmas[step].expand(len(x)).to(c.dev)
            with a.attention():
                a.velocity(x, sigma, traj.embeds, trainer.settings.guidance_scale).square().mean().backward()
        trainer.optim.optimizer.step()
        trainer.optim.zero_grad()

    c.reset_peak()
    t_upd = c.timed(update)
    peak = c.peak_gib()
    t_bare = c.timed(bare)
    n = traj.batch_size * len(plan.chunks)
    # forward + input-gradient backward ≈ 2 forwards (LoRA weight gradients are negligible)
    flops = 2 * c.flops * n
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
        work = trainer.objective.work(traj, adv, plan, 0)
        work = trainer.objective.recompute(trainer.adapter, work) if rec else work
        c.reset_peak()
        m = _update(trainer, work)
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


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _cli(c: Check, name: str, launcher: list[str], extra: tuple[str, ...] = (), env: dict | None = None) -> dict:
    entry = MODELS[c.args.model]
    folder = c.out / f"reduced_{c.args.model}"
    if not _has_index(folder):
        entry.cli_folder(c, folder)
        if c.dev.type == "cuda":
            torch.cuda.empty_cache()
    prompt_file = c.out / "cli_prompts.jsonl"  # editing families: each record names the source image
    prompt_file.write_text("".join(json.dumps({"prompt": p, **({"image": str(m["images"][0])} if m else {})}) + "\n"
                                   for p, m in zip(_prompts(4), c.metadata(4), strict=True)))
    res = c.size.resolution
    over = [f"model.pretrained={folder}", "model.finetune=lora", f"model.height={res}", f"model.width={res}",
            f"model.max_sequence_length={c.size.text_tokens}", "train.num_epochs=2", "train.prompts_per_epoch=2",
            "train.group_size=4", "train.rollout_batch_size=4", "train.train_batch_size=4",
            "train.optimizer_steps_per_epoch=1", "eval_rewards=[]",
            # a video family: its frames, and the image reward over every frame
            *([f"model.num_frames={_frames(c)}", "rewards=[{name: video_frames, kwargs: {base: jpeg_compressibility}}]"]
              if _frames(c) else ["rewards=[{name: jpeg_compressibility}]"]),
            f"data.train_prompts={prompt_file}", "data.eval_prompts=null", "logging.progress=false",
            "logging.trackers=[]", f"output_dir={c.out / name}", "logging.overwrite=true"]
    if c.args.dry_run:
        over += ["model.dtype=float32", "sampling.num_steps=3", "eval_sampling.num_steps=2",
                 f"sampling.guidance_scale={c.case.guidance_scale}"]
        if c.args.model == "flux":  # flux_chunk.yaml's chunks, shrunk to the toy run's trainable transitions
            over.append("objective.chunker.chunk_sizes=[1,1]")
    cmd = [*launcher, str(REPO / "flowgrpo" / "train.py"), str(REPO / "configs" / entry.config), *over, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **(env or {})})
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-1500:]}")
    recs = [json.loads(line) for line in (c.out / name / "metrics.jsonl").read_text().splitlines()]
    keys = ("policy/logprob_mismatch_max", "memory/update_peak_gb", "memory/rollout_peak_gb", "timing/update",
            "timing/rollout")
    return {"epochs": [{k: r.get(k) for k in keys} for r in recs]}


def part_f(c: Check) -> dict:
    """(f) the CLI main job (one process)."""
    if c.args.dry_run and c.case.module_patches:
        return {"skipped": "toy size: the training process would encode sources at the pipeline's real areas "
                           f"({', '.join(c.case.module_patches)}) with toy encoders on the CPU"}
    return _cli(c, "cli", [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
                + (["--cpu"] if c.args.dry_run else []))


#: part (g)'s settings: full fine-tuning under FSDP2, with a sharded KL reference and offloaded text encoders
SHARDED = ("model.finetune=full", "parallel.sharding=fsdp2", "parallel.text_encoders=offload", "objective.kl_beta=0.01",
           "train.lr=1e-5")


def part_g(c: Check) -> dict:
    """(g) the CLI main job under FSDP2: one process, and two where two GPUs are."""
    if c.args.dry_run and c.case.module_patches:
        return {"skipped": "toy size: the training process would encode sources at the pipeline's real areas"}
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    out = {"one_process": _cli(c, "cli_fsdp", [*launch, "--num_processes", "1"]
                               + (["--cpu"] if c.args.dry_run else []), SHARDED)}
    if c.args.dry_run:  # two gloo processes through the same entry point, in bf16 as on the GPUs (a bf16 full
        # fine-tune with a KL reference crashed on two processes until the empty transformer took loading's dtypes)
        out["two_processes"] = _cli(c, "cli_fsdp2", [sys.executable, "-m", "torch.distributed.run",
                                                     "--nproc_per_node", "2", "--master_port", _free_port()],
                                    (*SHARDED, "model.dtype=bfloat16"), env={"ACCELERATE_USE_CPU": "true"})
    elif torch.cuda.device_count() >= 2:
        out["two_processes"] = _cli(c, "cli_fsdp2", [*launch, "--config_file", str(REPO / "configs" / "accelerate" /
                                                                                 "fsdp.yaml"), "--num_processes", "2"],
                                    SHARDED)
    else:
        out["two_processes"] = {"skipped": f"{torch.cuda.device_count()} GPU: the 2-process run needs 2"}
    return out





def part_h(c: Check) -> dict:
    """(h) the forward-process update (DiffusionNFT, LoRA r64: B samples × int(0.99·T) σ's, an old-copy and a
    reference pass per row) vs the bare forwards + backward of the same (x0, σ, ε) draws (target ≤ 1.05×)."""
    from forward_speed import update_and_bare

    from flowgrpo.records import Advantages
    from flowgrpo.sampling.rollout import RolloutRequest

    b = c.size.batch
    trainer = _trainer(c, False, b, objective={"name": "nft"})
    request = RolloutRequest(_prompts(b), c.metadata(b), torch.arange(b) // 2, torch.arange(b) % 2,
                             settings=trainer.settings, batch_size=b, seed=0, epoch=0)
    samples = trainer.objective.rollout(c.adapter, request)
    adv = Advantages(values=torch.linspace(-1, 1, b), train_mask=torch.ones(b, dtype=torch.bool),
                     zero_spread_frac=0.0, nan_frac=0.0, learning_frac=1.0)
    update, bare, rows = update_and_bare(trainer, samples, adv)
    c.reset_peak()
    t_upd = c.timed(update)
    peak = c.peak_gib()
    t_bare = c.timed(bare)
    return {"update_s": t_upd, "bare_s": t_bare, "ratio": t_upd / t_bare, "rows": rows, "rows_per_s": rows / t_upd,
            "peak_gib": peak}


#: parts (i) and (j): the FLUX.1 body at full width and reduced depth (2 + 4 blocks, 1.25 B parameters: float32
#: masters, gradients and AdamW state 20 GB), so a sharded checkpoint of it is written in seconds
SHARDED_BODY = (2, 4)


def _sharded_body(c: Check, offload: bool):
    """The FLUX.1 body (:data:`SHARDED_BODY`) with float32 masters sharded by ``flowgrpo.parallel.shard`` on a
    one-process mesh (bf16 compute on a GPU), its AdamW, and one step's inputs."""
    from flowgrpo.parallel import device_mesh, shard

    mesh = device_mesh(c.dev)  # flowgrpo's mesh over a one-process group
    model = build_flux(c.size, torch.device("cpu"), torch.float32, layers=min(SHARDED_BODY[0], c.size.layers),
                       single_layers=min(SHARDED_BODY[1], c.size.single_layers)).transformer
    model = shard(model, mesh=mesh, param_dtype=c.dtype, reshard=True, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    n, t = (c.size.resolution // 16) ** 2, c.size.text_tokens
    g = torch.Generator().manual_seed(0)
    x = {"hidden_states": torch.randn(1, n, 64, generator=g).to(c.dev, c.dtype),
         "encoder_hidden_states": torch.randn(1, t, c.size.t5_width, generator=g).to(c.dev, c.dtype),
         "pooled_projections": torch.randn(1, c.size.clip_width, generator=g).to(c.dev, c.dtype),
         "timestep": torch.full((1,), 0.5, device=c.dev), "guidance": torch.full((1,), 3.5, device=c.dev),
         "img_ids": torch.zeros(n, 3, device=c.dev), "txt_ids": torch.zeros(t, 3, device=c.dev)}

    def step():
        model(**x).sample.float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def part_i(c: Check) -> dict:
    """(i) sharded save and resume on one process: the FSDP2 state (float32 masters and AdamW moments of
    :data:`SHARDED_BODY`) written by ``torch.distributed.checkpoint`` and read back into the sharded model; the
    seconds of each, the bytes written, and that the weights read back are the ones written."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, step = _sharded_body(c, offload=False)
    step()
    folder = c.out / "sharded_ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    msd, osd = get_state_dict(model, opt)
    before = {k: v.to_local().detach().clone() if hasattr(v, "to_local") else v for k, v in msd.items()}
    c.sync()
    start = time.perf_counter()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    c.sync()
    save_s = time.perf_counter() - start
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msd, osd = get_state_dict(model, opt)
    c.sync()
    start = time.perf_counter()
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    c.sync()
    load_s = time.perf_counter() - start
    after = get_state_dict(model, opt)[0]
    diff = max(float((before[k].float() - (v.to_local() if hasattr(v, "to_local") else v).float()).abs().max())
               for k, v in after.items() if torch.is_tensor(before[k]))
    shutil.rmtree(folder, ignore_errors=True)
    del model, opt
    if c.dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"save_s": save_s, "load_s": load_s, "written_gb": written / 1e9, "save_gb_per_s": written / 1e9 / save_s,
            "load_gb_per_s": written / 1e9 / load_s, "max_diff_after_resume": diff}


def part_j(c: Check) -> dict:
    """(j) the cost of FSDP2's ``CPUOffloadPolicy``: the median forward + backward + AdamW step of
    :data:`SHARDED_BODY` with the shards, gradients and optimizer state in host memory vs on the device, and the
    peak device memory of each."""
    out = {}
    for name, offload in (("device", False), ("cpu_offload", True)):
        model, opt, step = _sharded_body(c, offload)
        c.reset_peak()
        out[f"{name}_step_s"] = c.timed(step)
        out[f"{name}_peak_gib"] = c.peak_gib()
        del model, opt, step
        if c.dev.type == "cuda":
            torch.cuda.empty_cache()
    out["slowdown"] = out["cpu_offload_step_s"] / out["device_step_s"]
    return out


def part_k(c: Check) -> dict:
    """(k) several GPUs: torchrun over every visible GPU runs ``bench/gpu_check_multi.py`` (an HSDP / FSDP2 step on
    a replicate × shard mesh, and a context-parallel forward and backward against the unsplit one); the dry run
    runs it on 2 CPU processes under gloo; one GPU: skipped."""
    n = 2 if c.args.dry_run else torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"{n} GPU visible: the multi-GPU part needs 2 or more"}
    result = c.out / "multi.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           str(REPO / "bench" / "gpu_check_multi.py"), "--out", str(result),
           *(["--dry-run"] if c.args.dry_run else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {_failure_lines(proc.stderr)}")
    return json.loads(result.read_text())


def _failure_lines(stderr: str) -> str:
    """What a failed torchrun's stderr says of the cause: its lines naming an error, an abort or a C++ exception
    (a worker killed by a signal leaves no Python traceback, and the launcher's summary at the end names only the
    signal), then the last 1500 characters."""
    marks = ("Error", "error:", "terminate called", "what():", "Traceback", "Aborted", "Signal")
    cause = [line for line in stderr.splitlines() if any(m in line for m in marks)][:12]
    return "\n".join(cause) + "\n…\n" + stderr[-1500:]



def _uncompile(module: torch.nn.Module) -> None:
    """Undo ``model.compile=regional`` on ``module`` (the blocks' compiled call dropped), so later parts run eager."""
    for m in module.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    module._flowgrpo_compiled = False
    torch._dynamo.reset()


def part_l(c: Check) -> dict:
    """(l) ``model.compile=regional`` (flowgrpo.compile) against eager: the SDE rollout with log-probs of (a) and
    the LoRA update of (b) (targets ≤ 0.75× and ≤ 0.8×), the first compiled call of each (compile included), and
    the first update's mismatch compiled: in the rollout's layout (reported) and in recompute mode (must be 0.0)."""
    from flowgrpo.compile import compile_regions
    from flowgrpo.config import CompileConfig, SamplingConfig
    from flowgrpo.sampling.rollout import RolloutRequest, rollout

    a, s = c.adapter, c.size
    b, t = s.batch, s.rollout_steps
    settings = SamplingConfig(num_steps=t, guidance_scale=c.case.guidance_scale, sde_kind="flow_sde",
                               noise_level=0.7)
    request = RolloutRequest(_prompts(b), c.metadata(b), torch.arange(b), torch.zeros(b, dtype=torch.long),
                             settings=settings, batch_size=b, seed=0, epoch=0)
    trainer = _trainer(c, False, b)
    traj, adv, plan = _rollout_for(c, trainer)

    def roll():
        rollout(a, request, torch.ones(t, dtype=torch.bool))

    def update():
        _update(trainer, trainer.objective.work(traj, adv, plan, 0))

    def first(fn) -> float:
        c.sync()
        start = time.perf_counter()
        fn()
        c.sync()
        return time.perf_counter() - start

    eager_roll, eager_upd = c.timed(roll), c.timed(update)
    # the dry run (CI) checks the plumbing with aot_eager: inductor's C++ compiles take minutes on a CPU
    compile_regions(a.transformer, CompileConfig(name="regional", backend="aot_eager" if c.args.dry_run
                                                 else "inductor"))
    try:
        first_roll, first_upd = first(roll), first(update)
        c.reset_peak()
        comp_roll, comp_upd = c.timed(roll), c.timed(update)
        peak = c.peak_gib()
        mismatch = {}
        for name, rec in (("matched", False), ("recompute", True)):
            tr = _trainer(c, False, b, recompute=rec)
            traj2, adv2, plan2 = _rollout_for(c, tr)
            work = tr.objective.work(traj2, adv2, plan2, 0)
            work = tr.objective.recompute(a, work) if rec else work
            mismatch[name] = _update(tr, work)["policy/logprob_mismatch_max"]
    finally:
        _uncompile(a.transformer)
    return {"rollout_eager_s": eager_roll, "rollout_compiled_s": comp_roll, "rollout_ratio": comp_roll / eager_roll,
            "rollout_first_call_s": first_roll, "update_eager_s": eager_upd, "update_compiled_s": comp_upd,
            "update_ratio": comp_upd / eager_upd, "update_first_call_s": first_upd, "peak_gib": peak,
            "mismatch_matched": mismatch["matched"], "mismatch_recompute": mismatch["recompute"]}


#: part (m)'s first_block thresholds (0.8: the digits row of docs/results.md)
CACHE_THRESHOLDS = (0.2, 0.8)


def part_m(c: Check) -> dict:
    """(m) the cached forward-process rollout (DiffusionNFT's DPM-Solver++(2M), ``sampling.cache`` first_block)
    against uncached: time ratio, largest and mean pixel difference of the decoded images, per threshold."""
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.config import FeatureCacheConfig
    from flowgrpo.sampling.final_rollout import solver_rollout
    from flowgrpo.sampling.rollout import RolloutRequest

    a, s = c.adapter, c.size
    b, t = s.batch, s.rollout_steps
    request = RolloutRequest(_prompts(b), c.metadata(b), torch.arange(b) // 2, torch.arange(b) % 2,
                             settings=SamplingConfig(num_steps=t, guidance_scale=c.case.guidance_scale),
                             batch_size=b, seed=0, epoch=0)
    grid = a.sigmas(t)

    def run(cache):
        return solver_rollout(a, request, solver="dpmpp_2m", sigmas=grid, cache=cache)

    base = run(None).images
    t_plain = c.timed(lambda: run(None))
    out = {"uncached_s": t_plain, "batch": b, "steps": t}
    for th in CACHE_THRESHOLDS:
        cache = FeatureCacheConfig(name="first_block", kwargs={"threshold": th})
        diff = (run(cache).images - base).abs()
        t_cached = c.timed(lambda cache=cache: run(cache))
        out[f"threshold_{th}"] = {"cached_s": t_cached, "ratio": t_cached / t_plain,
                                  "max_pixel_diff": float(diff.max()), "mean_pixel_diff": float(diff.mean())}
    return out


#: verl-omni's Qwen-Image OCR LoRA step (4×H800 with a dedicated reward GPU: 32 prompts × 16 images at 512² in
#: 360 s): images per GPU per second
VERL_OMNI_OCR = 0.305
#: the OCR configuration: prompts × images per epoch over the GPUs of verl-omni's run
OCR_PROMPTS, OCR_GROUP, OCR_GPUS = 32, 16, 4


def part_n(c: Check) -> dict:
    """(n) one end-to-end epoch (rollout, advantages, update; the first of two, so no end-of-run plot) at
    verl-omni's Qwen-Image OCR LoRA configuration, this GPU's share of it: 32 prompts × 16 images over 4 GPUs =
    8 prompts × 16 images here, 512², LoRA r64/α128 on ``configs/qwenimage.yaml``'s modules, its 10 steps, true
    CFG 4.0, 2-step SDE window and gradient checkpointing, on the full 60-block Qwen-Image transformer with random
    weights (20 B parameters, bf16); the text encoder and VAE are the zoo's tiny ones of the real output widths,
    and the reward is a zero (verl-omni scores OCR on a dedicated GPU). Printed as images/GPU/s beside verl-omni's
    0.305 (dry run: toy sizes)."""
    from accelerate import Accelerator

    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config import load_config
    from flowgrpo.data.prompts import PromptSet
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.models.random_pipelines import REAL_SIZE
    from flowgrpo.rewards.compose import ComposedReward
    from flowgrpo.training.loop import Trainer

    full = not c.args.dry_run
    prompts, group = (OCR_PROMPTS // OCR_GPUS, OCR_GROUP) if full else (2, 2)
    res = 512 if full else c.size.resolution
    body = {**REAL_SIZE["qwenimage"], "num_layers": 60} if full else {}
    sub = Check.__new__(Check)  # the qwenimage family at this check's device, dtype and output folder
    sub.__dict__.update(c.__dict__)
    from flowgrpo.models.random_pipelines import CASES

    sub.case = CASES["qwenimage"]
    sub.size = dataclasses.replace(c.size, resolution=res, text_tokens=c.size.text_tokens if full else 64)
    saved = BODIES["qwenimage"]
    BODIES["qwenimage"] = (body, saved[1], "Qwen-Image, full depth (60 blocks)")
    try:
        a = _zoo_load("qwenimage", sub)
    finally:
        BODIES["qwenimage"] = saved
    base = load_config(REPO / "configs" / "qwenimage.yaml")
    cfg = load_config(REPO / "configs" / "qwenimage.yaml", [
        "model.pretrained=unused", f"model.height={res}", f"model.width={res}",
        f"model.max_sequence_length={sub.size.text_tokens}", f"train.prompts_per_epoch={prompts}",
        f"train.group_size={group}", "train.num_epochs=2", "rewards=[{name: jpeg_compressibility}]",
        "data.train_prompts=unused", "data.eval_prompts=null", "logging.trackers=[]", "logging.progress=false",
        f"output_dir={c.out / 'ocr_step'}",
        *([] if full else ["sampling.num_steps=3", "objective.chunker.window_size=1",
                           "train.optimizer_steps_per_epoch=1"])])
    setup_trainable(a, finetune="lora", rank=base.model.lora_rank, alpha=base.model.lora_alpha,
                    target_modules=list(base.model.lora_target_modules), need_reference=False,
                    gradient_checkpointing=base.model.gradient_checkpointing)

    class _Zero:
        def setup(self, device):
            pass

        def __call__(self, images, prompts, metadata):
            return torch.zeros(len(prompts))

    trainer = Trainer(cfg, adapter=a, rewards=ComposedReward({"zero": _Zero()}, {"zero": 1.0}), eval_rewards=None,
                      objective=build_objective(cfg), prompts=PromptSet(_prompts(prompts), sub.metadata(prompts),
                                                                        "ocr"),
                      eval_prompts=None, accelerator=Accelerator(cpu=c.dev.type == "cpu"))
    (c.out / "ocr_step").mkdir(parents=True, exist_ok=True)  # the run folder fit() would make (plots)
    c.reset_peak()
    c.sync()
    start = time.perf_counter()
    record = trainer.train_epoch(0)
    c.sync()
    seconds = time.perf_counter() - start
    images = prompts * group
    return {"images": images, "epoch_s": seconds, "images_per_gpu_s": images / seconds,
            "verl_omni_images_per_gpu_s": VERL_OMNI_OCR, "rollout_s": record.get("timing/rollout"),
            "update_s": record.get("timing/update"), "peak_gib": c.peak_gib(),
            "transformer_parameters": sum(p.numel() for p in a.transformer.parameters())}


def _ray_cli() -> list[str]:
    """Ray's command line (``ray``, else through the interpreter)."""
    ray = shutil.which("ray")
    return [ray] if ray else [sys.executable, "-m", "ray.scripts.scripts"]


def part_o(c: Check) -> dict:
    """(o) Ray (docs/async.md): one ``max_staleness: 1`` run of configs/tiny_jpeg.yaml through the CLI, the rollout
    worker on a GPU: with two GPUs the trainer on GPU 0 and a Ray head started on GPU 1 (the worker there), with one
    both share it (a local Ray instance); the figures of bench/async_ray.py (seconds after the first epoch)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"skipped": "Ray is not installed (pip install 'flowgrpo[ray]')"}
    out_dir = c.out / "ray_staleness_1"
    over = ["train.num_epochs=4", "train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=4",
            "data.eval_num_prompts=2", "runtime.engine=ray", "runtime.max_staleness=1", f"output_dir={out_dir}",
            "logging.overwrite=true", "logging.progress=false", "logging.trackers=[]"]
    two = not c.args.dry_run and torch.cuda.device_count() >= 2
    env = {**os.environ}
    if two:
        port = _free_port()
        subprocess.run([*_ray_cli(), "start", "--head", f"--port={port}", "--num-gpus=1", "--num-cpus=4",
                        "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})  # its workers on GPU 1
        env.update(CUDA_VISIBLE_DEVICES="0", RAY_ADDRESS=f"127.0.0.1:{port}")
    try:
        proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "train", str(REPO / "configs" / "tiny_jpeg.yaml"),
                               *over], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    finally:
        if two:  # the head this part started (a machine lent to this check: no other Ray runs there)
            subprocess.run([*_ray_cli(), "stop", "--force"], capture_output=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-1500:]}")
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    later = recs[1:]

    def mean(key: str) -> float:
        return round(sum(r.get(key) or 0.0 for r in later) / len(later), 3)

    epoch = [sum(v for k, v in r.items() if k.startswith("timing/") and k not in ("timing/eval", "timing/plots",
                                                                                 "timing/save")) for r in later]
    return {"gpus": "trainer GPU 0, rollout worker GPU 1" if two else "shared" if c.dev.type == "cuda" else "CPU",
            "epoch_s": round(sum(epoch) / len(epoch), 3), "rollout_s": mean("timing/rollout"),
            "update_s": mean("timing/update"), "wait_s": mean("runtime/wait_seconds"),
            "worker_s": mean("runtime/worker_seconds"), "sync_s": mean("runtime/sync_seconds"),
            "sync_mb": round(max(r.get("runtime/sync_bytes", 0.0) for r in recs) / 1e6, 2),
            "lags": str([r.get("runtime/lag") for r in recs])}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f, "g": part_g, "h": part_h,
         "i": part_i, "j": part_j, "k": part_k, "l": part_l, "m": part_m, "n": part_n, "o": part_o}


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
    from flowgrpo.models.quiet import quiet_libraries

    quiet_libraries()
    Check(args).run(args.parts)


if __name__ == "__main__":
    main()
