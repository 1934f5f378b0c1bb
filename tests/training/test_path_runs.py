"""The path objectives end to end (``refl``: ReFL / DRaFT; ``opd``: on-policy distillation) through
``flowgrpo.runner.run`` on the tiny FLUX and SD3.5 pipelines, a save–kill–resume equal to the uninterrupted run, and
one epoch on two CPU processes (DDP, gloo) equal to one process.

The reward is the digits task's differentiable ``digit_correctness`` on the pipelines' 32×32 images (JSONL prompts
with a ``digit``); the distillation teacher is the tiny pipeline's transformer with its weights moved (saved with
``save_pretrained``), so the student has something to learn from its first step.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here
from tests.training.objective_runs import assert_resume_equals_whole, tiny_config

pytestmark = pytest.mark.slow

OBJECTIVES = {"refl": {"name": "refl", "variant": "draft_lv", "lv_samples": 2},
              "refl_k": {"name": "refl", "variant": "draft_k", "k": 2},
              "opd": {"name": "opd"}}


def _teacher(tmp_path, model_dir):
    """The pipeline's transformer, every weight moved by 2 % (a ``from_pretrained`` folder)."""
    import diffusers

    cfg = json.loads((model_dir / "transformer" / "config.json").read_text())
    cls = getattr(diffusers, cfg["_class_name"])
    tr = cls.from_pretrained(str(model_dir / "transformer"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.parameters():
            p.mul_(1 + 0.02 * torch.randn(p.shape, generator=g))
    folder = tmp_path / "teacher"
    tr.save_pretrained(str(folder))
    return folder


def _config(tmp_path, model_dir, objective: dict, out: str = "run", **sections):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red cube", "digit": 3}\n{"prompt": "a blue ball", "digit": 7}\n')
    return tiny_config(tmp_path / out, model_dir, objective, prompts,
                       {"algo": {"clip_range": 1e-4, "kl_beta": 0.0}, "rewards": [{"name": "digit_correctness"}],
                        "logging": {"save_rollout_stats": True}}, sections)


def _objective(name, tmp_path, model_dir):
    o = dict(OBJECTIVES[name])
    if o["name"] == "opd":
        o["teacher"] = str(_teacher(tmp_path, model_dir))
    return o


@pytest.mark.parametrize("model", ["flux", "sd3"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_path_objective_trains_an_epoch_through_the_command(tmp_path, tiny_flux_dir, tiny_sd3_dir, name, model):
    from flowgrpo.runner import run

    folder = tiny_flux_dir if model == "flux" else tiny_sd3_dir
    summary = run(_config(tmp_path, folder, _objective(name, tmp_path, folder)))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert summary and rec["policy/grad_norm"] > 0
    # rows: DRaFT-LV 2 copies of each of the 4 samples; DRaFT-K 1; OPD int(3 * 0.99) = 2 steps of each
    assert rec["objective/rows"] == {"refl": 8, "refl_k": 4, "opd": 8}[name]
    # the rollout: T = 3 Euler calls for each of 2 micro-batches of 2 (SD3's CFG, guidance 3, doubles the rows)
    assert rec["rollout/transformer_calls"] == 6
    # the update (checkpointed steps recomputed in the backward; OPD's teacher is another module, not counted):
    # DRaFT-LV 2 copies x 2 micro-batches x (forward + recompute); DRaFT-K 2 steps x 2 x 2; OPD 2 steps x 2
    assert rec["update/transformer_calls"] == {"refl": 8, "refl_k": 8, "opd": 4}[name]
    if name.startswith("refl"):  # the replay's reward is the rollout's before the first step (same sampler)
        assert abs(rec["objective/reward"] - rec["reward/digit_correctness/mean"]) < 0.05
    weights = load_file(tmp_path / "run" / "checkpoints" / "epoch_0" / "trainable.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())  # the update moved LoRA B


def test_refl_trains_at_the_releases_scale_and_margin_through_the_command(tmp_path, tiny_flux_dir):
    """``objective: {name: refl, variant: refl}`` with nothing else set: the loss of every row is
    1e-3·relu(2 − R) (ImageReward ``ImageReward/ReFL.py`` lines 70, 755–756), and with the digits probability
    (R ≤ 1) every row is inside the margin: the logged loss is 1e-3·(2 − mean R)."""
    from flowgrpo.runner import run

    run(_config(tmp_path, tiny_flux_dir, {"name": "refl", "variant": "refl", "refl_last_steps": 3}))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["objective/active"] == 1.0 and rec["policy/grad_norm"] > 0
    assert rec["objective/loss"] == pytest.approx(1e-3 * (2.0 - rec["objective/reward"]), rel=1e-4)


@pytest.mark.parametrize("name", ["refl", "opd"])
def test_save_kill_resume_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir, name):
    """Two epochs in one go against one epoch, saved, and a run resuming it: the same weights and optimizer
    state to the bit (DRaFT-LV's re-noising draws are seeded by the sample and the epoch, not by a live RNG)."""
    o = _objective(name, tmp_path, tiny_flux_dir)
    assert_resume_equals_whole(tmp_path, lambda out, **s: _config(tmp_path, tiny_flux_dir, o, out, **s))


def test_a_lora_run_is_a_teacher(tmp_path, tiny_flux_dir):
    """``objective.teacher`` naming a LoRA run's output_dir: its LoRA fused into a copy of the base model gives the
    velocity of the base model with that LoRA loaded (diffusers' ``load_lora_weights``), not the base's."""
    from flowgrpo.algo.objectives.opd import load_teacher
    from flowgrpo.models import load_model_from_config
    from flowgrpo.models.base import _forward_with
    from flowgrpo.models.lora import load_lora_into
    from flowgrpo.runner import run

    cfg = _config(tmp_path, tiny_flux_dir, {"name": "refl", "variant": "draft_k", "k": 1})
    run(cfg)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    student = load_model_from_config(cfg.model, progress=False)
    teacher = load_teacher(str(tmp_path / "run"), student, cfg.model)
    with_lora = load_model_from_config(cfg.model, progress=False)
    load_lora_into(with_lora.pipe, tmp_path / "run" / "lora")
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    x = student.initial_latents(2, gens)
    sigma = torch.tensor([0.6, 0.6])
    with torch.no_grad():
        embeds = student.encode_prompts(["a red cube", "a blue ball"])
        v_base = student.velocity(x, sigma, embeds, 3.0)
        with _forward_with(student, teacher):
            v_teacher = student.velocity(x, sigma, embeds, 3.0)
        v_lora = with_lora.velocity(x, sigma, with_lora.encode_prompts(["a red cube", "a blue ball"]), 3.0)
    assert torch.allclose(v_teacher, v_lora, atol=1e-5)
    assert float((v_teacher - v_base).abs().max()) > 1e-4  # the LoRA moved the teacher: the test has power
    assert not any(p.requires_grad for p in teacher.parameters())


def test_a_teacher_of_another_architecture_is_refused_in_one_line_before_any_run(tmp_path, tiny_flux_dir):
    """A teacher whose transformer differs from the student's (another width here) is refused when it loads,
    naming the first differing setting; before, it loaded and the first update crashed on a shape mismatch, after
    the "before" evaluation."""
    from diffusers import FluxTransformer2DModel

    from flowgrpo.algo.objectives.opd import load_teacher
    from flowgrpo.models import load_model

    adapter = load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)
    config = dict(adapter.transformer.config)
    other = {k: v for k, v in config.items() if not k.startswith("_")}
    other["num_attention_heads"] = config["num_attention_heads"] * 2
    FluxTransformer2DModel(**other).save_pretrained(tmp_path / "teacher" / "transformer")
    heads = config["num_attention_heads"]
    with pytest.raises(ValueError, match=rf"is another architecture than the student: its num_attention_heads is "
                                         rf"{2 * heads}, the student's {heads}"):
        load_teacher(str(tmp_path / "teacher"), adapter, None)
    same = tmp_path / "same" / "transformer"
    adapter.transformer.save_pretrained(same)
    assert load_teacher(str(tmp_path / "same"), adapter, None) is not None
