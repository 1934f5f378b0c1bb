"""The Wan video adapter: a diffusers ``WanPipeline`` (Wan2.1 T2V 1.3B / 14B, Wan2.2 T2V A14B with its two experts,
Wan2.2 TI2V-5B) behind the :class:`~flowgrpo.models.base.ModelAdapter` interface.

What ``WanPipeline.__call__`` does, and this adapter with it:

* one UMT5 text encoder through the pipeline's own ``encode_prompt`` (ftfy + whitespace cleaning, padded to
  ``max_sequence_length`` with the padded rows zeroed); the negative prompt is ``""`` (``negative_prompt=None``);
* latents (B, C, F', h, w) float32 in the transformer's layout, F' = (F − 1)/4 + 1 latent frames, drawn by
  ``randn_tensor`` as ``prepare_latents``;
* the transformer gets the raw timestep ``t = σ·1000`` (``scheduler.timesteps``); Wan2.2 TI2V-5B
  (``expand_timesteps``) gets it once per latent token, (B, F'·h/2·w/2);
* classifier-free guidance as two separate forwards (cond, then uncond), ``v = v_u + s·(v_c − v_u)`` (Ho &
  Salimans, arXiv 2207.12598, eq. 6), only when ``guidance_scale > 1`` (``do_classifier_free_guidance``);
* Wan2.2 A14B: the high-noise expert ``transformer`` for ``t >= boundary_ratio·1000``, the low-noise
  ``transformer_2`` below, with its own scale ``guidance_scale_2`` (default: ``guidance_scale``). One expert
  is trained (``trained_expert``); the other runs frozen (its steps have ratio 1 and no gradient);
* decoding: ``x / (1/latents_std) + latents_mean`` per channel, the Wan VAE, ``VideoProcessor.postprocess_video``
  to (B, F, 3, H, W) in [0, 1].

The scheduler must be ``FlowMatchEulerDiscreteScheduler`` (the Euler step the SDE kinds extend). The released Wan
folders ship ``UniPCMultistepScheduler`` with flow sigmas; :func:`load_wan_adapter` replaces it by the Euler
scheduler with the same ``flow_shift`` (Wan2.1 480p: 3.0) and says so in the log — the trainers that RL-tune Wan
(DanceGRPO, Flow-GRPO, Flow-Factory) all sample with Euler / SDE steps, never UniPC.

    python -m flowgrpo.models.wan OUT_DIR [--variant wan21|wan22|ti2v]   # a tiny random pipeline
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from flowgrpo.models.base import AdapterBase, PromptEmbeds
from flowgrpo.models.empty import empty_components, empty_names

logger = logging.getLogger(__name__)

__all__ = ["WanAdapter", "load_wan_adapter", "build_tiny_wan"]


class WanAdapter(AdapterBase):
    """Adapter for a loaded ``diffusers.WanPipeline`` whose scheduler is ``FlowMatchEulerDiscreteScheduler``.

    Args:
        pipe: the pipeline (its trained expert may carry a peft LoRA).
        height, width: frame size in pixels, positive multiples of the VAE's spatial factor times the patch
            (16 for Wan2.1, 32 for Wan2.2 TI2V-5B). num_frames: F, 1 + a multiple of the VAE's temporal factor (4).
        max_sequence_length: UMT5 tokens per prompt (the pipeline's default 512; verl-omni's Wan2.2 uses 1024).
        guidance_scale_2: the low-noise expert's CFG scale (two-expert pipelines; None: the step's own scale).
        trained_expert: ``"transformer"`` or ``"transformer_2"`` (two-expert pipelines): the module trained.

    Raises:
        ValueError: a size, frame count or text length the pipeline cannot take, a ``guidance_scale_2`` or
            ``transformer_2`` asked of a one-expert pipeline, or a scheduler that is not the Euler one.
    """

    video = True

    def _check_rope(self, config, height: int, width: int, num_frames: int) -> None:
        """The transformer's rotary tables cover ``rope_max_seq_len`` patches per axis (frames, height, width);
        a larger size would fail inside diffusers with a reshape error. ``ValueError`` naming the size and the
        largest one the model takes."""
        limit = getattr(config, "rope_max_seq_len", None)
        if not limit:
            return
        pf, ph, pw = config.patch_size
        grid = (self.latent_shape[1] // pf, self.latent_shape[2] // ph, self.latent_shape[3] // pw)
        step = self.pipe.vae_scale_factor_spatial * ph
        if max(grid[1:]) > limit:
            raise ValueError(f"Wan frame size {height}x{width} is too large for this model: its rotary position "
                             f"tables (rope_max_seq_len={limit}) cover {limit} patches per side, i.e. at most "
                             f"{limit * step} pixels (height and width multiples of {step})")
        if grid[0] > limit:
            most = (limit * pf - 1) * self.pipe.vae_scale_factor_temporal + 1
            raise ValueError(f"Wan num_frames={num_frames} is too many for this model: its rotary position tables "
                             f"(rope_max_seq_len={limit}) cover at most {most} frames")

    def __init__(self, pipe, *, height: int, width: int, num_frames: int, max_sequence_length: int = 512,
                 guidance_scale_2: float | None = None, trained_expert: str = "transformer") -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"the Wan adapter needs FlowMatchEulerDiscreteScheduler, got "
                             f"{type(pipe.scheduler).__name__}; load the folder with load_wan_adapter")
        two = pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None
        if not two and (guidance_scale_2 is not None or trained_expert != "transformer"):
            raise ValueError("guidance_scale_2 and trained_expert 'transformer_2' need a two-expert Wan2.2 pipeline "
                             "(transformer_2 and boundary_ratio); this one has one transformer")
        if trained_expert not in ("transformer", "transformer_2"):
            raise ValueError(f"trained_expert must be 'transformer' or 'transformer_2', got {trained_expert!r}")
        patch = pipe.transformer.config.patch_size
        self.check_image_size("Wan frame size", height, width, pipe.vae_scale_factor_spatial * patch[1])
        k = pipe.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"Wan num_frames must be 1 + a multiple of {k} (e.g. 5, 81), got {num_frames}")
        self.check_sequence_length("Wan", max_sequence_length, 4096)  # UMT5's relative positions: no hard limit
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length)
        self.num_frames = num_frames
        # one sample's latents (C, F', h, w): the initial noise is drawn in this shape, as WanPipeline.prepare_latents
        self.latent_shape = (pipe.transformer.config.in_channels, (num_frames - 1) // k + 1,
                             height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)
        self._check_rope(pipe.transformer.config, height, width, num_frames)
        self.num_train_timesteps = pipe.scheduler.config.num_train_timesteps
        ratio = pipe.config.boundary_ratio if two else None
        self.boundary = None if ratio is None else ratio * self.num_train_timesteps  # a Python float, as __call__
        self.guidance_scale_2 = guidance_scale_2
        self.expand_timesteps = bool(pipe.config.expand_timesteps)
        self.experts = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2 if two else None}
        self.trained_expert = trained_expert
        self.transformer = self.forward_module = self.experts[trained_expert]
        for name, module in self.experts.items():  # the other expert runs frozen: no gradient kept for it
            if module is not None and name != trained_expert:
                module.requires_grad_(False)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """UMT5 embeddings of B prompts, ``prompt_embeds`` (B, L, D), and of the empty negative prompt, shared
        ``negative_prompt_embeds`` (1, L, D) (L = ``max_sequence_length``, zero rows past each prompt's tokens),
        from ``WanPipeline.encode_prompt`` with ``negative_prompt=None``, as ``__call__``.

        Raises:
            ValueError: an empty prompt list.
        """
        prompts = self.prompt_list(prompts)
        self.truncation("UMT5", self.pipe.tokenizer, prompts, self.max_sequence_length)
        pos, neg = self.pipe.encode_prompt(prompt=prompts, negative_prompt=None, do_classifier_free_guidance=True,
                                           num_videos_per_prompt=1, max_sequence_length=self.max_sequence_length,
                                           device=self.device)
        return PromptEmbeds({"prompt_embeds": pos}, {"negative_prompt_embeds": neg[:1]})

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, C, F', h, w) float32 guided velocity at (latents, σ) (module docstring); rows whose σ falls on
        different sides of a two-expert boundary are run by their own expert. The guidance combination is in
        float32.

        Args:
            latents: (B, C, F', h, w) any float dtype. sigma: (B,) or scalar σ in (0, 1].
            embeds: B rows of :meth:`encode_prompts` output.
        Raises:
            ValueError: embeds whose batch size differs from the latents'.
        """
        sigma = self.batch_sigma(latents, sigma, embeds)
        t = sigma * self.num_train_timesteps  # (B,) float32, bitwise the pipeline's scheduler.timesteps
        high = torch.ones_like(t, dtype=torch.bool) if self.boundary is None else t >= self.boundary
        if bool(high.all()) or not bool(high.any()):
            return self._guided(latents, t, embeds, guidance_scale, bool(high[0]))
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for rows, is_high in ((high.nonzero().flatten(), True), ((~high).nonzero().flatten(), False)):
            out[rows] = self._guided(latents[rows], t[rows], embeds.index(rows), guidance_scale, is_high)
        return out

    def _guided(self, latents, t, embeds: PromptEmbeds, guidance_scale: float, high: bool) -> torch.Tensor:
        module = self.experts["transformer" if high else "transformer_2"]
        if module is self.transformer:
            module = self.forward_module  # the trained expert through its (possibly distributed) wrapper
        scale = guidance_scale if high or self.guidance_scale_2 is None else self.guidance_scale_2
        hidden, extra = self._model_inputs(latents, embeds)
        cond = self._forward(module, hidden, t, embeds["prompt_embeds"], extra)
        if guidance_scale <= 1:  # the pipeline's do_classifier_free_guidance reads the first scale
            return cond
        uncond = self._forward(module, hidden, t, embeds["negative_prompt_embeds"].expand(latents.shape[0], -1, -1),
                               extra)
        return uncond + scale * (cond - uncond)

    def _model_inputs(self, latents: torch.Tensor, embeds: PromptEmbeds) -> tuple[torch.Tensor, dict]:
        """The transformer's ``hidden_states`` for ``latents`` and its other conditioning arguments, shared by the
        conditional and unconditional forwards: text-to-video passes the latents alone (the image-to-video
        adapter, :mod:`flowgrpo.models.wan_i2v`, adds its condition channels and image embeddings)."""
        return latents, {}

    def _forward(self, module, latents, t, text, extra: dict | None = None) -> torch.Tensor:
        b = latents.shape[0]
        if self.expand_timesteps:  # one timestep per latent token: F' · (h/2) · (w/2), as __call__'s mask
            _, f, h, w = self.latent_shape
            t = t.view(b, 1).expand(b, f * (h // 2) * (w // 2))
        extra = {k: v.to(self.dtype) for k, v in (extra or {}).items()}
        with self.attention():
            out = module(hidden_states=latents.to(self.dtype), timestep=t, encoder_hidden_states=text.to(self.dtype),
                         return_dict=False, **extra)[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, F, 3, H, W) float32 in [0, 1] from (B, C, F', h, w) clean latents, as ``WanPipeline`` decodes."""
        vae = self.pipe.vae
        x = latents.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        std_inv = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        video = vae.decode(x / std_inv + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid of ``scheduler.set_timesteps(T)`` (no custom σ, as ``WanPipeline.__call__``):
        T points from σ_max to σ_min of the shifted training schedule, shifted by ``s·σ/(1 + (s − 1)·σ)`` (Esser
        et al., arXiv 2403.03206), then a terminal 0.

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        self.check_num_steps(num_steps)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_steps)
        return scheduler.sigmas.float().cpu()


def euler_scheduler(scheduler):
    """``scheduler`` if it is ``FlowMatchEulerDiscreteScheduler``, else the Euler scheduler of a flow-sigma
    ``UniPCMultistepScheduler`` (the released Wan folders'): same ``num_train_timesteps``, ``shift = flow_shift``.

    Raises:
        ValueError: another scheduler (its prediction is not a flow velocity).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    cfg = scheduler.config
    if not (cfg.get("use_flow_sigmas") and cfg.get("prediction_type") == "flow_prediction"):
        raise ValueError(f"Wan scheduler {type(scheduler).__name__} is not a flow-matching one (use_flow_sigmas, "
                         "flow_prediction); cannot train it with flow SDE steps")
    shift = float(cfg.get("flow_shift", 1.0))
    logger.info("Wan: sampling with FlowMatchEulerDiscreteScheduler(shift=%g) in place of the folder's %s", shift,
                type(scheduler).__name__)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.num_train_timesteps, shift=shift)


def load_wan_adapter(path: str, **options) -> WanAdapter:
    """``WanPipeline.from_pretrained(path)`` wrapped in a :class:`WanAdapter` (``options``: those of
    :func:`load_wan_pipeline`)."""
    from diffusers import WanPipeline

    return load_wan_pipeline(WanPipeline, WanAdapter, path, **options)


def load_wan_pipeline(pipeline_class, adapter_class, path: str, *, dtype: torch.dtype, height: int | None,
                      width: int | None, max_sequence_length: int, num_frames: int | None = None,
                      guidance_scale_2: float | None = None, trained_expert: str = "transformer",
                      empty_transformer: bool = False, empty_other_expert: bool = False):
    """``pipeline_class.from_pretrained(path)`` (``WanPipeline`` or ``WanImageToVideoPipeline``) in ``dtype`` with
    an Euler scheduler (:func:`euler_scheduler`), wrapped in ``adapter_class`` (:class:`WanAdapter` or its
    image-to-video subclass). Defaults: the pipeline's 480 x 832 and 81 frames. ``empty_transformer`` /
    ``empty_other_expert``: leave the trained / the other expert's weights on the meta device
    (:func:`~flowgrpo.models.empty.empty_names`).

    Raises:
        ValueError: as ``adapter_class``, naming the defaults used (and the options that set the size) when
            a size was not given.
    """
    pipe = pipeline_class.from_pretrained(
        path, torch_dtype=dtype, **empty_components(
            path, empty_names(path, trained_expert, empty_transformer, empty_other_expert), dtype))
    pipe.scheduler = euler_scheduler(pipe.scheduler)
    try:
        return adapter_class(pipe, height=height or 480, width=width or 832, num_frames=num_frames or 81,
                             max_sequence_length=max_sequence_length, guidance_scale_2=guidance_scale_2,
                             trained_expert=trained_expert)
    except ValueError as err:
        unset = [n for n, v in (("height", height), ("width", width), ("num_frames", num_frames)) if v is None]
        if not unset:
            raise
        raise ValueError(f"{path}: {err}; {' and '.join(unset)} not given, so the pipeline's defaults (480x832, 81 "
                         f"frames) were used: give {' and '.join('--' + n.replace('_', '-') for n in unset)} "
                         f"(model.{', model.'.join(unset)} in a config)") from None


# ---------------------------------------------------------------------------------------------- tiny builder
def _tiny_vae(ti2v: bool, seed: int):
    """A random tiny Wan VAE (3 temporal downsamplings of 2 → 4×, spatial 8× — or, Wan2.2's, 8× plus a 2×2
    patch = 16× with 12 patched channels and residual blocks), non-trivial latent mean/std."""
    from diffusers import AutoencoderKLWan

    z = 8 if ti2v else 4
    torch.manual_seed(seed)
    extra = {"is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
             "scale_factor_spatial": 16} if ti2v else {}
    return AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True],
                            latents_mean=[0.1 * (i % 3) - 0.1 for i in range(z)],
                            latents_std=[1.0 + 0.5 * (i % 2) for i in range(z)], **extra)


def tiny_text_encoder(words: Iterable[str], seed: int):
    """(tokenizer, encoder) of the tiny Wan pipelines: an in-memory T5 unigram tokenizer (``words`` become single
    pieces, 32 tokens at most) and a random ``UMT5EncoderModel`` (2 layers of width 24, seeded with ``seed``)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from flowgrpo.models.tiny import build_t5_tokenizer

    tok = build_t5_tokenizer(words, model_max_length=32)
    torch.manual_seed(seed)
    return tok, UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=24, d_kv=8, d_ff=48, num_layers=2,
                                            num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                            eos_token_id=1)).eval()


def _tiny_transformer(in_channels: int, text_dim: int, seed: int, transformer_kwargs: dict | None):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": in_channels,
        "out_channels": in_channels, "text_dim": text_dim, "freq_dim": 16, "ffn_dim": 32, "num_layers": 2,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
        **(transformer_kwargs or {})})


def build_tiny_wan(out_dir: str | os.PathLike, seed: int = 0, *, words: Iterable[str] = (), sample_size: int = 32,
                   variant: str = "wan21", transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny ``WanPipeline`` of the real classes and ``save_pretrained`` it into ``out_dir``.

    ``variant``: ``"wan21"`` (Wan2.1 T2V: one ``WanTransformer3DModel``, the 16× Wan VAE layout at 8×),
    ``"wan22"`` (Wan2.2 T2V A14B: two experts, ``boundary_ratio`` 0.875) or ``"ti2v"`` (Wan2.2 TI2V-5B:
    ``expand_timesteps``, the Wan2.2 VAE with a 2×2 patch). UMT5 encoder (2 layers of width 24) with an in-memory
    T5 unigram tokenizer (``words`` become single pieces); ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.
    ``sample_size`` is only checked (give the size and ``num_frames`` when loading).

    Raises:
        ValueError: an unknown ``variant`` or a ``sample_size`` that is not a positive multiple of 32.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    if variant not in ("wan21", "wan22", "ti2v"):
        raise ValueError(f"variant must be 'wan21', 'wan22' or 'ti2v', got {variant!r}")
    if sample_size <= 0 or sample_size % 32:
        raise ValueError(f"tiny Wan sample_size must be a positive multiple of 32, got {sample_size}")
    tok, text = tiny_text_encoder(words, seed)
    vae = _tiny_vae(variant == "ti2v", seed + 1)
    channels = vae.config.z_dim
    transformer = _tiny_transformer(channels, 24, seed + 2, transformer_kwargs)
    experts = {}
    if variant == "wan22":
        experts = {"transformer_2": _tiny_transformer(channels, 24, seed + 3, transformer_kwargs),
                   "boundary_ratio": 0.875}
    pipe = WanPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                       expand_timesteps=variant == "ti2v", **experts)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    from flowgrpo.models.tiny import builder_main

    builder_main(lambda out, words, seed, variant: build_tiny_wan(out, seed, words=words, variant=variant), "Wan",
                 __doc__, argv, variants=("wan21", "wan22", "ti2v"))


if __name__ == "__main__":
    main()
