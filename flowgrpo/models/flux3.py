"""The FLUX.3 adapter: diffusers' modular ``Flux3ModularPipeline`` (FLUX.3) and ``Flux3DistilledModularPipeline``
(its step-distilled flow-map variant) behind the :class:`~flowgrpo.models.base.ModelAdapter` interface, through
:class:`~flowgrpo.models.modular.ModularAdapter`.

The pipeline's own blocks (diffusers 0.42.1, ``modular_pipelines/flux3``) do everything outside the denoising loop:

* ``text_encoder`` (``Flux3TextEncoderStep``): one prompt per call through Qwen3-VL's chat template, right-padded
  to a multiple of 80 tokens (capped at ``max_sequence_length``) and *not* masked in the transformer, the hidden
  states of layers 4, 8, …, 32 stacked along the channels. A batch's rows are padded here to its longest window
  and each row keeps its own length (``text_len``); the transformer sees each row's own window, rows of one length
  in one call, so a row's velocity is the pipeline's;
* ``prepare_latents`` (``Flux3PrepareLatentsStep``): ``randn_tensor`` (B, C, h/2, w/2) of the packed 128-channel
  latent (16× down: the FLUX.2 VAE's 8× and a 2×2 patch), flattened to (B, N, C) tokens; the image position ids;
* ``prepare_rope_inputs`` (``Flux3TextRoPEInputsStep``): the text position ids of each window length;
* ``after_denoise`` and ``decode`` (``Flux3UnpackLatentsStep``, ``Flux3DecodeStep``): tokens back to the grid,
  the VAE's BatchNorm un-normalisation, un-patchify, decode, ``[-1, 1] → [0, 1]``.

The loop is flowgrpo's sampler; :meth:`Flux3Adapter.velocity` is the transformer call of the loop-denoiser block:
timestep ``(σ·1000)/1000`` cast to the transformer's dtype as the block computes it; **FLUX.3**: classifier-free
guidance as the pipeline's ``ClassifierFreeGuidance`` guider computes it, ``v_u + s·(v_c − v_u)`` with the empty
negative prompt, two transformer calls, off at s = 1 (the guider's ``isclose(s, 1)``); **distilled**: no guidance,
one call, and the transformer is a flow map (``flow_map=True``) that also takes the σ the step jumps to
(``target_timestep``): the adapter jumps from σ to the largest σ' < σ of its sampling grid, which is the pipeline's
step at every grid σ (the rollout, the ratio's re-scoring) and defines the velocity at any other σ (the
forward-process objectives' σ, the health probe); one grid per run (the first :meth:`sigmas` fixes T).
σ grid: ``linspace(1, 1/T, T)`` shifted by the scheduler's static shift 6.93
(``Flux3SetTimestepsStep``; 50 steps by default, the distilled pipeline 16).

The prompt upsampler block (a Qwen3.5 language model that rewrites a request into FLUX.3's long captions) is
removed: the prompt file's text is what the model is conditioned on (rewrite the prompts offline to train on
captions). Image-conditioned generation (``vae_encoder``, reference images) is not adapted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from flowgrpo.models.base import PromptEmbeds, scheduler_sigmas
from flowgrpo.models.modular import ModularAdapter, find_block, load_modular_pipeline

__all__ = ["Flux3Adapter", "load_flux3_adapter", "build_tiny_flux3"]

#: the Flux3 text windows are right-padded to multiples of this many tokens (``Flux3TextEncoderStep.pad_multiple``)
PAD_MULTIPLE = 80


class Flux3Adapter(ModularAdapter):
    """Adapter for a loaded ``Flux3ModularPipeline`` or ``Flux3DistilledModularPipeline`` (module docstring).

    Args:
        pipe: the modular pipeline without its prompt upsampler (:func:`load_flux3_adapter`).
        height, width: image size in pixels, positive multiples of ``2·vae_scale_factor`` (16).
        max_sequence_length: the text window's cap in tokens (the block's default is 8192), ≥ 1.
        negative_prompt: the unconditional prompt of classifier-free guidance (the block's default ``""``).
    Raises:
        ValueError: a size the VAE and the 2×2 patch cannot represent, ``max_sequence_length`` < 1, a scheduler with
            dynamic shifting (the FLUX.3 blocks pass no ``mu``), or a guider other than plain classifier-free
            guidance over all steps (rescaled, original formulation or a step range: not adapted).
    """

    def __init__(self, pipe, *, height: int, width: int, max_sequence_length: int = 8192,
                 negative_prompt: str = "") -> None:
        step = pipe.vae_scale_factor * 2
        self.check_image_size("FLUX.3 size", height, width, step)
        self.check_sequence_length("FLUX.3", max_sequence_length, 1 << 20)
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError("a FLUX.3 scheduler with use_dynamic_shifting=True is not supported (the FLUX.3 "
                             "timestep block passes no mu)")
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.flow_map = bool(pipe.transformer.config.get("flow_map", False))
        self.distilled = type(pipe).__name__ == "Flux3DistilledModularPipeline"
        if self.flow_map != self.distilled:
            raise ValueError(f"a {type(pipe).__name__} with a transformer of flow_map={self.flow_map} is not "
                             "supported (the distilled pipeline runs a flow map, FLUX.3 does not)")
        guider = getattr(pipe, "guider", None)
        if not self.distilled and guider is not None:
            cfg = guider.config
            if (cfg.get("guidance_rescale", 0.0) or cfg.get("use_original_formulation", False)
                    or cfg.get("start", 0.0) != 0.0 or cfg.get("stop", 1.0) != 1.0):
                raise ValueError(f"the FLUX.3 guider must be plain classifier-free guidance over all steps, got "
                                 f"{dict(cfg)}")
        self.negative_prompt = negative_prompt
        self.latent_h, self.latent_w = height // step, width // step  # the packed token grid
        self.num_channels = pipe.num_channels_latents
        zeros = torch.zeros(1, self.num_channels, self.latent_h, self.latent_w)
        self.img_ids = self._prepare_latents(1, None, latents=zeros).get("img_ids")
        self._txt_ids: dict[int, torch.Tensor] = {}
        self._grid: torch.Tensor | None = None  # the flow map's σ grid, fixed by the first sigmas(T)
        if self.flow_map:
            steps = self.block(f"{self._core}.set_timesteps").num_inference_steps
            self._default_grid = scheduler_sigmas(pipe.scheduler, steps)

    # --------------------------------------------------------------------------------------------- blocks
    @property
    def _core(self) -> str:
        return "denoise.text2image"

    def _prepare_latents(self, batch_size: int, generator, latents=None):
        return self.run(f"{self._core}.prepare_latents", batch_size=batch_size, num_images_per_prompt=1,
                        generator=generator, height=self.height, width=self.width, latents=latents,
                        dtype=torch.float32)

    def _encode_one(self, prompt: str) -> torch.Tensor:
        """(1, L, D) of one prompt through the ``text_encoder`` block, L its own window."""
        guider = getattr(self.pipe, "guider", None)
        enabled = guider is not None and self.pipe.requires_unconditional_embeds
        if enabled:  # the negative prompt is encoded once per batch below, not once per prompt by the block
            guider.disable()
        try:
            state = self.run("text_encoder", prompt=prompt, max_sequence_length=self.max_sequence_length)
        finally:
            if enabled:
                guider.enable()
        return state.get("prompt_embeds")

    def _txt_ids_of(self, length: int) -> torch.Tensor:
        """(L, 4) text position ids of a window of ``length`` tokens (the ``prepare_rope_inputs`` block)."""
        if length not in self._txt_ids:
            dummy = torch.zeros(1, length, 1)
            self._txt_ids[length] = self.run(f"{self._core}.prepare_rope_inputs", prompt_embeds=dummy).get("txt_ids")
        return self._txt_ids[length]

    # --------------------------------------------------------------------------------------------- interface
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3-VL embeddings of B prompts, no gradient: ``prompt_embeds`` (B, L, 8·D) padded with zeros after each
        row's own window to the batch's longest L (the padding is never read), ``text_len`` (B,) long, each row's
        window; for FLUX.3 (not the distilled model) the shared ``negative_prompt_embeds`` (1, L', 8·D).

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        rows = [self._encode_one(p) for p in prompts]
        longest = max(r.shape[1] for r in rows)
        embeds = torch.cat([torch.nn.functional.pad(r, (0, 0, 0, longest - r.shape[1])) for r in rows])
        lengths = torch.tensor([r.shape[1] for r in rows], dtype=torch.long, device=embeds.device)
        shared = {} if self.distilled else {"negative_prompt_embeds": self._encode_one(self.negative_prompt)}
        return PromptEmbeds({"prompt_embeds": embeds, "text_len": lengths}, shared)

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, N, C) float32 packed noise (contiguous) from the ``prepare_latents`` block: ``randn_tensor`` of
        (B, C, h/2, w/2) with one generator per sample, flattened to tokens.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        if isinstance(generator, list | tuple) and len(generator) != batch_size:
            raise ValueError(f"got {len(generator)} generators for a batch of {batch_size} latents")
        gen = list(generator) if isinstance(generator, tuple) else generator
        return self._prepare_latents(batch_size, gen).get("latents").float().contiguous()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, N, C) float32 velocity at (latents, σ), as the module docstring says: per row its own text window;
        FLUX.3's guidance for s ≠ 1; the distilled flow map's jump from σ to the largest σ' < σ of its grid (the
        first :meth:`sigmas` grid; before one, the pipeline's default step count): at a grid step, the step the
        pipeline takes.

        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        sigma = self.batch_sigma(latents, sigma, embeds)
        dtype = self.dtype
        t = (sigma * 1000 / 1000).to(dtype)  # the block: (scheduler timestep / 1000) cast to the latents' dtype
        target = self._target(sigma).to(dtype) if self.flow_map else None
        v_c = self._by_length(latents, t, target, embeds["prompt_embeds"], embeds["text_len"])
        if self.distilled or math.isclose(guidance_scale, 1.0):
            return v_c.float()
        neg = embeds["negative_prompt_embeds"]
        lengths = torch.full((latents.shape[0],), neg.shape[1], dtype=torch.long)
        v_u = self._by_length(latents, t, target, neg.expand(latents.shape[0], -1, -1), lengths)
        return (v_u + guidance_scale * (v_c - v_u)).float()  # the guider's formula, in the transformer's dtype

    def _target(self, sigma: torch.Tensor) -> torch.Tensor:
        """(B,) float32: for each σ the largest σ' < σ of the flow map's grid (the next step of a grid σ, as the
        distilled pipeline's loop passes it; 0 below the last positive step, and 0 at σ = 0, where no σ' is
        below: the identity jump, never a jump back up the grid), computed as the loop computes it from the
        scheduler's timestep: ``(σ'·1000)/1000`` in float32 (``next_t / 1000``, ``next_t = timesteps[i + 1]``;
        one float32 ulp from σ' at some σ')."""
        grid = (self._grid if self._grid is not None else self._default_grid).to(sigma.device)
        below = grid[None, :] < sigma[:, None]  # the grid descends: the first True is the largest
        nxt = torch.where(below.any(dim=1), grid[below.float().argmax(dim=1)], torch.zeros_like(sigma))
        return nxt.float() * 1000 / 1000

    def _by_length(self, latents, t, target, prompt_embeds, lengths) -> torch.Tensor:
        """The transformer on the rows of each text length (one call per length, in order of first appearance)."""
        lengths = lengths.tolist()
        out = None
        for length in dict.fromkeys(lengths):
            rows = [i for i, n in enumerate(lengths) if n == length]
            whole = len(rows) == len(lengths)
            idx = None if whole else torch.tensor(rows, device=latents.device)

            def pick(x, idx=idx):
                return x if idx is None else x.index_select(0, idx)

            v = self._forward(pick(latents), pick(t), None if target is None else pick(target),
                              pick(prompt_embeds)[:, :length], length)
            if whole:
                return v
            if out is None:
                out = v.new_empty((latents.shape[0], *v.shape[1:]))
            out[idx] = v
        return out

    def _forward(self, latents, t, target, prompt_embeds, length) -> torch.Tensor:
        dtype = self.dtype
        kwargs = {} if target is None else {"target_timestep": target}
        return self.forward_module(
            hidden_states=latents.to(dtype), timestep=t, encoder_hidden_states=prompt_embeds.to(dtype),
            txt_ids=self._txt_ids_of(length).to(latents.device), img_ids=self.img_ids.to(latents.device),
            return_dict=False, **kwargs,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 in [0, 1]: the ``after_denoise`` block (tokens back to (B, C, h/2, w/2)) and the
        ``decode`` block (BatchNorm un-normalisation, un-patchify, VAE decode, postprocess to ``pt``)."""
        grid = self.run(f"{self._core}.after_denoise", latents=latents.to(self.pipe.vae.dtype), height=self.height,
                        width=self.width).get("latents")
        return self.run("decode", latents=grid, output_type="pt").get("images").float()

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid as the ``set_timesteps`` block builds it: ``linspace(1, 1/T, T)`` through the
        scheduler's static shift, then 0. The distilled adapter keeps the first grid it gives: its velocity jumps
        to that grid's next σ.

        Raises:
            ValueError: ``num_steps`` < 1; for the distilled model, another T than its first.
        """
        grid = scheduler_sigmas(self.pipe.scheduler, num_steps)
        if self.flow_map:
            if self._grid is not None and len(self._grid) != len(grid):
                raise ValueError(f"the distilled FLUX.3 flow map jumps along one σ grid per run: it samples with "
                                 f"{len(self._grid) - 1} steps, got {num_steps} (set sampling.num_steps and "
                                 "eval_sampling.num_steps alike)")
            self._grid = grid
        return grid


def load_flux3_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                       max_sequence_length: int, empty_transformer: bool = False) -> Flux3Adapter:
    """The modular FLUX.3 pipeline of ``path`` (either class; its index names which) without its prompt upsampler,
    components in ``dtype``, wrapped; the size defaults to the ``prepare_latents`` block's (1024 px)."""
    pipe = load_modular_pipeline(path, dtype=dtype, drop_blocks=("prompt_upsampler",),
                                 empty_transformer=empty_transformer)
    block = find_block(pipe, "denoise.text2image.prepare_latents")
    return Flux3Adapter(pipe, height=height or block.default_height, width=width or block.default_width,
                        max_sequence_length=max_sequence_length)


# ---------------------------------------------------------------------------------------------- tiny builder
def build_tiny_flux3(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32, seed: int = 0,
                     transformer_kwargs: dict | None = None, distilled: bool = False) -> Path:
    """Build a random tiny FLUX.3 modular pipeline (``distilled``: the step-distilled one, a flow-map transformer)
    and ``save_pretrained`` it into ``out_dir`` (``modular_model_index.json`` and one folder per component, the
    layout of a modular hub repository); return the folder.

    The real classes at toy size: ``Flux3Transformer2DModel`` (1 per-mode and 1 single block, 2 heads of 16),
    ``AutoencoderKLFlux2`` (4 latent channels → 16 packed), a 32-layer ``Qwen3VLForConditionalGeneration`` of width
    16 (the block stacks layers 4…32: 128 channels) with a ``Qwen3VLProcessor`` around a tokenizer trained in memory;
    scheduler and guider are the blocks' own ``from_config`` defaults (shift 6.93, guidance 3.5), not saved. The index
    names each component by this folder's absolute path, as diffusers writes it; a copy of the folder loads its own
    component folders (diffusers reads local ones first).
    ``sample_size`` is only checked.

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from diffusers import Flux3AutoBlocks, Flux3DistilledAutoBlocks, Flux3Transformer2DModel

    from flowgrpo.models.flux2 import build_flux2_vae
    from flowgrpo.models.tiny import build_tiny_qwen3vl
    from flowgrpo.models.zimage import build_tiny_qwen3_tokenizer

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny FLUX.3 sample_size must be a positive multiple of 16, got {sample_size}")
    tok = build_tiny_qwen3_tokenizer(words)
    processor, encoder = build_tiny_qwen3vl(tok, num_layers=32, seed=seed)
    torch.manual_seed(seed + 2)
    transformer = Flux3Transformer2DModel(**{
        "in_channels": 16, "cond_in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 8 * 16, "timestep_channels": 32,
        "axes_dims_rope": (4, 4, 4, 4), "flow_map": distilled, **(transformer_kwargs or {}),
    })
    blocks = Flux3DistilledAutoBlocks() if distilled else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")  # its Qwen3.5 components are not part of the tiny repository
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=transformer, vae=build_flux2_vae(seed + 1), text_encoder=encoder,
                           tokenizer=processor)
    out = Path(out_dir).absolute()
    pipe.save_pretrained(str(out), overwrite_modular_index=True)
    return out
