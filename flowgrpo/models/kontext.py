"""The FLUX.1 Kontext adapter: image editing with a diffusers ``FluxKontextPipeline`` behind the
:class:`~flowgrpo.models.base.ModelAdapter` interface.

Kontext is FLUX.1 (same text encoders, guidance embedding, timestep, packing and σ grid: see
:mod:`flowgrpo.models.flux`) with the source image in context, as ``FluxKontextPipeline.__call__`` (diffusers 0.42)
does it:

* the source image is resized to the output size, scaled to [−1, 1], VAE-encoded with the posterior's mode
  (``sample_mode="argmax"``), normalised ``(z − shift)·scale`` and packed into 2×2 tokens; its position ids are
  the target's with the first coordinate set to 1;
* each transformer call sees ``[target tokens ‖ source tokens]`` and the velocity is the output's first N
  (target) tokens;
* the source latents are encoded once per (prompt, image) and shared by the group: they are part of the prompt
  conditioning (:class:`~flowgrpo.models.base.PromptEmbeds`).

Difference from the pipeline's defaults: the pipeline resizes the source to one of its preferred ~1 MP
resolutions (``_auto_resize=True``) and the output to ``max_area`` (1024²); the adapter uses the configured
output size for both, as Flow-GRPO's Kontext training does. ``_auto_resize=False, max_area=H·W`` make the
pipeline do the same (the conformance suite's parity check).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from diffusers import FluxKontextPipeline

from flowgrpo.models.base import PromptEmbeds, pipeline_timestep
from flowgrpo.models.empty import empty_components
from flowgrpo.models.flux import FluxAdapter
from flowgrpo.models.tiny import build_tiny_flux

__all__ = ["KontextAdapter", "load_kontext_adapter"]


class KontextAdapter(FluxAdapter):
    """Adapter for a loaded :class:`diffusers.FluxKontextPipeline` (arguments and errors as
    :class:`~flowgrpo.models.flux.FluxAdapter`)."""

    image_conditioned = True

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list] | None = None) -> PromptEmbeds:
        """FLUX.1 text embeddings of B prompts plus ``image_latents`` (B, N, 4·C): each prompt's source image,
        encoded as the module docstring says; shared ``image_ids`` (N, 3). No gradient.

        Args:
            prompts: B edit instructions.
            images: B lists holding one PIL image each (the source).
        Raises:
            ValueError: no images, a count that differs from the prompts', or not exactly one image per prompt.
        """
        if images is None or len(images) != len(prompts):
            raise ValueError(f"Kontext needs one source image per prompt, got {0 if images is None else len(images)}"
                             f" image lists for {len(prompts)} prompts")
        if any(len(imgs) != 1 for imgs in images):
            raise ValueError(f"Kontext takes exactly one source image per prompt, got {[len(i) for i in images]}")
        text = super().encode_prompts(prompts)
        latents = torch.cat([self._encode_image(imgs[0]) for imgs in images])  # per image, as the pipeline
        ids = self._image_ids().clone()
        ids[..., 0] = 1  # the pipeline's marker of context tokens
        return PromptEmbeds({**text.tensors, "image_latents": latents}, {**text.shared, "image_ids": ids})

    def _encode_image(self, image) -> torch.Tensor:
        pipe, vae = self.pipe, self.pipe.vae
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, self.height, self.width),
                                                 self.height, self.width)
        z = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor
        return FluxKontextPipeline._pack_latents(z, 1, self.num_channels, self.latent_h, self.latent_w).float()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N, 4·C) float32 velocity of the target tokens, the transformer seeing target and source tokens
        (module docstring); guidance embedding and timestep as FLUX.1.

        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        b, n = latents.shape[0], latents.shape[1]
        sigma = self.batch_sigma(latents, sigma, embeds)
        dtype = self.dtype
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), float(guidance_scale), device=latents.device, dtype=torch.float32)
        out = self.forward_module(
            hidden_states=torch.cat([latents, embeds["image_latents"]], dim=1).to(dtype),
            timestep=pipeline_timestep(sigma, dtype),  # the pipeline's timestep / 1000, in the transformer's dtype
            guidance=guidance,
            pooled_projections=embeds["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
            txt_ids=embeds["text_ids"],
            img_ids=torch.cat([self._image_ids(), embeds["image_ids"]], dim=0),
            return_dict=False,
        )[0]
        return out[:, :n].float()


def load_kontext_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                         max_sequence_length: int, empty_transformer: bool = False) -> KontextAdapter:
    """``FluxKontextPipeline.from_pretrained(path)`` in ``dtype``, wrapped; the size defaults to the VAE's sample
    size (1024 px for FLUX.1 Kontext); ``max_sequence_length`` is clipped to the T5 tokenizer's maximum."""
    pipe = FluxKontextPipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    size = int(pipe.vae.config.get("sample_size") or pipe.default_sample_size * pipe.vae_scale_factor)
    msl = min(max_sequence_length, pipe.tokenizer_2.model_max_length)
    return KontextAdapter(pipe, height=height or size, width=width or size, max_sequence_length=msl)


def build_tiny_kontext(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 64,
                       seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """The tiny random FLUX.1 pipeline (:func:`flowgrpo.models.tiny.build_tiny_flux`) saved as a
    ``FluxKontextPipeline`` folder (Kontext has FLUX.1-dev's architecture: same classes and sizes)."""
    folder = build_tiny_flux(out_dir, words=words, sample_size=sample_size, seed=seed,
                             transformer_kwargs=transformer_kwargs)
    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.save_pretrained(folder)
    return Path(folder)
