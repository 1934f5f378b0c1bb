"""Shared fixtures of the core specification tests.

The tiny FLUX pipeline is built once per session with random weights (``flowgrpo.models.tiny.build_tiny_flux``),
saved in the diffusers folder format and loaded back through ``FluxPipeline.from_pretrained``: the code path of a
real FLUX.1 folder, offline.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    """A tiny random FLUX pipeline folder (64×64 images, 16 latent channels packed to 16 tokens of 64)."""
    from flowgrpo.models.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux") / "pipeline")


@pytest.fixture(scope="session")
def tiny_flux(tiny_flux_dir):
    """The tiny pipeline behind our FLUX adapter (64×64, 32 T5 tokens). Shared: tests must not change it
    (a test that adds LoRA or trains loads its own copy with :func:`flowgrpo.models.load_model`)."""
    from flowgrpo.models import load_model

    return load_model(str(tiny_flux_dir), max_sequence_length=32, height=64, width=64)
