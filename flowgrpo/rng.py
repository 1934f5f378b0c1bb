"""Deterministic random streams: every draw comes from a generator seeded from named parts
(seed, epoch, prompt, sample, purpose), so a run is reproducible whatever the batching or process count."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from the parts' text (stable across processes and Python versions)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_generator(*parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded by :func:`derive_seed` of ``parts``."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))
