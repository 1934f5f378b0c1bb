"""The final transformer of a full fine-tune is written one file at a time (``flowgrpo.checkpoints.state_dicts
.export_transformer``) and is, byte for byte, what diffusers' own ``save_pretrained`` writes: the same file names,
the same safetensors files (the split into files of at most ``max_shard_size`` by huggingface_hub), the same index
and ``config.json``. The expected files come from diffusers itself, on a copy of the model cast to the dtype."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("max_size", ["10GB", 60_000])  # one file; several files and an index
def test_export_writes_what_save_pretrained_writes(tmp_path, tiny_flux_dir, max_size):
    from diffusers import FluxTransformer2DModel

    from flowgrpo.checkpoints.state_dicts import export_transformer

    model = FluxTransformer2DModel.from_pretrained(tiny_flux_dir, subfolder="transformer")
    copy = FluxTransformer2DModel.from_config(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(torch.bfloat16).save_pretrained(tmp_path / "diffusers", max_shard_size=max_size)
    export_transformer(model, tmp_path / "ours", torch.bfloat16, main=True, max_file_size=max_size)
    expected = _digests(tmp_path / "diffusers")
    assert (max_size != "10GB") == any(name.endswith(".index.json") for name in expected)
    assert _digests(tmp_path / "ours") == expected


def test_only_the_main_process_writes(tmp_path, tiny_flux_dir):
    from diffusers import FluxTransformer2DModel

    from flowgrpo.checkpoints.state_dicts import export_transformer

    model = FluxTransformer2DModel.from_pretrained(tiny_flux_dir, subfolder="transformer")
    export_transformer(model, tmp_path / "other", torch.float32, main=False)
    assert not (tmp_path / "other").exists()
