"""Diffusers modular pipelines as an adapter source: a repository with ``modular_model_index.json`` (a
``ModularPipeline`` of blocks instead of a ``__call__``).

A modular pipeline is a sequence of blocks (encode the prompt, prepare the latents, set the timesteps, the
denoising loop, decode) that read and write a shared ``PipelineState`` and use the pipeline's components. An
adapter built on :class:`ModularAdapter` runs the family's own blocks for everything outside the loop, by their
names in the pipeline's block tree (:meth:`ModularAdapter.run`), and replaces the loop by flowgrpo's sampler calling
the adapter's :meth:`velocity` (the transformer call of the family's loop-denoiser block), so rollout and training
compute the same function and the on-policy ratio is exactly 1.

A new modular flow-matching family is then one small file: a subclass naming its blocks and writing ``velocity``,
its loader (:func:`load_modular_pipeline`) registered under the ``_class_name`` of the repository's index
(:mod:`flowgrpo.models`), and a conformance case (:mod:`flowgrpo.models.random_pipelines`). ``docs/new_model.md`` walks
through it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from flowgrpo.models.base import AdapterBase
from flowgrpo.models.empty import WEIGHTS_ATTR, cast_as_loaded

__all__ = ["ModularAdapter", "find_block", "load_modular_pipeline", "modular_index", "empty_modular_components"]

def modular_index(path: str) -> dict:
    """The parsed ``modular_model_index.json`` of a local folder or hub id (diffusers' own reader).

    Raises:
        OSError: the repository has no modular index (diffusers' ``EnvironmentError``).
    """
    from diffusers import ModularPipeline

    return dict(ModularPipeline.load_config(path))


def empty_modular_components(path: str, names: list[str],
                             dtype: torch.dtype | None = None) -> dict[str, torch.nn.Module]:
    """{name: component ``name`` of the modular repository ``path``, built from its config with its parameters on the
    meta device and its buffers real}, as :func:`flowgrpo.models.empty.empty_components` does for a regular
    pipeline; the component's class and folder are read from its loading spec in the modular index
    (``[library, class, {pretrained_model_name_or_path, subfolder, ...}]``; a local folder holding the component's
    subfolder is read itself, as ``ModularPipeline`` reads a local copy); ``dtype`` and the weights' location
    (:data:`~flowgrpo.models.empty.WEIGHTS_ATTR`) as there. Raises ``KeyError`` for a name the index does not
    have."""
    if not names:
        return {}
    from accelerate import init_empty_weights

    index = modular_index(path)
    out = {}
    for name in names:
        library, class_name, spec = index[name]
        cls = getattr(importlib.import_module(library), class_name)
        subfolder = spec.get("subfolder") or name
        # a local copy reads its own component folder first, as ModularPipeline does; else the spec's repository
        local = Path(path, subfolder).is_dir()
        source = path if local else spec.get("pretrained_model_name_or_path") or path
        with init_empty_weights(include_buffers=False):
            out[name] = cls.from_config(cls.load_config(source, subfolder=subfolder,
                                                        revision=None if local else spec.get("revision")))
        if dtype is not None:
            cast_as_loaded(out[name], dtype)
        setattr(out[name], WEIGHTS_ATTR, (source, subfolder))
    return out


def load_modular_pipeline(path: str, *, dtype: torch.dtype, drop_blocks: tuple[str, ...] = (),
                          empty_transformer: bool = False):
    """``ModularPipeline.from_pretrained(path)`` (the pipeline class and its default blocks named by the modular
    index) with its ``from_pretrained`` components loaded in ``dtype`` (``load_components``); the ``from_config``
    ones (scheduler, guider) are created from the blocks' specs.

    ``drop_blocks``: top-level blocks removed before the pipeline is built (FLUX.3's ``prompt_upsampler``, a
    language model that rewrites the prompt: flowgrpo encodes the prompt file's text as given); their components
    are then not loaded. ``empty_transformer``: the transformer is built empty
    (:func:`empty_modular_components`), its weights never read.

    Raises:
        ValueError: a ``drop_blocks`` name the pipeline's blocks do not have.
    """
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(path)
    if drop_blocks:
        blocks = pipe.blocks  # a copy
        unknown = [n for n in drop_blocks if n not in blocks.sub_blocks]
        if unknown:
            raise ValueError(f"{type(pipe).__name__} has no blocks {unknown}; its blocks: {list(blocks.sub_blocks)}")
        for name in drop_blocks:
            blocks.sub_blocks.pop(name)
        pipe = type(pipe)(blocks=blocks, pretrained_model_name_or_path=path)
    names = [n for n in pipe.pretrained_component_names if not (empty_transformer and n == "transformer")]
    pipe.load_components(names=names, torch_dtype=dtype)
    if empty_transformer:
        pipe.update_components(**empty_modular_components(path, ["transformer"], dtype))
    return pipe


def find_block(pipe, path: str):
    """The block at ``path`` in a modular pipeline's block tree, names joined by dots (e.g.
    ``"denoise.text2image.prepare_latents"``; an auto block's branches are its sub-blocks).

    Raises:
        ValueError: no block at ``path`` (naming the names available where it fails).
    """
    node = pipe.blocks  # a copy of the pipeline's block tree (blocks hold their settings, not state)
    owner = pipe.label if isinstance(pipe, _Holder) else type(pipe).__name__
    for name in path.split("."):
        subs = getattr(node, "sub_blocks", {})
        if name not in subs:
            raise ValueError(f"{owner} has no block {path!r}: {name!r} is not one of {list(subs)}")
        node = subs[name]
    return node


class ModularAdapter(AdapterBase):
    """An adapter over a diffusers ``ModularPipeline``: runs the pipeline's own blocks by name.

    Args:
        pipe: the loaded modular pipeline (:func:`load_modular_pipeline`); its ``transformer`` is the trained module.
        height, width, max_sequence_length: as :class:`~flowgrpo.models.base.AdapterBase`.
    """

    def block(self, path: str):
        """The block at ``path`` of this pipeline (:func:`find_block`), from the copy of its block tree taken
        once per adapter."""
        if getattr(self, "_tree", None) is None:
            self._tree = _Holder(self.pipe.blocks, type(self.pipe).__name__)
        return find_block(self._tree, path)

    @torch.no_grad()
    def run(self, path: str, **inputs):
        """Run the block at ``path`` (:meth:`block`) on this pipeline's components with ``inputs``, every other
        input of the block at its declared default, as ``ModularPipeline.__call__`` fills them; returns the
        resulting ``PipelineState`` (read its outputs with ``state.get(name)``).

        Raises:
            ValueError: an input the block does not take.
        """
        from diffusers.modular_pipelines import PipelineState

        block = self.block(path)
        params = {p.name: p for p in block.inputs if p.name}
        unknown = sorted(set(inputs) - set(params))
        if unknown:
            raise ValueError(f"block {path!r} takes no inputs {unknown}; it takes {sorted(params)}")
        state = PipelineState()
        for name, p in params.items():
            state.set(name, inputs[name] if name in inputs else p.default, p.kwargs_type)
        _, state = block(self.pipe, state)
        return state


class _Holder:
    """A fixed block tree in the shape :func:`find_block` reads (``.blocks``), and the pipeline class's name
    (``label``) its errors name."""

    def __init__(self, blocks, label: str) -> None:
        self.blocks, self.label = blocks, label
