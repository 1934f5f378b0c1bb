"""The Wan image-to-video adapter: a diffusers ``WanImageToVideoPipeline`` (Wan2.1 I2V 14B 480p / 720p with its CLIP
image encoder; Wan2.2 I2V A14B with its two experts and no image encoder) behind the
:class:`~flowgrpo.models.base.ModelAdapter` interface.

It is the text-to-video adapter (:mod:`flowgrpo.models.wan`: UMT5 text, Euler σ grid, raw timestep ``σ·1000``,
two-forward CFG, Wan2.2's expert switch at ``boundary_ratio`` and its ``guidance_scale_2``, decoding) with the
conditioning image of each prompt record (its ``image`` field, as the edit models take it) used as
``WanImageToVideoPipeline.__call__`` (diffusers 0.42) uses it:

* the image is resized to the output size (``video_processor.preprocess(image, height, width)``), put as frame 0
  of an otherwise black video of F frames, VAE-encoded with the posterior's mode, normalised
  ``(z − latents_mean)·(1/latents_std)``; a mask (B, 4, F', h, w) marks frame 0 (its 4 temporal slots: 1, the
  rest 0); ``condition = [mask ‖ z]`` (B, 4 + C, F', h, w), all through the pipeline's own ``prepare_latents``;
* Wan2.1 I2V only (``transformer.config.image_dim`` set): the CLIP image encoder's penultimate hidden states of
  the image (``encode_image``: (1, 257, 1280) for the released model) go to every forward as
  ``encoder_hidden_states_image``, conditional and unconditional alike;
* each forward sees ``hidden_states = [latents ‖ condition]`` (B, 2C + 4, F', h, w) and predicts the velocity of
  the C latent channels.

**The conditioning image is a fixed input, not part of the sampled state.** The state, whose transitions are
sampled and whose log-probs are computed, is the latents (B, C, F', h, w) alone — every latent frame of it,
frame 0 included, is denoised and noised by the SDE step as in the pipeline (Wan2.1/2.2 I2V generate the first
frame too, guided by the condition channels); the condition (mask and image latents) and the image embeddings
live in :class:`~flowgrpo.models.base.PromptEmbeds`, are encoded once per (prompt, image) without gradient and
shared by the group, and no noise is ever added to them.

Not supported: Wan2.2 TI2V-5B used for image-to-video (``expand_timesteps``: it overwrites the first latent frame
of the state with the image latents at timestep 0, so the state itself holds conditioning frames) and
first-last-frame-to-video (``last_image``); both are refused with a ``ValueError``. The pipeline takes one image
per call; a batch here holds one image per row.

    python -m flowgrpo.models.wan_i2v OUT_DIR [--variant wan21|wan22]   # a tiny random pipeline
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from flowgrpo.models.base import PromptEmbeds, one_image_per_prompt
from flowgrpo.models.wan import WanAdapter, _tiny_transformer, _tiny_vae, load_wan_pipeline, tiny_text_encoder

logger = logging.getLogger(__name__)

__all__ = ["WanI2VAdapter", "load_wan_i2v_adapter", "build_tiny_wan_i2v"]


class WanI2VAdapter(WanAdapter):
    """Adapter for a loaded ``diffusers.WanImageToVideoPipeline`` whose scheduler is
    ``FlowMatchEulerDiscreteScheduler`` (arguments as :class:`~flowgrpo.models.wan.WanAdapter`).

    Raises:
        ValueError: as :class:`~flowgrpo.models.wan.WanAdapter`, or a pipeline with ``expand_timesteps`` (Wan2.2
            TI2V-5B's image-to-video; module docstring).
    """

    image_conditioned = True

    def __init__(self, pipe, *, height: int, width: int, num_frames: int, max_sequence_length: int = 512,
                 guidance_scale_2: float | None = None, trained_expert: str = "transformer") -> None:
        if pipe.config.expand_timesteps:
            raise ValueError("WanImageToVideoPipeline with expand_timesteps (Wan2.2 TI2V-5B image-to-video) puts the "
                             "image latents into the sampled state's first frame; this adapter does not support it "
                             "(train TI2V-5B text-to-video with WanPipeline)")
        super().__init__(pipe, height=height, width=width, num_frames=num_frames,
                         max_sequence_length=max_sequence_length, guidance_scale_2=guidance_scale_2,
                         trained_expert=trained_expert)
        # the sampled state is the VAE's C channels; the transformer's input adds the 4 + C condition channels
        self.latent_shape = (pipe.vae.config.z_dim, *self.latent_shape[1:])
        self.image_embeddings = pipe.transformer.config.image_dim is not None

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list] | None = None) -> PromptEmbeds:
        """The text embeddings of :meth:`WanAdapter.encode_prompts` plus, per row, its image's ``condition``
        (B, 4 + C, F', h, w) float32 and, for a model with an image encoder, ``image_embeds`` (B, N, D_img) (module
        docstring). No gradient.

        Args:
            prompts: B prompts. images: B lists holding one PIL image each (the first frame's image).
        Raises:
            ValueError: no images, a count that differs from the prompts', or not exactly one image per prompt.
        """
        one_image_per_prompt(images, prompts, "Wan")
        text = super().encode_prompts(prompts)
        tensors = {**text.tensors, "condition": torch.cat([self._condition(imgs[0]) for imgs in images])}
        if self.image_embeddings:
            tensors["image_embeds"] = torch.cat([self.pipe.encode_image(imgs[0], self.device) for imgs in images])
        return PromptEmbeds(tensors, text.shared)

    def _condition(self, image) -> torch.Tensor:
        """(1, 4 + C, F', h, w) float32 ``[mask ‖ image latents]`` by the pipeline's own ``prepare_latents`` (its
        noise draw skipped by passing zero latents)."""
        pipe = self.pipe
        pixels = pipe.video_processor.preprocess(image, height=self.height, width=self.width).to(
            self.device, dtype=torch.float32)
        zeros = torch.zeros((1, *self.latent_shape), device=self.device)
        _, condition = pipe.prepare_latents(pixels, 1, self.latent_shape[0], self.height, self.width, self.num_frames,
                                            torch.float32, self.device, None, zeros)
        return condition.float()

    def _model_inputs(self, latents: torch.Tensor, embeds: PromptEmbeds) -> tuple[torch.Tensor, dict]:
        """``[latents ‖ condition]`` along the channels, and the image embeddings when the model has them."""
        hidden = torch.cat([latents.to(embeds["condition"].dtype), embeds["condition"]], dim=1)
        return hidden, ({"encoder_hidden_states_image": embeds["image_embeds"]} if self.image_embeddings else {})


def load_wan_i2v_adapter(path: str, **options) -> WanI2VAdapter:
    """``WanImageToVideoPipeline.from_pretrained(path)`` wrapped in a :class:`WanI2VAdapter` (``options``: those
    of :func:`~flowgrpo.models.wan.load_wan_pipeline`)."""
    from diffusers import WanImageToVideoPipeline

    return load_wan_pipeline(WanImageToVideoPipeline, WanI2VAdapter, path, **options)


# ---------------------------------------------------------------------------------------------- tiny builder
def build_tiny_wan_i2v(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (), sample_size: int = 32,
                       variant: str = "wan21", transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny ``WanImageToVideoPipeline`` of the real classes and ``save_pretrained`` it.

    ``variant``: ``"wan21"`` (Wan2.1 I2V: one ``WanTransformer3DModel`` with ``image_dim`` and
    ``added_kv_proj_dim``, a 2-layer ``CLIPVisionModel`` of width 16 on 32² inputs (17 tokens) and its
    ``CLIPImageProcessor``) or ``"wan22"`` (Wan2.2 I2V A14B: two experts, ``boundary_ratio`` 0.9, no image
    encoder). Both: the tiny Wan VAE (4 latent channels) of :mod:`flowgrpo.models.wan`, transformer input
    4 + 4 + 4 = 12 channels (latents, mask, image latents), UMT5 text encoder,
    ``FlowMatchEulerDiscreteScheduler(shift=3.0)``. ``sample_size`` is only checked.

    Raises:
        ValueError: an unknown ``variant`` or a ``sample_size`` that is not a positive multiple of 32.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    if variant not in ("wan21", "wan22"):
        raise ValueError(f"variant must be 'wan21' or 'wan22', got {variant!r}")
    if sample_size <= 0 or sample_size % 32:
        raise ValueError(f"tiny Wan I2V sample_size must be a positive multiple of 32, got {sample_size}")
    tok, text = tiny_text_encoder(words, seed)
    vae = _tiny_vae(False, seed + 1)
    z = vae.config.z_dim
    kwargs = {"in_channels": 2 * z + 4, "out_channels": z}
    components = {}
    if variant == "wan21":
        kwargs.update(image_dim=16, added_kv_proj_dim=24)  # the tiny transformer's inner width: 2 heads of 12
        torch.manual_seed(seed + 4)
        components["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8)).eval()
        components["image_processor"] = CLIPImageProcessor(size={"shortest_edge": 32},
                                                           crop_size={"height": 32, "width": 32})
    kwargs.update(transformer_kwargs or {})
    components["transformer"] = _tiny_transformer(z, 24, seed + 2, kwargs)
    if variant == "wan22":
        components.update(transformer_2=_tiny_transformer(z, 24, seed + 3, kwargs), boundary_ratio=0.9)
    pipe = WanImageToVideoPipeline(tokenizer=tok, text_encoder=text, vae=vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                                   **components)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    from flowgrpo.models.tiny import builder_main

    builder_main(lambda out, words, seed, variant: build_tiny_wan_i2v(out, seed, words=words, variant=variant),
                 "Wan I2V", __doc__, argv, variants=("wan21", "wan22"))


if __name__ == "__main__":
    main()
