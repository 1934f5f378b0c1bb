"""A LoRA of another model is refused in one line before diffusers loads it
(:func:`flowgrpo.models.lora.check_lora_fits`).

diffusers 0.42 loaded both of these without an error: the LoRA of a deeper FLUX transformer (its extra block's
tensors dropped with a warning: a partial LoRA sampled as if whole), and the LoRA of a FLUX transformer with more
input channels (FLUX's loader, made for Control LoRAs, widened ``x_embedder`` of the loaded model to the LoRA's
width: the base model changed under the user). A LoRA of the same model loads as before.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.lora import load_lora_into

#: the tiny FLUX transformer (``build_tiny_flux``'s defaults, the embedded ``tiny`` model's) and LoRAs of others
OTHERS = {
    "deeper": ({"num_layers": 2}, "'transformer_blocks.1.attn.to_k.lora_A.weight' is for the module "
                                  "'transformer_blocks.1.attn.to_k', which FluxTransformer2DModel has not"),
    "more input channels": ({"in_channels": 128}, "'x_embedder.lora_A.weight' has shape (4, 128), and 'x_embedder' "
                                                  "is a Linear of 64 -> 32 features"),
    "wider heads": ({"attention_head_dim": 32}, "has shape (4, 64), and 'single_transformer_blocks.0.attn.to_k' is a "
                                                "Linear of 32 -> 32 features"),
}


def _lora_of(folder, transformer_kwargs: dict) -> None:
    """A rank-4 LoRA on ``x_embedder``, ``to_k`` and ``to_q`` of a random tiny FLUX transformer built with
    ``transformer_kwargs``, saved as a pipeline LoRA (``FluxPipeline.save_lora_weights``, as ``save_lora``)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from flowgrpo.models.tiny import TEXT_DIM

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(**{"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1,
                                   "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": TEXT_DIM,
                                   "pooled_projection_dim": TEXT_DIM, "guidance_embeds": True,
                                   "axes_dims_rope": (4, 6, 6), **transformer_kwargs})
    tr.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["x_embedder", "to_k", "to_q"]))
    FluxPipeline.save_lora_weights(str(folder), transformer_lora_layers=get_peft_model_state_dict(tr),
                                   safe_serialization=True)


@pytest.mark.parametrize("other", list(OTHERS))
def test_a_lora_of_another_flux_is_refused_and_the_model_is_left_as_it_was(tiny_flux_dir, tmp_path, other):
    from diffusers import FluxPipeline

    kwargs, why = OTHERS[other]
    _lora_of(tmp_path / "lora", kwargs)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_lora_into(pipe, tmp_path / "lora")
    line = str(err.value)
    assert "\n" not in line and why in line and "does not fit this model" in line, line
    after = pipe.transformer.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert pipe.transformer.x_embedder.in_features == 64


def test_a_lora_of_the_same_model_loads(tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline

    _lora_of(tmp_path / "lora", {})
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    load_lora_into(pipe, tmp_path / "lora")
    loaded = [k for k in pipe.transformer.state_dict() if "lora_A" in k]
    assert len(loaded) == 5  # x_embedder, to_k and to_q of the double block, to_k and to_q of the single block


def test_flowgrpo_sample_refuses_a_lora_of_another_model_in_one_line(tmp_path, capsys):
    """Through the command a user types: ``flowgrpo sample --model tiny --lora FOLDER``."""
    from flowgrpo.cli import main as cli_main

    _lora_of(tmp_path / "lora", {"num_layers": 2})
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--model", "tiny", "--lora", str(tmp_path / "lora"), "--prompts", "digits_eval",
                  "--num-images", "1", "--out", str(tmp_path / "out")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert info.value.code == 2 and len(errors) == 1, errors
    assert "does not fit this model" in errors[0] and "transformer_blocks.1.attn.to_k" in errors[0]
    assert not (tmp_path / "out" / "images.pt").exists()


def test_a_bare_lora_teacher_of_another_model_is_refused_in_one_line(tiny_flux_dir, tmp_path):
    """``objective.teacher`` a LoRA folder without a run's config (no base to compare before the load): the same check
    at its load, in the teacher's own line."""
    from flowgrpo.algo.objectives.opd import load_teacher
    from flowgrpo.config import build_config

    _lora_of(tmp_path / "lora", {"in_channels": 128})
    cfg = build_config({"model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 64,
                                  "width": 64}})
    with pytest.raises(ValueError) as err:
        load_teacher(str(tmp_path / "lora"), None, cfg.model)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"objective.teacher={str(tmp_path / 'lora')!r}: its LoRA does not fit")
    assert "'x_embedder.lora_A.weight' has shape (4, 128)" in line, line


@pytest.mark.parametrize("content", [b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":"], ids=["empty", "cut short"])
def test_an_unreadable_lora_file_is_refused_in_one_line_as_teacher_before_any_load_and_by_sample(
        tiny_flux_dir, tmp_path, capsys, monkeypatch, content):
    """An empty or truncated ``pytorch_lora_weights.safetensors`` was a 34-line traceback (safetensors'
    ``SafetensorError``) after the student model was built; now one line, the teacher's from its header before
    anything loads, and ``flowgrpo sample --lora``'s."""
    import flowgrpo.models as models
    from flowgrpo.algo.objectives.opd import check_teacher
    from flowgrpo.cli import main as cli_main
    from flowgrpo.config import build_config

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "pytorch_lora_weights.safetensors").write_bytes(content)
    cfg = build_config({"model": {"pretrained": str(tiny_flux_dir)}})

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model_from_config", no_load)
    with pytest.raises(ValueError) as err:
        check_teacher(str(tmp_path / "lora"), cfg.model)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"objective.teacher={str(tmp_path / 'lora')!r}: the LoRA file ")
    assert "cannot be read as safetensors" in line
    monkeypatch.undo()
    for name in ("load_model", "load_model_from_config"):  # sample's check, too, before the model builds
        monkeypatch.setattr(models, name, no_load)
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--model", "tiny", "--lora", str(tmp_path / "lora"), "--prompts", "digits_eval",
                  "--num-images", "1", "--out", str(tmp_path / "out")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert info.value.code == 2 and len(errors) == 1 and "cannot be read as safetensors" in errors[0], errors


def test_flowgrpo_sample_refuses_another_models_transformer_folder_in_one_line(tmp_path, capsys):
    """``--lora`` a full fine-tune's ``transformer/`` folder of another model: a 79-line size-mismatch traceback from
    ``load_state_dict``; now one line naming the first setting that differs, before its weights load."""
    from diffusers import FluxTransformer2DModel

    from flowgrpo.cli import main as cli_main
    from flowgrpo.models.tiny import TEXT_DIM

    FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=1, attention_head_dim=16,
                           num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
                           guidance_embeds=True, axes_dims_rope=(4, 6, 6)).save_pretrained(tmp_path / "transformer")
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--model", "tiny", "--lora", str(tmp_path / "transformer"), "--prompts", "digits_eval",
                  "--num-images", "1", "--out", str(tmp_path / "out")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert info.value.code == 2 and len(errors) == 1, errors
    assert "are another model's transformer (its num_layers is 2, the model's 1)" in errors[0], errors
