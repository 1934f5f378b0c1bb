"""The FLUX.2 adapter: diffusers ``Flux2KleinPipeline`` (FLUX.2 [klein]) and ``Flux2Pipeline`` (FLUX.2 [dev]) behind
the :class:`~flowgrpo.models.base.ModelAdapter` interface.

Everything FLUX.2-specific lives here, as the two pipelines' ``__call__`` (diffusers 0.42) do it:

* the text encoder through the pipeline's own ``encode_prompt``: hidden states of several layers stacked along
  the channel dim (klein: Qwen3, layers 9/18/27, chat template without thinking; dev: Mistral Small 3.1, layers
  10/20/30, with the pipeline's system message), padded to ``max_sequence_length``; 4-D text position ids;
* guidance: **klein** runs true classifier-free guidance with the empty negative prompt when s > 1 and the
  pipeline is not ``is_distilled`` (two transformer calls, ``v = v_u + s·(v_c − v_u)``, Ho & Salimans, arXiv
  2207.12598, eq. 6); **dev** is guidance-distilled: s goes into the transformer's guidance embedding, one call;
* the timestep ``(σ·1000)/1000`` computed in the transformer's dtype as the pipelines do it (σ·1000 cast to
  the latents' dtype, then divided: in bf16 two roundings; :func:`~flowgrpo.models.base.pipeline_timestep`); the
  transformer scales σ itself;
* latents drawn directly in the patchified (B, 4·C, h/2, w/2) layout and packed to (B, (h/2)·(w/2), 4·C) tokens
  with 4-D (t, h, w, l) position ids; decoding scatters them back, un-normalises with the VAE's BatchNorm running
  statistics, un-patchifies and decodes;
* the σ grid ``linspace(1, 1/T, T)`` with FLUX.2's empirical ``mu`` (``compute_empirical_mu``, which depends on
  both the image token count and T) through the scheduler's dynamic shift.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from flowgrpo.models.base import AdapterBase, PromptEmbeds, pipeline_timestep, scheduler_sigmas
from flowgrpo.models.empty import empty_components
from flowgrpo.models.zimage import build_tiny_qwen3_tokenizer

__all__ = ["Flux2Adapter", "load_flux2_adapter", "build_tiny_flux2_klein"]


class Flux2Adapter(AdapterBase):
    """Adapter for a loaded :class:`diffusers.Flux2KleinPipeline` or :class:`diffusers.Flux2Pipeline`.

    Args:
        pipe: the pipeline (its transformer may carry a peft LoRA adapter).
        height, width: image size in pixels, positive multiples of ``2·vae_scale_factor`` (16).
        max_sequence_length: text tokens per prompt (the pipelines pad to it), in [1, 512].
    Raises:
        ValueError: a size the VAE and the 2×2 patchify cannot represent, ``max_sequence_length`` outside
            [1, 512], or a scheduler with ``use_flow_sigmas`` (its grid ignores the pipeline's σ; not supported).
    """

    def __init__(self, pipe, *, height: int, width: int, max_sequence_length: int = 512) -> None:
        step = pipe.vae_scale_factor * 2
        self.check_image_size("FLUX.2 size", height, width, step)
        self.check_sequence_length("FLUX.2", max_sequence_length, 512)
        if pipe.scheduler.config.get("use_flow_sigmas", False):
            raise ValueError("a FLUX.2 scheduler with use_flow_sigmas=True is not supported")
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.latent_h = 2 * (height // step)
        self.latent_w = 2 * (width // step)
        self.num_channels = pipe.transformer.config.in_channels  # 4·C: patchified
        self.guidance_embeds = bool(pipe.transformer.config.guidance_embeds)
        # klein: true CFG unless step-distilled; dev: guidance embedding
        self.true_cfg = type(pipe).__name__ == "Flux2KleinPipeline" and not pipe.config.get("is_distilled", False)
        shape = torch.empty(1, self.num_channels, self.latent_h // 2, self.latent_w // 2)
        self.latent_ids = type(pipe)._prepare_latent_ids(shape)  # (1, N, 4)

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                       max_sequence_length=self.max_sequence_length)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Text embeddings of B prompts, no gradient: batched ``prompt_embeds`` (B, L, 3·D) (L =
        ``max_sequence_length``); shared ``text_ids`` (1, L, 4) and, for klein with CFG, the empty prompt's
        ``negative_prompt_embeds`` (1, L, 3·D).

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        pos, text_ids = self._encode(prompts)
        shared = {"text_ids": text_ids[:1]}
        if self.true_cfg:
            shared["negative_prompt_embeds"] = self._encode([""])[0]
        return PromptEmbeds({"prompt_embeds": pos}, shared)

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N, 4·C) float32 packed noise (contiguous), drawn as the pipelines' ``prepare_latents`` do:
        ``randn_tensor`` of shape (B, 4·C, h/2, w/2), then flattened to tokens.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        noise = self.normal_noise((batch_size, self.num_channels, self.latent_h // 2, self.latent_w // 2), generator)
        # contiguous: the packing is a transposed view, and a strided input takes another matmul kernel than the
        # contiguous rows the trainer gathers later (measured: a last-bit log-prob mismatch at the first step)
        return type(self.pipe)._pack_latents(noise).contiguous()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N, 4·C) float32 velocity at (latents, σ): klein's true CFG for s > 1 (unless distilled), dev's
        guidance embedding, as the module docstring says.

        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        b = latents.shape[0]
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = pipeline_timestep(sigma, self.dtype)  # the pipelines' timestep / 1000, in the transformer's dtype
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), float(guidance_scale), device=latents.device, dtype=torch.float32)
        v_c = self._forward(latents, t, embeds["prompt_embeds"], embeds["text_ids"], guidance)
        if not self.true_cfg or guidance_scale <= 1:
            return v_c
        neg = embeds["negative_prompt_embeds"].expand(b, -1, -1).contiguous()
        v_u = self._forward(latents, t, neg, embeds["text_ids"], guidance)
        return v_u + guidance_scale * (v_c - v_u)

    def _forward(self, latents, t, prompt_embeds, text_ids, guidance) -> torch.Tensor:
        b, dtype = latents.shape[0], self.dtype
        out = self.forward_module(
            hidden_states=latents.to(dtype), timestep=t.to(dtype), guidance=guidance,
            encoder_hidden_states=prompt_embeds.to(dtype), txt_ids=text_ids.expand(b, -1, -1),
            img_ids=self.latent_ids.to(latents.device).expand(b, -1, -1), return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1], as the pipelines decode: tokens put back to (B, 4·C, h/2, w/2) at their
        (row-major) position ids, ``x·√(var + eps) + mean`` with the VAE's BatchNorm running statistics, un-patchify,
        VAE decode, ``[-1, 1] → [0, 1]`` clamped."""
        pipe, vae = self.pipe, self.pipe.vae
        b, _, c = latents.shape
        # the ids are row-major (h, w): scattering tokens by id is this reshape (pure data movement)
        x = latents.transpose(1, 2).reshape(b, c, self.latent_h // 2, self.latent_w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, x.dtype)
        x = type(pipe)._unpatchify_latents(x * std + mean)
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid exactly as the FLUX.2 pipelines build it (module docstring).

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        self.check_num_steps(num_steps)
        mu = compute_empirical_mu((self.latent_h // 2) * (self.latent_w // 2), num_steps)
        return scheduler_sigmas(self.pipe.scheduler, num_steps, mu=mu)


def load_flux2_adapter(path: str, pipeline_class: str, *, dtype: torch.dtype, height: int | None,
                       width: int | None, max_sequence_length: int, empty_transformer: bool = False) -> Flux2Adapter:
    """``<pipeline_class>.from_pretrained(path)`` in ``dtype``, wrapped; the size defaults to the pipelines'
    1024 px (``default_sample_size`` 128 × 8); ``max_sequence_length`` is clipped to 512."""
    import diffusers

    pipe = getattr(diffusers, pipeline_class).from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    size = pipe.default_sample_size * pipe.vae_scale_factor
    return Flux2Adapter(pipe, height=height or size, width=width or size,
                        max_sequence_length=min(max_sequence_length, 512))


# ---------------------------------------------------------------------------------------------- tiny builders
def build_flux2_vae(seed: int = 0, latent_channels: int = 4):
    """A random tiny ``AutoencoderKLFlux2`` (8× down, 2×2 patch BatchNorm with random running statistics, so a
    missing un-normalisation fails the parity tests)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    return vae


def build_flux2_transformer(seed: int, *, joint_attention_dim: int, guidance_embeds: bool,
                            transformer_kwargs: dict | None = None):
    """A random tiny ``Flux2Transformer2DModel`` (1 double and 1 single block, 2 heads of 16)."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(**{
        "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": joint_attention_dim, "timestep_guidance_channels": 32,
        "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": guidance_embeds, **(transformer_kwargs or {}),
    })


def _flux2_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2's scheduler configuration: dynamic exponential shift with the pipeline's empirical mu
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           time_shift_type="exponential")


def build_tiny_flux2_klein(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32,
                           seed: int = 0, transformer_kwargs: dict | None = None,
                           is_distilled: bool = False) -> Path:
    """Build a random tiny FLUX.2 [klein] pipeline and ``save_pretrained`` it into ``out_dir``; return the folder.

    The real classes at toy size: ``Flux2Transformer2DModel`` (no guidance embedding), ``AutoencoderKLFlux2``
    (4 latent channels → 16 patchified), a 27-layer ``Qwen3ForCausalLM`` of width 16 (the pipeline reads layers
    9, 18 and 27: 48 channels) with a ``Qwen2Tokenizer`` trained in memory (chat template included), and
    FLUX.2's scheduler configuration. ``sample_size`` is only checked (the pipeline's default size is 1024 px).

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny FLUX.2 sample_size must be a positive multiple of 16, got {sample_size}")
    tok = build_tiny_qwen3_tokenizer(words)
    torch.manual_seed(seed)
    encoder = Qwen3ForCausalLM(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                                           num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                           vocab_size=len(tok), max_position_embeddings=512)).eval()
    pipe = Flux2KleinPipeline(
        scheduler=_flux2_scheduler(), vae=build_flux2_vae(seed + 1), text_encoder=encoder, tokenizer=tok,
        transformer=build_flux2_transformer(seed + 2, joint_attention_dim=3 * 16, guidance_embeds=False,
                                            transformer_kwargs=transformer_kwargs),
        is_distilled=is_distilled,
    )
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


# A minimal Mistral-style chat template (system prompt, user turns; text parts of list contents), written for the
# toy tokenizer; Flux2Pipeline applies it with add_generation_prompt=False.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set text = m['content'] if m['content'] is string else m['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
_MISTRAL_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                     "[IMG]", "[IMG_BREAK]", "[IMG_END]")


def build_pixtral_processor(texts: Iterable[str], vocab_size: int = 600):
    """A ``PixtralProcessor`` around a small byte-level BPE tokenizer trained in memory on ``texts`` (with Mistral's
    chat and image special tokens and the chat template above)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(_MISTRAL_SPECIALS), show_progress=False)
    bpe.train_from_iterator(list(texts), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    return PixtralProcessor(image_processor=PixtralImageProcessor(), tokenizer=tok,
                            chat_template=MISTRAL_CHAT_TEMPLATE, patch_size=16)


def build_tiny_flux2(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32,
                     seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny FLUX.2 [dev] pipeline and ``save_pretrained`` it into ``out_dir``; return the folder.

    The real classes at toy size: ``Flux2Transformer2DModel`` with the guidance embedding,
    ``AutoencoderKLFlux2``, a ``Mistral3ForConditionalGeneration`` with a 30-layer language model of width 16
    (the pipeline reads layers 10, 20 and 30: 48 channels) and a 1-layer Pixtral vision tower, a
    ``PixtralProcessor`` with a tokenizer trained in memory on the pipeline's system message and ``words``, and
    FLUX.2's scheduler configuration. ``sample_size`` is only checked (the default size is 1024 px).

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny FLUX.2 sample_size must be a positive multiple of 16, got {sample_size}")
    proc = build_pixtral_processor([SYSTEM_MESSAGE, " ".join(words)])
    tok = proc.tokenizer
    config = Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 30,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": len(tok),
                     "max_position_embeddings": 1024},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "patch_size": 16, "image_size": 64},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1,
    )
    torch.manual_seed(seed)
    encoder = Mistral3ForConditionalGeneration(config).eval()
    pipe = Flux2Pipeline(
        scheduler=_flux2_scheduler(), vae=build_flux2_vae(seed + 1), text_encoder=encoder, tokenizer=proc,
        transformer=build_flux2_transformer(seed + 2, joint_attention_dim=3 * 16, guidance_embeds=True,
                                            transformer_kwargs=transformer_kwargs),
    )
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out
