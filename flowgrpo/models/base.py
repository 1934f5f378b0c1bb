"""The model adapter interface: the only place model-specific code lives.

An adapter wraps one diffusers flow-matching pipeline and exposes the five operations the sampler and trainer
need. Rollout and training both call :meth:`ModelAdapter.velocity`, so the importance ratio is exactly 1
on-policy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Protocol

import torch

from flowgrpo.models.attention import attention_context
from flowgrpo.records import PromptEmbeds

logger = logging.getLogger(__name__)


__all__ = ["AdapterBase", "ModelAdapter", "PromptEmbeds", "decode_latents"]  # PromptEmbeds lives in flowgrpo.records


class ModelAdapter(Protocol):
    """What the sampler and trainer need from a text-to-image flow-matching model.

    Latents are kept in the transformer's own layout (FLUX: packed (B, N, 4·C) tokens; SD3: (B, C, h, w)).
    """

    transformer: torch.nn.Module
    height: int
    width: int

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Text embeddings for B prompts, computed without gradient."""

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, …) float32 standard normal latents at σ = 1, one generator per sample."""

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float) -> torch.Tensor:
        """(B, …) float32 velocity v = ε − x₀ at (latents, σ).

        Args:
            latents: (B, …) in the transformer's layout, any float dtype.
            sigma: (B,) or scalar σ in (0, 1].
            embeds: B rows of :meth:`encode_prompts` output.
        Raises:
            ValueError: embeds whose batch size differs from the latents' (:meth:`AdapterBase.batch_sigma`).
        """

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) float32 images in [0, 1] from clean latents (σ = 0). An adapter whose state lacks part of
        what it decodes (LTX-2 image-to-video: the conditioning frame) sets ``decode_needs_embeds = True`` and
        takes the rows' :class:`PromptEmbeds` as a second argument; callers go through :func:`decode_latents`."""

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """(T+1,) float32 σ grid of the model's scheduler for ``num_steps`` steps, from 1 down to 0, on the host
        (the trainer indexes it with host indices)."""

    def reference(self) -> contextlib.AbstractContextManager:
        """Context in which :meth:`velocity` is the frozen reference policy (LoRA disabled, or a frozen copy)."""


def decode_latents(adapter, latents: torch.Tensor, embeds: PromptEmbeds | None) -> torch.Tensor:
    """``adapter.decode(latents)``, or ``adapter.decode(latents, embeds)`` for an adapter with
    ``decode_needs_embeds`` (:meth:`ModelAdapter.decode`); ``embeds`` are the B rows of the latents."""
    if getattr(adapter, "decode_needs_embeds", False):
        return adapter.decode(latents, embeds)
    return adapter.decode(latents)


@contextlib.contextmanager
def lora_disabled(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` with its peft adapters disabled (the reference policy), re-enabling them after."""
    module.disable_adapters()
    try:
        yield
    finally:
        module.enable_adapters()


def one_image_per_prompt(images, prompts: list[str], family: str) -> list:
    """The image-to-video adapters' conditioning check: ``images`` holds one list of exactly one image per prompt.
    Returns each prompt's image.

    Raises:
        ValueError: naming ``family``: no images, a count that differs from the prompts', or a prompt with other
            than one image.
    """
    if images is None or len(images) != len(prompts):
        raise ValueError(f"{family} image-to-video needs one image per prompt, got "
                         f"{0 if images is None else len(images)} image lists for {len(prompts)} prompts")
    if any(len(imgs) != 1 for imgs in images):
        raise ValueError(f"{family} image-to-video takes exactly one image per prompt, got {[len(i) for i in images]}")
    return [imgs[0] for imgs in images]


def config_difference(ours, theirs) -> tuple[str, object, object] | None:
    """The first setting (key, theirs, ours) in which two transformer configs (diffusers ``config`` mappings)
    disagree, among the keys both hold (``_``-prefixed bookkeeping left out), or None when they agree: the test
    that a transformer's weights are of the same architecture as ``ours`` (a size, a block count, a width)."""
    for key in ours:
        if not key.startswith("_") and key in theirs and theirs[key] != ours[key]:
            return key, theirs[key], ours[key]
    return None


def check_num_steps(num_steps: int) -> None:
    """The σ grid's input check: ``ValueError`` unless ``num_steps`` >= 1."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")


class AdapterBase:
    """What every adapter shares: the pipeline, its transformer, the reference policy, and the module that runs
    the forward pass.

    ``attention_backend`` names the SDPA kernels the transformer may use (``model.attention_backend``).
    ``transformer`` is always the bare diffusers module (its config, its peft adapters, its parameters);
    ``forward_module`` is what is called, the same module or the trainer's distributed wrapper of it
    (``accelerator.prepare``), so that gradients are synchronised across processes.
    """

    def __init__(self, pipe, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int | None = None) -> None:
        self.pipe = pipe
        self.height, self.width = height, width  # image size in pixels
        self.max_sequence_length = max_sequence_length  # text tokens per prompt
        self.transformer = pipe.transformer
        self.forward_module: torch.nn.Module = pipe.transformer
        self.frozen_reference: torch.nn.Module | None = None
        self.truncation = TruncationCheck()
        self.attention_backend = "auto"
        self.compute_dtype: torch.dtype | None = None  # set for float32 master weights (flowgrpo.parallel)
        self.encoders_offload = None  # set by flowgrpo.parallel.place_pipeline (parallel.text_encoders=offload)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the transformer computes in (its inputs are cast to it): ``compute_dtype`` when its weights
        are float32 masters of a lower-precision forward, else its parameters' dtype."""
        return self.compute_dtype or next(self.transformer.parameters()).dtype

    def encoding(self) -> contextlib.AbstractContextManager:
        """The scope prompts are encoded in: with offloaded encoders (``parallel.text_encoders=offload``) they
        are on the device inside it and back in host memory after; otherwise nothing happens."""
        return self.encoders_offload() if self.encoders_offload is not None else contextlib.nullcontext()

    def initial_latents(self, batch_size: int, generator) -> torch.Tensor:
        """(B, *latent_shape) float32 standard-normal latents at σ = 1, drawn by :meth:`normal_noise`, for an
        adapter whose latents are the pipeline's own unpacked noise (it sets ``latent_shape``, one sample's shape:
        the video adapters' (C, F', h, w)); an adapter that packs its noise overrides this.

        Raises:
            ValueError: a generator list whose length is not ``batch_size``.
        """
        return self.normal_noise((batch_size, *self.latent_shape), generator)

    def normal_noise(self, shape: tuple[int, ...], generator) -> torch.Tensor:
        """``shape`` (B, …) float32 standard-normal noise on the model's device, drawn by diffusers'
        ``randn_tensor`` as the pipelines' ``prepare_latents`` draw it (a generator per sample, or one for all).

        Raises:
            ValueError: a generator list whose length is not B = ``shape[0]``.
        """
        from diffusers.utils.torch_utils import randn_tensor

        if isinstance(generator, list | tuple) and len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]} latents")
        gen = list(generator) if isinstance(generator, tuple) else generator
        return randn_tensor(shape, generator=gen, device=self.device, dtype=torch.float32)

    @staticmethod
    def check_image_size(what: str, height: int, width: int, step: int) -> None:
        """The size check: ``ValueError`` naming ``what`` (e.g. "FLUX image size") unless ``height`` and ``width``
        are positive multiples of ``step`` pixels (the VAE's scale factor times the transformer's patch)."""
        if height <= 0 or width <= 0 or height % step or width % step:
            raise ValueError(f"{what} must be a positive multiple of {step}, got {height}x{width}")

    def check_images_shape(self, images: torch.Tensor) -> None:
        """The input check of ``encode_images``: ``ValueError`` unless ``images`` is (B, 3, height, width) with
        B >= 1, the adapter's size."""
        want = (3, self.height, self.width)
        if images.ndim != 4 or images.shape[0] < 1 or tuple(images.shape[1:]) != want:
            raise ValueError(f"encode_images needs (B, 3, {self.height}, {self.width}) images in [0, 1], got shape "
                             f"{tuple(images.shape)}")

    @staticmethod
    def check_sequence_length(family: str, max_sequence_length: int, limit: int) -> None:
        """The text-length check: ``ValueError`` unless ``max_sequence_length`` is in [1, ``limit``]."""
        if not 1 <= max_sequence_length <= limit:
            raise ValueError(f"{family} max_sequence_length must be in [1, {limit}], got {max_sequence_length}")

    @staticmethod
    def prompt_list(prompts) -> list[str]:
        """``prompts`` as a list; ``ValueError`` when it is empty (the check every ``encode_prompts`` shares)."""
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        return prompts

    check_num_steps = staticmethod(check_num_steps)

    @staticmethod
    def batch_sigma(latents: torch.Tensor, sigma, embeds) -> torch.Tensor:
        """σ as (B,) float32 on the latents' device, B = ``latents.shape[0]``; the input check every ``velocity``
        shares. Raises ``ValueError`` when ``embeds`` holds other than B rows."""
        b = latents.shape[0]
        if len(embeds) != b:
            raise ValueError(f"velocity got {b} latents but {len(embeds)} prompt embeddings")
        return torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(b)

    def attention(self) -> contextlib.AbstractContextManager:
        """The SDPA kernels of ``attention_backend`` (see :mod:`flowgrpo.models.attention`): every transformer
        call and the update's backward pass run inside it. Inside an open one (the update's forward within its
        backward's context) it is a no-op: the kernels are already chosen."""
        if getattr(self, "_attention_open", False):
            return contextlib.nullcontext()
        return self._attention_scope()

    @contextlib.contextmanager
    def _attention_scope(self):
        self._attention_open = True
        try:
            with attention_context(self.attention_backend, self.device):
                yield
        finally:
            self._attention_open = False

    #: the transformer's attributes that hold its blocks, in the order its forward runs them (DMD2's GAN head reads
    #: one block's image tokens, :meth:`feature_blocks`); empty: a family whose blocks are not named here
    block_lists: tuple[str, ...] = ()

    def feature_blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks of ``module`` (this family's transformer, or a copy of it) in forward order, each returning
        ``(encoder_hidden_states, hidden_states)`` (:meth:`block_image_tokens`). Raises ``ValueError`` (one line)
        for a family without ``block_lists`` or a module without them."""
        lists = [getattr(module, name, None) for name in self.block_lists]
        if not self.block_lists or any(blocks is None for blocks in lists):
            raise ValueError(f"objective.gan needs the transformer blocks of the model, and {type(self).__name__} "
                             f"names none (block_lists: {list(self.block_lists)}); the GAN term runs on FLUX.1 "
                             "and SD3 models")
        return [block for blocks in lists for block in blocks]

    @staticmethod
    def block_image_tokens(output) -> torch.Tensor:
        """(B, L, C) the image tokens of a block's output: ``hidden_states``, the second of the
        ``(encoder_hidden_states, hidden_states)`` pair the FLUX.1 and SD3 blocks return (diffusers 0.42)."""
        return output[1] if isinstance(output, tuple | list) else output

    @staticmethod
    def feature_width(module: torch.nn.Module) -> int:
        """C, the width of ``module``'s block outputs: ``num_attention_heads · attention_head_dim`` of its
        config (the inner dimension of FLUX.1 and SD3)."""
        return int(module.config.num_attention_heads) * int(module.config.attention_head_dim)

    def reference(self) -> contextlib.AbstractContextManager:
        """The frozen reference policy: the base model with LoRA disabled, or the frozen copy (full
        fine-tuning, created by :func:`flowgrpo.models.lora.setup_trainable` when β > 0)."""
        if self.frozen_reference is not None:
            return _forward_with(self, self.frozen_reference)
        return lora_disabled(self.transformer)


class TruncationCheck:
    """Counts prompts a text encoder's tokenizer cuts at its limit, and warns once per encoder and run.

    Two prompts that differ only after an encoder's limit get the same embedding while the rewards read the whole
    prompt; a user must know. ``counts`` holds, per encoder, how many encodings so far were truncated (the
    trainer logs it as ``rollout/truncated_prompts``).
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._cache: dict[tuple[str, str], bool] = {}

    def __call__(self, encoder: str, tokenizer, prompts: list[str], limit: int) -> int:
        """Count (and warn about) the ``prompts`` longer than ``limit`` tokens of ``tokenizer``, special tokens
        included (the encoders see at most ``limit``). Returns the number truncated in this call."""
        todo = [p for p in dict.fromkeys(prompts) if (encoder, p) not in self._cache]
        if todo:
            lengths = [len(ids) for ids in tokenizer(todo, truncation=False, add_special_tokens=True).input_ids]
            self._cache.update({(encoder, p): n > limit for p, n in zip(todo, lengths, strict=True)})
        cut = [p for p in prompts if self._cache[(encoder, p)]]
        if cut and encoder not in self.counts:
            logger.warning("%d of %d prompts exceed the %s text encoder's limit of %d tokens and are truncated "
                           "(e.g. %r): the model does not see their end, the rewards do. Shorten them or raise "
                           "model.max_sequence_length (T5) where the encoder allows it. Shown once; counted in "
                           "rollout/truncated_prompts.", len(cut), len(prompts), encoder, limit, cut[0][:80])
        if cut or encoder in self.counts:
            self.counts[encoder] = self.counts.get(encoder, 0) + len(cut)
        return len(cut)

    @property
    def total(self) -> int:
        """Truncated encodings so far, summed over the encoders."""
        return sum(self.counts.values())


@contextlib.contextmanager
def _forward_with(adapter: AdapterBase, module: torch.nn.Module) -> Iterator[None]:
    current = adapter.forward_module
    adapter.forward_module = module
    try:
        yield
    finally:
        adapter.forward_module = current


def scheduler_sigmas(scheduler, num_steps: int, *, mu: float | None = None,
                     grid: list[float] | None = None) -> torch.Tensor:
    """(T+1,) float32 σ grid that ``scheduler.set_timesteps`` builds, on a copy (the pipeline's scheduler keeps
    its state).

    ``grid``: the unshifted σ the pipeline passes (default ``numpy.linspace(1, 1/T, T)``, as the FLUX-family
    pipelines do); ``mu``: the resolution-dependent shift, used only when the
    scheduler has ``use_dynamic_shifting`` (Esser et al., arXiv 2403.03206, sec. 5.3.2; the pipelines'
    ``calculate_shift``). The scheduler then applies its own static or dynamic shift and terminal stretch.

    Raises:
        ValueError: ``num_steps`` < 1.
    """
    import copy

    import numpy as np

    check_num_steps(num_steps)
    scheduler = copy.deepcopy(scheduler)
    kwargs = {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps) if grid is None else grid}
    if scheduler.config.get("use_dynamic_shifting", False):
        kwargs["mu"] = mu
    scheduler.set_timesteps(num_steps, **kwargs)
    return scheduler.sigmas.float().cpu()


def pipeline_timestep(sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B,) the timestep the FLUX.1, Kontext, FLUX.2 and Qwen-Image pipelines pass their transformer, computed as
    they compute it (diffusers 0.42: ``timestep = t.expand(B).to(latents.dtype)`` … ``timestep=timestep / 1000``,
    with ``t = σ·1000`` the float32 ``scheduler.timesteps``): σ·1000 in float32, cast to the latents' ``dtype``
    (the transformer's), divided by 1000 in that dtype.

    In float32 this is (σ·1000)/1000; in bfloat16 it rounds twice, σ·1000 to 8 significant bits and then the
    quotient, which lands up to one bf16 ulp away from σ rounded once (≤ 0.0039 for σ near 1) at several steps of
    the 10-, 28- and 50-step grids. ``sigma``: (B,) float32 on the model's device.
    """
    return (sigma.float() * 1000).to(dtype) / 1000
