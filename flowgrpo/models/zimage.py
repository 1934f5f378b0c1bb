"""The Z-Image adapter: a diffusers ``ZImagePipeline`` behind the :class:`~flowgrpo.models.base.ModelAdapter`
interface.

Everything Z-Image-specific lives here, as ``ZImagePipeline.__call__`` (diffusers 0.42) does it:

* one text encoder, Qwen3, through the pipeline's ``encode_prompt``: the prompt in the tokenizer's chat template
  (``enable_thinking=True``), padded to ``max_sequence_length``, the **second-to-last** hidden state, and only the
  real tokens kept: each prompt is a variable-length (L_i, D) sequence (stored here zero-padded with its length);
* **classifier-free guidance in Z-Image's convention**: ``out = out_c + s·(out_c − out_u)`` (Ho & Salimans,
  arXiv 2207.12598, eq. 6 with w = s), on whenever s > 0, from one transformer call on the list
  ``[conditional…, unconditional…]`` with the empty negative prompt; s = 0 (Z-Image-Turbo) is the conditional
  output alone. The pipeline's optional ``cfg_normalization`` and ``cfg_truncation`` are left at their defaults
  (off; truncation 1.0 never triggers);
* the transformer predicts the **negative** velocity at the reversed time ``(1000 − σ·1000)/1000`` (1 = clean):
  the velocity is ``v = −out``;
* latents in the VAE's (B, 16, h, w) layout, passed to the transformer as a list of (16, 1, h, w) frames (it
  patchifies 2×2 itself); the FLUX.1 VAE's scaling and shift factors;
* the σ grid ``torch.linspace(1, 1/T, T)`` (float32, as ``get_default_z_image_sigmas``) through the scheduler's
  shift (Z-Image: static shift 3; a dynamic-shift scheduler gets ``mu = calculate_shift(image tokens)``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

from flowgrpo.models.base import AdapterBase, PromptEmbeds, scheduler_sigmas
from flowgrpo.models.empty import empty_components
from flowgrpo.models.qwenimage import build_qwen_tokenizer
from flowgrpo.models.tiny import build_tiny_vae

__all__ = ["ZImageAdapter", "load_zimage_adapter", "build_tiny_zimage"]


class ZImageAdapter(AdapterBase):
    """Adapter for a loaded :class:`diffusers.ZImagePipeline`.

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA adapter).
        height, width: image size in pixels, positive multiples of ``2·vae_scale_factor`` (16).
        max_sequence_length: tokens per templated prompt (the pipeline pads to it), ≥ 1.
    Raises:
        ValueError: a size the VAE and the 2×2 patchify cannot represent, or ``max_sequence_length`` < 1.
    """

    def __init__(self, pipe: ZImagePipeline, *, height: int, width: int, max_sequence_length: int = 512) -> None:
        step = pipe.vae_scale_factor * 2
        self.check_image_size("Z-Image size", height, width, step)
        if max_sequence_length < 1:
            raise ValueError(f"Z-Image max_sequence_length must be >= 1, got {max_sequence_length}")
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.latent_h = 2 * (height // step)
        self.latent_w = 2 * (width // step)
        self.num_channels = pipe.transformer.in_channels

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        seqs, _ = self.pipe.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                          max_sequence_length=self.max_sequence_length)
        lengths = torch.tensor([s.shape[0] for s in seqs], dtype=torch.long, device=self.device)
        padded = torch.zeros(len(seqs), int(lengths.max()), seqs[0].shape[-1], dtype=seqs[0].dtype,
                             device=self.device)
        for i, s in enumerate(seqs):
            padded[i, : s.shape[0]] = s
        return padded, lengths

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3 embeddings of B prompts and of the empty negative prompt, no gradient.

        Returns batched ``prompt_embeds`` (B, L, D) zero-padded and ``prompt_len`` (B,) long (the real tokens of
        each prompt; D = 2560 for Z-Image); shared ``negative_prompt_embeds`` (1, L', D), ``negative_prompt_len``
        (1,).

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        pos, lengths = self._encode(prompts)
        neg, neg_len = self._encode([""])
        return PromptEmbeds({"prompt_embeds": pos, "prompt_len": lengths},
                            {"negative_prompt_embeds": neg, "negative_prompt_len": neg_len})

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, C, h, w) float32 standard-normal latents, drawn as ``ZImagePipeline.prepare_latents`` does.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        return self.normal_noise((batch_size, self.num_channels, self.latent_h, self.latent_w), generator)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, C, h, w) float32 velocity ``v = −out`` at (latents, σ), with Z-Image's CFG for s > 0 (module
        docstring), computed in float32 per sample as the pipeline does. ``latents`` (B, C, h, w); arguments and
        errors as :meth:`~flowgrpo.models.base.ModelAdapter.velocity`.
        """
        b = latents.shape[0]
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = (1000 - sigma * 1000) / 1000  # the pipeline's (1000 − timestep)/1000 with timestep = σ·1000
        caps = _unpad(embeds["prompt_embeds"], embeds["prompt_len"])
        x = latents.to(self.dtype)
        if guidance_scale <= 0:
            return -self._forward(x, t, caps)
        neg = _unpad(embeds["negative_prompt_embeds"], embeds["negative_prompt_len"]) * b
        out = self._forward(torch.cat([x, x]), torch.cat([t, t]), caps + neg)
        pos, negative = out[:b], out[b:]
        return -(pos + guidance_scale * (pos - negative))

    def _forward(self, x: torch.Tensor, t: torch.Tensor, caps: list[torch.Tensor]) -> torch.Tensor:
        frames = list(x.unsqueeze(2).unbind(dim=0))  # B × (C, 1, h, w)
        out = self.forward_module(x=frames, t=t, cap_feats=[c.to(self.dtype) for c in caps], return_dict=False)[0]
        return torch.stack([o.float() for o in out], dim=0).squeeze(2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1], as ``ZImagePipeline`` decodes (``x / scaling + shift``, VAE,
        ``[-1, 1] → [0, 1]`` clamped)."""
        vae = self.pipe.vae
        x = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(x, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid exactly as ``ZImagePipeline.__call__`` builds it (module docstring).

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        self.check_num_steps(num_steps)
        cfg = self.pipe.scheduler.config
        mu = calculate_shift((self.latent_h // 2) * (self.latent_w // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        grid = torch.linspace(1.0, 1 / num_steps, num_steps).tolist()
        return scheduler_sigmas(self.pipe.scheduler, num_steps, mu=mu, grid=grid)


def _unpad(padded: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    return [row[:n] for row, n in zip(padded, lengths.tolist(), strict=True)]


def load_zimage_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                        max_sequence_length: int, empty_transformer: bool = False) -> ZImageAdapter:
    """``ZImagePipeline.from_pretrained(path)`` in ``dtype``, wrapped; the size defaults to the VAE's
    ``sample_size`` if it names one, else the pipeline's 1024 px."""
    pipe = ZImagePipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    size = int(pipe.vae.config.get("sample_size") or 1024)
    return ZImageAdapter(pipe, height=height or size, width=width or size, max_sequence_length=max_sequence_length)


# ---------------------------------------------------------------------------------------------- tiny builder
# A minimal Qwen3-style chat template (user turns, generation prompt, the thinking switch), written for the toy
# tokenizer; ZImagePipeline applies it with add_generation_prompt=True, enable_thinking=True.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tiny_qwen3_tokenizer(words: Iterable[str]):
    """The toy Qwen3 tokenizer of the tiny Z-Image and FLUX.2 [klein] pipelines: trained on ``words`` in the chat
    format, with Z-Image's chat template (:data:`CHAT_TEMPLATE`)."""
    tok = build_qwen_tokenizer([f"user\n{' '.join(words)}\nassistant\n<think>\n\n</think>\n\n"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_zimage(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32,
                      seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny Z-Image pipeline and ``save_pretrained`` it into ``out_dir``; return the folder.

    The real classes at toy size: ``ZImageTransformer2DModel`` (2 layers, 1 refiner layer, width 32), the
    16-channel ``AutoencoderKL`` with FLUX.1's scaling/shift factors and 8× downsampling, a ``Qwen3Model``
    (width 16) with a ``Qwen2Tokenizer`` trained in memory (chat template included), and
    ``FlowMatchEulerDiscreteScheduler(shift=3.0)``. The transformer's padding tokens (``torch.empty`` in its
    constructor) are set to seeded random values. ``transformer_kwargs`` override its constructor arguments.

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny Z-Image sample_size must be a positive multiple of 16, got {sample_size}")
    words = list(words)
    tok = build_tiny_qwen3_tokenizer(words)
    torch.manual_seed(seed)
    encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                     vocab_size=len(tok), max_position_embeddings=512)).eval()
    torch.manual_seed(seed + 1)
    transformer = ZImageTransformer2DModel(**{
        "all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 32, "n_layers": 2,
        "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "qk_norm": True, "cap_feat_dim": 16,
        "axes_dims": [8, 4, 4], "axes_lens": [256, 32, 32], **(transformer_kwargs or {}),
    })
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for pad in (transformer.x_pad_token, transformer.cap_pad_token):
            pad.copy_(torch.randn(pad.shape, generator=g))
    torch.manual_seed(seed + 3)
    vae = build_tiny_vae(sample_size)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tok, transformer=transformer)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out
