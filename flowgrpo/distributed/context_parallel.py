"""Context (sequence) parallelism: each transformer call's tokens split over the ``context`` ranks of the device
mesh (``parallel.context_degree`` > 1), with diffusers' own implementation (``enable_parallelism`` with a
``ContextParallelConfig``: Ulysses or ring attention, on the transformers that declare a ``_cp_plan``).

:func:`check_context` refuses what a model or device cannot run, in one line; :func:`enable_context` splits the
modules :func:`context_modules` names (every pipeline transformer and a separate frozen reference), before they
are sharded by :func:`flowgrpo.parallel.prepare_model`; :func:`cpu_accelerator` is the one shim diffusers needs
on the CPU. The ranks of one context group hold the same samples (:mod:`flowgrpo.distributed.dist`'s data ranks), and
the
output of each call is gathered, so every rank of a group gets the whole velocity (docs/many_gpus.md, "Context
parallelism").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cpu_accelerator() -> Iterator[None]:
    """While open, torch reports the CPU as the accelerator with one device.

    Why: diffusers 0.42's ``ModelMixin._resolve_parallel_config`` (inside ``enable_parallelism``) takes the device
    of context parallelism from ``torch._C._get_accelerator()`` and ``rank % torch.accelerator.device_count()``;
    on a machine without an accelerator the count is 0 (``ZeroDivisionError``), and on a GPU machine running on
    the CPU the device would be a GPU. The device it computes is only recorded: the collectives run on the mesh's
    groups (gloo on the CPU). Used by :func:`enable_context` for a CPU device only; both are restored on exit.
    """
    get, count = torch._C._get_accelerator, torch.accelerator.device_count
    torch._C._get_accelerator = lambda: torch.device("cpu")
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch._C._get_accelerator, torch.accelerator.device_count = get, count


#: a transformer's second token stream (beside ``hidden_states``) that its own attention layers run over: under
#: context parallelism diffusers' attention dispatch treats every sequence as split, so a stream the ``_cp_plan``
#: leaves whole reaches Ulysses' all-to-all unsplit (LTX-2 in diffusers 0.42: its audio self- and cross-attention
#: fail on shapes; ``bench/context_families.py``). A text the plan leaves whole is harmless (Wan: cross-attention
#: keys repeated on every rank give the same softmax average) and not listed.
UNSPLIT_STREAMS = ("audio_hidden_states",)


def check_context(adapter, settings, device: torch.device) -> None:
    """Refuse a context-parallel run this model or device cannot run, with one line (``parallel.context_degree``
    > 1; nothing to check at 1).

    Raises:
        ValueError: the transformer has no ``_cp_plan`` (diffusers cannot split it: SD3, Z-Image,
            HunyuanVideo-1.5, Qwen-Image 2.1, FLUX.3), naming the family; a second token stream the plan leaves
            whole (LTX-2's audio, :data:`UNSPLIT_STREAMS`); Ulysses with attention heads the degree does not divide;
            ring attention with a masked text (Qwen-Image: the flash kernel ring runs takes no mask), or on the CPU
            (diffusers 0.42's ring needs the attention's log-sum-exp, which its CPU (native SDPA) backend does not
            return).
    """
    n = settings.context_degree
    if n == 1:
        return
    tr = next((m for m in context_modules(adapter) if getattr(m, "_cp_plan", None) is None), adapter.transformer)
    family = f"{type(tr).__name__} ({type(adapter.pipe).__name__})"
    if getattr(tr, "_cp_plan", None) is None:
        raise ValueError(f"parallel.context_degree={n}: diffusers cannot split the tokens of {family}, whose "
                         "transformer declares no _cp_plan (context parallelism runs on FLUX.1, FLUX.2, Qwen-Image "
                         "and Wan, text-to-video and image-to-video; docs/many_gpus.md lists each family); set "
                         "parallel.context_degree=1")
    unsplit = [a for a in UNSPLIT_STREAMS if a in _forward_args(tr) and a not in _split_names(tr)]
    if unsplit:
        raise ValueError(f"parallel.context_degree={n}: diffusers' _cp_plan of {family} splits its video tokens "
                         f"but not its {unsplit[0]}, whose attention then mixes whole and split sequences and "
                         "fails; set parallel.context_degree=1")
    check_split(n, settings.context_attention, family, heads=getattr(tr.config, "num_attention_heads", None))
    if settings.context_attention == "ring" and "encoder_hidden_states_mask" in _split_names(tr):
        raise ValueError(f"parallel.context_attention=ring with {family}: its text is masked (prompts padded to the "
                         "batch's longest), and the flash kernel of diffusers' ring attention takes no mask; use "
                         "parallel.context_attention=ulysses")
    if settings.context_attention == "ring" and torch.device(device).type == "cpu":
        raise ValueError("parallel.context_attention=ring on the CPU: diffusers' ring attention needs each block's "
                         "log-sum-exp, which its CPU attention backend (native SDPA) does not return; use "
                         "parallel.context_attention=ulysses")


def check_split(degree: int, attention: str, family: str, heads: int | None = None,
                tokens: tuple[int, str] | None = None) -> None:
    """The one check of how a context group of ``degree`` processes splits a model, shared by the run's preflight
    (:func:`flowgrpo.preflight.check_context_tokens`, from the model folder's configs), the loaded model
    (:func:`check_context`) and the memory plan (:func:`flowgrpo.memory_plan.estimate.plan_config`): Ulysses
    (``attention``
    ``"ulysses"``) splits the ``heads`` attention heads of ``family``, and every transformer call's image
    ``tokens`` (count, how it was counted) split evenly. None: not known here (nothing checked). Nothing to check
    at degree 1.

    Raises:
        ValueError: one line naming the degree, the count, and the settings that fix it.
    """
    if degree == 1:
        return
    if attention == "ulysses" and heads is not None and heads % degree:
        raise ValueError(f"parallel.context_degree={degree} with ulysses attention splits the attention heads: "
                         f"{family} has {heads}, not a multiple of {degree}; choose a degree that divides {heads} "
                         "or parallel.context_attention=ring")
    if tokens is not None and tokens[0] % degree:
        raise ValueError(f"parallel.context_degree={degree} splits each transformer call's tokens evenly, but an "
                         f"image of this run has {tokens[0]} tokens ({tokens[1]}), not a multiple of {degree}; "
                         "choose model.height and model.width (model.num_frames for a video) that make it one, or "
                         "parallel.context_degree=1")


def context_modules(adapter) -> list[torch.nn.Module]:
    """The modules whose calls context parallelism splits: every transformer of the pipeline (Wan2.2 A14B's
    frozen second expert too) and the frozen reference copy of full fine-tuning, if any."""
    parts = [m for name, m in adapter.pipe.components.items()
             if name.startswith("transformer") and isinstance(m, torch.nn.Module)]
    ref = adapter.frozen_reference
    return parts + ([ref] if isinstance(ref, torch.nn.Module) else [])


def _forward_args(module) -> set[str]:
    """The names of ``module.forward``'s arguments (none when it has no inspectable forward)."""
    import inspect

    forward = getattr(module, "forward", None)
    try:
        return set(inspect.signature(forward).parameters) if forward is not None else set()
    except (TypeError, ValueError):
        return set()


def _split_names(module) -> set[str]:
    """The forward arguments the model's ``_cp_plan`` splits somewhere (by name)."""
    return {name for plan in module._cp_plan.values() if isinstance(plan, dict) for name in plan
            if isinstance(name, str)}


def _tokens(module, x: torch.Tensor) -> int:
    """Tokens of a transformer input: dim 1 of a (B, S, C) sequence, else the patches of a (B, C, [F,] H, W)
    latent by the model's ``patch_size``."""
    if x.dim() <= 3:
        return x.shape[1] if x.dim() == 3 else x.shape[0]
    patch = getattr(module.config, "patch_size", 1)
    patch = tuple(patch) if isinstance(patch, list | tuple) else (patch,) * (x.dim() - 2)
    out = 1
    for size, p in zip(x.shape[2:], patch, strict=True):
        out *= size // p
    return out


def _pad_masked_text(kwargs: dict, degree: int) -> dict:
    """``kwargs`` with ``encoder_hidden_states`` (B, L, D) and its mask (B, L) padded at the end to a multiple of
    ``degree`` tokens: zero rows, masked out (mask 0; a mask of ones is made when there was none), so the
    attention of every real token is unchanged."""
    text = kwargs.get("encoder_hidden_states")
    if not isinstance(text, torch.Tensor) or text.dim() != 3 or text.shape[1] % degree == 0:
        return kwargs
    pad = degree - text.shape[1] % degree
    mask = kwargs.get("encoder_hidden_states_mask")
    if mask is None:
        mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
    return {**kwargs, "encoder_hidden_states": torch.nn.functional.pad(text, (0, 0, 0, pad)),
            "encoder_hidden_states_mask": torch.nn.functional.pad(mask, (0, pad))}


def _check_sequence(degree: int, family: str):
    """A forward pre-hook refusing a call whose token counts the degree does not divide (``ValueError``, one line
    naming ``family``, the transformer's class), before diffusers' own split (an ``assert``) sees them. A model
    that takes a text mask and splits it (Qwen-Image, whose prompts are padded to the longest of the batch) gets
    its text padded to a multiple of the degree instead (:func:`_pad_masked_text`)."""

    def hook(module, args, kwargs):
        names = _split_names(module)
        if "encoder_hidden_states_mask" in names:
            kwargs = _pad_masked_text(kwargs, degree)
        for name in ("hidden_states", "encoder_hidden_states"):
            x = kwargs.get(name, args[0] if name == "hidden_states" and args else None)
            if name not in names or not isinstance(x, torch.Tensor):
                continue
            n = _tokens(module, x)
            if n % degree:
                raise ValueError(f"parallel.context_degree={degree} splits each call's tokens evenly: {name} of "
                                 f"{family} has {n} tokens, not a multiple of {degree}; choose "
                                 "model.height/width (num_frames, model.max_sequence_length) to make it one")
        return args, kwargs

    return hook


def enable_context(modules, mesh, settings, device: torch.device) -> None:
    """Split each call of every module in ``modules`` (:func:`context_modules`: the transformers and any separate
    frozen reference) over the mesh's ``context`` ranks with diffusers' context parallelism:
    ``enable_parallelism`` with a ``ContextParallelConfig`` of ``ulysses_degree`` (or ``ring_degree``)
    ``parallel.context_degree``, on the mesh's ``context`` dimension unflattened into the ``("ring", "ulysses")``
    dimensions diffusers names. The inputs the model's ``_cp_plan`` names are split along the sequence, attention
    exchanges heads (Ulysses) or key/value blocks (ring), and the output is gathered, so every rank of the group
    gets the whole velocity; the backward of the gather keeps each rank's slice, so the ranks' parameter gradients
    sum to the whole one. Ring attention on CUDA uses diffusers' ``_native_flash`` attention backend (the native
    one returns no log-sum-exp). A forward pre-hook refuses token counts the degree does not divide, or pads a
    masked text to a multiple of it (:func:`_check_sequence`).
    """
    from diffusers import ContextParallelConfig

    n, ring = settings.context_degree, settings.context_attention == "ring"
    cp_mesh = mesh["context"]._unflatten(0, (n, 1) if ring else (1, n), ("ring", "ulysses"))
    for module in modules:
        if ring:
            module.set_attention_backend("_native_flash")
        config = ContextParallelConfig(ring_degree=n, mesh=cp_mesh) if ring else \
            ContextParallelConfig(ulysses_degree=n, mesh=cp_mesh)
        with cpu_accelerator() if torch.device(device).type == "cpu" else contextlib.nullcontext():
            module.enable_parallelism(config=config)
        module.register_forward_pre_hook(_check_sequence(n, type(module).__name__), with_kwargs=True)
