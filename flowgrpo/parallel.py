"""Where each part of the model lives, and how the trained transformer is spread over the processes.

One boundary decides it, once, before the first rollout (docs/many_gpus.md, "What sits on each GPU"):

* :func:`flowgrpo.distributed.launch.check_launch` (run first) refuses a launch that asked for several processes
  and started one (``accelerate launch --cpu --num_processes N``: accelerate starts one process on the CPU unless
  MPI starts the others); :func:`check_engine` refuses accelerate's own FSDP and DeepSpeed engines (accelerate
  launches the processes and names their devices; the sharding is ours, so that the same code runs under gloo on
  the CPU and NCCL on CUDA);
* :func:`device_mesh` lays the processes out as a named three-dimensional mesh ``("replicate", "shard",
  "context")`` of ``parallel.replicate`` x world/(replicate·context) x ``parallel.context_degree``; FSDP2 shards
  over :func:`fsdp_mesh`, replicate x (shard·context): HSDP across the replica groups (typically nodes), plain
  FSDP when ``replicate`` is 1;
* :func:`place_pipeline` puts the pipeline's parts where the rule per module says:

  - the VAE: on the device, whole (it decodes every rollout micro-batch);
  - the text and image encoders (``parallel.text_encoders``): ``device`` whole; ``offload`` whole in host
    memory, moved to the device only while prompts are encoded; ``shard`` FSDP2 over :func:`fsdp_mesh` on the
    device, each block gathered for its forward and freed after it;
  - the trained transformer: left in host memory when it is sharded (each block moves as its shard is made, by
    :func:`prepare_model`, so a process never holds the whole transformer on its device), else on the device;
  - the untrained other expert of a two-expert model (Wan2.2 A14B, ``parallel.experts``): ``device`` whole;
    ``offload`` whole in host memory on every process, each block copied to the device for its forward
    (diffusers' block-level group offloading: no collective, so processes may call it unequally); ``shard``
    FSDP2 over :func:`fsdp_mesh` on the device (every process runs it in the same order: the rollout's steps and
    the update's chunk plan are the same on every process);

* :func:`place_rewards` keeps each reward's models on the device (``parallel.reward_models=device``) or in host
  memory, moved to the device only while a batch is scored (``offload``);
* :func:`prepare_model` makes the module the trainer calls: the transformer itself (one process), its DDP
  wrapper (several, ``parallel.sharding=none``), or the transformer with torch's ``fully_shard`` applied to each
  block the model names in ``_no_split_modules`` and to the root (``fsdp2``, any process count), its shards,
  gradients and optimizer state on the device or in host memory (``parallel.offload=cpu``). Full fine-tuning
  keeps float32 master weights and computes in ``model.dtype`` (FSDP2's ``MixedPrecisionPolicy``, or autocast
  without sharding); the frozen reference of full fine-tuning is sharded like the policy (or kept in host
  memory, ``parallel.reference=cpu_offload``). Rollout, recompute and update all call the module this returns,
  so the on-policy ratio stays exactly 1 whatever the layout of the weights. On several processes no process
  holds the whole transformer: in full fine-tuning every process builds it on the meta device
  (:mod:`flowgrpo.models.empty`) and reads only its own shards from the weight files
  (:func:`~flowgrpo.checkpoints.state_dicts.read_own_shards`); with LoRA the main process loads it and sends the others
  their shards, one tensor at a time (:func:`fill_from_main`); the full fine-tune's reference is built on the meta
  device too and filled from each process's own policy shards (:func:`copy_shards`), never a whole copy;
* :func:`gradient_sync` is the accumulation context of one micro-batch (``parallel.gradient_sync``);
  :func:`clip_grad_norm` clips by the global gradient norm, sharded or not; :func:`reshard` frees gathered
  weights around every swap of the shards' values (EMA, old copies), whatever ``reshard_after_forward``.
* :mod:`flowgrpo.distributed.context_parallel` splits each transformer call's tokens over the ``context`` ranks of the
  device mesh (``parallel.context_degree`` > 1) with diffusers' own context parallelism; the ranks of one context
  group hold the same samples (:mod:`flowgrpo.distributed.dist`'s data ranks).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from flowgrpo.checkpoints.state_dicts import read_own_shards
from flowgrpo.distributed import context_parallel, dist
from flowgrpo.models.empty import weights_folder

logger = logging.getLogger(__name__)

#: pipeline components that only encode the conditioning (prompts, source images), by name prefix
ENCODER_PREFIXES = ("text_encoder", "image_encoder")
#: the names of the device mesh's dimensions (:func:`device_mesh`), outermost first
MESH_DIMS = ("replicate", "shard", "context")
#: the two dimensions of the mesh FSDP2 shards over (:func:`fsdp_mesh`)
FSDP_DIMS = ("replicate", "shard_context")
#: environment variables through which MPI tells a process how many were started
def process_group_kwargs(settings) -> list:
    """accelerate's ``kwargs_handlers`` for the run's process group: its timeout,
    ``parallel.collective_timeout_s`` (how long a process waits in a barrier or broadcast of the default group,
    where the others wait while the main process exports alone; the device mesh's groups, whose collectives every
    process enters together, keep torch's default); and with ``parallel.offload=cpu`` on CUDA the backend
    ``cuda:nccl,cpu:gloo`` (FSDP2 then holds CPU shards whose collectives, the clipping norm's all-reduce and a
    checkpoint's gathering, NCCL cannot run; torch picks the backend by each tensor's device), else accelerate's
    default (NCCL on CUDA, gloo on the CPU, where a given backend is ignored anyway)."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    timeout = timedelta(seconds=getattr(settings, "collective_timeout_s", 3600.0))
    if getattr(settings, "offload", "none") == "cpu" and torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="cuda:nccl,cpu:gloo", timeout=timeout)]
    return [InitProcessGroupKwargs(timeout=timeout)]


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


def other_expert(adapter) -> torch.nn.Module | None:
    """The untrained expert of a two-expert adapter (Wan2.2 A14B: ``adapter.experts``, one of them trained), or
    None."""
    experts = getattr(adapter, "experts", None) or {}
    others = [m for m in experts.values() if m is not None and m is not adapter.transformer]
    return others[0] if others else None


def place_pipeline(adapter, device: torch.device, settings) -> None:
    """Put every module of ``adapter.pipe`` where the run uses it (the rule of the module docstring).

    ``adapter.pipe.to(device)`` of everything is what this replaces: with ``text_encoders=offload`` the encoders
    stay in host memory, and the adapter's :meth:`~flowgrpo.models.base.AdapterBase.encoding` scope moves them to
    ``device`` for each encoding; with ``text_encoders=shard`` they are FSDP2-sharded onto the device; under
    ``sharding=fsdp2`` the transformer stays where it was loaded (host memory) until :func:`prepare_model` shards
    it block by block onto the device; the other expert of a two-expert model goes where ``experts`` says.

    Raises:
        ValueError: a world size the mesh cannot take (:func:`mesh_shape`), when something is sharded; or
            ``experts`` other than ``device`` for a model without an untrained second expert.
    """
    encoders = []
    expert = other_expert(adapter)
    if expert is None and settings.experts != "device":
        raise ValueError(f"parallel.experts={settings.experts} places the untrained expert of a two-expert model "
                         f"(Wan2.2 A14B); {type(adapter.transformer).__name__} here has no second expert: use "
                         "parallel.experts=device")
    for name, part in adapter.pipe.components.items():
        if not isinstance(part, torch.nn.Module):
            continue
        if part is adapter.transformer and settings.sharding == "fsdp2":
            continue
        if part is expert and settings.experts != "device":
            place_expert(part, device, settings)
            continue
        if is_encoder(name) and settings.text_encoders == "offload":
            encoders.append(part.to("cpu"))
            continue
        if is_encoder(name) and settings.text_encoders == "shard":
            shard(part, mesh=device_mesh(device, settings), param_dtype=None, reshard=True)
            continue
        part.to(device)
    adapter.encoders_offload = EncoderOffload(encoders, device) if encoders else None


def place_expert(expert: torch.nn.Module, device: torch.device, settings) -> None:
    """Place the untrained expert by ``settings.experts``: ``shard`` FSDP2 over :func:`fsdp_mesh` on the device
    (reshard after every forward; on several processes it was built empty and each reads its own shards from the
    weight files, :func:`~flowgrpo.checkpoints.state_dicts.read_own_shards`); ``offload`` whole in host memory, each
    block copied to ``device`` for its forward and dropped after (diffusers' block-level group offloading, one block a
    group, on a side stream on CUDA; no collective); ``device`` whole on the device."""
    if settings.experts == "shard":
        files = _files_of(expert)  # built empty (several processes): each reads its own shards from the files
        dtypes = {n: p.dtype for n, p in expert.named_parameters()}
        shard(expert, mesh=device_mesh(device, settings), param_dtype=None, reshard=True)
        if files is not None:
            _materialize(expert, device)
            read_own_shards(expert, weights_folder(files), dtypes)
    elif settings.experts == "offload":
        expert.to("cpu")
        expert.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                    offload_type="block_level", num_blocks_per_group=1,
                                    use_stream=torch.device(device).type == "cuda")
    else:
        expert.to(device)


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


class OffloadedReward:
    """A reward whose models wait in host memory and are on ``device`` only while it scores
    (``parallel.reward_models=offload``). Every other attribute is the reward's own (its name, ``group_wise``,
    hooks), so the scoring path (:func:`flowgrpo.rewards.compose.score_components_named`) calls it as the reward.

    Args:
        reward: a reward already ``setup`` on ``device``.
        device: where its models compute.
    Attributes:
        modules: the reward's ``torch.nn.Module`` parts: the reward itself when it is one, else its attributes that
            are modules (or lists, tuples and dict values of modules), one level deep.
    """

    def __init__(self, reward, device: torch.device) -> None:
        self.reward = reward
        self.device = torch.device(device)
        self.modules = reward_modules(reward)
        for m in self.modules:
            m.to("cpu")

    def __getattr__(self, name):
        return getattr(self.__dict__["reward"], name)

    def __call__(self, *args, **kwargs):
        for m in self.modules:
            m.to(self.device)
        try:
            return self.reward(*args, **kwargs)
        finally:
            for m in self.modules:
                m.to("cpu")


def reward_modules(reward) -> list[torch.nn.Module]:
    """The ``torch.nn.Module`` parts of a reward object (:class:`OffloadedReward`), each once."""
    if isinstance(reward, torch.nn.Module):
        return [reward]
    found: dict[int, torch.nn.Module] = {}
    for value in getattr(reward, "__dict__", {}).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
        for v in items:
            if isinstance(v, torch.nn.Module):
                found.setdefault(id(v), v)
    return list(found.values())


def place_rewards(composed, device: torch.device, settings) -> None:
    """Apply ``settings.reward_models`` to every reward of ``composed`` (a
    :class:`~flowgrpo.rewards.compose.ComposedReward` already set up on ``device``, or None): ``offload`` wraps
    each reward that holds modules in :class:`OffloadedReward`; ``device`` leaves them as set up."""
    if composed is None or settings.reward_models != "offload":
        return
    for name, reward in list(composed.rewards.items()):
        if not isinstance(reward, OffloadedReward) and reward_modules(reward):
            composed.rewards[name] = OffloadedReward(reward, device)


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


def mesh_shape(world: int, replicate: int = 1, context: int = 1) -> tuple[int, int, int]:
    """(replicate, shard, context) sizes of the device mesh for ``world`` processes: shard = world / (replicate ·
    context).

    Raises:
        ValueError: a size below 1, or a world size that is not replicate x shard x context (naming the numbers).
    """
    if replicate < 1 or context < 1:
        raise ValueError(f"parallel.replicate and parallel.context_degree must be >= 1, got {replicate} and "
                         f"{context}")
    if world % (replicate * context):
        raise ValueError(f"the world size {world} is not replicate x shard x context: parallel.replicate={replicate} "
                         f"x parallel.context_degree={context} = {replicate * context} does not divide it")
    return replicate, world // (replicate * context), context


_MESHES: dict = {}  # (device type, shape) -> (process group, device mesh, FSDP2 mesh): made once per layout


def device_mesh(device: torch.device, settings=None):
    """The named device mesh ``("replicate", "shard", "context")`` over every process (a one-process group is made
    when none was launched), of :func:`mesh_shape` (``settings.replicate``, ``settings.context_degree``; 1 and 1
    without ``settings`` or without the field). A dimension of size 1 is kept, so code names the same dimensions
    whatever the layout. Global rank = (r·shard + s)·context + c, so a replica group is a run of consecutive
    ranks (a node when replicate is the node count) and a context group consecutive ranks inside it. Made once
    per layout and process group (with its :func:`fsdp_mesh`).

    Raises:
        ValueError: a world size that is not replicate x shard x context (:func:`mesh_shape`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    dist.ensure_process_group(device)
    r, s, c = shape = mesh_shape(dist.world_size(), getattr(settings, "replicate", 1),
                                 getattr(settings, "context_degree", 1))
    group = torch.distributed.group.WORLD
    cached = _MESHES.get((device.type, shape))
    if cached is not None and cached[0] is group:
        return cached[1]
    # one flat mesh over the world, unflattened into each named layout (torch's way to hold several layouts of
    # the same ranks: none is sliced by a flattened name)
    world = init_device_mesh(device.type, (dist.world_size(),), mesh_dim_names=("world",))
    mesh = world._unflatten(0, shape, MESH_DIMS)
    flat = world._unflatten(0, (r, s * c), FSDP_DIMS)
    _MESHES[(device.type, shape)] = (group, mesh, flat if r > 1 else flat["shard_context"])
    return mesh


def fsdp_mesh(mesh):
    """The mesh FSDP2 shards over, for the device mesh of :func:`device_mesh`: two-dimensional (``"replicate"``,
    ``"shard_context"``), HSDP (each replica group holds the whole model, sharded over its shard·context ranks;
    the gradient shards are all-reduced across the groups), when ``replicate`` > 1; one-dimensional
    (``"shard_context"``), plain FSDP, when it is 1. Any other mesh is returned as it is (FSDP2 shards over it).
    """
    for _group, named, flat in _MESHES.values():
        if named is mesh:
            return flat
    return mesh


def shard(module: torch.nn.Module, *, mesh, param_dtype: torch.dtype | None, reshard: bool, offload: bool = False,
          master_dtype: torch.dtype | None = None, names=None) -> torch.nn.Module:
    """Apply ``fully_shard`` to every block of :func:`shard_blocks` (innermost first) and to the root, in place.

    Args:
        module: a module in host memory (each block is moved to the mesh's device as its shard is made).
        mesh: the device mesh of :func:`device_mesh` (sharded over :func:`fsdp_mesh`: HSDP when it replicates),
            or a mesh for FSDP2 itself.
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

    mesh = fsdp_mesh(mesh)
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
    context_parallel.check_context(adapter, settings, device)
    if config.model.compile.name == "regional":  # before sharding, as torchtitan: fully_shard renames the blocks
        from flowgrpo.compile import compile_regions

        for module in (tr, ref) if ref is not None else (tr,):
            compile_regions(module, config.model.compile)
    if settings.sharding == "fsdp2":
        model = forward = _shard_transformer(adapter, settings, compute, device)
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


def _shard_transformer(adapter, settings, compute: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """The FSDP2 branch of :func:`prepare_model`: shard ``adapter.transformer`` over the device mesh of
    ``settings`` (``config.parallel``), context parallelism first when its degree is > 1; with several processes
    (built on the meta device) each process reads its own shards from the weight files, or receives them from
    the main process. The frozen reference, if any, is sharded alike (``adapter.frozen_reference`` replaced).
    Returns the sharded transformer."""
    tr, ref = adapter.transformer, adapter.frozen_reference
    mesh = device_mesh(device, settings)
    context = settings.context_degree
    dist.set_context_degree(context)
    if context > 1:  # before sharding: diffusers' hooks wrap the plain modules' forwards
        context_parallel.enable_context(context_parallel.context_modules(adapter), mesh, settings, device)
    names = getattr(adapter, "shard_blocks", None)
    units = len(shard_blocks(tr, names))
    stream = dist.world_size() > 1  # built on the meta device: each process reads or receives its shards
    files = _files_of(tr) if stream else None
    dtypes = {n: p.dtype for n, p in tr.named_parameters()}
    whole = _whole_weights(tr) if stream and files is None else None
    model = shard(tr, mesh=mesh, param_dtype=compute, reshard=settings.reshard_after_forward,
                  offload=settings.offload == "cpu", master_dtype=torch.float32 if compute is not None else None,
                  names=names)
    if stream:
        # offloaded shards live in host memory (CPUOffloadPolicy), the rest on the device
        place = torch.device("cpu") if settings.offload == "cpu" else device
        if files is not None:
            _materialize(model, place)
            folder = weights_folder(files)
            read_own_shards(model, folder, dtypes)
            logger.info("each process read its own shards of the transformer from %s", folder)
        else:
            fill_from_main(model, whole, place)
        del whole
    if ref is not None:
        offload = settings.reference == "cpu_offload"
        adapter.frozen_reference = shard(ref, mesh=mesh, param_dtype=None, reshard=True, offload=offload, names=names)
        if _on_meta(ref):
            copy_shards(model, ref, torch.device("cpu") if offload else device)
    r, s, c = mesh.shape
    logger.info("transformer sharded over %d process(es) (FSDP2, %d blocks; mesh replicate=%d x shard=%d x "
                "context=%d%s)", dist.world_size(), units, r, s, c,
                "; shards, gradients and optimizer state in host memory" if settings.offload == "cpu" else "")
    if context > 1:
        logger.info("context degree %d (%s), %d data rank(s)", context, settings.context_attention,
                    dist.data_world_size())
    return model


def _files_of(module: torch.nn.Module) -> tuple[str, str] | None:
    """Where every process reads its shards of ``module`` from, when the main process built it empty too (a full
    fine-tune's transformer, a sharded untrained expert: :func:`flowgrpo.runner` builds them on the meta device
    everywhere); None when the main process holds the whole module (it sends the others their shards: LoRA's base,
    whose adapter the main process initialised). The main process decides for all. A collective."""
    from flowgrpo.models.empty import WEIGHTS_ATTR

    files = getattr(module, WEIGHTS_ATTR, None) if _on_meta(module) else None
    return dist.broadcast_object(files)


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
    from flowgrpo.checkpoints.state_dicts import local, scatter_from_rank0

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
    from flowgrpo.checkpoints.state_dicts import local

    _materialize(reference, device)
    weights = dict(policy.named_parameters())
    with torch.no_grad():
        for n, r in reference.named_parameters():
            local(r).copy_(local(weights[n]))
def gradient_sync(model: torch.nn.Module, *, sync: bool, every_micro_batch: bool):
    """The accumulation context of one micro-batch's (pack's) forward and backward.

    Gradients are reduced over the processes in this backward when ``sync`` (the optimizer step's last pack) or
    ``every_micro_batch`` (``parallel.gradient_sync=micro_batch``); otherwise they accumulate locally and the last
    pack's backward reduces their sum (``step``): an FSDP2 module through ``set_requires_gradient_sync(False)``
    for the pack (it then holds whole unsharded gradients until the step; HSDP's all-reduce is skipped with the
    reduce-scatter), a DDP wrapper through its ``no_sync``. A module that reduces nothing (one process unsharded)
    gets a null context.
    """
    from torch.distributed.fsdp import FSDPModule

    if sync or every_micro_batch:
        return contextlib.nullcontext()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    no_sync = getattr(model, "no_sync", None)  # DistributedDataParallel
    return no_sync() if no_sync is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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
    gathers them again from the shards: needed before and after every swap of the shards' values (the EMA for
    evaluation and saving, the old copy of the forward-process objectives), since with
    ``reshard_after_forward=false`` a forward would reuse weights gathered before the swap (and a swap back would
    leave the swapped-in values gathered for the next rollout). Harmless when nothing is gathered; a no-op for an
    unsharded module or None."""
    if model is None:
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def release() -> None:
    """Undo what this module set up for a run that ends (the meshes, the one-process group made for FSDP2)."""
    _MESHES.clear()
    dist.release_own_group()
