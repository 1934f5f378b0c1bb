"""The state of the trained model, its optimizer and loose tensors, whole or as each process holds it, and the way
back.

The one place that converts between the training state, whose parameters may be FSDP2 DTensors split over the
processes, and what a run writes:

* **sharded** (:func:`sharded_trainable_state`, :func:`sharded_optimizer_state`): ``torch.distributed.checkpoint
  .state_dict`` without ``full_state_dict``: each process's DTensor shards, nothing gathered, for the sharded
  checkpoint each process writes its own part of (:mod:`flowgrpo.checkpoints.save_load`), and loaded back in place
  (torch's distributed checkpoint reshards: another process count or layout reads the same files);
* **whole** (:func:`trainable_state`, :func:`optimizer_state`): ``full_state_dict`` with ``cpu_offload``: the
  whole tensors arrive in host memory on the main process (global rank 0) alone, for the final LoRA and the
  checkpoints of unsharded runs; the final transformer of a full fine-tune is written one file at a time
  (:func:`export_transformer`: the files a one-process run writes, never the whole state at once).
* **from the weight files** (:func:`read_own_shards`): a sharded model built empty reads only its own shards of
  the safetensors files it was configured from. Loading
  whole tensors into a sharded model (:func:`load_trainable_state`, :func:`load_optimizer_state` with
  ``from_rank0``, :func:`scatter_from_rank0`) reads them on the main process alone and sends each process its
  shard (``broadcast_from_rank0``), one tensor at a time.

Every function is a collective when the model is sharded: every process calls it, in the same order.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from flowgrpo.distributed import dist
from flowgrpo.writing.outputs import save_tensors, write_text_file

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the trained parameters (``requires_grad``), in the module's order (the optimizer's order)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: whole tensor in host memory} of the trained parameters, on the main process ({} on the others).

    LoRA gathers only the adapter weights; full fine-tuning gathers every weight (the float32 masters)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    names = set(trainable_names(model))
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k in names}


def _inner(optimizer):
    """The torch optimizer behind accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer's state keyed by parameter name (whole tensors, host memory), on the main process.

    An optimizer that has not stepped yet is written as it is (its param groups, no state): the gathering
    function would first initialise it with a step of learning rate 0, which sets Adam's step count to 1."""
    opt = _inner(optimizer)
    if not opt.state:
        names = trainable_names(model)
        groups, start = [], 0
        for g in opt.state_dict()["param_groups"]:
            groups.append({**g, "params": names[start:start + len(g["params"])]})
            start += len(g["params"])
        return {"state": {}, "param_groups": groups}
    return get_optimizer_state_dict(model, opt, options=_GATHER)


def _by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter index (``Optimizer.state_dict()``, older checkpoints) keyed by
    name; a state keyed by name is returned as it is."""
    params = [p for g in state.get("param_groups", []) for p in g["params"]]
    if not params or not isinstance(params[0], int):
        return state
    return {"state": {names[i]: v for i, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict | None, *, from_rank0: bool = False) -> None:
    """Load an optimizer state written by :func:`optimizer_state` (or an index-keyed one) into ``optimizer``,
    whose shards each process keeps. ``from_rank0``: only the main process has ``state`` (the others pass None)
    and sends each process its shards (a sharded model; every process calls it).

    Raises:
        ValueError: the state names parameters the model does not train (naming the first).
    """
    opt = _inner(optimizer)
    names = trainable_names(model)
    if from_rank0:
        stepped = dist.broadcast_object(bool(state and state.get("state")) if dist.rank() == 0 else None)
        if stepped:
            opt.zero_grad(set_to_none=True)
            if dist.rank() == 0:
                state = _by_name(state, names)
            set_optimizer_state_dict(model, opt, state if dist.rank() == 0 else {},
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            return
        state = dist.broadcast_object(state if dist.rank() == 0 else None)  # param groups only: small
    state = _by_name(state, names)
    unknown = [n for g in state["param_groups"] for n in g["params"] if n not in set(names)]
    if unknown:
        raise ValueError(f"the optimizer state names parameters this model does not train: {unknown[:3]}")
    if not state["state"]:  # never stepped: only the param groups' settings
        index = {n: i for i, n in enumerate(names)}
        opt.load_state_dict({"state": {}, "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                           for g in state["param_groups"]]})
        return
    opt.zero_grad(set_to_none=True)  # the loader initialises an empty state only where no gradient is set
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, *,
                         from_rank0: bool = False) -> None:
    """Copy whole tensors {name: tensor} into the model's parameters of those names (each process keeps its
    shard; cast to each parameter's dtype). ``from_rank0``: only the main process has ``state`` (the others pass
    None); it sends each process its shard of one tensor at a time (``broadcast_from_rank0``). Names and shapes
    are the caller's check."""
    params = dict(model.named_parameters())
    state = {k: v.to(params[k].dtype) for k, v in (state or {}).items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False,
                                                                broadcast_from_rank0=from_rank0))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2-sharded, on any process count)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def sharded_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: DTensor shard as this process holds it (no copy)} of the trained parameters: nothing is gathered."""
    options = StateDictOptions(ignore_frozen_params=True)
    names = set(trainable_names(model))
    return {k: v for k, v in get_model_state_dict(model, options=options).items() if k in names}


def sharded_optimizer_state(model: torch.nn.Module, optimizer) -> tuple[dict, list[dict]]:
    """(state, param_groups) of the optimizer with parameters named: ``state`` {name: {key: tensor}} holds this
    process's DTensor shards of the moments (and the step counts), ``param_groups`` the groups' settings with
    parameter names (plain data). An optimizer that has not stepped yet gives ``{}`` (see :func:`optimizer_state`
    for why it is not initialised)."""
    opt = _inner(optimizer)
    if not opt.state:
        return {}, optimizer_state(model, optimizer)["param_groups"]
    state = get_optimizer_state_dict(model, opt)
    return state["state"], state["param_groups"]


def load_sharded_optimizer_state(model: torch.nn.Module, optimizer, state: dict, param_groups: list[dict]) -> None:
    """Load ``state`` (:func:`sharded_optimizer_state`'s shards, or whole tensors of an unsharded model) and
    ``param_groups`` into ``optimizer``.

    Raises:
        ValueError: the groups name parameters the model does not train (naming the first).
    """
    opt = _inner(optimizer)
    names = trainable_names(model)
    unknown = [n for g in param_groups for n in g["params"] if n not in set(names)]
    if unknown:
        raise ValueError(f"the optimizer state names parameters this model does not train: {unknown[:3]}")
    if not state:
        load_optimizer_state(model, optimizer, {"state": {}, "param_groups": param_groups})
        return
    opt.zero_grad(set_to_none=True)
    set_optimizer_state_dict(model, opt, {"state": state, "param_groups": param_groups})


def load_sharded_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (tensors of the model's own layout: its DTensor shards, or whole tensors of an unsharded
    model; :func:`sharded_trainable_state`) into the trained parameters of those names."""
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def optimizer_target(model: torch.nn.Module, optimizer) -> dict:
    """{name: {key: tensor}}: tensors of the optimizer state's layout (this process's shards) for a sharded
    checkpoint to load into; the optimizer's state is made (a step of learning rate 0) when it has none, which
    the load then overwrites."""
    return get_optimizer_state_dict(model, _inner(optimizer))["state"]


def dtensor_like(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``part`` (this process's shard of a tensor laid out as ``like``) as a DTensor of ``like``'s mesh,
    placements and shape, sharing ``part``'s memory; ``part`` itself when ``like`` is not a DTensor.

    A shard in host memory (``parallel.ema=cpu``) stays there: ``DTensor.from_local`` would copy it to the
    mesh's device, so it is wrapped as FSDP2 wraps its CPU-offloaded shards (a DTensor of a device mesh whose
    local tensor is in host memory)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return part
    mesh = like.device_mesh
    if part.device.type == mesh.device_type:
        return DTensor.from_local(part, mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(like.placements), tensor_meta=TensorMeta(like.shape, like.stride(), part.dtype))
    return DTensor(part, spec, requires_grad=False)


def scatter_from_rank0(whole: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor read by the main process alone (``whole``; None on the others) laid out as ``like``: for a
    DTensor ``like``, each process receives its shard (``distribute_tensor`` with ``src_data_rank=0``, a
    collective); otherwise ``whole`` itself, which every process must then have. ``like``'s dtype is kept."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return whole.to(like.dtype)
    device = like.device_mesh.device_type
    src = whole.to(device, like.dtype) if whole is not None else torch.empty(like.shape, dtype=like.dtype,
                                                                             device=device)
    return distribute_tensor(src, like.device_mesh, like.placements, src_data_rank=0)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view: writing it writes the DTensor), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective, its value on every process), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``like``: this process's shard of it when ``like`` is a DTensor (every process gives
    the same ``whole``; a ``whole`` that is already a DTensor is taken as laid out), else ``whole`` on ``like``'s
    device and dtype."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = whole.to(like.dtype)
    if isinstance(whole, DTensor):
        return whole
    if isinstance(like, DTensor):
        return distribute_tensor(whole.to(like.device_mesh.device_type), like.device_mesh, like.placements)
    return whole.to(like.device)


#: diffusers' default largest file of a saved model (``ModelMixin.save_pretrained(max_shard_size=...)``)
MAX_FILE_SIZE = "10GB"


def export_transformer(model: torch.nn.Module, folder, dtype: torch.dtype, *, main: bool,
                       max_file_size: int | str = MAX_FILE_SIZE) -> None:
    """Write the whole transformer as diffusers' ``save_pretrained(folder, max_shard_size=max_file_size)`` writes it
    (the same files, byte for byte: ``config.json``, the safetensors files split by huggingface_hub's
    ``split_torch_state_dict_into_shards`` and their index), every tensor in ``dtype``, **one file at a time**:
    each file's tensors are gathered whole (a sharded one by an all-gather of its shards), written by the main
    process and freed before the next file's, so no process ever holds more than one file (at most
    ``max_file_size``: 10 GB, where gathering the whole state held 71 GB of float32 masters for Wan2.2 A14B).
    Every process takes part in the same order (a collective when the model is sharded); the main process writes.
    """
    import json
    from pathlib import Path

    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
    from huggingface_hub import split_torch_state_dict_into_shards

    state = model.state_dict()  # parameters (a sharded model's DTensors) and persistent buffers, nothing gathered
    plan = split_torch_state_dict_into_shards(
        {k: torch.empty(v.shape, dtype=dtype, device="meta") for k, v in state.items()},
        max_shard_size=max_file_size, filename_pattern=SAFETENSORS_WEIGHTS_NAME.replace(".safetensors",
                                                                                        "{suffix}.safetensors"))
    folder = Path(folder)
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        _meta_clone(model).save_config(folder)
    for filename, names in plan.filename_to_tensors.items():
        tensors = {n: _gathered(state[n]).to(dtype).contiguous() for n in names}
        if main:
            save_tensors(tensors, folder / filename, metadata={"format": "pt"})
        del tensors
    if main and plan.is_sharded:
        index = {"metadata": dict(plan.metadata), "weight_map": plan.tensor_to_filename}
        write_text_file(folder / SAFE_WEIGHTS_INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")


def _meta_clone(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s own class (not FSDP2's subclass, whose name would go into ``config.json``) built on
    the meta device from its config: no memory."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        return cls.from_config(model.config)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole in host memory: a DTensor's shards all-gathered over its mesh (moved to the mesh's device first
    when they are kept in host memory, ``parallel.offload=cpu``), a plain tensor as it is. A collective for a
    DTensor."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        local = t.to_local()
        if local.device.type != mesh.device_type:
            t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, run_check=False, shape=t.shape,
                                   stride=t.stride())
        t = t.full_tensor()
    return t.cpu()


def save_final_weights(adapter, model: torch.nn.Module, folder, *, finetune: str, dtype: torch.dtype,
                       main: bool) -> None:
    """The trained LoRA (diffusers ``load_lora_weights`` format) or the whole transformer (``from_pretrained``
    folder, weights in ``dtype``, written one file at a time: :func:`export_transformer`) in ``folder``; every
    process takes part, the main process writes."""
    from flowgrpo.models.lora import save_lora

    if finetune == "lora":
        state = trainable_state(model)
        if main:
            save_lora(adapter, folder, state)
    else:
        export_transformer(model, folder, dtype, main=main)
    dist.barrier()


def read_own_shards(model: torch.nn.Module, folder: str, dtypes: dict[str, torch.dtype]) -> None:
    """Fill sharded ``model`` (FSDP2, its parameters already given storage on their device) from the safetensors
    files in ``folder``, each process reading only the slices of its own shards (torch's distributed checkpoint with
    its ``HuggingFaceStorageReader``, which reads ``safe_open(...).get_slice(name)[rows]``): no process holds a
    whole tensor it does not keep, and nothing is sent between them. Persistent buffers the files hold are read
    too; the others keep their constructor's values.

    ``dtypes``: {parameter name: the dtype loading the model gives it} (:func:`flowgrpo.models.empty
    .cast_as_loaded`); a parameter held in another dtype (the float32 master of a model loaded in bfloat16) is
    rounded through it after reading, so it holds exactly what loading then casting gives on one process.

    Raises:
        ValueError: a parameter of the model that the files do not hold (named, with the folder). A collective.
    """
    import torch.distributed.checkpoint as dcp

    reader = dcp.HuggingFaceStorageReader(folder)
    stored = reader.read_metadata().state_dict_metadata
    missing = [n for n, _ in model.named_parameters() if n not in stored]
    if missing:
        raise ValueError(f"the weight files in {folder} do not hold {len(missing)} parameter(s) of "
                         f"{type(model).__name__}, e.g. {missing[:3]}: not this model's weights")
    state = {k: v for k, v in model.state_dict().items() if k in stored}
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if dtypes[n] != p.dtype:
                local(p).copy_(local(p).to(dtypes[n]))
