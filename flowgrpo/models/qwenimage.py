"""The Qwen-Image adapter: a diffusers ``QwenImagePipeline`` behind the :class:`~flowgrpo.models.base.ModelAdapter`
interface.

Everything Qwen-Image-specific lives here, as ``QwenImagePipeline.__call__`` (diffusers 0.42) does it:

* one text encoder, Qwen2.5-VL, through the pipeline's ``encode_prompt``: the prompt inside the pipeline's chat
  template, the last hidden state without the template's 34 system tokens, padded to the longest prompt of the
  batch with an attention mask (dropped when nothing is padded), cut to ``max_sequence_length`` (≤ 1024);
* **true classifier-free guidance with a negative prompt** (Qwen-Image is not guidance-distilled): two separate
  transformer calls, ``v_cfg = v_u + s·(v_c − v_u)`` (Ho & Salimans, arXiv 2207.12598, eq. 6) rescaled per token
  to the conditional prediction's norm, ``v = v_cfg · ‖v_c‖ / ‖v_cfg‖`` (norms over the channel dim; the
  pipeline's rule, Qwen-Image technical report arXiv 2508.02324); guidance is on when s > 1;
* the timestep ``(σ·1000)/1000`` computed in the transformer's dtype as the pipeline does it (σ·1000 cast to
  the latents' dtype, then divided: in bf16 two roundings; :func:`~flowgrpo.models.base.pipeline_timestep`); the
  transformer takes σ in [0, 1], as FLUX;
* latents packed into 2×2 patches: (B, (h/2)·(w/2), 4·C) tokens, from noise drawn in the VAE's (B, 1, C, h, w)
  video layout; the VAE (Wan-style, 8× down) un-normalises with per-channel ``latents_mean`` / ``latents_std``;
* the σ grid ``linspace(1, 1/T, T)`` with the dynamic (resolution-dependent) exponential shift ``mu`` of
  ``calculate_shift(image tokens)`` and the scheduler's terminal stretch (Qwen-Image: ``shift_terminal`` 0.02).

    python -m flowgrpo.models.random_pipelines qwenimage OUT_DIR     # a tiny random QwenImagePipeline folder
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from flowgrpo.models.base import AdapterBase, PromptEmbeds, pipeline_timestep, scheduler_sigmas
from flowgrpo.models.empty import empty_components

__all__ = ["QwenImageAdapter", "load_qwenimage_adapter", "build_tiny_qwenimage", "build_qwen_tokenizer"]


class QwenImageAdapter(AdapterBase):
    """Adapter for a loaded :class:`diffusers.QwenImagePipeline`.

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA adapter).
        height, width: image size in pixels, positive multiples of ``2·vae_scale_factor`` (16 for Qwen-Image).
        max_sequence_length: text tokens per prompt after the template, in [1, 1024] (the pipeline's limit).
        negative_prompt: the unconditional prompt of true CFG (``" "``, the Qwen-Image model card's and
            Flow-GRPO's choice).
    Raises:
        ValueError: a size the VAE and 2×2 packing cannot represent, or ``max_sequence_length`` outside [1, 1024].
    """

    def __init__(self, pipe: QwenImagePipeline, *, height: int, width: int, max_sequence_length: int = 512,
                 negative_prompt: str = " ") -> None:
        step = pipe.vae_scale_factor * 2
        self.check_image_size("Qwen-Image size", height, width, step)
        self.check_sequence_length("Qwen-Image", max_sequence_length, 1024)
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.negative_prompt = negative_prompt
        self.latent_h = 2 * (height // step)
        self.latent_w = 2 * (width // step)
        self.num_channels = pipe.transformer.config.in_channels // 4
        if pipe.transformer.config.guidance_embeds:
            raise ValueError("a guidance-distilled QwenImage transformer (guidance_embeds=True) is not supported")

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask; keep it explicit, velocity drops it again
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen2.5-VL embeddings of B prompts and of the negative prompt, no gradient.

        Returns batched ``prompt_embeds`` (B, L, D) (L: the longest prompt of this batch, ≤
        ``max_sequence_length``; D = 3584 for Qwen-Image) and ``prompt_mask`` (B, L) long (1 = token, 0 = padding);
        shared ``negative_prompt_embeds`` (1, L', D) and ``negative_prompt_mask`` (1, L').

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        pos, mask = self._encode(prompts)
        neg, neg_mask = self._encode([self.negative_prompt])
        return PromptEmbeds({"prompt_embeds": pos, "prompt_mask": mask},
                            {"negative_prompt_embeds": neg, "negative_prompt_mask": neg_mask})

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N, 4·C) float32 packed standard-normal latents, drawn as ``QwenImagePipeline.prepare_latents``
        does: ``randn_tensor`` of shape (B, 1, C, h, w), then 2×2 packing.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        noise = self.normal_noise((batch_size, 1, self.num_channels, self.latent_h, self.latent_w), generator)
        return QwenImagePipeline._pack_latents(noise, batch_size, self.num_channels, self.latent_h, self.latent_w)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N, 4·C) float32 velocity at (latents, σ): for s > 1 the renormalised true-CFG combination of a
        conditional and a negative-prompt forward (module docstring), else the conditional prediction alone.
        ``latents`` (B, N, 4·C) packed; arguments and errors as :meth:`~flowgrpo.models.base.ModelAdapter.velocity`.
        """
        b = latents.shape[0]
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = pipeline_timestep(sigma, self.dtype)  # the pipeline's timestep / 1000, in the transformer's dtype
        v_c = self._forward(latents, t, embeds["prompt_embeds"], embeds["prompt_mask"], embeds)
        if guidance_scale <= 1:
            return v_c
        # a shared (1, L') negative prompt (text to image) or one per row (editing: it sees the source images)
        neg = embeds["negative_prompt_embeds"].expand(b, -1, -1).contiguous()
        neg_mask = embeds["negative_prompt_mask"].expand(b, -1).contiguous()
        v_u = self._forward(latents, t, neg, neg_mask, embeds)
        v = v_u + guidance_scale * (v_c - v_u)
        return v * (v_c.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))

    def _context(self, embeds: PromptEmbeds) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
        """Image tokens appended after the target's (none for text to image) and their (frames, h, w) shapes."""
        return None, []

    def _forward(self, latents, t, prompt_embeds, mask, embeds) -> torch.Tensor:
        dtype = self.dtype
        b, n = latents.shape[:2]
        context, shapes = self._context(embeds)
        x = latents if context is None else torch.cat([latents, context], dim=1)
        out = self.forward_module(
            hidden_states=x.to(dtype),
            timestep=t.to(dtype),
            guidance=None,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            encoder_hidden_states=prompt_embeds.to(dtype),
            img_shapes=[[(1, self.latent_h // 2, self.latent_w // 2), *shapes]] * b,
            return_dict=False,
        )[0]
        return out[:, :n].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1], as ``QwenImagePipeline`` decodes: unpack to (B, C, 1, h, w),
        ``x·std + mean`` per channel, VAE decode of the single frame, ``[-1, 1] → [0, 1]`` clamped."""
        vae = self.pipe.vae
        x = QwenImagePipeline._unpack_latents(latents, self.height, self.width, self.pipe.vae_scale_factor)
        x = x.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        image = vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid exactly as ``QwenImagePipeline.__call__`` builds it: ``linspace(1, 1/T, T)``,
        the scheduler's shift with ``mu = calculate_shift((h/2)·(w/2))`` (Qwen-Image: dynamic, exponential,
        base/max shift 0.5/0.9 over 256…8192 tokens, terminal σ stretched to 0.02), then 0.

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        cfg = self.pipe.scheduler.config
        mu = calculate_shift((self.latent_h // 2) * (self.latent_w // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        return scheduler_sigmas(self.pipe.scheduler, num_steps, mu=mu)


def load_qwenimage_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                           max_sequence_length: int, empty_transformer: bool = False) -> QwenImageAdapter:
    """``QwenImagePipeline.from_pretrained(path)`` in ``dtype``, wrapped; the size defaults to the pipeline's
    (``default_sample_size`` 128 × ``vae_scale_factor`` 8 = 1024 px); ``max_sequence_length`` is clipped to the
    pipeline's limit of 1024."""
    pipe = QwenImagePipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    size = pipe.default_sample_size * pipe.vae_scale_factor
    return QwenImageAdapter(pipe, height=height or size, width=width or size,
                            max_sequence_length=min(max_sequence_length, 1024))


# ---------------------------------------------------------------------------------------------- tiny builder
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>")


def build_qwen_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A small byte-level BPE ``Qwen2Tokenizer`` trained in memory on ``texts`` (with the ``tokenizers`` library),
    carrying Qwen's chat and vision special tokens (``<|endoftext|>`` is id 0 and the padding token). Words of
    ``texts`` become single tokens, so a chat template's system prefix has the real tokenizer's token count."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    plain = list(texts)
    for s in QWEN_SPECIAL_TOKENS:
        plain = [t.replace(s, "\n") for t in plain]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(QWEN_SPECIAL_TOKENS), show_progress=False)
    bpe.train_from_iterator(plain, trainer)
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    return tok


def build_qwen25vl_encoder(tokenizer, hidden: int = 16, seed: int = 0):
    """A random 2-layer ``Qwen2_5_VLForConditionalGeneration`` of width ``hidden`` (a 2-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                     "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 2, "hidden_size": hidden, "intermediate_size": hidden, "num_heads": 2,
                       "out_hidden_size": hidden},
        hidden_size=hidden, vocab_size=len(tokenizer), vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], vision_token_id=ids[2],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_qwenimage_vae(seed: int = 0, z_dim: int = 4):
    """A random tiny ``AutoencoderKLQwenImage`` (8× spatial downsampling, ``z_dim`` channels, non-trivial
    per-channel mean/std so that a missing un-normalisation fails the parity tests)."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(
        base_dim=z_dim * 6, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * (i % 3) - 0.1 for i in range(z_dim)],
        latents_std=[1.0 + 0.5 * (i % 2) for i in range(z_dim)],
    )


def build_tiny_qwen_transformer(seed: int, transformer_kwargs: dict | None = None):
    """The tiny Qwen-Image transformer (2 layers, 2 heads of 16; random weights drawn after
    ``torch.manual_seed(seed + 1)``; ``transformer_kwargs`` override its constructor arguments) and the Qwen-Image
    scheduler (exponential dynamic shift, terminal 0.02), shared by the Qwen-Image and Qwen-Image-Edit builders.
    Returns (transformer, scheduler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(**{
        "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 16, "guidance_embeds": False, "axes_dims_rope": (8, 4, 4),
        **(transformer_kwargs or {}),
    })
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return transformer, scheduler


def build_tiny_qwenimage(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32,
                         seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny Qwen-Image pipeline and ``save_pretrained`` it into ``out_dir``; return the folder.

    ``sample_size`` is only checked (the Qwen-Image VAE config has no size; the pipeline's default is 1024 px,
    so pass ``model.height``/``model.width``).

    The real classes at toy size: ``QwenImageTransformer2DModel`` (2 blocks), ``AutoencoderKLQwenImage`` (8×
    down, 4 channels → 16 packed), ``Qwen2_5_VLForConditionalGeneration`` (width 16), a ``Qwen2Tokenizer`` trained
    in memory on the pipeline's template and ``words``, and Qwen-Image's scheduler configuration
    (``FlowMatchEulerDiscreteScheduler``: dynamic exponential shift, base/max shift 0.5/0.9 over 256…8192 tokens,
    ``shift_terminal`` 0.02). ``transformer_kwargs`` override the transformer's constructor arguments.

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny Qwen-Image sample_size must be a positive multiple of 16, got {sample_size}")
    tok = build_qwen_tokenizer([_QWEN_TEMPLATE.format(" ".join(words)), " "])
    encoder = build_qwen25vl_encoder(tok, hidden=16, seed=seed)
    vae = build_qwenimage_vae(seed)
    transformer, scheduler = build_tiny_qwen_transformer(seed, transformer_kwargs)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tok,
                             transformer=transformer)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


# the chat template QwenImagePipeline.__init__ sets (prompt_template_encode), used only to train the toy tokenizer
_QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
