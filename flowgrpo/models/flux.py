"""The FLUX.1 adapter: a diffusers ``FluxPipeline`` behind the :class:`~flowgrpo.models.base.ModelAdapter` interface.

Everything FLUX-specific lives here: latent packing into 2×2 patches, text/image position ids, the guidance
embedding (FLUX.1-dev is guidance-distilled: no doubled CFG batch), the transformer's timestep = σ convention (it
multiplies by 1000 inside), and the resolution-dependent shifted σ grid (``calculate_shift``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from flowgrpo.models.base import AdapterBase, PromptEmbeds, pipeline_timestep


class FluxAdapter(AdapterBase):
    """Adapter for a loaded :class:`diffusers.FluxPipeline`.

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA adapter).
        height, width: image size in pixels (multiples of 2·vae_scale_factor).
        max_sequence_length: T5 tokens per prompt.
    Raises:
        ValueError: a height or width that the VAE and 2×2 packing cannot represent.
    """

    block_lists = ("transformer_blocks", "single_transformer_blocks")  # the double-stream blocks, then the single

    def __init__(self, pipe: FluxPipeline, *, height: int, width: int, max_sequence_length: int = 512) -> None:
        step = pipe.vae_scale_factor * 2
        self.check_image_size("FLUX image size", height, width, step)
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.latent_h = 2 * (height // step)
        self.latent_w = 2 * (width // step)
        self.num_channels = pipe.transformer.config.in_channels // 4
        self.guidance_embeds = bool(pipe.transformer.config.guidance_embeds)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """CLIP pooled (B, 768) and T5 sequence (B, L, 4096) embeddings (sizes of FLUX.1), no gradient.
        Prompts longer than an encoder's limit are truncated (warned once per encoder, counted)."""
        self.truncation("CLIP", self.pipe.tokenizer, prompts, self.pipe.tokenizer_max_length)
        self.truncation("T5", self.pipe.tokenizer_2, prompts, self.max_sequence_length)
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(
            {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}, {"text_ids": text_ids}
        )

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N, 4·C) float32 packed standard-normal latents, drawn as ``FluxPipeline.prepare_latents`` does.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        noise = self.normal_noise((batch_size, self.num_channels, self.latent_h, self.latent_w), generator)
        return FluxPipeline._pack_latents(noise, batch_size, self.num_channels, self.latent_h, self.latent_w)

    def _image_ids(self) -> torch.Tensor:
        return FluxPipeline._prepare_latent_image_ids(
            1, self.latent_h // 2, self.latent_w // 2, self.device, self.dtype
        )

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N, 4·C) float32 velocity; ``sigma`` (B,) is passed as the timestep (FLUX scales it by 1000), computed
        as the pipeline computes it (:func:`~flowgrpo.models.base.pipeline_timestep`: σ·1000 cast to the
        transformer's dtype, then divided by 1000)."""
        b = latents.shape[0]
        dtype = self.dtype
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), float(guidance_scale), device=latents.device, dtype=torch.float32)
        with self.attention():
            out = self.forward_module(
                hidden_states=latents.to(dtype),
                timestep=pipeline_timestep(torch.as_tensor(sigma, device=latents.device).expand(b), dtype),
                guidance=guidance,
                pooled_projections=embeds["pooled_prompt_embeds"].to(dtype),
                encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
                txt_ids=embeds["text_ids"],
                img_ids=self._image_ids(),
                return_dict=False,
            )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1], as ``FluxPipeline`` decodes (unpack, unscale, VAE, [-1, 1] → [0, 1])."""
        vae = self.pipe.vae
        x = FluxPipeline._unpack_latents(latents, self.height, self.width, self.pipe.vae_scale_factor)
        x = x / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, N, 4·C) float32 packed clean latents of ``images`` (B, 3, H, W) in [0, 1], the inverse of
        :meth:`decode`: [0, 1] → [-1, 1], the VAE posterior's mode, ``(z − shift_factor)·scaling_factor`` (as
        ``FluxKontextPipeline`` encodes its source image), packed into 2×2 patches. Used by the objectives that train
        on a dataset's images (``sft``, ``dpo_offline``).

        Raises:
            ValueError: images that are not (B, 3, height, width).
        """
        self.check_images_shape(images)
        vae = self.pipe.vae
        z = vae.encode((images * 2 - 1).to(self.device, vae.dtype)).latent_dist.mode()
        z = (z.float() - vae.config.shift_factor) * vae.config.scaling_factor
        return FluxPipeline._pack_latents(z, z.shape[0], self.num_channels, self.latent_h, self.latent_w)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid exactly as ``FluxPipeline.__call__`` builds it (resolution shift, terminal 0)."""
        self.check_num_steps(num_steps)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        cfg = scheduler.config
        seq_len = (self.latent_h // 2) * (self.latent_w // 2)
        mu = calculate_shift(
            seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if cfg.get("use_dynamic_shifting", False):
            scheduler.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
        else:
            scheduler.set_timesteps(num_steps, sigmas=sigmas)
        return scheduler.sigmas.float().cpu()
