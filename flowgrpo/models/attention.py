"""Which scaled-dot-product-attention kernels the transformer may use (``model.attention_backend``).

PyTorch picks among its SDPA kernels per call (flash, memory-efficient, cuDNN, math). On some torch/cuDNN pairs
the cuDNN kernel's backward fails (``Expected mha_graph.execute(...).is_good() to be true``, seen with torch
2.11 + CUDA 13 on an H200), so ``auto`` lets PyTorch choose among flash, memory-efficient and math on CUDA, never
cuDNN. Elsewhere ``auto`` leaves PyTorch's choice alone. The choice is applied with
:func:`torch.nn.attention.sdpa_kernel` around every transformer call (rollout and training) and around the
backward pass (so activation checkpointing recomputes with the same kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowgrpo.strategies.registry import Registry

ATTENTION_BACKENDS: Registry = Registry("attention backend")
_FIXED = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}
for _name, _kernels in _FIXED.items():
    ATTENTION_BACKENDS.register(_name)(lambda device_type, k=_kernels: k)


@ATTENTION_BACKENDS.register("auto")
def _auto(device_type: str) -> list[SDPBackend] | None:
    if device_type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return None


class AttentionBackendError(RuntimeError):
    """An attention kernel failed; the message names ``model.attention_backend`` and the alternatives."""


@contextlib.contextmanager
def attention_context(name: str, device: torch.device) -> Iterator[None]:
    """Run with the SDPA kernels of backend ``name`` on ``device`` (unrestricted when the backend says so).

    Raises:
        KeyError: an unknown name, listing the valid ones.
        AttentionBackendError: an attention kernel failed inside the context (forward or backward).
    """
    kernels = ATTENTION_BACKENDS.get(name)(torch.device(device).type)
    try:
        with contextlib.nullcontext() if kernels is None else sdpa_kernel(kernels):
            yield
    except AttentionBackendError:
        raise
    except RuntimeError as err:
        raise_attention_error(err, name)
        raise


_ATTENTION_MARKERS = ("scaled_dot_product", "no viable backend", "mha_graph", "flash attention", "flash_attention",
                      "cudnn", "sdpa", "efficient_attention")


def raise_attention_error(err: RuntimeError, name: str) -> None:
    """Re-raise a failure of an attention kernel as one :class:`AttentionBackendError` naming
    ``model.attention_backend``; return (doing nothing) for any other error."""
    text = str(err).lower()
    if not any(m in text for m in _ATTENTION_MARKERS):
        return
    raise AttentionBackendError(
        f"the attention kernel failed with model.attention_backend={name!r}: {str(err).splitlines()[0][:300]}. "
        f"Choose another backend (model.attention_backend=math always works; one of {ATTENTION_BACKENDS.names()}); "
        "'auto' avoids cuDNN attention, whose backward fails on some torch/cuDNN versions."
    ) from err
