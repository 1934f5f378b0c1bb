"""A pipeline's trained transformer built without its weights, for the processes of a sharded run that read only
their own shards of it from the files (full fine-tuning) or receive them from the main process (LoRA), instead of
loading the whole model (:func:`flowgrpo.parallel.prepare_model`).

Every loader of :data:`flowgrpo.models.ADAPTERS` takes ``empty_transformer``; when it is set the pipeline is
loaded with :func:`empty_components` passed as its trained transformer (diffusers' ``from_pretrained`` takes a
component given by name instead of loading it), so the transformer's weight files are not read while loading. The
module remembers where its weights are (:data:`WEIGHTS_ATTR`: the folder or hub id and the subfolder).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

#: the attribute of an empty component naming its weights: ``(folder or hub id, subfolder)``
WEIGHTS_ATTR = "flowgrpo_weights"


def empty_components(path: str, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.nn.Module]:
    """{name: pipeline component ``name`` of the diffusers folder or hub id ``path``, built from its config with
    its parameters on the meta device (no memory, no values) and its buffers real (computed by the module's own
    constructor, as the non-persistent rotary tables are)}; ``{}`` for no names.

    ``dtype``: the ``torch_dtype`` the pipeline is loaded with; the parameters then take the dtypes loading would
    give them (:func:`cast_as_loaded`), so every process of a sharded run, and the full fine-tune's reference copy
    made from the module, has the dtypes of a loaded model. Each module keeps its weights' location in
    :data:`WEIGHTS_ATTR`. Raises ``KeyError`` for a name the pipeline does not have."""
    if not names:
        return {}
    from accelerate import init_empty_weights
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(path)
    out = {}
    for name in names:
        library, class_name = index[name]
        cls = getattr(importlib.import_module(library), class_name)
        with init_empty_weights(include_buffers=False):
            out[name] = cls.from_config(cls.load_config(path, subfolder=name))
        if dtype is not None:
            cast_as_loaded(out[name], dtype)
        # as loading through the pipeline records it (its config.json is written with the final weights)
        out[name].register_to_config(_name_or_path=str(Path(path, name)) if Path(path).is_dir() else path)
        setattr(out[name], WEIGHTS_ATTR, (path, name))
    return out


def empty_names(path: str, trained: str, empty_transformer: bool, empty_other_expert: bool) -> list[str]:
    """The components of a two-expert pipeline (Wan2.2 A14B: ``transformer`` and ``transformer_2``) to build empty:
    the trained expert with ``empty_transformer``, the other one with ``empty_other_expert`` (it is sharded,
    ``parallel.experts: shard``, and each process reads its own shards), when the pipeline has it."""
    names = [trained] if empty_transformer else []
    other = "transformer_2" if trained == "transformer" else "transformer"
    if empty_other_expert:
        from diffusers import DiffusionPipeline

        if (DiffusionPipeline.load_config(path).get(other) or [None])[0] is not None:
            names.append(other)
    return names


def cast_as_loaded(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the floating-point parameters of ``module`` (built from its config) the dtypes
    ``from_pretrained(..., torch_dtype=dtype)`` gives them: ``dtype``, except those of a module the class keeps in
    float32 (``_keep_in_fp32_modules``, matched against the parts of the parameter's name, as diffusers'
    ``load_model_dict_into_meta`` in ``diffusers/models/model_loading_utils.py`` does). Meta parameters stay on
    the meta device."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    for name, p in module.named_parameters():
        if p.is_floating_point():
            target = torch.float32 if any(k in name.split(".") for k in keep) else dtype
            if p.dtype != target:
                p.data = p.data.to(target)


def weights_folder(source: tuple[str, str]) -> str:
    """The local folder of an empty component's weights (``source``: :data:`WEIGHTS_ATTR`'s ``(folder or hub id,
    subfolder)``): the subfolder of a local folder, or of the hub snapshot (``huggingface_hub.snapshot_download``
    of that subfolder alone: the processes of one node fetch it in turn, the first of them before the others, so
    the files are downloaded once per node and read from the cache by the rest).

    Raises:
        FileNotFoundError: the folder holds no ``*.safetensors`` file (only the safetensors format can be read a
            slice at a time).
    """
    from flowgrpo.distributed import dist

    path, subfolder = source
    local = Path(path, subfolder)
    if not local.is_dir():
        from huggingface_hub import snapshot_download

        def fetch() -> Path:
            return Path(snapshot_download(path, allow_patterns=[f"{subfolder}/*"])) / subfolder

        local = dist.local_main_first(fetch)
    if not any(local.glob("*.safetensors")):
        raise FileNotFoundError(f"{local} holds no *.safetensors file: a sharded full fine-tune reads each "
                                "process's shard from safetensors files (save the model with diffusers' "
                                "save_pretrained, which writes them)")
    return str(local)
