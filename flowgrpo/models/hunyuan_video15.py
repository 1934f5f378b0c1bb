"""The HunyuanVideo-1.5 adapter: a diffusers ``HunyuanVideo15Pipeline`` (text-to-video) behind the
:class:`~flowgrpo.models.base.ModelAdapter` interface.

What ``HunyuanVideo15Pipeline.__call__`` does, and this adapter with it:

* two text encoders through the pipeline's own ``encode_prompt``: Qwen2.5-VL's text model on the chat template
  with the pipeline's video system message (1000 tokens after the first 108 are cropped, the third-to-last hidden
  state) and ByT5 on the quoted glyph text of the prompt (zeros when it has none); the negative prompt is ``""``
  (read as ``" "`` by the template), as ``negative_prompt=None``;
* latents (B, C, F', h, w) in the transformer's layout, F' = (F − 1)/4 + 1, 16× spatial compression, drawn by
  ``randn_tensor`` as ``prepare_latents``; the transformer's input is ``[x, 0, 0]`` (text-to-video has no
  condition latents and a zero mask: ``prepare_cond_latents_and_mask``) and zero ``image_embeds`` (729 tokens);
* the timestep ``t = σ·1000`` (``scheduler.timesteps``), cast to the latents' dtype;
* the σ grid ``numpy.linspace(1, 0, T + 1)[:-1]`` through the scheduler's static shift;
* guidance through the pipeline's ``ClassifierFreeGuidance`` guider: ``v = v_u + s·(v_c − v_u)`` (Ho & Salimans,
  arXiv 2207.12598, eq. 6) as two separate forwards (cond, then uncond) unless s ≈ 1. The adapter takes s from
  ``sampling.guidance_scale`` (the guider's own default is the pipeline's); a guider with rescaling, the
  original formulation or a step range is refused;
* decoding: ``x / scaling_factor``, the VAE, ``postprocess_video`` to (B, F, 3, H, W) in [0, 1].

``HunyuanVideo15Pipeline.__call__`` draws its initial noise in the transformer's dtype; the adapter draws it in
float32 (the same values in float32; in bfloat16 the pipeline's noise is a different draw).

    python -m flowgrpo.models.hunyuan_video15 OUT_DIR    # a tiny random pipeline
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from flowgrpo.models.base import AdapterBase, PromptEmbeds, one_image_per_prompt
from flowgrpo.models.empty import empty_components

logger = logging.getLogger(__name__)

__all__ = ["HunyuanVideo15Adapter", "load_hunyuan_video15_adapter", "build_tiny_hunyuan_video15"]


class HunyuanVideo15Adapter(AdapterBase):
    """Adapter for a loaded ``diffusers.HunyuanVideo15Pipeline`` (module docstring).

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA).
        height, width: frame size in pixels, positive multiples of 16 (the VAE's spatial compression).
        num_frames: F, 1 + a multiple of 4.

    Raises:
        ValueError: a size or frame count the pipeline cannot take, or a guider this adapter does not reproduce.
    """

    video = True

    def __init__(self, pipe, *, height: int, width: int, num_frames: int) -> None:
        from diffusers import ClassifierFreeGuidance

        g = pipe.guider
        if not isinstance(g, ClassifierFreeGuidance) or g.guidance_rescale or g.use_original_formulation or (
                g._start, g._stop) != (0.0, 1.0) or not g._enabled:
            raise ValueError("the HunyuanVideo-1.5 adapter reproduces the plain ClassifierFreeGuidance guider over "
                             f"every step (no rescale, no original formulation); got {g}")
        self.check_image_size("HunyuanVideo-1.5 frame size", height, width, pipe.vae_scale_factor_spatial)
        k = pipe.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"HunyuanVideo-1.5 num_frames must be 1 + a multiple of {k} (e.g. 5, 121), got "
                             f"{num_frames}")
        super().__init__(pipe, height=height, width=width, max_sequence_length=pipe.tokenizer_max_length)
        self.num_frames = num_frames
        # one sample's latents (C, F', h, w): the initial noise is drawn in this shape, as prepare_latents
        self.latent_shape = (pipe.num_channels_latents, (num_frames - 1) // k + 1,
                             height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)
        self.num_train_timesteps = pipe.scheduler.config.num_train_timesteps

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """``HunyuanVideo15Pipeline.encode_prompt`` of B prompts and of the empty negative prompt: batched
        ``prompt_embeds`` (B, 1000, D), ``prompt_embeds_mask`` (B, 1000), ``prompt_embeds_2`` (B, 256, D₂) and
        ``prompt_embeds_mask_2`` (B, 256); the negative four shared, one row each (``negative_…``), in the
        transformer's dtype (masks too, as the pipeline casts them).

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        self.truncation("Qwen2.5-VL", self.pipe.tokenizer, prompts, self.pipe.tokenizer_max_length)
        names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        pos = self.pipe.encode_prompt(prompt=prompts, device=self.device, dtype=self.dtype, batch_size=len(prompts))
        neg = self.pipe.encode_prompt(prompt=None, device=self.device, dtype=self.dtype, batch_size=1)
        return PromptEmbeds(dict(zip(names, pos, strict=True)),
                            {f"negative_{n}": t for n, t in zip(names, neg, strict=True)})

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, C, F', h, w) float32 guided velocity at (latents, σ) (module docstring); the guidance combination
        is in float32.

        Args:
            latents: (B, C, F', h, w) any float dtype. sigma: (B,) or scalar σ in (0, 1].
            embeds: B rows of :meth:`encode_prompts` output.
        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        b = latents.shape[0]
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = sigma * self.num_train_timesteps  # (B,) float32, bitwise the pipeline's scheduler.timesteps
        condition, image = self._condition(latents, embeds)
        x = torch.cat([latents.to(self.dtype), condition], dim=1)  # [latents, cond latents, mask]
        cond = self._forward(x, t, image, *(embeds[n] for n in _NAMES))
        if math.isclose(guidance_scale, 1.0):  # the guider's _is_cfg_enabled
            return cond
        uncond = self._forward(x, t, image, *(embeds[f"negative_{n}"].expand(b, *embeds[f"negative_{n}"].shape[1:])
                                               for n in _NAMES))
        return uncond + guidance_scale * (cond - uncond)

    def _condition(self, latents: torch.Tensor, embeds: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's condition channels (B, C + 1, F', h, w) (cond latents, mask) and ``image_embeds``
        (B, N, D_img), in the transformer's dtype: text-to-video's are zeros (``prepare_cond_latents_and_mask``; 729
        zero image tokens), the image-to-video adapter's its image's (:class:`HunyuanVideo15I2VAdapter`)."""
        b = latents.shape[0]
        zeros = torch.zeros((b, latents.shape[1] + 1, *latents.shape[2:]), dtype=self.dtype, device=latents.device)
        image = torch.zeros((b, self.pipe.vision_num_semantic_tokens, self.pipe.vision_states_dim), dtype=self.dtype,
                            device=latents.device)
        return zeros, image

    def _forward(self, x, t, image, text, text_mask, glyph, glyph_mask) -> torch.Tensor:
        with self.attention():
            out = self.forward_module(hidden_states=x, image_embeds=image, timestep=t.to(x.dtype),
                                      encoder_hidden_states=text, encoder_attention_mask=text_mask,
                                      encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
                                      return_dict=False)[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, F, 3, H, W) float32 in [0, 1] from clean latents, as the pipeline decodes, one video at a time:
        the VAE's mid-block attention in diffusers 0.42 broadcasts its causal mask (B, L, L) against (B, 1, L, L)
        queries, which fails for B > 1 (the pipeline itself decodes only one video per call)."""
        vae = self.pipe.vae
        x = latents.to(vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae.decode(x[i : i + 1], return_dict=False)[0] for i in range(x.shape[0])])
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid of ``set_timesteps(sigmas=linspace(1, 0, T + 1)[:-1])`` (``__call__``'s): the
        scheduler's static shift ``s·σ/(1 + (s − 1)·σ)`` (Esser et al., arXiv 2403.03206), then a terminal 0.

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        self.check_num_steps(num_steps)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
        return scheduler.sigmas.float().cpu()


_NAMES = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


def load_hunyuan_video15_adapter(path: str, **options) -> HunyuanVideo15Adapter:
    """``HunyuanVideo15Pipeline.from_pretrained(path)`` in a :class:`HunyuanVideo15Adapter` (``options``: those of
    :func:`load_hunyuan_video15_pipeline`)."""
    from diffusers import HunyuanVideo15Pipeline

    return load_hunyuan_video15_pipeline(HunyuanVideo15Pipeline, HunyuanVideo15Adapter, path, **options)


def load_hunyuan_video15_pipeline(pipeline_class, adapter_class, path: str, *, dtype: torch.dtype,
                                  height: int | None, width: int | None, max_sequence_length: int,
                                  num_frames: int | None = None, guidance_scale_2: float | None = None,
                                  trained_expert: str = "transformer", empty_transformer: bool = False):
    """``pipeline_class.from_pretrained(path)`` (``HunyuanVideo15Pipeline`` or
    ``HunyuanVideo15ImageToVideoPipeline``) in ``dtype``, wrapped in ``adapter_class``; the default size is the
    pipeline's 16:9 bucket at its ``target_size``, 121 frames. The text length is the pipeline's (1000 tokens),
    whatever ``max_sequence_length`` says. ``empty_transformer``: leave the transformer's weights on the meta
    device.

    Raises:
        ValueError: ``guidance_scale_2`` or ``trained_expert`` (Wan2.2 settings) given, or as ``adapter_class``
            (the image-to-video one refuses a step-distilled model).
    """
    if guidance_scale_2 is not None or trained_expert != "transformer":
        raise ValueError("model.guidance_scale_2 and model.trained_expert are Wan2.2 settings; HunyuanVideo-1.5 has "
                         "one transformer")
    pipe = pipeline_class.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, [trained_expert] if empty_transformer else [], dtype))
    if height is None or width is None:
        h, w = pipe.video_processor.calculate_default_height_width(9, 16, pipe.target_size)
        height, width = height or h, width or w
    return adapter_class(pipe, height=height, width=width, num_frames=num_frames or 121)


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    """Adapter for a loaded ``diffusers.HunyuanVideo15ImageToVideoPipeline``: the text-to-video adapter with each
    prompt record's image (its ``image`` field) as ``__call__`` (diffusers 0.42) uses it:

    * the image is resized and centre-cropped to the output size (``video_processor.resize(image, height, width,
      resize_mode="crop")``);
    * SigLIP's last hidden state of it (``encode_image``) is the transformer's ``image_embeds`` (729 tokens of 1152
      for the released model), conditional and unconditional forwards alike;
    * its VAE latents (posterior mode, times ``scaling_factor``) fill latent frame 0 of the condition channels,
      zeros elsewhere, and the mask channel is 1 on frame 0 (``prepare_cond_latents_and_mask``): the transformer
      sees ``[latents ‖ cond latents ‖ mask]``.

    **The image is a fixed input, not part of the sampled state**: the state (B, C, F', h, w) whose transitions are
    sampled and scored is the latents alone (frame 0 included: the model generates it, guided by the condition
    channels); the condition, mask and image embeddings are in :class:`PromptEmbeds`, encoded once per (prompt,
    image) without gradient, and get no noise.

    Difference from the pipeline: ``__call__`` takes no size; it picks the bucket of its ``target_size`` (480p:
    640) closest to the image's aspect ratio. The adapter uses the configured size (``model.height``,
    ``model.width``); give the bucket of your images' aspect ratio to match the pipeline (480p, 16:9: 480 x 848).

    Raises:
        ValueError: as :class:`HunyuanVideo15Adapter`, or a step-distilled (``use_meanflow``) transformer, whose
            forward takes the next step's timestep (a velocity that depends on the σ grid, not on (x, σ) alone).
    """

    image_conditioned = True

    def __init__(self, pipe, *, height: int, width: int, num_frames: int) -> None:
        if pipe.transformer.config.use_meanflow:
            raise ValueError("HunyuanVideo-1.5 with use_meanflow (the step-distilled checkpoints) takes the next "
                             "step's timestep in its forward; the adapter supports the undistilled transformer only")
        super().__init__(pipe, height=height, width=width, num_frames=num_frames)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list] | None = None) -> PromptEmbeds:
        """:meth:`HunyuanVideo15Adapter.encode_prompts` plus, per row, its image's ``cond_latents`` (B, C + 1, F', h,
        w) (condition latents and mask) and ``image_embeds`` (B, N, D_img) in the transformer's dtype.

        Args:
            prompts: B prompts. images: B lists holding one PIL image each.
        Raises:
            ValueError: no images, a count that differs from the prompts', or not exactly one image per prompt.
        """
        one_image_per_prompt(images, prompts, "HunyuanVideo-1.5")
        text = super().encode_prompts(prompts)
        pipe, conds, embeds = self.pipe, [], []
        zeros = torch.zeros((1, *self.latent_shape), dtype=self.dtype, device=self.device)
        for imgs in images:
            image = pipe.video_processor.resize(imgs[0], height=self.height, width=self.width, resize_mode="crop")
            embeds.append(pipe.encode_image(image=image, batch_size=1, device=self.device, dtype=self.dtype))
            cond, mask = pipe.prepare_cond_latents_and_mask(latents=zeros, image=image, batch_size=1,
                                                            height=self.height, width=self.width, dtype=self.dtype,
                                                            device=self.device)
            conds.append(torch.cat([cond, mask], dim=1))
        return PromptEmbeds({**text.tensors, "cond_latents": torch.cat(conds), "image_embeds": torch.cat(embeds)},
                            text.shared)

    def _condition(self, latents: torch.Tensor, embeds: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor]:
        return embeds["cond_latents"].to(self.dtype), embeds["image_embeds"].to(self.dtype)


def load_hunyuan_video15_i2v_adapter(path: str, **options) -> HunyuanVideo15I2VAdapter:
    """``HunyuanVideo15ImageToVideoPipeline.from_pretrained(path)`` in a :class:`HunyuanVideo15I2VAdapter`
    (``options``: those of :func:`load_hunyuan_video15_pipeline`)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    return load_hunyuan_video15_pipeline(HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15I2VAdapter, path,
                                         **options)


# ---------------------------------------------------------------------------------------------- tiny builder
def build_tiny_hunyuan_video15(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (),
                               sample_size: int = 32, transformer_kwargs: dict | None = None,
                               image_to_video: bool = False) -> Path:
    """Build a random tiny ``HunyuanVideo15Pipeline`` of the real classes and ``save_pretrained`` it.

    ``image_to_video``: a ``HunyuanVideo15ImageToVideoPipeline`` instead, with a 1-layer ``SiglipVisionModel`` of
    width 16 on 32² inputs (16 tokens) and its ``SiglipImageProcessor``, the transformer's ``task_type`` "i2v" and
    ``target_size`` 32 (the pipeline sizes its output from the image at that target: a square image → 32²).

    Qwen2.5-VL text model (2 layers of width 16, a byte-level BPE tokenizer trained on the system message and
    ``words``, Qwen2-VL's chat template), ByT5 (``T5EncoderModel`` of width 16, the byte tokenizer), a 1-layer
    ``HunyuanVideo15Transformer3DModel`` (2 heads of 16), a 4-channel ``AutoencoderKLHunyuanVideo15`` (16×
    spatial, 4× temporal), ``FlowMatchEulerDiscreteScheduler(shift=5.0)`` and ``ClassifierFreeGuidance(6.0)``.
    ``sample_size`` is only checked.

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny HunyuanVideo-1.5 sample_size must be a positive multiple of 16, got {sample_size}")
    tok, text, tok_2, glyph = _tiny_text_encoders(words, seed)
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4,
                                      scaling_factor=1.03682)
    torch.manual_seed(seed + 3)
    transformer = HunyuanVideo15Transformer3DModel(**{
        "in_channels": 9, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1,
        "num_refiner_layers": 1, "mlp_ratio": 2.0, "text_embed_dim": 16, "text_embed_2_dim": 16,
        "image_embed_dim": 16, "rope_axes_dim": (4, 6, 6), "target_size": 32 if image_to_video else 640,
        "task_type": "i2v" if image_to_video else "t2v", **(transformer_kwargs or {})})
    components = dict(text_encoder=text, tokenizer=tok, transformer=transformer, vae=vae,
                      scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0),
                      text_encoder_2=glyph, tokenizer_2=tok_2, guider=ClassifierFreeGuidance(guidance_scale=6.0))
    pipe = _tiny_i2v_pipeline(components, seed + 4) if image_to_video else HunyuanVideo15Pipeline(**components)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


def _tiny_text_encoders(words: Iterable[str], seed: int):
    """(Qwen tokenizer, Qwen2.5-VL text model, ByT5 tokenizer, ByT5 encoder) of the tiny HunyuanVideo-1.5
    pipelines (:func:`build_tiny_hunyuan_video15`), seeded with ``seed`` and ``seed + 1``."""
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from flowgrpo.models.qwenimage import build_qwen_tokenizer

    tok = build_qwen_tokenizer(["You are a helpful assistant. Describe the video by detailing the following "
                                "aspects: main content theme color shape size texture quantity text spatial "
                                "relationships objects actions events behaviors temporal physical movement changes "
                                "background environment light style atmosphere camera angles movements "
                                "transitions used in the video system user assistant", " ".join(words)])
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    tok.model_max_length = 2048
    torch.manual_seed(seed)
    text = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=2048,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})).eval()
    tok_2 = ByT5Tokenizer()
    torch.manual_seed(seed + 1)
    glyph = T5EncoderModel(T5Config(vocab_size=len(tok_2), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
    return tok, text, tok_2, glyph


def _tiny_i2v_pipeline(components: dict, seed: int):
    """A ``HunyuanVideo15ImageToVideoPipeline`` of ``components`` with a 1-layer ``SiglipVisionModel`` of width 16
    on 32² inputs (seeded with ``seed``) and its ``SiglipImageProcessor``."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=32, patch_size=8)).eval()
    return HunyuanVideo15ImageToVideoPipeline(
        image_encoder=siglip, feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}), **components)


def build_tiny_hunyuan_video15_i2v(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (),
                                   sample_size: int = 32, transformer_kwargs: dict | None = None) -> Path:
    """The tiny ``HunyuanVideo15ImageToVideoPipeline`` (:func:`build_tiny_hunyuan_video15` with
    ``image_to_video``)."""
    return build_tiny_hunyuan_video15(out_dir, seed, words=words, sample_size=sample_size,
                                      transformer_kwargs=transformer_kwargs, image_to_video=True)


#: Qwen2-VL / Qwen2.5-VL-Instruct's chat template (its chat_template.json).
_QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def main(argv: list[str] | None = None) -> None:
    from flowgrpo.models.tiny import builder_main

    builder_main(lambda out, words, seed: build_tiny_hunyuan_video15(out, seed, words=words), "HunyuanVideo-1.5",
                 __doc__, argv)


if __name__ == "__main__":
    main()
