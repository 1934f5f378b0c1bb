"""Whole (unsharded) state of the trained model, its optimizer and loose tensors, sharded or not, and the way back.

The one place that converts between the training state, whose parameters may be FSDP2 DTensors split over the
processes, and the files a run writes, so that checkpoints and final weights are the same files whatever the
process count (a run resumes with another one). Gathering uses ``torch.distributed.checkpoint.state_dict`` with
``full_state_dict`` and ``cpu_offload``: the whole tensors arrive in host memory on the main process (global
rank 0) alone. Loading hands every process the whole tensors (each reads the file), and each keeps its shard.

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

from flowgrpo import dist

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


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, whole and in host memory, on the main process ({} elsewhere)."""
    return {k: v.detach().cpu().contiguous() for k, v in get_model_state_dict(model, options=_GATHER).items()}


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


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load an optimizer state written by :func:`optimizer_state` (or an index-keyed one) into ``optimizer``,
    whose shards each process keeps.

    Raises:
        ValueError: the state names parameters the model does not train (naming the first).
    """
    opt = _inner(optimizer)
    names = trainable_names(model)
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


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors {name: tensor} into the model's parameters of those names (each process keeps its
    shard; cast to each parameter's dtype). Names and shapes are the caller's check."""
    params = dict(model.named_parameters())
    state = {k: v.to(params[k].dtype) for k, v in state.items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective, its value on every process), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``like``: this process's shard of it when ``like`` is a DTensor (every process gives
    the same ``whole``), else ``whole`` on ``like``'s device and dtype."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = whole.to(like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(whole.to(like.device_mesh.device_type), like.device_mesh, like.placements)
    return whole.to(like.device)


def save_transformer(model: torch.nn.Module, state: dict[str, torch.Tensor], folder, dtype: torch.dtype) -> None:
    """Write a whole transformer ``state`` (:func:`model_state`) as ``model.save_pretrained`` would, weights in
    ``dtype``: a copy of the model's class built on the meta device takes the tensors, so no second model is
    allocated and a sharded model is written exactly as an unsharded one. Main process only."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        clone = cls.from_config(model.config)
    clone.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    clone.save_pretrained(folder)


def save_final_weights(adapter, model: torch.nn.Module, folder, *, finetune: str, dtype: torch.dtype,
                       main: bool) -> None:
    """The trained LoRA (diffusers ``load_lora_weights`` format) or the whole transformer (``from_pretrained``
    folder, weights in ``dtype``) in ``folder``; every process takes part, the main process writes."""
    from flowgrpo.models.lora import save_lora

    if finetune == "lora":
        state = trainable_state(model)
        if main:
            save_lora(adapter, folder, state)
    else:
        state = model_state(model)
        if main:
            save_transformer(model, state, folder, dtype)
    dist.barrier()
