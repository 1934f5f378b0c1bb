"""Specification (issue #54): a frame size a model family cannot make is refused BEFORE the model loads, in one
line naming the setting as given (``model.height`` for train, ``--height`` for sample) and what is allowed; the
rule is read from the model folder's configs (:func:`flowgrpo.preflight.size_rule`), the adapter's own check
stays as the last guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main
from flowgrpo.preflight import size_rule

REPO = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path, cls: str, vae: dict, transformer: dict) -> str:
    (tmp_path / "vae").mkdir(parents=True)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    (tmp_path / "vae" / "config.json").write_text(json.dumps(vae))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(transformer))
    return str(tmp_path)


# expected steps from the diffusers pipelines' own formulas: vae_scale_factor (2^(len(block_out_channels)-1), or
# 2^len(temperal_downsample), or the VAE's spatial ratio) times the transformer's patch (FLUX/Qwen/Z-Image pack 2x2)
@pytest.mark.parametrize(("cls", "vae", "transformer", "family", "step"), [
    ("FluxPipeline", {"block_out_channels": [1, 2, 3, 4]}, {}, "FLUX", 16),
    ("StableDiffusion3Pipeline", {"block_out_channels": [1, 2, 3, 4]}, {"patch_size": 2}, "SD3", 16),
    ("QwenImagePipeline", {"temperal_downsample": [False, True, True]}, {}, "Qwen-Image", 16),
    ("ZImagePipeline", {"block_out_channels": [1, 2, 3, 4]}, {}, "Z-Image", 16),
    ("Flux2KleinPipeline", {"block_out_channels": [1, 2, 3, 4]}, {}, "FLUX.2", 16),
    ("WanPipeline", {"scale_factor_spatial": 16}, {"patch_size": [1, 2, 2]}, "Wan", 32),
    ("WanPipeline", {"temperal_downsample": [False, True, True]}, {"patch_size": [1, 2, 2]}, "Wan", 16),
    ("LTX2Pipeline", {"spatial_compression_ratio": 32}, {}, "LTX-2", 32),
])
def test_size_rule_of_each_family(tmp_path, cls, vae, transformer, family, step):
    assert size_rule(_folder(tmp_path, cls, vae, transformer)) == (family, step)


def test_size_rule_is_the_adapters(tiny_flux_dir):
    """The rule read from the folder is the step the loaded FLUX pipeline gives (vae_scale_factor · 2)."""
    from flowgrpo.models import load_model

    adapter = load_model(str(tiny_flux_dir), height=32, width=32)
    assert size_rule(str(tiny_flux_dir)) == ("FLUX", adapter.pipe.vae_scale_factor * 2)


def _no_load(monkeypatch):
    import flowgrpo.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the size was checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_model_from_config", refuse)


def test_sample_refuses_the_size_before_loading(tmp_path, tiny_flux_dir, monkeypatch, capsys):
    _no_load(monkeypatch)
    step = size_rule(str(tiny_flux_dir))[1]
    with pytest.raises(SystemExit) as ended:
        cli_main(["sample", "--model", str(tiny_flux_dir), "--height", "13", "--prompts", "digits_eval",
                  "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"flowgrpo sample: error: --height=13: FLUX needs a positive multiple of {step}"), err


def test_train_preflight_refuses_the_size_before_loading(tmp_path, tiny_flux_dir, monkeypatch):
    from flowgrpo.config import load_config
    from flowgrpo.preflight import preflight

    _no_load(monkeypatch)
    step = size_rule(str(tiny_flux_dir))[1]
    config = load_config(REPO / "configs" / "tiny_jpeg.yaml", [f"model.pretrained={tiny_flux_dir}",
                                                               f"output_dir={tmp_path / 'run'}", "model.height=13"])
    with pytest.raises(ValueError) as err:
        preflight(config, world_size=1)
    assert str(err.value).startswith(f"model.height=13: FLUX needs a positive multiple of {step}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("module", "builder", "truth"), [
    ("flowgrpo.models.sd3", "build_tiny_sd3", lambda p: p.vae_scale_factor * p.patch_size),
    ("flowgrpo.models.qwenimage", "build_tiny_qwenimage", lambda p: p.vae_scale_factor * 2),
    ("flowgrpo.models.wan", "build_tiny_wan",
     lambda p: p.vae_scale_factor_spatial * p.transformer.config.patch_size[1]),
    ("flowgrpo.models.ltx2", "build_tiny_ltx2", lambda p: p.vae_spatial_compression_ratio),
    ("flowgrpo.models.flux2", "build_tiny_flux2_klein", lambda p: p.vae_scale_factor * 2),
])
def test_size_rule_is_each_loaded_pipelines(tmp_path, module, builder, truth):
    """The step read from the folder's configs is the one the loaded diffusers pipeline computes (the adapters'
    own checks use these attributes)."""
    import importlib

    import diffusers

    folder = tmp_path / "model"
    getattr(importlib.import_module(module), builder)(folder)
    pipe = getattr(diffusers, json.loads((folder / "model_index.json").read_text())["_class_name"]).from_pretrained(
        folder)
    assert size_rule(str(folder))[1] == truth(pipe)
