"""The private diffusers helpers the adapters rely on (``flowgrpo.models.DIFFUSERS_PRIVATE_API``): present, with
the parameters we pass, and doing what we assume — checked against reshapes written here from the layouts the
FLUX and Qwen-Image papers describe (2×2 patches of the latent flattened channel-major into tokens)."""

from __future__ import annotations

import inspect

import diffusers
import pytest
import torch

from flowgrpo.models import DIFFUSERS_PRIVATE_API

CASES = [(cls, name, params) for cls, methods in DIFFUSERS_PRIVATE_API.items() for name, params in methods.items()]


@pytest.mark.parametrize("cls, name, params", CASES, ids=[f"{c}.{n}" for c, n, _ in CASES])
def test_present_with_the_parameters_we_pass(cls, name, params):
    pipeline = getattr(diffusers, cls)
    assert isinstance(inspect.getattr_static(pipeline, name), staticmethod), f"{cls}.{name} is no staticmethod"
    assert tuple(inspect.signature(getattr(pipeline, name)).parameters) == params


def _patchify(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B, H/2·W/2, C·4): token (i, j) holds channel c's 2×2 patch at c·4 + 2·di + dj."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


@pytest.mark.parametrize("cls", ["FluxPipeline", "FluxKontextPipeline", "QwenImagePipeline",
                                 "QwenImageEditPlusPipeline"])
def test_pack_latents_is_the_2x2_patchify(cls):
    x = torch.randn(2, 4, 6, 8)
    pipeline = getattr(diffusers, cls)
    packed = pipeline._pack_latents(x, 2, 4, 6, 8) if cls.startswith("Flux") else \
        pipeline._pack_latents(x.unsqueeze(2), 2, 4, 6, 8)  # Qwen-Image latents carry a frame axis
    assert torch.equal(packed, _patchify(x))


@pytest.mark.parametrize("cls", ["FluxPipeline", "QwenImagePipeline"])
def test_unpack_inverts_pack(cls):
    x = torch.randn(2, 4, 6, 8)
    pipeline = getattr(diffusers, cls)
    # pixel size = latent size · vae_scale_factor; the helpers take pixel sizes
    back = pipeline._unpack_latents(_patchify(x), 6 * 8, 8 * 8, 8)
    assert torch.equal(back.reshape(x.shape), x)


def test_flux_latent_image_ids_are_row_column_positions():
    ids = diffusers.FluxPipeline._prepare_latent_image_ids(1, 3, 4, "cpu", torch.float32)  # (12, 3)
    rows, cols = torch.meshgrid(torch.arange(3.0), torch.arange(4.0), indexing="ij")
    assert torch.equal(ids, torch.stack([torch.zeros(12), rows.flatten(), cols.flatten()], dim=1))


@pytest.mark.parametrize("cls", ["Flux2Pipeline", "Flux2KleinPipeline"])
def test_flux2_pack_is_flatten_and_ids_are_positions(cls):
    pipeline = getattr(diffusers, cls)
    x = torch.randn(2, 8, 3, 4)  # already patchified latents (B, C, H, W)
    assert torch.equal(pipeline._pack_latents(x), x.flatten(2).transpose(1, 2))
    ids = pipeline._prepare_latent_ids(x)  # (B, H·W, 4): (t, h, w, l)
    assert ids.shape == (2, 12, 4)
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    assert torch.equal(ids[0, :, 1].long(), rows.flatten()) and torch.equal(ids[0, :, 2].long(), cols.flatten())


@pytest.mark.parametrize("cls", ["Flux2Pipeline", "Flux2KleinPipeline"])
def test_flux2_unpatchify_is_the_2x2_unpatchify(cls):
    x = torch.randn(2, 4, 6, 8)
    patched = _patchify(x).transpose(1, 2).reshape(2, 16, 3, 4)  # (B, C·4, H/2, W/2)
    assert torch.equal(getattr(diffusers, cls)._unpatchify_latents(patched), x)


def test_qwenimage21_pack_is_a_flatten_and_unpack_inverts_it():
    """Qwen-Image 2.1 consumes its latents unpatched: (B, 1, C, h, w) → (B, h·w, C) tokens, row-major."""
    x = torch.randn(2, 1, 4, 4, 6)  # (an even latent grid: the pipeline's sizes are multiples of 32 px)
    packed = diffusers.QwenImage21Pipeline._pack_latents(x, 2, 4, 4, 6)
    assert torch.equal(packed, x[:, 0].flatten(2).transpose(1, 2))
    back = diffusers.QwenImage21Pipeline._unpack_latents(packed, 4 * 16, 6 * 16, 16)  # pixel sizes, 16x VAE
    assert torch.equal(back, x.transpose(1, 2))  # (B, C, 1, h, w)
