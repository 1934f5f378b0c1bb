"""The LTX-2 image-to-video adapter: a diffusers ``LTX2ImageToVideoPipeline`` (Lightricks LTX-2, the same 19B
folder as text-to-video) behind the :class:`~flowgrpo.models.base.ModelAdapter` interface.

It is the text-to-video adapter (:mod:`flowgrpo.models.ltx2`: Gemma 3 and the connectors, the joint video ‖ audio
noise, the dynamic-shift σ grid, the whole guidance stack in x₀ space, decoding with the decode noise off) with
the conditioning image of each prompt record (its ``image`` field) used as ``LTX2ImageToVideoPipeline.__call__``
(diffusers 0.42) uses it:

* the image is re-compressed as one H.264 frame at the model's CRF (``image_crf``; None: the pipeline's
  ``resolve_default_image_crf``, 33 for the Gemma 3 generations; 0 skips it), resized to the output size
  (``video_processor.preprocess``, bilinear), VAE-encoded with the posterior's mode and normalised
  ``(z − latents_mean)/latents_std`` (``_normalize_latents``, no scaling factor, as ``prepare_latents``);
* those latents **are** latent frame 0 of the video: ``prepare_latents`` writes them over the noise of frame 0
  (``init·mask + noise·(1 − mask)``, ``conditioning_mask`` 1 on frame 0) and every transformer call sees the
  packed video tokens with that frame clean, at video timestep ``t·(1 − mask)`` (0 on frame 0's tokens) and
  audio timestep ``t``; CFG, STG, modality isolation and the rescale run over all the video tokens, frame 0
  included (the rescale's per-sample std reads it); ``scheduler.step`` moves frames 1.. only, frame 0 stays the
  image latents to the end, and the decoder gets all frames.

**The choice: the sampled state holds only the generated tokens; the adapter re-inserts the conditioning frame.**
Unlike Wan and HunyuanVideo-1.5 I2V (condition channels beside a state the model generates wholly), LTX-2's image
is a frame of the video tokens themselves. Keeping it in the state would make the SDE step noise it and its
log-prob score it (the pipeline never moves it), so the state is ``[video tokens of frames 1.. ‖ audio]`` (B,
S_g·D_v + S_a·D_a), S_g = S_v − h·w: the joint state of the text-to-video adapter minus frame 0's tokens. The
audio stays in the state for the text-to-video adapter's reason (the video velocity depends on it, and the
pipeline samples it). The frame-0 tokens (B, h·w, D_v) are in :class:`~flowgrpo.models.base.PromptEmbeds`
(``image_tokens``), encoded once per (prompt, image) without gradient, shared by the group, never noised;
:meth:`LTX2I2VAdapter.velocity` puts them in front of the generated tokens for every transformer call and
returns the velocity of the generated tokens and the audio only. Rollout and training call that same function
on the same state, so the trained transition never contains the conditioning frame and the on-policy ratio is
exactly 1.

The decoder needs frame 0 back, and ``decode(latents)`` has no per-sample conditioning: this adapter sets
``decode_needs_embeds`` and its ``decode`` takes the rows' embeddings as a second argument; the callers decode
through :func:`flowgrpo.models.base.decode_latents`, which passes them only to such an adapter (every other
adapter's ``decode`` is unchanged). The alternative — frame 0 kept in the state with a zero velocity — would need
a per-element mask in the SDE step and its log-prob for every sampler, a wider change to shared code.

Not supported: a transformer patch size other than 1 (the pipeline's ``conditioning_mask`` packing assumes it),
given latents, ``noise_scale`` > 0, prompt enhancement, the duration head. LTX-2.5 (a Gemma 4 text encoder, CRF 18 by
the same ``resolve_default_image_crf``) is untested.
The pipeline takes one image per call; a batch here holds one image per row.

    python -m flowgrpo.models.ltx2_i2v OUT_DIR   # a tiny random pipeline
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from flowgrpo.models.base import PromptEmbeds, one_image_per_prompt
from flowgrpo.models.ltx2 import LTX2Adapter, LTX2Guidance, build_tiny_ltx2, load_ltx2_pipeline

logger = logging.getLogger(__name__)

__all__ = ["LTX2I2VAdapter", "load_ltx2_i2v_adapter", "build_tiny_ltx2_i2v"]

_PIPELINE_MODULE = "diffusers.pipelines.ltx2.pipeline_ltx2_image2video"


class LTX2I2VAdapter(LTX2Adapter):
    """Adapter for a loaded ``diffusers.LTX2ImageToVideoPipeline`` (module docstring).

    Args:
        pipe, height, width, num_frames, max_sequence_length, guidance: as :class:`~flowgrpo.models.ltx2.LTX2Adapter`.
        image_crf: the H.264 CRF the conditioning image is re-compressed at (the pipeline's ``image_crf``); None:
            the pipeline's default for its text encoder (33 for LTX-2 / 2.3); 0: no re-compression. A CRF other
            than 0 needs PyAV (``pip install "flowgrpo[video]"``), as the pipeline does.

    Raises:
        ValueError: as :class:`~flowgrpo.models.ltx2.LTX2Adapter`; a transformer patch size other than 1; a
            negative ``image_crf``.
    """

    image_conditioned = True
    decode_needs_embeds = True

    def __init__(self, pipe, *, height: int, width: int, num_frames: int, max_sequence_length: int = 1024,
                 guidance: LTX2Guidance | None = None, image_crf: int | None = None) -> None:
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        if (p, pt) != (1, 1):
            raise ValueError(f"LTX-2 image-to-video needs transformer patch sizes 1 x 1 (the pipeline packs its "
                             f"conditioning mask with them), got patch_size {p}, patch_size_t {pt}")
        if image_crf is not None and image_crf < 0:
            raise ValueError(f"LTX-2 image_crf must be >= 0 (0: no re-compression), got {image_crf}")
        super().__init__(pipe, height=height, width=width, num_frames=num_frames,
                         max_sequence_length=max_sequence_length, guidance=guidance)
        f, h, w = self.grid
        self.image_token_count = h * w  # frame 0's packed tokens (patch 1: the first h·w of the F'·h·w)
        self.split = (self.video_tokens - self.image_token_count) * self.video_dim  # the generated video's part
        self.latent_shape = (self.split + self.audio_frames * self.audio_dim,)
        # the pipeline's 1 − conditioning_mask over the packed video tokens: 0 on frame 0, 1 elsewhere (float32)
        self.video_t_scale = torch.ones(1, self.video_tokens)
        self.video_t_scale[:, : self.image_token_count] = 0.0
        self.image_crf = image_crf

    # ------------------------------------------------------------------ state layout
    def _unflatten(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) state → the generated video tokens (B, S_g, D_v) and audio (B, S_a, D_a), float32."""
        b = latents.shape[0]
        video = latents[:, : self.split].reshape(b, -1, self.video_dim).float().contiguous()
        audio = latents[:, self.split:].reshape(b, self.audio_frames, self.audio_dim).float().contiguous()
        return video, audio

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N) float32 noise of the generated tokens and the audio: per generator the whole video draw (frame 0
        included, as ``prepare_latents`` draws it before writing the image over frame 0) then the audio draw;
        frame 0's noise is dropped (the pipeline discards it too).

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        joint = super().initial_latents(batch_size, generator)
        return joint[:, self.image_token_count * self.video_dim:].contiguous()

    # ------------------------------------------------------------------ conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list] | None = None) -> PromptEmbeds:
        """The text streams of :meth:`LTX2Adapter.encode_prompts` plus, per row, its image's latent frame 0 as
        packed tokens, ``image_tokens`` (B, h·w, D_v) float32 (module docstring). No gradient.

        Args:
            prompts: B prompts. images: B lists holding one PIL image each (the first frame's image).
        Raises:
            ValueError: no images, a count that differs from the prompts', or not exactly one image per prompt.
            ImportError: a CRF other than 0 without PyAV installed.
        """
        one_image_per_prompt(images, prompts, "LTX-2")
        text = super().encode_prompts(prompts)
        tokens = torch.cat([self._image_tokens(imgs[0]) for imgs in images])
        return PromptEmbeds({**text.tensors, "image_tokens": tokens}, text.shared)

    def _image_tokens(self, image) -> torch.Tensor:
        """(1, h·w, D_v) float32: the pipeline's CRF round trip, preprocessing, VAE mode and normalisation of one
        PIL image, packed (``__call__`` and ``prepare_latents``; the functions read from the pipeline's module)."""
        import importlib

        import numpy as np
        import PIL.Image

        mod = importlib.import_module(_PIPELINE_MODULE)
        pipe, vae = self.pipe, self.pipe.vae
        crf = self.image_crf if self.image_crf is not None else mod.resolve_default_image_crf(pipe.text_encoder)
        if crf != 0:
            try:
                image = PIL.Image.fromarray(mod.apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
            except ImportError as err:
                raise ImportError(f"LTX-2 image-to-video re-compresses the conditioning image at H.264 CRF {crf} "
                                  f"as its pipeline does, which needs PyAV: pip install 'flowgrpo[video]' "
                                  f"({err})") from None
        pixels = pipe.video_processor.preprocess(image, height=self.height, width=self.width)
        pixels = pixels.to(device=self.device, dtype=vae.dtype)
        z = vae.encode(pixels[0].unsqueeze(0).unsqueeze(2)).latent_dist.mode()  # retrieve_latents(…, "argmax")
        z = pipe._normalize_latents(z.to(torch.float32), vae.latents_mean, vae.latents_std)
        return pipe._pack_latents(z, 1, 1).float()

    # ------------------------------------------------------------------ velocity and decoding
    def _video(self, generated: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """The packed video tokens (B, S_v, D_v) float32: the rows' clean frame 0, then the generated tokens."""
        return torch.cat([embeds["image_tokens"].to(generated.device, torch.float32), generated], dim=1)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N) float32 guided velocity of the generated video tokens and the audio at (latents, σ): every
        transformer call sees the rows' frame 0 in front of the generated tokens, at video timestep 0 there (module
        docstring); frame 0's own velocity is dropped, as ``scheduler.step`` skips it in the pipeline.

        Args:
            latents: (B, N) state, any float dtype. sigma: (B,) or scalar σ in (0, 1].
            embeds: B rows of :meth:`encode_prompts` output. guidance_scale: the video CFG scale.
        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        sigma = self.batch_sigma(latents, sigma, embeds)
        generated, audio = self._unflatten(latents)
        video = self._video(generated, embeds)
        out_v, out_a = self._guided(video, audio, sigma, embeds, guidance_scale,
                                    video_t_scale=self.video_t_scale.to(video.device))
        return torch.cat([out_v[:, self.image_token_count:].flatten(1), out_a.flatten(1)], dim=1)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, embeds: PromptEmbeds | None = None) -> torch.Tensor:
        """(B, F, 3, H, W) float32 in [0, 1] from (B, N) clean latents and their rows' embeddings: frame 0 put back
        in front of the generated tokens, then decoded as :meth:`LTX2Adapter.decode` (the audio is not decoded).

        Raises:
            ValueError: no embeddings, or embeddings of another batch size.
        """
        if embeds is None or len(embeds) != latents.shape[0]:
            raise ValueError(f"LTX-2 image-to-video decodes with its rows' embeddings (the conditioning frame): got "
                             f"{'none' if embeds is None else len(embeds)} for {latents.shape[0]} latents")
        return self._decode_video(self._video(self._unflatten(latents)[0], embeds))


def load_ltx2_i2v_adapter(path: str, **options) -> LTX2I2VAdapter:
    """``LTX2ImageToVideoPipeline.from_pretrained(path)`` wrapped in an :class:`LTX2I2VAdapter` (``options``:
    those of :func:`~flowgrpo.models.ltx2.load_ltx2_pipeline`)."""
    from diffusers import LTX2ImageToVideoPipeline

    return load_ltx2_pipeline(LTX2ImageToVideoPipeline, LTX2I2VAdapter, path, **options)


def build_tiny_ltx2_i2v(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (),
                        sample_size: int = 32, transformer_kwargs: dict | None = None) -> Path:
    """The tiny ``LTX2ImageToVideoPipeline`` (:func:`~flowgrpo.models.ltx2.build_tiny_ltx2` with
    ``image_to_video``)."""
    return build_tiny_ltx2(out_dir, seed, words=words, sample_size=sample_size,
                           transformer_kwargs=transformer_kwargs, image_to_video=True)


def main(argv: list[str] | None = None) -> None:
    from flowgrpo.models.tiny import builder_main

    builder_main(lambda out, words, seed: build_tiny_ltx2_i2v(out, seed, words=words), "LTX-2 I2V", __doc__, argv)


if __name__ == "__main__":
    main()
