"""Per-GPU memory plan of a training run, computed without allocating anything (``bench/memory.py --plan``).

Every model is built on the meta device from its release's diffusers configuration (transformers, VAEs) or from
its text encoder's architecture (T5-XXL, CLIP-L, OpenCLIP bigG); Qwen2.5-VL-7B enters by its published parameter
count (8.29 B, its model card). LoRA adapters are added to the meta transformer with the config's rank and
target modules, so their size is counted, not estimated. Figures are GiB (2**30 bytes) per GPU.

What each column holds, for ``N`` processes (``parallel.sharding: fsdp2`` divides by N what it shards):

* weights: frozen and trained transformer weights (LoRA: base in ``model.dtype`` + float32 adapter; full
  fine-tuning: float32 master weights); sharded by FSDP2;
* grads: float32 gradients of the trained parameters (sharded by FSDP2; DDP keeps a second copy in its
  all-reduce buckets, ``gradient_as_bucket_view`` off as accelerate leaves it);
* optimizer: AdamW's two float32 moments;
* reference: full fine-tuning with ``algo.kl_beta`` > 0 keeps a frozen copy in ``model.dtype`` (sharded like the
  policy; 0 with ``parallel.reference: cpu_offload``); LoRA's reference is the same weights, adapter off;
* EMA: a float32 shadow of the trained parameters (``train.ema_decay``), sharded like them;
* text enc.: the text encoders in ``model.dtype``; with ``parallel.text_encoders: offload`` they occupy the device
  only while prompts are encoded (the "encode" phase), never beside activations;
* VAE: its weights; ``decode``: its activations while decoding a rollout micro-batch (three live feature maps of
  its widest full-resolution stage, 16-bit);
* trajectories: the rollout's latents of this process's samples, float32, (T + 1) per sample (0 with
  ``train.latents_on_cpu``);
* activations: what the training forward keeps for the backward, per transformer call of ``train_batch_size``
  rows of s = image + text tokens at width h: 34·s·h bytes per block and row without gradient checkpointing
  (Korthikanti et al. 2022, arXiv 2205.05198, eq. 2, 16-bit activations, without the attention-score term that
  SDPA kernels never store; their dropout masks, absent here, stand in for the modulation and q/k norms of these
  blocks), and 2·s·h per block plus one block's 34·s·h with it (each block keeps its input and is recomputed in
  the backward). LoRA keeps the same (an upper bound: a frozen linear's input is kept only where LoRA reads it);
* transient: FSDP2's gathered weights in ``model.dtype`` (the block computing and the next one prefetched; the
  whole model with ``reshard_after_forward: false``), or autocast's ``model.dtype`` copies of float32 master
  weights without sharding (held by the autograd graph until the backward).

A phase's peak is the sum of what is live in it: the update (all but the text encoders when offloaded, and the
decode), the rollout (no gradients: weights, optimizer, reference, EMA, encoders, VAE, trajectories, and either a
no-grad forward's working set of 10·s·h·2 bytes per row (doubled by true CFG) with the transient weights, or the
decode), the encoding (resident state + the text encoders). A
config *fits* a GPU of 80 GiB when the largest peak stays under 76 GiB (5 % for the CUDA context, NCCL buffers and
the caching allocator's fragmentation). The model is an estimate to ±20 %; a real run logs
``memory/<phase>_peak_gb`` and ``bench/gpu_check.sh`` measures one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

GIB = 2**30
BUDGET_GIB = 76.0  # of an 80 GiB GPU, the rest for the CUDA context, NCCL buffers and fragmentation
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _flux_dev(**over):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**{"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                                     "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                                     "pooled_projection_dim": 768, "guidance_embeds": True,
                                     "axes_dims_rope": (16, 56, 56), **over})


def _sd35_medium():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                                 num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                                 dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")


def _qwen_image():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                       guidance_embeds=False, axes_dims_rope=(16, 56, 56))


def _kl_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                         up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                         layers_per_block=2, latent_channels=16)


def _qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage()  # its defaults are Qwen-Image's VAE (base_dim 96, z_dim 16)


def _t5_xxl():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, vocab_size=32128,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def _clip(hidden: int, layers: int, heads: int, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, projection_dim=hidden)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


QWEN25_VL_7B = 8.29e9  # Qwen2.5-VL-7B-Instruct's parameters (model card), Qwen-Image's text encoder


@dataclass(frozen=True)
class Family:
    """A released model: its transformer, text encoders and VAE (builders run on the meta device), its
    transformer width and how many tokens one image and one prompt make."""

    name: str
    transformer: Callable
    encoders: tuple[Callable | float, ...]  # a builder, or a parameter count
    vae: Callable
    width: int
    text_tokens: Callable[[int], int]  # max_sequence_length -> text tokens
    image_tokens_factor: int = 1  # editing models: the source image's tokens join the output's
    source_tokens: int = 0  # or a source image of a fixed area joins them (Qwen-Image-Edit-Plus: 1024², 4096)
    cfg_rows: int = 1  # true classifier-free guidance doubles the rollout's rows


FAMILIES = {
    "flux": Family("FLUX.1-dev", _flux_dev, (lambda: _clip(768, 12, 12, False), _t5_xxl), _kl_vae, 3072,
                   lambda msl: msl),
    "kontext": Family("FLUX.1-Kontext-dev", _flux_dev, (lambda: _clip(768, 12, 12, False), _t5_xxl), _kl_vae, 3072,
                      lambda msl: msl, image_tokens_factor=2),
    "sd3": Family("SD3.5-Medium", _sd35_medium, (lambda: _clip(768, 12, 12, True), lambda: _clip(1280, 32, 20, True),
                                                 _t5_xxl), _kl_vae, 1536, lambda msl: 77 + msl, cfg_rows=2),
    "qwenimage": Family("Qwen-Image", _qwen_image, (QWEN25_VL_7B,), _qwen_vae, 3072, lambda msl: msl, cfg_rows=2),
    "qwenimage_edit_plus": Family("Qwen-Image-Edit-2509", _qwen_image, (QWEN25_VL_7B,), _qwen_vae, 3072,
                                  lambda msl: msl, source_tokens=4096, cfg_rows=2),
}
#: a shipped config's model.pretrained -> family (configs of other families are not planned)
PRETRAINED = {"black-forest-labs/FLUX.1-dev": "flux", "black-forest-labs/FLUX.1-Kontext-dev": "kontext",
              "stabilityai/stable-diffusion-3.5-medium": "sd3", "Qwen/Qwen-Image": "qwenimage",
              "Qwen/Qwen-Image-Edit-2509": "qwenimage_edit_plus"}


def _count(build) -> int:
    if isinstance(build, float | int):
        return int(build)
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of a family (and of a LoRA on it)."""

    transformer: int
    largest_block: int
    blocks: int
    lora: int
    encoders: int
    vae: int


_SIZES: dict = {}


def sizes(family: str, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> Sizes:
    """The family's parameter counts, from meta-device models (cached); ``lora`` for the given rank and
    targets (0 without)."""
    key = (family, lora_rank, tuple(lora_targets))
    if key in _SIZES:
        return _SIZES[key]
    from flowgrpo.parallel import shard_blocks

    fam = FAMILIES[family]
    with torch.device("meta"):
        tr = fam.transformer()
        blocks = shard_blocks(tr)
        n = sum(p.numel() for p in tr.parameters())
        largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        lora = 0
        if lora_rank:
            from peft import LoraConfig

            tr.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=list(lora_targets)))
            lora = sum(p.numel() for name, p in tr.named_parameters() if "lora_" in name)
    out = Sizes(n, largest, len(blocks), lora, sum(_count(e) for e in fam.encoders), _count(fam.vae))
    _SIZES[key] = out
    return out


@dataclass(frozen=True)
class Workload:
    """What one run asks of each GPU (from a config, or the reference workload of the table)."""

    family: str
    finetune: str  # lora | full
    dtype: str
    height: int
    width: int
    max_sequence_length: int
    train_rows: int  # rows per training transformer call (train.train_batch_size)
    rollout_rows: int  # rows per rollout call (train.rollout_batch_size)
    samples: int  # trajectories per epoch over all processes (B, E-GRPO's branches included)
    steps: int  # T
    gradient_checkpointing: bool
    lora_rank: int = 64
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    kl: bool = False
    ema: bool = False
    latents_on_cpu: bool = False
    sharding: str = "none"
    text_encoders: str = "device"
    reference: str = "device"
    reshard_after_forward: bool = True


def plan(w: Workload, gpus: int, s: Sizes | None = None, fam: Family | None = None) -> dict[str, float]:
    """Per-GPU GiB of each part and of each phase's peak for ``w`` on ``gpus`` processes (the module docstring
    says what each holds); ``s`` and ``fam`` default to the sizes and family of ``w.family``."""
    s = s or sizes(w.family, w.lora_rank if w.finetune == "lora" else 0, w.lora_targets)
    fam = fam or FAMILIES[w.family]
    half = BYTES[w.dtype]
    shard = gpus if w.sharding == "fsdp2" else 1
    full = w.finetune == "full"
    trained = s.transformer if full else s.lora
    frozen = 0 if full else s.transformer
    img = fam.image_tokens_factor * (w.height // 16) * (w.width // 16) + fam.source_tokens
    tokens, h = img + fam.text_tokens(w.max_sequence_length), fam.width
    out = {
        "weights": (frozen * half + trained * 4) / shard,
        "grads": trained * 4 / shard * (2 if gpus > 1 and w.sharding == "none" else 1),
        "optimizer": trained * 8 / shard,
        "reference": (s.transformer * half / shard if full and w.kl and w.reference == "device" else 0),
        "ema": trained * 4 / shard if w.ema else 0,
        "text_encoders": s.encoders * half,
        "vae": s.vae * half,
        "decode": 3 * 128 * w.height * w.width * 2 * w.rollout_rows,
        "trajectories": 0 if w.latents_on_cpu else math.ceil(w.samples / gpus) * (w.steps + 1) * 16
        * (w.height // 8) * (w.width // 8) * 4,
        "activations": (2 * s.blocks + 34 if w.gradient_checkpointing else 34 * s.blocks) * tokens * h * w.train_rows,
    }
    if w.sharding == "fsdp2":
        out["transient"] = (s.transformer if not w.reshard_after_forward else 2 * s.largest_block) * half
    else:
        out["transient"] = s.transformer * half if full and half < 4 else 0
    resident = sum(out[k] for k in ("weights", "optimizer", "reference", "ema", "vae", "trajectories"))
    encoders_resident = out["text_encoders"] if w.text_encoders == "device" else 0
    working = 10 * tokens * h * 2 * w.rollout_rows * fam.cfg_rows
    out["update_peak"] = resident + encoders_resident + out["grads"] + out["activations"] + out["transient"]
    out["rollout_peak"] = resident + encoders_resident + max(working + out["transient"], out["decode"])
    out["encode_peak"] = resident + out["text_encoders"]
    out["peak"] = max(out["update_peak"], out["rollout_peak"], out["encode_peak"])
    return {k: v / GIB for k, v in out.items()}


def fits(p: dict[str, float]) -> bool:
    return p["peak"] <= BUDGET_GIB


def workload_of(config) -> Workload:
    """The :class:`Workload` of a loaded config (``KeyError`` for a family this plan does not know)."""
    m, t = config.model, config.train
    family = PRETRAINED[m.pretrained]
    samples = config.batch_size
    if config.chunker.name == "entropy_merge":  # E-GRPO: one trajectory per (sample, branch step)
        samples *= len(getattr(config.chunker, "merge_steps", None) or [0, 1, 2, 4])
    return Workload(family=family, finetune=m.finetune, dtype=m.dtype, height=m.height or 1024, width=m.width or 1024,
                    max_sequence_length=m.max_sequence_length, train_rows=config.train_batch_size,
                    rollout_rows=t.rollout_batch_size, samples=samples, steps=config.sampling.num_steps,
                    gradient_checkpointing=m.gradient_checkpointing, lora_rank=m.lora_rank,
                    lora_targets=tuple(m.lora_target_modules), kl=config.algo.kl_beta > 0,
                    ema=t.ema_decay is not None, latents_on_cpu=t.latents_on_cpu, sharding=config.parallel.sharding,
                    text_encoders=config.parallel.text_encoders, reference=config.parallel.reference,
                    reshard_after_forward=config.parallel.reshard_after_forward)


def reference_workload(family: str, finetune: str, gradient_checkpointing: bool, sharding: str) -> Workload:
    """The table's workload: 1024², one row per transformer call, LoRA r64 on the attention projections, no
    KL or EMA, text encoders offloaded, latents on the host; ``max_sequence_length`` 512 (SD3.5: 256)."""
    return Workload(family=family, finetune=finetune, dtype="bfloat16", height=1024, width=1024,
                    max_sequence_length=256 if family == "sd3" else 512, train_rows=1, rollout_rows=1, samples=0,
                    steps=16, gradient_checkpointing=gradient_checkpointing, latents_on_cpu=True, sharding=sharding,
                    text_encoders="offload")


COLUMNS = ("weights", "grads", "optimizer", "reference", "ema", "text_encoders", "vae", "activations", "transient",
           "peak")


def _row(label: list[str], p: dict[str, float]) -> str:
    cells = label + [f"{p[k]:.1f}" for k in COLUMNS] + ["yes" if fits(p) else "**no**"]
    return "| " + " | ".join(cells) + " |"


def _header(first: list[str]) -> list[str]:
    cols = first + ["weights", "grads", "optim.", "ref.", "EMA", "text enc.", "VAE", "activ.", "transient", "peak",
                    "fits 80 GB"]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def reference_table() -> str:
    """LoRA / full × 1 / 8 / 16 GPUs × gradient checkpointing off / on, for FLUX.1-dev, SD3.5-M and Qwen-Image
    (one GPU: no sharding; several: FSDP2)."""
    lines = _header(["model", "train", "GPUs", "ckpt"])
    for family in ("flux", "sd3", "qwenimage"):
        for finetune in ("lora", "full"):
            for gpus in (1, 8, 16):
                for ckpt in (False, True):
                    w = reference_workload(family, finetune, ckpt, "none" if gpus == 1 else "fsdp2")
                    lines.append(_row([FAMILIES[family].name, finetune, str(gpus), "yes" if ckpt else "no"],
                                      plan(w, gpus)))
    return "\n".join(lines)


def config_table(paths, gpu_counts=(1, 2, 4, 8, 16)) -> str:
    """Peak GiB per GPU of each shipped config of a planned family at 1, 2, 4, 8 and 16 GPUs: as shipped, and with the
    other placements (FSDP2; FSDP2 with the text encoders offloaded) where they differ from it."""
    from flowgrpo.config import load_config

    lines = ["| config | parallel | " + " | ".join(f"{n} GPU{'s' * (n > 1)}" for n in gpu_counts) + " |",
             "|---|---|" + "---|" * len(gpu_counts)]
    for path in paths:
        cfg = load_config(path)
        if cfg.model.pretrained not in PRETRAINED:
            continue
        shipped = workload_of(cfg)
        variants = list(dict.fromkeys([shipped, dataclasses.replace(shipped, sharding="fsdp2"),
                                       dataclasses.replace(shipped, sharding="fsdp2", text_encoders="offload")]))
        for w in variants:
            label = f"{w.sharding}, encoders on {w.text_encoders}" + (" (shipped)" if w == shipped else "")
            peaks = [plan(w, n) for n in gpu_counts]
            cells = [f"{p['peak']:.0f}" if fits(p) else f"**{p['peak']:.0f}**" for p in peaks]
            lines.append(f"| {path.name} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
