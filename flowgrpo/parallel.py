"""Where each part of the model lives, and how the trained transformer is spread over the processes.

One boundary decides it, once, before the first rollout (docs/many_gpus.md, "What sits on each GPU"):

* :func:`check_engine` refuses accelerate's own FSDP and DeepSpeed engines (accelerate launches the processes
  and names their devices; the sharding is ours, so that the same code runs under gloo on the CPU and NCCL on
  CUDA);
* :func:`place_pipeline` puts the pipeline's parts on the device: the VAE always (it decodes every rollout
  micro-batch), the text encoders unless ``parallel.text_encoders=offload`` (then they wait in host memory and
  move to the device only while prompts are encoded), the transformer unless it is sharded (then each block
  moves as its shard is made, so a process never holds the whole transformer on its device);
* :func:`prepare_model` makes the module the trainer calls: the transformer itself (one process), its DDP
  wrapper (several, ``parallel.sharding=none``), or the transformer with torch's ``fully_shard`` applied to each
  block the model names in ``_no_split_modules`` and to the root (``fsdp2``, any process count). Full
  fine-tuning keeps float32 master weights and computes in ``model.dtype`` (FSDP2's ``MixedPrecisionPolicy``,
  or autocast without sharding); the frozen reference of full fine-tuning is sharded like the policy (or kept
  in host memory, ``parallel.reference=cpu_offload``). Rollout, recompute and update all call the module this
  returns, so the on-policy ratio stays exactly 1 whatever the layout of the weights;
* :func:`clip_grad_norm` clips by the global gradient norm, sharded or not;
* :func:`enable_context` splits each transformer call's tokens over the ``context`` ranks of the device mesh
  (``parallel.context_degree`` > 1) with diffusers' own context parallelism (``enable_parallelism`` with a
  ``ContextParallelConfig``, Ulysses or ring attention, on the transformers that declare a ``_cp_plan``); the
  ranks of one context group hold the same samples (:mod:`flowgrpo.dist`'s data ranks).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from flowgrpo import dist

logger = logging.getLogger(__name__)

#: pipeline components that only encode the conditioning (prompts, source images), by name prefix
ENCODER_PREFIXES = ("text_encoder", "image_encoder")


def check_engine(accelerator, settings) -> None:
    """Refuse the launch engines whose update is not ours, with one line naming what to use instead.

    Args:
        accelerator: the run's ``accelerate.Accelerator``.
        settings: the ``parallel`` section (:class:`~flowgrpo.config.ParallelConfig`).
    Raises:
        ValueError: accelerate's DeepSpeed or Megatron-LM engine (they step the optimizer on their own boundary
            and clip with their own setting), accelerate's FSDP plugin (the transformer is sharded by
            ``parallel.sharding=fsdp2`` here), or accelerate mixed precision with ``fsdp2`` (the precision of a
            sharded run comes from ``model.dtype``).
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"accelerate's {kind.value} engine is not supported: it steps the optimizer at its own accumulation "
            "boundary and clips with its own setting, while the update takes train.optimizer_steps_per_epoch "
            "steps, clips at train.max_grad_norm and checks for a non-finite gradient before each step. Shard with "
            "parallel.sharding=fsdp2 and launch with configs/accelerate/fsdp.yaml (docs/many_gpus.md)")
    if kind == DistributedType.FSDP:
        raise ValueError(
            "accelerate's FSDP plugin is not used: flowgrpo shards the transformer itself. Launch a plain "
            "multi-process job (configs/accelerate/fsdp.yaml or multi_gpu.yaml) with parallel.sharding=fsdp2 "
            "(docs/many_gpus.md)")
    if settings.sharding == "fsdp2" and str(accelerator.mixed_precision) != "no":
        raise ValueError(
            f"accelerate mixed_precision={accelerator.mixed_precision} with parallel.sharding=fsdp2: a sharded run "
            "computes in model.dtype (float32 master weights for full fine-tuning); launch with mixed_precision "
            "'no' and set model.dtype")


def is_encoder(name: str) -> bool:
    """Whether the pipeline component ``name`` only encodes conditioning (a text or image encoder)."""
    return name.startswith(ENCODER_PREFIXES)


def place_pipeline(adapter, device: torch.device, settings) -> None:
    """Put every module of ``adapter.pipe`` where the run uses it (the rule of the module docstring).

    ``adapter.pipe.to(device)`` of everything is what this replaces: with ``text_encoders=offload`` the encoders
    stay in host memory, and the adapter's :meth:`~flowgrpo.models.base.AdapterBase.encoding` scope moves them to
    ``device`` for each encoding; under ``sharding=fsdp2`` the transformer stays where it was loaded (host
    memory) until :func:`prepare_model` shards it block by block onto the device.
    """
    encoders = []
    for name, part in adapter.pipe.components.items():
        if not isinstance(part, torch.nn.Module):
            continue
        if part is adapter.transformer and settings.sharding == "fsdp2":
            continue
        if is_encoder(name) and settings.text_encoders == "offload":
            encoders.append(part.to("cpu"))
            continue
        part.to(device)
    adapter.encoders_offload = EncoderOffload(encoders, device) if encoders else None


class EncoderOffload:
    """The text and image encoders of a pipeline kept in host memory: ``with offload():`` they are on the device,
    and back in host memory after (``parallel.text_encoders=offload``)."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device) -> None:
        self.modules = modules
        self.device = torch.device(device)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        for m in self.modules:
            m.to(self.device)
        try:
            yield
        finally:
            for m in self.modules:
                m.to("cpu")


class ComputeIn:
    """Calls ``module`` under ``torch.autocast(device_type, dtype)``: float32 master weights computing in
    ``dtype`` without sharding (one process or DDP; under FSDP2 its ``MixedPrecisionPolicy`` does this).

    The matrix products run in ``dtype`` with the weights cast once per forward; autocast keeps its float32 list
    (normalisations, softmax) in float32. Rollout and training both call it, so the on-policy ratio is exactly 1.
    """

    def __init__(self, module, dtype: torch.dtype, device_type: str) -> None:
        self.module = module
        self.dtype = dtype
        self.device_type = device_type

    def __call__(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def shard_blocks(module: torch.nn.Module, names=None) -> list[torch.nn.Module]:
    """The submodules of ``module`` that become FSDP2 units, outermost first: those whose class is named in
    ``names``, by default the model's own ``_no_split_modules`` (diffusers' list of blocks that must stay whole).

    Raises:
        ValueError: the model names no blocks, or none of the named classes occurs in it (naming both).
    """
    names = list(names if names is not None else getattr(module, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(module).__name__} declares no blocks to shard (_no_split_modules is empty); give "
                         "its adapter a shard_blocks list of block class names")
    blocks = [m for m in module.modules() if m is not module and type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"none of the block classes {names} occurs in {type(module).__name__}")
    return blocks


MESH_DIMS = ("replicate", "shard", "context")


def device_mesh(device: torch.device, context: int = 1):
    """The device mesh over every process, dimensions named :data:`MESH_DIMS` (a size-1 dimension kept, so every
    code path names them the same way): ``context`` innermost (``context`` consecutive global ranks split one
    transformer call's tokens), ``shard`` the rest. A one-process group is made when none was launched.

    Raises:
        ValueError: ``context`` does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    dist.ensure_process_group(device)
    world = dist.world_size()
    if context < 1 or world % context:
        raise ValueError(f"parallel.context_degree={context} must divide the world size {world}")
    return init_device_mesh(device.type, (1, world // context, context), mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh):
    """The mesh FSDP2 shards over: the ``shard`` and ``context`` dimensions flattened into one (the ranks of a
    context group hold different shards of the same weights; their gradients, each from its own tokens, are
    reduced with the others')."""
    return mesh["shard", "context"]._flatten()


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


def check_context(adapter, settings, device: torch.device) -> None:
    """Refuse a context-parallel run this model or device cannot run, with one line (``parallel.context_degree``
    > 1; nothing to check at 1).

    Raises:
        ValueError: the transformer has no ``_cp_plan`` (diffusers cannot split it: SD3, Z-Image,
            HunyuanVideo-1.5), naming the family; Ulysses with attention heads the degree does not divide; ring
            attention with a masked text (Qwen-Image: the flash kernel ring runs takes no mask), or on the CPU
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
                         "transformer declares no _cp_plan (context parallelism runs on FLUX, FLUX.2, Qwen-Image "
                         "and Wan); set parallel.context_degree=1")
    heads = getattr(tr.config, "num_attention_heads", None)
    if settings.context_attention == "ulysses" and heads is not None and heads % n:
        raise ValueError(f"parallel.context_degree={n} with ulysses attention splits the attention heads: "
                         f"{family} has {heads}, not a multiple of {n}; choose a degree that divides {heads} or "
                         "parallel.context_attention=ring")
    if settings.context_attention == "ring" and "encoder_hidden_states_mask" in _split_names(tr):
        raise ValueError(f"parallel.context_attention=ring with {family}: its text is masked (prompts padded to the "
                         "batch's longest), and the flash kernel of diffusers' ring attention takes no mask; use "
                         "parallel.context_attention=ulysses")
    if settings.context_attention == "ring" and torch.device(device).type == "cpu":
        raise ValueError("parallel.context_attention=ring on the CPU: diffusers' ring attention needs each block's "
                         "log-sum-exp, which its CPU attention backend (native SDPA) does not return; use "
                         "parallel.context_attention=ulysses")


def context_modules(adapter) -> list[torch.nn.Module]:
    """The modules whose calls context parallelism splits: every transformer of the pipeline (Wan2.2 A14B's
    frozen second expert too) and the frozen reference copy of full fine-tuning, if any."""
    parts = [m for name, m in adapter.pipe.components.items()
             if name.startswith("transformer") and isinstance(m, torch.nn.Module)]
    ref = adapter.frozen_reference
    return parts + ([ref] if isinstance(ref, torch.nn.Module) else [])


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


def shard(module: torch.nn.Module, *, mesh, param_dtype: torch.dtype | None, reshard: bool, offload: bool = False,
          master_dtype: torch.dtype | None = None, names=None) -> torch.nn.Module:
    """Apply ``fully_shard`` to every block of :func:`shard_blocks` (innermost first) and to the root, in place.

    Args:
        module: a module in host memory (each block is moved to the mesh's device as its shard is made).
        mesh: the device mesh.
        param_dtype: the dtype the gathered weights compute in (None: each parameter's own dtype); gradients are
            reduced in float32.
        reshard: free the gathered weights after each forward (``reshard_after_forward``).
        offload: keep the shards in host memory (``CPUOffloadPolicy``), gathered to the device for each forward.
        master_dtype: cast each block to this dtype just before it is sharded (the float32 master weights), so the
            host never holds a second whole copy of the model.
        names: block class names (default: the model's ``_no_split_modules``).
    Returns:
        ``module`` (now an ``FSDPModule``; its parameters are DTensors).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    blocks = shard_blocks(module, names)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    rest = [p for p in module.parameters() if id(p) not in in_blocks]  # embedders, norms, output projection
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard, "offload_policy": policy,
              "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
    for block in reversed(blocks):
        if master_dtype is not None:
            block.to(master_dtype)
        fully_shard(block, **kwargs)
    if master_dtype is not None:
        for p in rest:
            p.data = p.data.to(master_dtype)
    fully_shard(module, **kwargs)
    return module


def master_weights(config) -> torch.dtype | None:
    """The compute dtype when the trained weights are float32 masters computing in another dtype: full
    fine-tuning with ``model.dtype`` bfloat16 (or float16); None otherwise (LoRA trains float32 adapters over
    frozen weights of ``model.dtype``; a float32 model computes in float32)."""
    from flowgrpo.models import DTYPES

    dtype = DTYPES[config.model.dtype]
    return dtype if config.model.finetune == "full" and dtype != torch.float32 else None


def prepare_model(adapter, accelerator, config) -> torch.nn.Module:
    """Make the module the trainer trains and calls, and point the adapter's forward (and reference) at it.

    Returns the module whose parameters the optimizer, clipping, EMA and checkpoints use: the FSDP2-sharded
    transformer (``parallel.sharding=fsdp2``), accelerate's DDP wrapper (several processes), or the transformer.
    With float32 master weights (:func:`master_weights`) the transformer's parameters become float32 and
    ``adapter.compute_dtype`` is ``model.dtype``: the adapter casts its inputs to it, and the forward computes in
    it (the mixed-precision policy, or :class:`ComputeIn`). The frozen reference (full fine-tuning, β > 0) keeps
    ``model.dtype`` weights and computes through the same path.
    """
    tr, settings = adapter.transformer, config.parallel
    compute = master_weights(config)
    device = accelerator.device
    ref = adapter.frozen_reference
    check_context(adapter, settings, device)
    if settings.sharding == "fsdp2":
        context = settings.context_degree
        mesh = device_mesh(device, context)
        dist.set_context_degree(context)
        if context > 1:  # before sharding: diffusers' hooks wrap the plain modules' forwards
            enable_context(context_modules(adapter), mesh, settings, device)
        names = getattr(adapter, "shard_blocks", None)
        units = len(shard_blocks(tr, names))
        flat = fsdp_mesh(mesh)
        model = shard(tr, mesh=flat, param_dtype=compute, reshard=settings.reshard_after_forward,
                      master_dtype=torch.float32 if compute is not None else None, names=names)
        if ref is not None:
            adapter.frozen_reference = shard(ref, mesh=flat, param_dtype=None, reshard=True,
                                             offload=settings.reference == "cpu_offload", names=names)
        forward = model
        logger.info("transformer sharded over %d process(es) (FSDP2, %d blocks)%s", dist.world_size(), units,
                    f"; context degree {context} ({settings.context_attention}), {dist.data_world_size()} data "
                    "rank(s)" if context > 1 else "")
    else:
        if compute is not None:
            tr.to(torch.float32)
        model = accelerator.prepare(tr)  # DDP over several processes, the module itself on one
        forward = model if compute is None else ComputeIn(model, compute, device.type)
        if ref is not None and compute is not None:
            adapter.frozen_reference = ComputeIn(ref, compute, device.type)
    adapter.compute_dtype = compute
    adapter.forward_module = forward  # forward through the distributed wrapper (gradient sync)
    return model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer trains, taken from the prepared (wrapped or sharded) module: after
    ``fully_shard`` they are new DTensor objects, so a list taken before would get no gradient."""
    return [p for p in model.parameters() if p.requires_grad]


def clip_grad_norm(accelerator, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of ``params`` to a global 2-norm of at most ``max_norm``; returns the norm before
    clipping, over all processes' shards (one host read).

    Sharded parameters (DTensors) go through ``torch.nn.utils.clip_grad_norm_``, whose norm of DTensor gradients
    reduces the shards' squared sums over the mesh; plain ones through ``accelerator.clip_grad_norm_`` (DDP's
    gradients are already the all-reduced mean on every process).
    """
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return float(accelerator.clip_grad_norm_(params, max_norm))


def reshard(model: torch.nn.Module | None) -> None:
    """Free the gathered weights of every FSDP2 unit of ``model`` (``FSDPModule.reshard``), so the next forward
    gathers them again from the shards: needed around a swap of the shards' values (the old copy of the
    forward-process objectives), since with ``reshard_after_forward=false`` a forward would reuse weights gathered
    before the swap. A no-op for an unsharded module or None."""
    if model is None:
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def release() -> None:
    """Undo what this module set up for a run that ends (the one-process group made for FSDP2)."""
    dist.release_own_group()
