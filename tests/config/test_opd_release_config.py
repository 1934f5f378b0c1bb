"""configs/sd35_opd.yaml against DiffusionOPD's release (ali-vilab/DiffusionOPD, arXiv 2605.15055; read in an
unofficial mirror at commit abecb69cfa29, not linked: its later commits carry an installer lure):
``scripts/train_sd3_opd.py`` (LoRA, EMA, text length, the loss's noise-level branch) and the values of
``config/opd.py`` ``sopd_pickscore`` over ``config/base.py``, written
here from the release, field by field; the deliberate differences are the config's header (36 prompts x 2 samples for
72 x 1, the EMA every step, the teacher a whole fused transformer)."""

from __future__ import annotations

from pathlib import Path

from flowgrpo.config import load_config
from flowgrpo.strategies.settings import flat_dict

REPO = Path(__file__).resolve().parents[2]

RELEASE = {
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",   # pretrained.model
    "model.height": 512, "model.width": 512,                          # resolution = 512
    "model.max_sequence_length": 128,                                 # compute_text_embeddings(..., 128)
    "model.finetune": "lora", "model.lora_rank": 32, "model.lora_alpha": 64,   # LoraConfig(r=32, lora_alpha=64)
    "sampling.num_steps": 10,                                         # sample.num_steps (the student's steps)
    "sampling.guidance_scale": 4.5,                                   # sample.guidance_scale (and train.cfg)
    "eval_sampling.num_steps": 40, "eval_sampling.guidance_scale": 4.5,   # sample.eval_num_steps / eval_guidance
    "objective.name": "opd",
    "objective.teacher_guidance_scale": 4.5,                          # teachers[pickscore].guidance_scale
    "objective.noise_level": 0.0,                                     # sample.noise_level: the ODE loss branch
    "objective.timestep_fraction": 0.99,                              # train.timestep_fraction
    "train.rollout_batch_size": 3, "train.train_batch_size": 3,       # sample.train_batch_size, train.batch_size
    "train.optimizer_steps_per_epoch": 1,                             # 72 samples / (3 x 8 x GAS 3)
    "train.inner_epochs": 1,                                          # train.num_inner_epochs
    "train.lr": 3.0e-4, "train.weight_decay": 1.0e-4, "train.adam_eps": 1.0e-8,   # base.py train.*
    "train.max_grad_norm": 1.0, "train.ema_decay": 0.9, "train.seed": 42,
}


def test_sd35_opd_is_the_release_field_by_field():
    flat = flat_dict(load_config(REPO / "configs" / "sd35_opd.yaml").model_dump())
    for key, value in RELEASE.items():
        assert flat[key] == value, (key, flat[key], value)
    assert flat["model.lora_target_modules"] == ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj",
                                                 "attn.to_add_out", "attn.to_k", "attn.to_out.0", "attn.to_q",
                                                 "attn.to_v"]
    assert flat["train.adam_betas"] in ([0.9, 0.999], (0.9, 0.999))
    # 8 processes x 3 samples x 3 batches = 72 samples an epoch, as the release
    assert flat["train.prompts_per_epoch"] * flat["train.group_size"] == 72
