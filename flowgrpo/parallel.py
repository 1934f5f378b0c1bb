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
  returns, so the on-policy ratio stays exactly 1 whatever the layout of the weights. On several processes the
  weights are read once: the main process loads the transformer, the others build it on the meta device
  (:mod:`flowgrpo.models.empty`) and receive their shards from it, one tensor at a time
  (:func:`fill_from_main`); the full fine-tune's reference is built on the meta device too and filled from each
  process's own policy shards (:func:`copy_shards`), never a whole copy;
* :func:`clip_grad_norm` clips by the global gradient norm, sharded or not.
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


def device_mesh(device: torch.device):
    """A one-dimensional device mesh over every process (a one-process group is made when none was launched)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.ensure_process_group(device)
    return init_device_mesh(device.type, (dist.world_size(),))


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
    if settings.sharding == "fsdp2":
        mesh = device_mesh(device)
        names = getattr(adapter, "shard_blocks", None)
        units = len(shard_blocks(tr, names))
        stream = dist.world_size() > 1  # the main process's weights, sent to the others (built on meta)
        whole = _whole_weights(tr) if stream else None
        model = shard(tr, mesh=mesh, param_dtype=compute, reshard=settings.reshard_after_forward,
                      master_dtype=torch.float32 if compute is not None else None, names=names)
        if stream:
            fill_from_main(model, whole, device)
            del whole
        if ref is not None:
            offload = settings.reference == "cpu_offload"
            adapter.frozen_reference = shard(ref, mesh=mesh, param_dtype=None, reshard=True, offload=offload,
                                             names=names)
            if _on_meta(ref):
                copy_shards(model, ref, torch.device("cpu") if offload else device)
        forward = model
        logger.info("transformer sharded over %d process(es) (FSDP2, %d blocks)", dist.world_size(), units)
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


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _whole_weights(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Before sharding: {name: parameter} of the main process's whole transformer (kept alive until
    :func:`fill_from_main` has sent it), None on the others; every process's parameters take the main
    process's dtypes (a transformer built on the meta device has ``from_config``'s, not the loaded ones)."""
    dtypes = dist.broadcast_object({n: p.dtype for n, p in module.named_parameters()} if dist.rank() == 0 else None)
    for n, p in module.named_parameters():
        if p.dtype != dtypes[n]:
            p.data = p.data.to(dtypes[n])
    return {n: p.detach() for n, p in module.named_parameters()} if dist.rank() == 0 else None


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give a sharded module built on the meta device real (uninitialised) shards on ``device``, its buffers
    (real already: :func:`flowgrpo.models.empty.empty_components`, :func:`flowgrpo.models.lora.structure_copy`)
    kept."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in module.named_buffers():
            b.copy_(buffers[n])


def fill_from_main(model: torch.nn.Module, whole: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """The weights of sharded ``model`` from the main process's whole tensors ``whole`` (None on the others, whose
    transformer was built on the meta device and never read the files): each process receives its shard of one
    tensor at a time (a scatter from the main process), and the persistent buffers by broadcast. A collective.
    The main process's dtypes were given to every process before sharding (:func:`_whole_weights`)."""
    from flowgrpo.ema import local
    from flowgrpo.state_dicts import scatter_from_rank0

    if _on_meta(model):
        _materialize(model, device)
    with torch.no_grad():
        for n, p in model.named_parameters():
            part = scatter_from_rank0(whole[n] if whole is not None else None, p)
            local(p).copy_(local(part))
        for b in model.buffers():
            b.copy_(dist.broadcast_from_main(b))


def copy_shards(policy: torch.nn.Module, reference: torch.nn.Module, device: torch.device) -> None:
    """Fill ``reference`` (the full fine-tune's frozen reference, sharded as ``policy`` but built on the meta
    device) with ``policy``'s weights as they are now (the base model: before any update or resume), each process
    copying its own shards (cast to the reference's dtype: exact, the policy's float32 masters hold
    ``model.dtype`` values) onto ``device``; nothing is sent."""
    from flowgrpo.ema import local

    _materialize(reference, device)
    weights = dict(policy.named_parameters())
    with torch.no_grad():
        for n, r in reference.named_parameters():
            local(r).copy_(local(weights[n]))


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
