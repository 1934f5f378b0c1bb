"""The Qwen-Image 2.1 adapter: diffusers ``QwenImage21Pipeline`` (text to image) behind the
:class:`~flowgrpo.models.base.ModelAdapter` interface.

Through the regular pipeline rather than its modular one (``QwenImage21ModularPipeline``): diffusers 0.42.1 ships
both, and the regular pipeline's ``__call__`` takes ``callback_on_step_end``, so the conformance suite compares every
step of the rollout with it unchanged, and its ``encode_prompt``, ``_pack_latents`` and ``_unpack_latents`` are the
pieces the adapter reuses, as the Qwen-Image adapter does. Everything Qwen-Image-2.1-specific, as
``QwenImage21Pipeline.__call__`` (diffusers 0.42.1) does it:

* the prompt through the pipeline's own ``encode_prompt``: a raw Qwen3-VL chat template (system line dropped),
  the last decoder layer's hidden states before the final norm, left-padded in the encoder, right-padded to the
  batch's longest prompt with a (B, L) mask (the transformer masks the padding); ``image_pad_mask`` (B, L) marks the
  encoder's image slots (none for text to image);
* latents unpatched: ``randn_tensor`` (B, 1, C, H/16, W/16) of the 64-channel 16× VAE, flattened to (B, N, C)
  tokens; the transformer's ``img_mask`` is ``image_pad_mask`` followed by one slot per 2×2 group of tokens;
* the timestep ``(σ·1000)/1000`` in the transformer's dtype (:func:`~flowgrpo.models.base.pipeline_timestep`);
* guidance: none by default (Qwen recommends 40 steps without guidance); for s > 1, true classifier-free guidance
  with the negative prompt (``" "``: the pipeline encodes an empty prompt as one space), ``v_u + s·(v_c − v_u)``,
  two transformer calls;
* the σ grid: the pipeline config's ``sample_sigmas`` when it has them (their length is the step count), else
  ``linspace(1, 1/T, T)``; ``mu = calculate_shift(N)`` through the scheduler's dynamic shift;
* the transformer recomputes the text tokens at every step (the pipeline's key/value cache of the text prefix,
  exact in exact arithmetic under ``causal_condition``, is a rollout-only speed-up the training forward could not
  share);
* decoding: ``x·std + mean`` per channel, VAE decode of the single frame; the VAE decodes RGBA, the adapter returns
  its RGB channels (the alpha channel is dropped: rewards score RGB images).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from flowgrpo.models.base import AdapterBase, PromptEmbeds, pipeline_timestep, scheduler_sigmas
from flowgrpo.models.empty import empty_components

__all__ = ["QwenImage21Adapter", "load_qwenimage21_adapter", "build_tiny_qwenimage21"]


class QwenImage21Adapter(AdapterBase):
    """Adapter for a loaded ``diffusers.QwenImage21Pipeline`` (module docstring).

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA adapter).
        height, width: image size in pixels, positive multiples of ``2·vae_scale_factor`` (32).
        negative_prompt: the unconditional prompt of true CFG (s > 1).
    Raises:
        ValueError: a size the pipeline would round (it rounds down to multiples of 32).
    """

    def __init__(self, pipe, *, height: int, width: int, negative_prompt: str = " ") -> None:
        self.check_image_size("Qwen-Image 2.1 size", height, width, pipe.vae_scale_factor * 2)
        super().__init__(pipe, height=height, width=width, max_sequence_length=None)
        self.negative_prompt = negative_prompt
        self.latent_h, self.latent_w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
        self.num_channels = pipe.transformer.config.in_channels
        self.num_tokens = self.latent_h * self.latent_w

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, pad = self.pipe.encode_prompt(prompts, device=self.device)
        if mask is None:  # the pipeline drops an all-ones mask; keep it explicit, velocity drops it again
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"embeds": embeds, "mask": mask, "pad": pad}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3-VL embeddings of B prompts, no gradient: batched ``prompt_embeds`` (B, L, D) (L: the batch's
        longest prompt), ``prompt_mask`` (B, L) long and ``image_pad_mask`` (B, L) bool; shared
        ``negative_prompt_embeds`` (1, L', D), ``negative_prompt_mask`` and ``negative_image_pad_mask`` (1, L').

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        pos, neg = self._encode(prompts), self._encode([self.negative_prompt])
        return PromptEmbeds(
            {"prompt_embeds": pos["embeds"], "prompt_mask": pos["mask"], "image_pad_mask": pos["pad"]},
            {"negative_prompt_embeds": neg["embeds"], "negative_prompt_mask": neg["mask"],
             "negative_image_pad_mask": neg["pad"]})

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N, C) float32 latents (contiguous), drawn as ``prepare_latents`` does: ``randn_tensor`` of
        (B, 1, C, h, w), flattened to tokens by the pipeline's ``_pack_latents``.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        noise = self.normal_noise((batch_size, 1, self.num_channels, self.latent_h, self.latent_w), generator)
        return type(self.pipe)._pack_latents(noise, batch_size, self.num_channels, self.latent_h,
                                             self.latent_w).contiguous()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N, C) float32 velocity at (latents, σ): the conditional prediction, and for s > 1 the true-CFG
        combination with the negative prompt's (module docstring).

        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        b = latents.shape[0]
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = pipeline_timestep(sigma, self.dtype)
        v_c = self._forward(latents, t, embeds["prompt_embeds"], embeds["prompt_mask"], embeds["image_pad_mask"])
        if guidance_scale <= 1:
            return v_c.float()
        neg = [embeds[k].expand(b, *embeds[k].shape[1:]).contiguous()
               for k in ("negative_prompt_embeds", "negative_prompt_mask", "negative_image_pad_mask")]
        v_u = self._forward(latents, t, *neg)
        return (v_u + guidance_scale * (v_c - v_u)).float()  # the pipeline's combination, in its dtype

    def _forward(self, latents, t, prompt_embeds, mask, pad) -> torch.Tensor:
        dtype, b = self.dtype, latents.shape[0]
        img_mask = torch.cat([pad, pad.new_ones(pad.shape[0], self.num_tokens // 4)], dim=1)
        return self.forward_module(
            hidden_states=latents.to(dtype), timestep=t.to(dtype), encoder_hidden_states=prompt_embeds.to(dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask, img_mask=img_mask,
            img_shapes=[[(1, self.latent_h, self.latent_w)]] * b, return_dict=False,
        )[0][:, -self.num_tokens:]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1], as the pipeline decodes: unpack to (B, C, 1, h, w), ``x·std + mean``,
        VAE decode of the frame, ``[-1, 1] → [0, 1]`` clamped; the RGB channels of the VAE's RGBA output."""
        vae = self.pipe.vae
        x = type(self.pipe)._unpack_latents(latents, self.height, self.width, self.pipe.vae_scale_factor)
        x = x.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        image = vae.decode(x * std + mean, return_dict=False)[0][:, :, 0]
        return (image[:, :3].float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid exactly as ``__call__`` builds it (module docstring).

        Raises:
            ValueError: ``num_steps`` < 1, or another T than the length of the config's ``sample_sigmas``.
        """
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

        self.check_num_steps(num_steps)
        grid = self.pipe.config.get("sample_sigmas")
        if grid is not None and len(grid) != num_steps:
            raise ValueError(f"this Qwen-Image 2.1 pipeline samples its own {len(grid)}-step grid (its config's "
                             f"sample_sigmas), got num_steps={num_steps}")
        cfg = self.pipe.scheduler.config
        mu = calculate_shift(self.num_tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        return scheduler_sigmas(self.pipe.scheduler, num_steps, mu=mu, grid=None if grid is None else list(grid))


def load_qwenimage21_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                             max_sequence_length: int, empty_transformer: bool = False) -> QwenImage21Adapter:
    """``QwenImage21Pipeline.from_pretrained(path)`` in ``dtype``, wrapped; the size defaults to the pipeline's
    ``output_resolution`` (1024 px). ``max_sequence_length`` is not used: the pipeline encodes whole prompts."""
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    return QwenImage21Adapter(pipe, height=height or 1024, width=width or 1024)


# ---------------------------------------------------------------------------------------------- tiny builder
def build_tiny_qwenimage21(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32,
                           seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny Qwen-Image 2.1 pipeline and ``save_pretrained`` it into ``out_dir``; return the folder.

    The real classes at toy size: ``QwenImage21Transformer2DModel`` (2 blocks, 2 heads of 16, block-causal
    attention with ``causal_condition``), ``AutoencoderKLQwenImage21`` (16× down, 4 latent channels, RGBA in and
    out, non-trivial per-channel mean/std), a 2-layer ``Qwen3VLForConditionalGeneration`` of width 16 with a
    ``Qwen3VLProcessor`` around a tokenizer trained in memory on the pipeline's template, and the Qwen-Image
    scheduler configuration (dynamic exponential shift). ``sample_size`` is only checked.

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 32.
    """
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel

    from flowgrpo.models.qwenimage import build_qwen_tokenizer, build_tiny_qwen_transformer
    from flowgrpo.models.tiny import build_tiny_qwen3vl

    if sample_size <= 0 or sample_size % 32:
        raise ValueError(f"tiny Qwen-Image 2.1 sample_size must be a positive multiple of 32, got {sample_size}")
    template = ("<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n<|im_start|>user\n{}"
                "<|im_end|>\n<|im_start|>assistant\n")
    tok = build_qwen_tokenizer([template.format(" ".join(words)), " "])
    tok.add_special_tokens({"additional_special_tokens": ["<|video_pad|>"]}, replace_extra_special_tokens=False)
    tok.chat_template = QWEN3VL_CHAT_TEMPLATE
    processor, encoder = build_tiny_qwen3vl(tok, num_layers=2, seed=seed)
    torch.manual_seed(seed + 1)
    z = 4
    vae = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, False, False, False],
        latents_mean=[0.1 * (i % 3) - 0.1 for i in range(z)], latents_std=[1.0 + 0.5 * (i % 2) for i in range(z)],
    )
    torch.manual_seed(seed + 2)
    transformer = QwenImage21Transformer2DModel(**{
        "in_channels": z, "out_channels": z, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
        "context_in_dim": 16, "mlp_ratio": 2, "axes_dims_rope": (8, 4, 4), **(transformer_kwargs or {}),
    })
    _, scheduler = build_tiny_qwen_transformer(seed)
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, processor=processor,
                               transformer=transformer)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


# A minimal Qwen3-VL-style chat template (string or text-part contents), written for the toy tokenizer: the pipeline
# applies it to its system message to count the tokens it drops from the encoder's output.
QWEN3VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
