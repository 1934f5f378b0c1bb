"""The Stable Diffusion 3 / 3.5 adapter: a diffusers ``StableDiffusion3Pipeline`` behind the
:class:`~flowgrpo.models.base.ModelAdapter` interface.

Everything SD3-specific lives here:

* three text encoders (CLIP-L, CLIP-G, T5-XXL) through the pipeline's own ``encode_prompt``; the negative
  (unconditional) pair is the empty prompt, as ``StableDiffusion3Pipeline.__call__`` does with
  ``negative_prompt=None`` and as Flow-GRPO's ``train_sd3.py`` does (``compute_text_embeddings([""])``);
* true classifier-free guidance on a doubled batch ``[uncond; cond]``, ``v = v_u + s·(v_c − v_u)``
  (Ho & Salimans, arXiv 2207.12598, eq. 6, in velocity form; SD3: Esser et al., arXiv 2403.03206),
  applied only when ``s > 1`` as the pipeline's ``do_classifier_free_guidance``;
* the raw timestep ``t = σ·1000`` (``num_train_timesteps``) that the pipeline passes from
  ``scheduler.timesteps``: unlike FLUX, the SD3 transformer does not scale σ itself;
* latents in the transformer's own (B, 16, h, w) layout (no packing: the transformer patchifies 2×2 inside);
* the σ grid of ``FlowMatchEulerDiscreteScheduler.set_timesteps(T)`` with the static shift (3.0 for SD3.5) —
  the pipeline passes no custom σ, and SD3.5's scheduler has dynamic shifting off.

    python -m flowgrpo.models.sd3 OUT_DIR      # build and save the tiny random SD3 pipeline
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from flowgrpo.models.base import AdapterBase, PromptEmbeds
from flowgrpo.models.empty import empty_components
from flowgrpo.models.tiny import build_clip_tokenizer, build_t5_tokenizer, build_tiny_vae, builder_main

logger = logging.getLogger(__name__)

__all__ = ["SD3Adapter", "load_sd3_adapter", "build_tiny_sd3"]


class SD3Adapter(AdapterBase):
    """Adapter for a loaded :class:`diffusers.StableDiffusion3Pipeline`.

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA adapter).
        height, width: image size in pixels, positive multiples of ``vae_scale_factor · patch_size``
            (16 for SD3), as the pipeline's ``check_inputs`` requires.
        max_sequence_length: T5 tokens per prompt (the pipeline's default is 256; Flow-GRPO uses 128).
        cfg_detach_uncond: compute the unconditional branch of classifier-free guidance under
            ``torch.no_grad`` in its own forward (saves its activations; its gradient is dropped). Default
            ``False``: one doubled-batch forward with gradient through both branches, as Flow-GRPO's
            ``compute_log_prob`` and the pipeline do. Rollout and training take the same path either way, so
            the on-policy importance ratio stays exactly 1.
    Raises:
        ValueError: a height or width the VAE and the 2×2 patchify cannot represent, or a
            ``max_sequence_length`` outside [1, 512] (the pipeline's own limit).
    """

    block_lists = ("transformer_blocks",)  # the joint (MMDiT) blocks

    def __init__(self, pipe: StableDiffusion3Pipeline, *, height: int, width: int,
                 max_sequence_length: int = 256, cfg_detach_uncond: bool = False) -> None:
        step = pipe.vae_scale_factor * pipe.patch_size
        self.check_image_size("SD3 image size", height, width, step)
        self.check_sequence_length("SD3", max_sequence_length, 512)
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.cfg_detach_uncond = bool(cfg_detach_uncond)
        self.latent_h = height // pipe.vae_scale_factor
        self.latent_w = width // pipe.vae_scale_factor
        self.num_channels = pipe.transformer.config.in_channels
        self.num_train_timesteps = pipe.scheduler.config.num_train_timesteps

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings of B prompts and of the empty negative prompt, no gradient.

        Returns a :class:`PromptEmbeds` with batched ``prompt_embeds`` (B, 77 + L, D_T5) (CLIP-L ‖ CLIP-G
        penultimate hidden states zero-padded to the T5 width, then the L T5 tokens) and
        ``pooled_prompt_embeds`` (B, D_L + D_G); and, shared by the batch, ``negative_prompt_embeds``
        (1, 77 + L, D_T5) and ``negative_pooled_prompt_embeds`` (1, D_L + D_G) of ``""`` (SD3.5:
        D_T5 = 4096, D_L + D_G = 2048), in the text encoders' dtype. Computed by
        ``StableDiffusion3Pipeline.encode_prompt`` with ``negative_prompt=None``, as ``__call__`` does.

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        # prompts longer than an encoder's limit are truncated: warned once per encoder, counted
        self.truncation("CLIP", self.pipe.tokenizer, prompts, self.pipe.tokenizer_max_length)
        if self.pipe.tokenizer_3 is not None:
            self.truncation("T5", self.pipe.tokenizer_3, prompts, self.max_sequence_length)
        pos, neg, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=True, negative_prompt=None,
            max_sequence_length=self.max_sequence_length,
        )
        # Every row of the negative pair is the same "" embedding: keep one, shared by any batch layout.
        return PromptEmbeds(
            {"prompt_embeds": pos, "pooled_prompt_embeds": pooled},
            {"negative_prompt_embeds": neg[:1], "negative_pooled_prompt_embeds": neg_pooled[:1]},
        )

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, C, H/8, W/8) float32 standard-normal latents, drawn as
        ``StableDiffusion3Pipeline.prepare_latents`` does (``randn_tensor``, one generator per sample or one
        for the batch).

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        return self.normal_noise((batch_size, self.num_channels, self.latent_h, self.latent_w), generator)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, C, h, w) float32 guided velocity at (latents, σ).

        The transformer gets the timestep ``σ·1000`` (float32, as ``scheduler.timesteps``). For
        ``guidance_scale`` s > 1, ``v = v_u + s·(v_c − v_u)`` (Ho & Salimans, arXiv 2207.12598, eq. 6) with
        ``v_u`` the empty-prompt prediction, from one doubled batch ``[uncond; cond]`` (or, with
        ``cfg_detach_uncond``, an uncond forward under ``no_grad`` plus a cond forward); for s ≤ 1 the
        conditional prediction alone, as the pipeline (``do_classifier_free_guidance = s > 1``). The guidance
        combination is computed in float32.

        Args:
            latents: (B, C, h, w) any float dtype.
            sigma: (B,) or scalar float σ in (0, 1].
            embeds: B rows of :meth:`encode_prompts` output.
        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        b = latents.shape[0]
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = sigma * self.num_train_timesteps  # (B,) float32, bitwise the pipeline's scheduler.timesteps
        cond = (embeds["prompt_embeds"], embeds["pooled_prompt_embeds"])
        if guidance_scale <= 1:
            return self._forward(latents, t, *cond)
        uncond = (embeds["negative_prompt_embeds"].expand(b, -1, -1),
                  embeds["negative_pooled_prompt_embeds"].expand(b, -1))
        if self.cfg_detach_uncond:
            with torch.no_grad():
                v_u = self._forward(latents, t, *uncond)
            v_c = self._forward(latents, t, *cond)
        else:
            # one doubled batch [uncond; cond], the pipeline's layout
            v = self._forward(torch.cat([latents, latents]), torch.cat([t, t]),
                              torch.cat([uncond[0], cond[0]]), torch.cat([uncond[1], cond[1]]))
            v_u, v_c = v.chunk(2)
        return v_u + guidance_scale * (v_c - v_u)

    def _forward(self, latents, timestep, prompt_embeds, pooled) -> torch.Tensor:
        dtype = self.dtype
        with self.attention():
            out = self.forward_module(
                hidden_states=latents.to(dtype),
                timestep=timestep,
                encoder_hidden_states=prompt_embeds.to(dtype),
                pooled_projections=pooled.to(dtype),
                return_dict=False,
            )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1] from (B, C, h, w) clean latents, as ``StableDiffusion3Pipeline``
        decodes: ``x / scaling_factor + shift_factor``, VAE decode, ``[-1, 1] → [0, 1]`` clamped."""
        vae = self.pipe.vae
        x = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) float32 clean latents of ``images`` (B, 3, H, W) in [0, 1], the inverse of :meth:`decode`:
        [0, 1] → [-1, 1], the VAE posterior's mode, ``(z − shift_factor)·scaling_factor``. Used by the objectives
        that train on a dataset's images (``sft``, ``dpo_offline``).

        Raises:
            ValueError: images that are not (B, 3, height, width).
        """
        self.check_images_shape(images)
        vae = self.pipe.vae
        z = vae.encode((images * 2 - 1).to(self.device, vae.dtype)).latent_dist.mode()
        return (z.float() - vae.config.shift_factor) * vae.config.scaling_factor

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid exactly as ``StableDiffusion3Pipeline.__call__`` builds it.

        The pipeline calls ``scheduler.set_timesteps(T)`` with no custom σ: ``T`` points evenly spaced from
        ``σ_max`` to ``σ_min`` of the training schedule, shifted by ``σ' = s·σ / (1 + (s − 1)·σ)`` (Esser et
        al., arXiv 2403.03206, resolution-dependent timestep shifting; s = 3 for SD3.5), then a terminal 0.
        Since ``σ_min`` is itself already shifted, the last nonzero σ is shifted twice (0.0089 for s = 3), as
        in the pipeline. A scheduler with dynamic shifting gets the pipeline's resolution-dependent ``mu``
        (``calculate_shift`` with SD3's default ``max_shift`` 1.16).

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        self.check_num_steps(num_steps)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        cfg = scheduler.config
        if cfg.get("use_dynamic_shifting", False):
            patch = self.transformer.config.patch_size
            mu = calculate_shift(
                (self.latent_h // patch) * (self.latent_w // patch), cfg.get("base_image_seq_len", 256),
                cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16),
            )
            scheduler.set_timesteps(num_steps, mu=mu)
        else:
            scheduler.set_timesteps(num_steps)
        return scheduler.sigmas.float().cpu()


def load_sd3_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                     max_sequence_length: int, cfg_detach_uncond: bool = False,
                     empty_transformer: bool = False) -> SD3Adapter:
    """``StableDiffusion3Pipeline.from_pretrained(path)`` in ``dtype``, wrapped in an :class:`SD3Adapter`.

    ``height``/``width`` default to the pipeline's sample size (1024 for SD3.5); ``max_sequence_length`` is
    clipped to the T5 tokenizer's ``model_max_length`` and to the pipeline's limit of 512.
    """
    pipe = StableDiffusion3Pipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    size = pipe.default_sample_size * pipe.vae_scale_factor
    msl = min(max_sequence_length, 512)
    if pipe.tokenizer_3 is not None:
        msl = min(msl, pipe.tokenizer_3.model_max_length)
    return SD3Adapter(pipe, height=height or size, width=width or size, max_sequence_length=msl,
                      cfg_detach_uncond=cfg_detach_uncond)


# ---------------------------------------------------------------------------------------------- tiny builder
# Widths chosen distinct so that a mix-up of the two CLIPs, or of sequence and pooled embeddings, fails
# loudly: CLIP-L-like 16 (projection 16), CLIP-G-like 24 (projection 24), T5 48. As in SD3, the CLIP
# sequence embeddings (16 + 24 = 40) are zero-padded to the T5 width (48 = joint_attention_dim) and the pooled
# ones concatenate to 16 + 24 = 40 (= pooled_projection_dim).
_CLIP_L, _CLIP_G, _T5 = 16, 24, 48


def _clip_with_projection(tokenizer, hidden: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden, hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()


def build_tiny_sd3(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (),
                   sample_size: int = 64, t5_max_length: int = 32, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny SD3.5-architecture pipeline and ``save_pretrained`` it into ``out_dir``; return it.

    Same classes as stabilityai/stable-diffusion-3.5-medium: ``SD3Transformer2DModel`` (2 joint blocks, the
    first with SD3.5's dual attention, RMS q/k norm, patch 2), a 16-channel ``AutoencoderKL`` with 8×
    downsampling and SD3's scaling/shift factors, two ``CLIPTextModelWithProjection`` (the real 49,408-token
    CLIP BPE tokenizer), a ``T5EncoderModel`` with a small in-memory unigram tokenizer (``words`` become
    single pieces), and ``FlowMatchEulerDiscreteScheduler(shift=3.0)``. Images are ``sample_size`` pixels
    square. ``transformer_kwargs`` override the transformer's constructor arguments (benchmarks at real size).

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import T5Config, T5EncoderModel

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny SD3 sample_size must be a positive multiple of 16, got {sample_size}")
    tok = build_clip_tokenizer()
    tok_2 = build_clip_tokenizer()
    clip_l = _clip_with_projection(tok, _CLIP_L, seed)
    clip_g = _clip_with_projection(tok_2, _CLIP_G, seed + 1)
    tok_3 = build_t5_tokenizer(words, model_max_length=t5_max_length)
    torch.manual_seed(seed + 2)
    t5 = T5EncoderModel(
        T5Config(vocab_size=len(tok_3), d_model=_T5, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ).eval()
    latent = sample_size // 8
    torch.manual_seed(seed + 3)
    transformer = SD3Transformer2DModel(**{
        "sample_size": latent, "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 4, "joint_attention_dim": _T5, "caption_projection_dim": 32,
        "pooled_projection_dim": _CLIP_L + _CLIP_G, "out_channels": 16, "pos_embed_max_size": max(latent // 2, 8),
        "dual_attention_layers": (0,), "qk_norm": "rms_norm", **(transformer_kwargs or {}),
    })
    torch.manual_seed(seed + 4)
    vae = build_tiny_vae(sample_size, scaling_factor=1.5305, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=clip_l, tokenizer=tok,
        text_encoder_2=clip_g, tokenizer_2=tok_2, text_encoder_3=t5, tokenizer_3=tok_3,
    )
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    builder_main(lambda out, words, seed: build_tiny_sd3(out, seed, words=words), "SD3", __doc__, argv)


if __name__ == "__main__":
    main()
