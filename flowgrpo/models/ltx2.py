"""The LTX-2 text-to-video adapter: a diffusers ``LTX2Pipeline`` (Lightricks LTX-2, 19B, video and audio generated
together) behind the :class:`~flowgrpo.models.base.ModelAdapter` interface.

**The sampled state is the joint (video, audio) latents.** ``LTX2VideoTransformer3DModel`` denoises the video and
the audio tokens in one forward with cross-attention between the streams, so the video velocity depends on the
audio latents of the same step. Each row of the state is ``[video ‖ audio]`` flattened, (B, S_v·D_v + S_a·D_a):
the packed video latents (B, S_v, D_v) of ``LTX2Pipeline._pack_latents`` and the packed, normalised audio latents
(B, S_a, D_a) of ``_pack_audio_latents``, both as ``__call__`` keeps them. The SDE step is Gaussian per element,
so its log-prob over the joint state is exact; both streams are noised and scored. Only the video is decoded and
rewarded; the audio is sampled (it conditions the video) but not decoded.

What ``LTX2Pipeline.__call__`` (diffusers 0.42) does, and this adapter with it:

* Gemma 3: every hidden state (embeddings + each layer) stacked and flattened, left padding to
  ``max_sequence_length`` (``_get_gemma_prompt_embeds``); the negative prompt is ``""``; the text connectors
  (``pipe.connectors``) run once on ``[negative ‖ positive]`` and give the video and audio text streams and a mask;
* noise: per generator, the video latents (B, C, F', h, w) then the audio latents (B, C_a, L, M) by
  ``randn_tensor`` (``prepare_latents``, ``prepare_audio_latents`` with ``noise_scale`` 0), packed;
* σ grid: ``linspace(1, 1/T, T)`` with the dynamic shift ``mu = calculate_shift(S_v, …)`` of the packed video
  token count, on the pipeline's scheduler (the audio scheduler is a copy with the same grid);
* each step: one transformer call on the doubled batch [uncond ‖ cond] with timestep and ``sigma`` = σ·1000, the
  pipeline's video and audio coordinates at ``frame_rate`` (24) × ``motion_speed`` (1); every output converted to
  x₀ = x − σ·v; CFG as a delta ``(s − 1)(x₀_c − x₀_u)`` (video scale ``guidance_scale``, audio scale
  ``audio_guidance_scale``); spatio-temporal guidance (STG: a forward of the positive rows with the
  ``spatio_temporal_guidance_blocks`` perturbed, delta ``stg·(x₀_c − x₀_stg)``); modality-isolation guidance (a
  forward with the audio↔video cross-attention off, delta ``(m − 1)(x₀_c − x₀_iso)``); the sum
  ``x₀_c + cfg + stg + mod`` rescaled towards the conditional's per-sample std by ``guidance_rescale``
  (``rescale_noise_cfg``); back to a velocity ``(x − x₀)/σ``. All in float32, in the pipeline's order.
  The guidance settings other than the video scale are an :class:`LTX2Guidance` (default: ``__call__``'s);
* decoding: the video latents unpacked, un-normalised (``latents·std/scaling + mean``), decoded by the LTX-2 VAE.
  A timestep-conditioned VAE (``timestep_conditioning``) gets ``decode_timestep`` with its decode noise **off**
  (``decode_noise_scale = 0``: the pipeline would mix in fresh noise drawn from the sampling generators, which a
  decoder of clean latents does not have); with noise 0 the result equals ``__call__(decode_noise_scale=0.0)``.

Not supported: ``noise_scale`` > 0, given latents, prompt enhancement, the duration head (``num_frames`` is always
given), LTX-2.3's per-modality projections are taken as the connectors compute them.

Image-to-video (``LTX2ImageToVideoPipeline``, the image as a clean latent frame 0 kept out of the state) is
:mod:`flowgrpo.models.ltx2_i2v`, built on this adapter's ``_guided`` and ``_decode_video``.

    python -m flowgrpo.models.ltx2 OUT_DIR   # a tiny random pipeline
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from flowgrpo.models.base import AdapterBase, PromptEmbeds, scheduler_sigmas
from flowgrpo.models.empty import empty_components

logger = logging.getLogger(__name__)

__all__ = ["LTX2Adapter", "LTX2Guidance", "load_ltx2_adapter", "build_tiny_ltx2", "DEFAULT_GUIDANCE"]


@dataclass(frozen=True)
class LTX2Guidance:
    """The guidance of ``LTX2Pipeline.__call__`` besides the video CFG scale (the sampler's ``guidance_scale``).

    Attributes: ``audio_guidance_scale`` (audio CFG; the pipeline's ``audio_guidance_scale or guidance_scale``),
    ``stg_scale`` / ``audio_stg_scale`` (spatio-temporal guidance; > 0 adds a forward), ``modality_scale`` /
    ``audio_modality_scale`` (modality isolation; > 1 adds a forward), ``guidance_rescale`` /
    ``audio_guidance_rescale`` (``rescale_noise_cfg``'s φ), ``stg_blocks`` (transformer block indices STG
    perturbs), ``frame_rate`` (frames per second: the RoPE coordinates and the audio length), ``decode_timestep``.
    """

    audio_guidance_scale: float = 7.0
    stg_scale: float = 1.0
    audio_stg_scale: float = 1.0
    modality_scale: float = 3.0
    audio_modality_scale: float = 3.0
    guidance_rescale: float = 0.7
    audio_guidance_rescale: float = 0.7
    stg_blocks: tuple[int, ...] = (28,)
    frame_rate: float = 24.0
    decode_timestep: float = 0.0

    def call_kwargs(self) -> dict:
        """The ``LTX2Pipeline.__call__`` keywords of these settings (with the decode noise off)."""
        return {"audio_guidance_scale": self.audio_guidance_scale, "stg_scale": self.stg_scale,
                "audio_stg_scale": self.audio_stg_scale, "modality_scale": self.modality_scale,
                "audio_modality_scale": self.audio_modality_scale, "guidance_rescale": self.guidance_rescale,
                "audio_guidance_rescale": self.audio_guidance_rescale,
                "spatio_temporal_guidance_blocks": list(self.stg_blocks), "frame_rate": self.frame_rate,
                "decode_timestep": self.decode_timestep, "decode_noise_scale": 0.0}


def _pipeline_defaults() -> LTX2Guidance:
    """:class:`LTX2Guidance` of ``LTX2Pipeline.__call__``'s own defaults (read from its signature)."""
    from diffusers import LTX2Pipeline

    p = inspect.signature(LTX2Pipeline.__call__).parameters
    d = {k: p[k].default for k in ("audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale",
                                   "audio_modality_scale", "guidance_rescale", "audio_guidance_rescale",
                                   "frame_rate", "decode_timestep")}
    return LTX2Guidance(**d, stg_blocks=tuple(p["spatio_temporal_guidance_blocks"].default or ()))


#: the guidance the adapter applies (``LTX2Pipeline.__call__``'s defaults; the conformance case scales the STG
#: block down to its two-block model)
DEFAULT_GUIDANCE: LTX2Guidance | None = None


class LTX2Adapter(AdapterBase):
    """Adapter for a loaded ``diffusers.LTX2Pipeline`` (module docstring).

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA).
        height, width: frame size in pixels, positive multiples of the VAE's spatial compression (32 for LTX-2).
        num_frames: F, 1 + a multiple of the VAE's temporal compression (8 for LTX-2), e.g. 121.
        max_sequence_length: Gemma tokens per prompt (the pipeline's default 1024).
        guidance: the guidance besides the video scale (None: :data:`DEFAULT_GUIDANCE`, else the pipeline's
            defaults).

    Raises:
        ValueError: a size or frame count the VAE cannot take, an STG block the transformer does not have, a
            scheduler without the dynamic shift, or a text length out of range.
    """

    video = True
    shard_blocks = ("LTX2VideoTransformerBlock",)  # the transformer declares no _no_split_modules

    def __init__(self, pipe, *, height: int, width: int, num_frames: int, max_sequence_length: int = 1024,
                 guidance: LTX2Guidance | None = None) -> None:
        s, k = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        self.check_image_size("LTX-2 frame size", height, width, s * p)
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"LTX-2 num_frames must be 1 + a multiple of {k} (e.g. 121), got {num_frames}")
        self.check_sequence_length("LTX-2", max_sequence_length, pipe.tokenizer_max_length)
        guidance = guidance or DEFAULT_GUIDANCE or _pipeline_defaults()
        layers = pipe.transformer.config.num_layers
        if (guidance.stg_scale > 0 or guidance.audio_stg_scale > 0) and any(
                not 0 <= b < layers for b in guidance.stg_blocks):
            raise ValueError(f"LTX-2 spatio-temporal guidance blocks {list(guidance.stg_blocks)} are not all blocks "
                             f"of this transformer (0..{layers - 1})")
        if not pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError("LTX-2 scheduler must have use_dynamic_shifting (the pipeline passes mu)")
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.num_frames = num_frames
        self.guidance = guidance
        self.grid = ((num_frames - 1) // k + 1, height // s, width // s)  # latent (F', h, w)
        f, h, w = self.grid
        self.video_tokens = (f // pt) * (h // p) * (w // p)
        self.video_dim = pipe.transformer.config.in_channels
        from diffusers.pipelines.ltx2.pipeline_ltx2 import get_conditioning_frame_rate

        self.fps = get_conditioning_frame_rate(guidance.frame_rate, 1.0)
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        self.audio_frames = round(num_frames / guidance.frame_rate * per_second)
        self.mel_bins = pipe.audio_vae.config.mel_bins
        self.audio_shape = (pipe.audio_vae.config.latent_channels, self.audio_frames,
                            self.mel_bins // pipe.audio_vae_mel_compression_ratio)
        self.audio_dim = self.audio_shape[0] * self.audio_shape[2]
        self.split = self.video_tokens * self.video_dim
        self.latent_shape = (self.split + self.audio_frames * self.audio_dim,)

    # ------------------------------------------------------------------ state layout
    def _unflatten(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) state → packed video (B, S_v, D_v) and audio (B, S_a, D_a), contiguous, float32."""
        b = latents.shape[0]
        video = latents[:, : self.split].reshape(b, self.video_tokens, self.video_dim).float().contiguous()
        audio = latents[:, self.split:].reshape(b, self.audio_frames, self.audio_dim).float().contiguous()
        return video, audio

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N) float32 joint noise: per generator the video then the audio draw, as ``prepare_latents`` and
        ``prepare_audio_latents`` draw them, packed and flattened (module docstring).

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        pipe = self.pipe
        f, h, w = self.grid
        video = self.normal_noise((batch_size, self.video_dim // (pipe.transformer_temporal_patch_size
                                                                   * pipe.transformer_spatial_patch_size ** 2),
                                   f, h, w), generator)
        audio = self.normal_noise((batch_size, *self.audio_shape), generator)
        video = pipe._pack_latents(video, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        audio = pipe._pack_audio_latents(audio)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1).contiguous()

    # ------------------------------------------------------------------ text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """The connectors' video and audio text streams of B prompts, ``video_text`` (B, L, D), ``audio_text``
        (B, L, D_a), ``text_mask`` (B, L), and of the empty negative prompt (shared, first dim 1), computed on
        ``[negative ‖ positive]`` as ``__call__`` does. No gradient.

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        pipe = self.pipe
        self.truncation("Gemma", pipe.tokenizer, prompts, self.max_sequence_length)
        pos, pos_mask, neg, neg_mask = pipe.encode_prompt(
            prompt=prompts, negative_prompt=None, do_classifier_free_guidance=True, num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length, device=self.device)
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, mask = pipe.connectors(torch.cat([neg, pos]), torch.cat([neg_mask, pos_mask]),
                                             padding_side=side)
        b = len(prompts)
        return PromptEmbeds({"video_text": video[b:], "audio_text": audio[b:], "text_mask": mask[b:]},
                            {"neg_video_text": video[:1], "neg_audio_text": audio[:1], "neg_text_mask": mask[:1]})

    # ------------------------------------------------------------------ velocity
    def _forward(self, video, audio, t, vtext, atext, mask, *, stg: bool = False, isolate: bool = False,
                 video_t: torch.Tensor | None = None):
        """One transformer call → (video, audio) velocities, float32. ``video_t``: a per-token (B, S_v) video
        timestep (image-to-video: 0 on the conditioning frame), the audio's then ``t``; None: ``t`` for both."""
        f, h, w = self.grid
        b = video.shape[0]
        tr = self.transformer
        vcoords = tr.rope.prepare_video_coords(b, f, h, w, video.device, fps=self.fps)
        acoords = tr.audio_rope.prepare_audio_coords(b, self.audio_frames, video.device)
        timesteps = {"timestep": t} if video_t is None else {"timestep": video_t, "audio_timestep": t}
        with self.attention():
            v, a = self.forward_module(
                hidden_states=video.to(self.dtype), audio_hidden_states=audio.to(self.dtype),
                encoder_hidden_states=vtext.to(self.dtype), audio_encoder_hidden_states=atext.to(self.dtype),
                **timesteps, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                num_frames=f, height=h, width=w, fps=self.fps, audio_num_frames=self.audio_frames,
                video_coords=vcoords, audio_coords=acoords, isolate_modalities=isolate,
                spatio_temporal_guidance_blocks=list(self.guidance.stg_blocks) if stg else None,
                perturbation_mask=None, use_cross_timestep=True, return_dict=False)
        return v.float(), a.float()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N) float32 guided joint velocity at (latents, σ) (module docstring: x₀-space CFG, STG, modality
        isolation and rescale, as ``LTX2Pipeline.__call__``).

        Args:
            latents: (B, N) joint state, any float dtype. sigma: (B,) or scalar σ in (0, 1].
            embeds: B rows of :meth:`encode_prompts` output. guidance_scale: the video CFG scale.
        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        sigma = self.batch_sigma(latents, sigma, embeds)
        video, audio = self._unflatten(latents)
        out_v, out_a = self._guided(video, audio, sigma, embeds, guidance_scale)
        return torch.cat([out_v.flatten(1), out_a.flatten(1)], dim=1)

    def _guided(self, video, audio, sigma, embeds, guidance_scale, video_t_scale=None):
        """The guided (video (B, S_v, D_v), audio (B, S_a, D_a)) float32 velocities of the packed streams at σ
        (B,) (:meth:`velocity`). ``video_t_scale``: (1, S_v) float32 factor of the video timestep per token (the
        image-to-video pipeline's ``1 − conditioning_mask``), or None."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        g = self.guidance
        b = video.shape[0]
        t = sigma * self.pipe.scheduler.config.num_train_timesteps  # bitwise scheduler.timesteps
        vt = None if video_t_scale is None else t.unsqueeze(-1) * video_t_scale  # the pipeline's video_timestep
        s = sigma.view(b, 1, 1)
        audio_scale = g.audio_guidance_scale or guidance_scale
        cfg = guidance_scale > 1.0 or audio_scale > 1.0
        vtext, atext, mask = embeds["video_text"], embeds["audio_text"], embeds["text_mask"]
        if cfg:
            v, a = self._forward(
                torch.cat([video] * 2), torch.cat([audio] * 2), torch.cat([t] * 2),
                torch.cat([embeds["neg_video_text"].expand_as(vtext), vtext]),
                torch.cat([embeds["neg_audio_text"].expand_as(atext), atext]),
                torch.cat([embeds["neg_text_mask"].expand_as(mask), mask]),
                video_t=None if vt is None else torch.cat([vt] * 2))
            vu, vc = v.chunk(2)
            au, ac = a.chunk(2)
            xv, xvu = video - vc * s, video - vu * s
            xa, xau = audio - ac * s, audio - au * s
            v_cfg = (guidance_scale - 1) * (xv - xvu)
            a_cfg = (audio_scale - 1) * (xa - xau)
        else:
            vc, ac = self._forward(video, audio, t, vtext, atext, mask, video_t=vt)
            xv, xa = video - vc * s, audio - ac * s
            v_cfg = a_cfg = 0
        v_stg = a_stg = 0
        if g.stg_scale > 0.0 or g.audio_stg_scale > 0.0:
            vs, as_ = self._forward(video, audio, t, vtext, atext, mask, stg=True, video_t=vt)
            v_stg = g.stg_scale * (xv - (video - vs * s))
            a_stg = g.audio_stg_scale * (xa - (audio - as_ * s))
        v_mod = a_mod = 0
        if g.modality_scale > 1.0 or g.audio_modality_scale > 1.0:
            vm, am = self._forward(video, audio, t, vtext, atext, mask, isolate=True, video_t=vt)
            v_mod = (g.modality_scale - 1) * (xv - (video - vm * s))
            a_mod = (g.audio_modality_scale - 1) * (xa - (audio - am * s))
        xv_g = xv + v_cfg + v_stg + v_mod
        xa_g = xa + a_cfg + a_stg + a_mod
        if g.guidance_rescale > 0:
            xv_g = rescale_noise_cfg(xv_g, xv, guidance_rescale=g.guidance_rescale)
        if g.audio_guidance_rescale > 0:
            xa_g = rescale_noise_cfg(xa_g, xa, guidance_rescale=g.audio_guidance_rescale)
        return (video - xv_g) / s, (audio - xa_g) / s

    # ------------------------------------------------------------------ decoding and σ
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, F, 3, H, W) float32 in [0, 1] from (B, N) clean joint latents: the video part, as ``LTX2Pipeline``
        decodes it with ``decode_noise_scale=0`` (module docstring); the audio part is not decoded."""
        return self._decode_video(self._unflatten(latents)[0])

    def _decode_video(self, video: torch.Tensor) -> torch.Tensor:
        """(B, F, 3, H, W) float32 in [0, 1] from the packed clean video latents (B, S_v, D_v) (:meth:`decode`)."""
        pipe, vae = self.pipe, self.pipe.vae
        f, h, w = self.grid
        x = pipe._unpack_latents(video, f, h, w, pipe.transformer_spatial_patch_size,
                                 pipe.transformer_temporal_patch_size).to(self.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            b = x.shape[0]
            # the pipeline's (1 − 0)·x + 0·noise is x exactly: decode noise off
            timestep = torch.tensor([self.guidance.decode_timestep] * b, device=x.device, dtype=x.dtype)
        x = pipe._denormalize_latents(x, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        out = vae.decode(x.to(vae.dtype), timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(out, output_type="pt").float()

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid of ``LTX2Pipeline.__call__``: ``linspace(1, 1/T, T)`` shifted with
        ``mu = calculate_shift(S_v, …)`` (S_v the packed video tokens, the pipeline's defaults 1024, 4096, 0.95,
        2.05 unless the scheduler config names them), then a terminal 0.

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        cfg = self.pipe.scheduler.config
        mu = calculate_shift(self.video_tokens, cfg.get("base_image_seq_len", 1024), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.95), cfg.get("max_shift", 2.05))
        return scheduler_sigmas(self.pipe.scheduler, num_steps, mu=mu)


def load_ltx2_adapter(path: str, **options) -> LTX2Adapter:
    """``LTX2Pipeline.from_pretrained(path)`` wrapped in an :class:`LTX2Adapter` (``options``: those of
    :func:`load_ltx2_pipeline`)."""
    from diffusers import LTX2Pipeline

    return load_ltx2_pipeline(LTX2Pipeline, LTX2Adapter, path, **options)


def load_ltx2_pipeline(pipeline_class, adapter_class, path: str, *, dtype: torch.dtype, height: int | None,
                       width: int | None, max_sequence_length: int, num_frames: int | None = None,
                       guidance_scale_2: float | None = None, trained_expert: str = "transformer",
                       empty_transformer: bool = False):
    """``pipeline_class.from_pretrained(path)`` (``LTX2Pipeline`` or ``LTX2ImageToVideoPipeline``) in ``dtype``,
    wrapped in ``adapter_class`` (:class:`LTX2Adapter` or its image-to-video subclass). Defaults: the pipeline's
    512 x 768 and 121 frames (and, image-to-video, its image CRF). ``empty_transformer``: leave the transformer's
    weights on the meta device.

    Raises:
        ValueError: as ``adapter_class``; ``guidance_scale_2`` or ``trained_expert`` other than ``"transformer"``
            (LTX-2 has one transformer).
    """
    if guidance_scale_2 is not None or trained_expert != "transformer":
        raise ValueError("LTX-2 has one transformer: model.guidance_scale_2 and model.trained_expert do not apply")
    pipe = pipeline_class.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    return adapter_class(pipe, height=height or 512, width=width or 768, num_frames=num_frames or 121,
                         max_sequence_length=max_sequence_length)


# ---------------------------------------------------------------------------------------------- tiny builder
def build_gemma_tokenizer(words: Iterable[str] = (), model_max_length: int = 32):
    """A small ``GemmaTokenizer`` (byte-pair merges): the special tokens, every lowercase letter and ``▁``, and
    the merges that build one ``▁word`` piece for each of ``words`` (a word of the list is one token)."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for c in "abcdefghijklmnopqrstuvwxyz▁":
        vocab.setdefault(c, len(vocab))
    merges = []
    for w in sorted({w.lower() for w in words if w.isalpha() and w.isascii()}):
        piece = "▁"
        for c in w:
            if piece + c not in vocab:
                merges.append((piece, c))
                vocab[piece + c] = len(vocab)
            piece += c
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.model_max_length = model_max_length
    return tok


def build_tiny_ltx2(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (), sample_size: int = 32,
                    transformer_kwargs: dict | None = None, image_to_video: bool = False) -> Path:
    """Build a random tiny ``LTX2Pipeline`` of the real classes and ``save_pretrained`` it (``image_to_video``: an
    ``LTX2ImageToVideoPipeline`` of the same components, as the released folder serves both).

    Gemma 3 (``Gemma3ForConditionalGeneration``, 2 layers of width 16, a 1-layer SigLIP), ``LTX2TextConnectors``
    (1 layer per stream, 8 registers), ``LTX2VideoTransformer3DModel`` (2 blocks, video width 16, audio width 8,
    8 latent channels each), ``AutoencoderKLLTX2Video`` (8 latent channels, spatial and temporal compression 8,
    timestep-conditioned decoder, non-trivial ``latents_mean``/``latents_std``), ``AutoencoderKLLTX2Audio`` (2
    latent channels, 16 mel bins), ``LTX2Vocoder``, ``FlowMatchEulerDiscreteScheduler`` with the dynamic shift.
    ``sample_size`` is only checked.

    Raises:
        ValueError: a ``sample_size`` that is not a positive multiple of 8.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline, LTX2VideoTransformer3DModel

    if sample_size <= 0 or sample_size % 8:
        raise ValueError(f"tiny LTX-2 sample_size must be a positive multiple of 8, got {sample_size}")
    tok, text, connectors = _tiny_text_encoder(words, seed)
    torch.manual_seed(seed + 2)
    kwargs = {"in_channels": 8, "out_channels": 8, "num_attention_heads": 2, "attention_head_dim": 8,
              "cross_attention_dim": 16, "audio_in_channels": 8, "audio_out_channels": 8,
              "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
              "num_layers": 2, "caption_channels": 16, **(transformer_kwargs or {})}
    transformer = LTX2VideoTransformer3DModel(**kwargs)
    vae, audio_vae, vocoder = _tiny_autoencoders(seed + 3)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    cls = LTX2Pipeline
    if image_to_video:
        from diffusers import LTX2ImageToVideoPipeline as cls
    pipe = cls(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text, tokenizer=tok,
               connectors=connectors, transformer=transformer, vocoder=vocoder)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


def _tiny_text_encoder(words: Iterable[str], seed: int):
    """(tokenizer, Gemma 3 encoder, text connectors) of :func:`build_tiny_ltx2`, seeded with ``seed`` and
    ``seed + 1``."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tok = build_gemma_tokenizer(words, model_max_length=32)
    torch.manual_seed(seed)
    text = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     max_position_embeddings=64, sliding_window=16, pad_token_id=0, eos_token_id=1,
                                     bos_token_id=2),
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=16, patch_size=4),
        mm_tokens_per_image=4)).eval()
    torch.manual_seed(seed + 1)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=8, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8, connector_rope_base_seq_len=32)
    return tok, text, connectors


def _tiny_autoencoders(seed: int):
    """(video VAE, audio VAE, vocoder) of :func:`build_tiny_ltx2`, seeded with ``seed`` (the video VAE),
    ``seed + 1`` (its latent mean and std) and ``seed + 2`` (the audio VAE, then the vocoder)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), timestep_conditioning=True,
        patch_size=1, patch_size_t=1, spatial_compression_ratio=8, temporal_compression_ratio=8)
    g = torch.Generator().manual_seed(seed + 1)
    vae.latents_mean.copy_(0.1 * torch.randn(vae.latents_mean.shape, generator=g))
    vae.latents_std.copy_(1.0 + 0.2 * torch.rand(vae.latents_std.shape, generator=g))
    torch.manual_seed(seed + 2)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, output_channels=2, ch_mult=(1, 2), num_res_blocks=1,
                                       latent_channels=2, mel_bins=16, resolution=16)
    vocoder = LTX2Vocoder(in_channels=32, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=16000)
    return vae, audio_vae, vocoder


def main(argv: list[str] | None = None) -> None:
    from flowgrpo.models.tiny import builder_main

    builder_main(lambda out, words, seed: build_tiny_ltx2(out, seed, words=words), "LTX-2", __doc__, argv)


if __name__ == "__main__":
    main()
