"""The embedded default model: a small FLUX-architecture pipeline pretrained on handwritten digits.

It gives the toolkit a task whose success can be verified without any downloaded model: "a handwritten digit
seven" should produce a seven, and a classifier can tell. The pipeline uses exactly the diffusers classes of FLUX.1
(``FluxTransformer2DModel``, ``AutoencoderKL``, CLIP + T5 text encoders, ``FlowMatchEulerDiscreteScheduler``) and
loads with ``FluxPipeline.from_pretrained``, so it exercises the real loading and sampling code.

Data, splits and prompts: :mod:`flowgrpo.tasks.digits.data`.

Recipe (:func:`pretrain`; the cache is built by :func:`pretrain_pinned`, whose bytes depend only on the seed, the
library versions and the CPU model, whatever the launcher, core count or load: another CPU, certainly another
vendor's, may build other bytes, see :mod:`flowgrpo.builds.repeatable`; the marker file records the weights' sha256 and
the build's numerical environment):

1. frozen random text encoders (:func:`flowgrpo.models.tiny.build_text_encoders`) whose tokenizers know the words
   of the prompts; T5 sequences are :data:`MAX_SEQUENCE_LENGTH` tokens (the pipeline must be called with
   ``max_sequence_length=MAX_SEQUENCE_LENGTH``: the T5 encoder runs without an attention mask, so the padding
   length changes the embeddings);
2. an ``AutoencoderKL`` (3 blocks of 16, 32, 32 channels, 4 latent channels, 4× downsampling, no attention)
   trained on the training digits with an L1 + MSE reconstruction loss and a small KL term (Kingma & Welling
   2014); its ``shift_factor``/``scaling_factor`` are the mean and inverse standard deviation of the training
   latents, so the transformer sees latents of zero mean and unit variance, as in FLUX.1 / SD3;
3. a ``FluxTransformer2DModel`` (2 double + 4 single blocks, 4 heads × 32; 16 packed tokens of 16 channels)
   trained by rectified flow (Liu et al. 2023; Lipman et al. 2023): x_σ = (1−σ)·x₀ + σ·ε, target v = ε − x₀,
   σ drawn logit-normal(0, 1) (Esser et al. 2024, SD3 paper, §3.1), AdamW at a constant rate after a short
   warmup; 450 steps of batch 128, so that the base model is good but imperfect and reinforcement learning has
   headroom: with 8 Euler steps the independent judge reads 0.83–0.91 of its digits as the prompted one
   (pretraining seeds 0, 1, 2 on an AMD EPYC: 0.913, 0.827, 0.891; 1000 images).
   Recipe 2 stopped at 225 steps and its bases read 0.40–0.61 depending on the seed and the machine: far from
   trained (at the same 225 steps a cosine decay of the rate read 0.13), so a base was a wide draw and the RL
   default's figures did not carry from one machine to another (docs/results.md, "The digits task").

Scheduler: ``FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)``, i.e. no timestep shift.
The SD3/FLUX shift moves sampling steps towards high noise for images with many more pixels than the training
resolution (Esser et al. 2024, eq. 23: shift = √(pixels / base pixels)); this model samples at the single
resolution it was trained on, with 16 image tokens, and FLUX.1's own resolution-dependent rule
(``calculate_shift``) extrapolated to 16 tokens gives exp(0.46) ≈ 1.6, close to no shift. The sampler therefore
uses the plain grid σ_i = 1 − i/T.

    python -m flowgrpo.tasks.digits.model [OUT_DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from flowgrpo.argtypes import OneLineParser
from flowgrpo.builds.cache_folder import build_once, cache_dir
from flowgrpo.models.tiny import TEXT_DIM, build_text_encoders
from flowgrpo.tasks.digits.data import (
    IMAGE_SIZE,
    PHRASINGS,
    digit_prompt,
    digits_to_images,
    load_digit_split,
    prompt_records,
)
from flowgrpo.writing.outputs import OutputRefused, check_folder, write_text_file

logger = logging.getLogger("flowgrpo.tasks.digits.model")  # also when run as __main__


MAX_SEQUENCE_LENGTH = 16  # T5 tokens per prompt; every caller of the pipeline must use this value
RECIPE_VERSION = 3  # bump when the recipe or its bytes change: the cache folder name carries it (2: pinned build;
                    #   3: 450 transformer steps)
MARKER_FILE = "flowgrpo_digits.json"  # written last into a finished model folder: recipe and sampling settings


# Training recipe defaults (measured on 2 CPU cores; the figures are in README, "The digits task").
VAE_STEPS = 250
VAE_BATCH_SIZE = 32
TRANSFORMER_STEPS = 450
BATCH_SIZE = 128


# ---------------------------------------------------------------------------------------------- model folder
def cache_root() -> Path:
    """The flowgrpo cache folder (:func:`flowgrpo.builds.cache_folder.cache_dir`)."""
    return cache_dir()


def default_model_dir(seed: int = 0) -> Path:
    """The cache folder of the pretrained digits pipeline for ``seed``:
    ``cache_root() / f"digits-v{RECIPE_VERSION}-seed{seed}"``."""
    return cache_root() / f"digits-v{RECIPE_VERSION}-seed{seed}"


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a finished digits pipeline (its marker file, written last, exists)."""
    return (Path(folder) / MARKER_FILE).is_file() and (Path(folder) / "model_index.json").is_file()


def read_model_info(folder: str | os.PathLike) -> dict:
    """The marker file of a digits pipeline folder: recipe, seed and sampling settings (height, width,
    ``max_sequence_length``, ``num_inference_steps``). Raises ``FileNotFoundError`` if the folder is not one."""
    path = Path(folder) / MARKER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a finished digits pipeline (no {MARKER_FILE})")
    return json.loads(path.read_text())


def ensure_digits_model(seed: int = 0, folder: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The pretrained digits pipeline folder for ``seed``, pretrained first (minutes) if it is absent.

    ``folder`` defaults to :func:`default_model_dir`. The build writes into a temporary sibling folder and renames
    it into place, so a crash never leaves a half-written model and concurrent builders cannot mix their files
    (the first rename wins; the others discard their copy).
    """
    target = Path(folder) if folder is not None else default_model_dir(seed)
    if not is_complete(target):
        logger.info("digits pipeline not found at %s: pretraining it (a few minutes, once)", target)
    return build_once(target, lambda tmp: pretrain_pinned(tmp, seed=seed, progress=progress),
                      is_complete=is_complete)


def pretrain_pinned(out_dir: str | os.PathLike, seed: int = 0, *, progress: bool = True, **recipe: int) -> Path:
    """:func:`pretrain` (``recipe``: its step and batch sizes) in a child process with the pinned numerical
    environment of :mod:`flowgrpo.builds.repeatable` (one thread, AVX2 kernels): the bytes depend only on the seed, the
    recipe, the torch and diffusers versions and the CPU model (an Intel Xeon and an AMD EPYC built different
    bytes; :mod:`flowgrpo.builds.repeatable`). Raises ``RuntimeError`` if the child fails."""
    from flowgrpo.builds.repeatable import run_pinned

    flags = [f"--{k.replace('_', '-')}={int(v)}" for k, v in _checked_sizes(**recipe).items()]
    run_pinned(["-m", "flowgrpo.tasks.digits.model", "--pinned-child", str(out_dir), f"--seed={int(seed)}", *flags,
                *([] if progress else ["--no-progress"])], "pretraining the digits model")
    return Path(out_dir)


# ---------------------------------------------------------------------------------------------- pretraining
def build_vae():
    """The digits ``AutoencoderKL``: 3 blocks (16, 32, 32), 4 latent channels, 4× downsampling, no attention
    (≈ 234 K parameters); random weights from the global torch RNG."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=IMAGE_SIZE,
        mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=1.0, shift_factor=0.0, force_upcast=False,
    )


def build_transformer():
    """The digits ``FluxTransformer2DModel``: 2 double + 4 single blocks, 4 heads × 32, 16 input channels (2×2
    patches of 4 latent channels), no guidance embedding (≈ 2.3 M parameters); random weights."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )


def build_scheduler():
    """Euler flow-matching scheduler without timestep shift (see the module docstring for why)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def _prompt_words() -> list[str]:
    words = {w for r in prompt_records("train") + prompt_records("eval") for w in r["prompt"].split()}
    return sorted(words)


def _train_vae(vae, images: torch.Tensor, steps: int, batch_size: int, gen: torch.Generator, progress: bool):
    """Reconstruction training: loss = mean |x̂−x| + mean (x̂−x)² + 1e-4·mean KL(q(z|x) ‖ N(0, I)), x in [−1, 1],
    KL of a diagonal Gaussian = ½(μ² + σ² − 1 − log σ²) per dimension (Kingma & Welling 2014, App. B); z is
    sampled by reparameterisation from the step's generator; AdamW with a one-cycle learning rate (peak 2e-3)."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=max(steps, 1), pct_start=0.1)
    x_all = images * 2.0 - 1.0
    vae.train()
    bar = tqdm(range(steps), desc="digits VAE", disable=not progress, leave=False)
    for _ in bar:
        idx = torch.randint(len(x_all), (batch_size,), generator=gen)
        x = x_all[idx]
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        kl = 0.5 * (post.mean.pow(2) + post.var - 1.0 - post.logvar).mean()
        loss = (rec - x).abs().mean() + (rec - x).pow(2).mean() + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    vae.eval()
    return float(loss.item()) if steps else float("nan")


@torch.no_grad()
def _encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """(N, 4, 8, 8) posterior means of ``images`` (N, 3, 32, 32) in [0, 1]."""
    return torch.cat([vae.encode(x * 2.0 - 1.0).latent_dist.mean for x in images.split(256)])


def _train_transformer(transformer, x0: torch.Tensor, labels: torch.Tensor, embeds: dict[str, torch.Tensor],
                       steps: int, batch_size: int, gen: torch.Generator, progress: bool) -> float:
    """Rectified-flow training on packed latents ``x0`` (N, 16, 16) with text ``embeds`` per (digit, phrasing)."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(transformer.parameters(), lr=1e-3, weight_decay=0.0)
    warmup = max(1, min(20, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    n_phr = embeds["prompt_embeds"].shape[1]
    transformer.train()
    bar = tqdm(range(steps), desc="digits transformer", disable=not progress, leave=False)
    loss = torch.tensor(float("nan"))
    for _ in bar:
        idx = torch.randint(len(x0), (batch_size,), generator=gen)
        phr = torch.randint(n_phr, (batch_size,), generator=gen)
        d = labels[idx]
        sigma = torch.sigmoid(torch.randn(batch_size, generator=gen))  # logit-normal(0, 1), SD3 §3.1
        eps = torch.randn(x0[idx].shape, generator=gen)
        s = sigma[:, None, None]
        x_t = (1.0 - s) * x0[idx] + s * eps
        v = transformer(
            hidden_states=x_t, timestep=sigma, guidance=None,
            pooled_projections=embeds["pooled_prompt_embeds"][d, phr],
            encoder_hidden_states=embeds["prompt_embeds"][d, phr],
            txt_ids=embeds["text_ids"], img_ids=embeds["img_ids"], return_dict=False,
        )[0]
        loss = (v - (eps - x0[idx])).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    transformer.eval()
    return float(loss.item())


def _checked_sizes(**sizes: int) -> dict[str, int]:
    """``sizes`` when every step count is an integer ≥ 0 and every batch size ≥ 1, else ``ValueError``."""
    for name, v in sizes.items():
        low = 1 if "batch" in name else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer ≥ {low}, got {v!r}")
    return sizes


def _random_pipeline(seed: int):
    """The untrained digits FluxPipeline: frozen random text encoders, a VAE and a transformer, seeded in order."""
    from diffusers import FluxPipeline

    clip_tok, clip, t5_tok, t5 = build_text_encoders(_prompt_words(), t5_max_length=MAX_SEQUENCE_LENGTH, seed=seed)
    torch.manual_seed(seed + 1)
    vae = build_vae()
    torch.manual_seed(seed + 2)
    transformer = build_transformer()
    return FluxPipeline(scheduler=build_scheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)


def _prompt_embeddings(pipe) -> dict[str, torch.Tensor]:
    """The embeddings of every (digit, phrasing) prompt, as the transformer's pretraining batches take them."""
    from diffusers import FluxPipeline

    prompts = [digit_prompt(d, p) for d in range(10) for p in range(len(PHRASINGS))]
    with torch.no_grad():
        pe, pooled, text_ids = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH)
    n_phr = len(PHRASINGS)
    return {
        "prompt_embeds": pe.reshape(10, n_phr, *pe.shape[1:]),  # (10, n_phr, L, 32)
        "pooled_prompt_embeds": pooled.reshape(10, n_phr, -1),  # (10, n_phr, 32)
        "text_ids": text_ids,  # (L, 3)
        "img_ids": FluxPipeline._prepare_latent_image_ids(1, IMAGE_SIZE // 8, IMAGE_SIZE // 8, "cpu", torch.float32),
    }


def _pretrain_vae(vae, images: torch.Tensor, steps: int, batch_size: int, seed: int,
                  progress: bool) -> tuple[torch.Tensor, float, float, float]:
    """Step 3 of :func:`pretrain`: train the VAE (generator seeded ``seed·1000 + 11``), freeze it, and set its
    ``shift_factor`` / ``scaling_factor`` to the mean and 1/std of the training images' latents.
    Returns (latents (N, 4, 8, 8), shift, scale, final VAE loss)."""
    t0 = time.perf_counter()
    vae_loss = _train_vae(vae, images, steps, batch_size, torch.Generator().manual_seed(seed * 1000 + 11), progress)
    vae.requires_grad_(False)
    lat = _encode_latents(vae, images)  # (N, 4, 8, 8)
    shift, std = float(lat.mean()), float(lat.std())
    scale = 1.0 / std if std > 0 else 1.0
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    logger.info("VAE: %d steps, final loss %.4f, %.1f s; latent mean %.4f std %.4f", steps, vae_loss,
                time.perf_counter() - t0, shift, std)
    return lat, shift, scale, vae_loss


def pretrain(out_dir: str | os.PathLike, seed: int = 0, *, vae_steps: int = VAE_STEPS,
             steps: int = TRANSFORMER_STEPS, batch_size: int = BATCH_SIZE, vae_batch_size: int = VAE_BATCH_SIZE,
             progress: bool = True) -> Path:
    """Pretrain the digits pipeline and ``save_pretrained`` it into ``out_dir`` (created); return the folder.

    ``vae_steps`` (at ``vae_batch_size``) and ``steps`` (the transformer's, at ``batch_size``) count optimizer
    steps; the defaults are the
    recipe of the cached model (about 4 minutes of one thread); tests pass a few steps. Every random draw
    comes from torch generators seeded from ``seed``, so a run is repeatable on one machine, but its bytes also
    depend on the thread count and the instruction set of the kernels (1 and 2 threads, or AVX2 and AVX-512
    kernels, round differently and give different, equally good, models): the cached model is built by
    :func:`pretrain_pinned`, which pins them. The marker file :data:`MARKER_FILE` is written last and records the
    numerical environment (:func:`flowgrpo.builds.repeatable.numerics`: CPU, instruction sets, BLAS) and ``sha256``, the
    transformer's and the VAE's weight digests (:func:`flowgrpo.builds.repeatable.weights_digest`).
    """
    from diffusers import FluxPipeline

    from flowgrpo.builds.repeatable import numerics, weights_digest

    sizes = _checked_sizes(vae_steps=vae_steps, steps=steps, batch_size=batch_size, vae_batch_size=vae_batch_size)
    out = Path(out_dir)
    t_start = time.perf_counter()

    # 1. data: the training split, upscaled
    grids, labels = load_digit_split("train")
    images = digits_to_images(grids)  # (N, 3, 32, 32)
    labels_t = torch.from_numpy(labels)

    # 2. frozen text encoders and the 10 × len(PHRASINGS) prompt embeddings
    pipe = _random_pipeline(seed)
    vae, transformer = pipe.vae, pipe.transformer
    embeds = _prompt_embeddings(pipe)

    # 3. the VAE, then latent statistics → scaling/shift factors
    lat, shift, scale, vae_loss = _pretrain_vae(vae, images, vae_steps, vae_batch_size, seed, progress)

    # 4. the transformer by rectified flow on packed, normalised latents
    t0 = time.perf_counter()
    x0 = FluxPipeline._pack_latents((lat - shift) * scale, len(lat), 4, 8, 8)  # (N, 16, 16)
    tr_loss = _train_transformer(transformer, x0, labels_t, embeds, steps, batch_size,
                                 torch.Generator().manual_seed(seed * 1000 + 12), progress)
    transformer.requires_grad_(False)
    t_tr = time.perf_counter() - t0
    logger.info("transformer: %d steps, final loss %.4f, %.1f s", steps, tr_loss, t_tr)

    # 5. save; the marker last
    pipe.save_pretrained(out)
    info = {
        "recipe": f"flowgrpo digits v{RECIPE_VERSION}", "seed": seed, **sizes, "height": IMAGE_SIZE,
        "width": IMAGE_SIZE, "max_sequence_length": MAX_SEQUENCE_LENGTH, "num_inference_steps": 8,
        "guidance_scale": None, "final_vae_loss": vae_loss, "final_transformer_loss": tr_loss,
        "numerics": numerics(), "sha256": weights_digest(out),
    }
    write_text_file(out / MARKER_FILE, json.dumps(info, indent=2) + "\n")
    logger.info("digits pipeline saved to %s (%.1f s in all)", out, time.perf_counter() - t_start)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m flowgrpo.tasks.digits.model [OUT_DIR] [--seed S] [--force] [recipe options]``: pretrain the digits
    model into OUT_DIR (default: the cache folder of the seed), unless it is already there."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", help="model folder (default: the cache folder for the seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", "--force", dest="force", action="store_true",
                        help="rebuild even if the folder holds a complete digits model (never a folder of other files)")
    parser.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    parser.add_argument("--steps", type=int, default=TRANSFORMER_STEPS, help="transformer optimizer steps")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="transformer batch size")
    parser.add_argument("--vae-batch-size", type=int, default=VAE_BATCH_SIZE)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--pinned-child", action="store_true", help=argparse.SUPPRESS)  # pretrain_pinned's child
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.pinned_child:  # the child of pretrain_pinned: its environment is pinned; build into OUT_DIR
        pretrain(args.out_dir, seed=args.seed, progress=not args.no_progress, vae_steps=args.vae_steps,
                 steps=args.steps, batch_size=args.batch_size, vae_batch_size=args.vae_batch_size)
        return
    target = Path(args.out_dir) if args.out_dir else default_model_dir(args.seed)
    recipe = {"vae_steps": args.vae_steps, "steps": args.steps, "batch_size": args.batch_size,
              "vae_batch_size": args.vae_batch_size}
    default = recipe == {"vae_steps": VAE_STEPS, "steps": TRANSFORMER_STEPS, "batch_size": BATCH_SIZE,
                         "vae_batch_size": VAE_BATCH_SIZE}
    if not (target / MARKER_FILE).is_file():  # not a digits model: flowgrpo's write rule (flowgrpo.writing.outputs)
        try:
            check_folder(target, "OUT_DIR", "model")
        except OutputRefused as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
    if target.exists() and (args.force or not default):
        if not args.force:
            parser.error(f"{target} exists; pass --overwrite to rebuild it with a non-default recipe")
        shutil.rmtree(target)
    if default:
        ensure_digits_model(args.seed, folder=target, progress=not args.no_progress)
    else:
        pretrain_pinned(target, seed=args.seed, progress=not args.no_progress, **recipe)
    logger.info("digits pipeline ready at %s", target)


if __name__ == "__main__":
    main()
