"""A pipeline's trained transformer built without its weights, for the processes of a sharded run that receive
their shards from the main process instead of reading the files (:func:`flowgrpo.parallel.prepare_model`).

Every loader of :data:`flowgrpo.models.ADAPTERS` takes ``empty_transformer``; when it is set the pipeline is
loaded with :func:`empty_components` passed as its trained transformer (diffusers' ``from_pretrained`` takes a
component given by name instead of loading it), so the transformer's weight files are never opened by that
process.
"""

from __future__ import annotations

import importlib

import torch


def empty_components(path: str, names: list[str]) -> dict[str, torch.nn.Module]:
    """{name: pipeline component ``name`` of the diffusers folder or hub id ``path``, built from its config with
    its parameters on the meta device (no memory, no values) and its buffers real (computed by the module's own
    constructor, as the non-persistent rotary tables are)}; ``{}`` for no names.

    The parameters' dtypes are those ``from_config`` gives: :func:`flowgrpo.parallel.prepare_model` sets them to
    the main process's before sharding. Raises ``KeyError`` for a name the pipeline does not have."""
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
    return out
