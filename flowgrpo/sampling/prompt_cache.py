"""Prompt embeddings computed once: a host-memory cache of each distinct prompt's text conditioning.

With a finite prompt set the rollout of every epoch and every evaluation would encode the same prompts again
(T5-XXL or Qwen2.5-VL, on the device). With ``model.cache_prompt_embeddings: true`` the first encoding of a
prompt is kept in host memory and every later use reads it back, so the encoders run once per distinct prompt;
with ``parallel.text_encoders: offload`` they then stay in host memory except while a new prompt is encoded
(after the first epoch of a finite set: never).

Exactness: a cached row is the row the adapter's ``encode_prompts`` returned for that prompt, copied bit for bit;
the trajectory carries the embeddings the rollout used and the update reads them from it, so the on-policy ratio
is the same as without the cache. The rows of one call are encoded in one batch; an adapter whose rows depend on
their batch (Qwen-Image pads to the batch's longest prompt) gives rows of different lengths, which are refused
with one line rather than padded (see :meth:`PromptEmbedCache.embeds`).

Key: (encoder identity, prompt, conditioning image paths). The identity (:func:`encoder_identity`) is a digest
of the adapter's class, the model source, ``max_sequence_length`` and each encoder's and tokenizer's class and
config, so embeddings of another encoder or other encoding settings are never mixed in.

Cost: host memory per distinct prompt = the bytes of one row (FLUX.1 at 512 tokens in bfloat16: 512·4096·2 B
= 4 MiB for T5 plus 1.5 KiB pooled CLIP).

On disk (``model.prompt_embeddings_dir``): each row is also written to
``<dir>/<identity[:16]>/<sha256 of the key>.safetensors`` (written to a temporary name and renamed, so a reader never
sees half a file) and read from there when it is not in host memory, so a resumed or later run with the same
encoders skips the encoders too; ``<dir>`` must be absent, empty or this cache's (:data:`OWN_NAMES`, the rule of
:mod:`flowgrpo.writing.outputs`). The file holds the row's tensors, the shared tensors (``shared.<name>``) and, in
its metadata, the full identity and key, which are checked on reading.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from flowgrpo.records import PromptEmbeds
from flowgrpo.writing.outputs import claim_folder, save_tensors

#: the names the cache gives the folders of ``model.prompt_embeddings_dir`` (one per encoder identity)
OWN_NAMES = r"[0-9a-f]{16}"

#: pipeline components that take part in encoding a prompt (their class and config enter the identity)
ENCODING_COMPONENTS = ("text_encoder", "tokenizer", "image_encoder", "feature_extractor", "processor")


def _component_digest(component) -> dict:
    config = getattr(component, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        text = config.to_json_string()
    elif isinstance(config, dict):
        text = json.dumps(config, sort_keys=True, default=str)
    else:  # tokenizers: their source, vocabulary size and length limit
        text = json.dumps({"name_or_path": str(getattr(component, "name_or_path", "")),
                           "vocab": len(component) if hasattr(component, "__len__") else None,
                           "max_length": getattr(component, "model_max_length", None)}, default=str)
    cls = type(component)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "config": hashlib.sha256(text.encode()).hexdigest()}


def encoder_identity(adapter, source: str) -> str:
    """A hex digest (sha256) naming what a prompt's embedding depends on: the adapter's class, the model ``source``
    (the folder or hub id), the adapter's ``max_sequence_length``, and the class and config digest of every
    pipeline component named in :data:`ENCODING_COMPONENTS` (``text_encoder``, ``text_encoder_2``, tokenizers, …)."""
    components = getattr(getattr(adapter, "pipe", None), "components", {}) or {}
    parts = {name: _component_digest(c) for name, c in sorted(components.items())
             if c is not None and name.startswith(ENCODING_COMPONENTS)}
    cls = type(adapter)
    ident = {"adapter": f"{cls.__module__}.{cls.__qualname__}", "source": str(source),
             "max_sequence_length": getattr(adapter, "max_sequence_length", None), "components": parts}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


class PromptEmbedCache:
    """Host-memory rows of :class:`~flowgrpo.records.PromptEmbeds`, one per distinct (prompt, images) key.

    Args:
        identity: the encoder identity (:func:`encoder_identity`); part of every key.
        directory: where rows are also kept on disk (module docstring), or None (host memory only).

    Attributes:
        encoded: how many rows were encoded (cache misses) since construction.
        hits: how many rows were read from the cache.
    """

    def __init__(self, identity: str, directory: str | Path | None = None) -> None:
        if not isinstance(identity, str) or not identity:
            raise ValueError(f"prompt cache identity must be a non-empty string, got {identity!r}")
        self.identity = identity
        self.directory = None if directory is None else Path(directory) / identity[:16]
        self.read = 0  # rows read from disk
        self.rows: dict[tuple, dict[str, torch.Tensor]] = {}
        self.shared: dict[str, torch.Tensor] | None = None
        self.encoded = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _key(self, key: Hashable) -> tuple:
        return (self.identity, key)

    def embeds(self, keys: Sequence[Hashable], encode: Callable[[list[int]], PromptEmbeds],
               device: torch.device | str) -> PromptEmbeds:
        """:class:`PromptEmbeds` of the distinct ``keys`` (U rows, in order) on ``device``.

        ``encode(positions)`` is called once, with the positions in ``keys`` of those not cached yet (none: not
        called), and returns their embeddings in that order; its rows are copied to host memory.

        Raises:
            ValueError: the encoder's rows or shared tensors differ in shape or value from those cached before
                (an adapter whose embeddings depend on the batch), naming the tensor.
        """
        if self.directory is not None:
            for k in keys:
                if self._key(k) not in self.rows:
                    self._read(k)
        missing = [i for i, k in enumerate(keys) if self._key(k) not in self.rows]
        self.hits += len(keys) - len(missing)
        if missing:
            fresh = encode(missing)
            if len(fresh) != len(missing):
                raise ValueError(f"prompt cache: the encoder returned {len(fresh)} rows for {len(missing)} prompts")
            shared = {k: v.detach().to("cpu", copy=True) for k, v in fresh.shared.items()}
            if self.shared is None:
                self.shared = shared
            else:
                self._check_shared(shared)
            for j, i in enumerate(missing):
                self.rows[self._key(keys[i])] = {k: v[j : j + 1].detach().to("cpu", copy=True)
                                                 for k, v in fresh.tensors.items()}
                if self.directory is not None:
                    self._write(keys[i])
            self.encoded += len(missing)
        rows = [self.rows[self._key(k)] for k in keys]
        tensors = {}
        for name in rows[0]:
            shapes = {tuple(r[name].shape) for r in rows}
            if len(shapes) > 1:
                raise ValueError(f"model.cache_prompt_embeddings: {name!r} rows have shapes {sorted(shapes)}; this "
                                 "model's embeddings depend on the batch they are encoded in, so they cannot be "
                                 "cached; set model.cache_prompt_embeddings=false")
            tensors[name] = torch.cat([r[name] for r in rows]).to(device)
        return PromptEmbeds(tensors, {k: v.to(device) for k, v in self.shared.items()})

    def _path(self, key: Hashable) -> Path:
        text = json.dumps(key, default=str)
        return self.directory / f"{hashlib.sha256(text.encode()).hexdigest()}.safetensors"

    def _write(self, key: Hashable) -> None:
        """The row of ``key`` (and the shared tensors) to its file, atomically (temporary file, then rename)."""
        claim_folder(self.directory.parent, "prompt embeddings", "model.prompt_embeddings_dir")  # checked before
        self.directory.mkdir(exist_ok=True)  # the run by the preflight (flowgrpo.writing.outputs.check_folder)
        tensors = {**{f"row.{k}": v.contiguous() for k, v in self.rows[self._key(key)].items()},
                   **{f"shared.{k}": v.contiguous() for k, v in self.shared.items()}}
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        os.close(fd)
        try:
            save_tensors(tensors, tmp, metadata={"identity": self.identity, "key": json.dumps(key, default=str)})
            os.replace(tmp, self._path(key))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _read(self, key: Hashable) -> None:
        """The row of ``key`` from its file into host memory, if the file exists.

        Raises:
            ValueError: a file that cannot be read, or whose identity or key differ from the expected ones (the
                message names the file).
        """
        from safetensors import safe_open

        path = self._path(key)
        if not path.exists():
            return
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iter
        except Exception as err:  # noqa: BLE001 - whatever safetensors raises on a damaged file
            raise ValueError(f"prompt embedding file {path} cannot be read ({type(err).__name__}: {err}); delete "
                             "it to encode the prompt again") from None
        if meta.get("identity") != self.identity or meta.get("key") != json.dumps(key, default=str):
            raise ValueError(f"prompt embedding file {path} holds another encoder's or prompt's row (identity "
                             f"{meta.get('identity', '')[:16]!r}, key {meta.get('key')!r}); delete it")
        shared = {k[len("shared."):]: v for k, v in tensors.items() if k.startswith("shared.")}
        if self.shared is None:
            self.shared = shared
        else:
            self._check_shared(shared)
        self.rows[self._key(key)] = {k[len("row."):]: v for k, v in tensors.items() if k.startswith("row.")}
        self.read += 1

    def _check_shared(self, shared: dict[str, torch.Tensor]) -> None:
        for name in set(shared) | set(self.shared):
            a, b = self.shared.get(name), shared.get(name)
            if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
                raise ValueError(f"model.cache_prompt_embeddings: the shared tensor {name!r} differs between "
                                 "encodings; this model's embeddings depend on the batch they are encoded in, so "
                                 "they cannot be cached; set model.cache_prompt_embeddings=false")


def attach_prompt_cache(adapter, source: str, text_encoders: str,
                        directory: str | Path | None = None) -> PromptEmbedCache:
    """Give ``adapter`` a :class:`PromptEmbedCache` (``adapter.prompt_cache``, on disk too in ``directory`` when
    given), read by :func:`~flowgrpo.sampling.rollout.encode_rows`.

    Raises:
        ValueError: ``text_encoders`` is ``shard``: sharded encoders encode in lockstep on every process, and a
            cache that hits on one process and misses on another would leave the others waiting.
    """
    if text_encoders == "shard":
        raise ValueError("model.cache_prompt_embeddings=true needs parallel.text_encoders device or offload, got "
                         "'shard' (sharded encoders encode in lockstep; per-process cache misses would hang)")
    adapter.prompt_cache = PromptEmbedCache(encoder_identity(adapter, source), directory)
    return adapter.prompt_cache
