"""configs/sd35_tdm_r1.yaml against TDM-R1's release (Luo-Yihong/TDM-R1): the values of ``config/tdmr1_clean.py``
(commit 0c37f9f) ``general_ocr_sd3_8gpu_G24_4step`` over ``compressibility`` and ``config/base.py``, and the constants
of ``scripts/train_tdmr1_pub.py`` (1ee7d9f), written here from the release, field by field; the deliberate
differences are the config's header (micro-batches of one whole group, no TDM LoRA to start from)."""

from __future__ import annotations

from pathlib import Path

from flowgrpo.config import load_config
from flowgrpo.strategies.settings import flat_dict

REPO = Path(__file__).resolve().parents[2]

RELEASE = {
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
    "model.height": 512, "model.width": 512,                          # compressibility(): resolution = 512
    "model.max_sequence_length": 128,                                 # compute_text_embeddings(..., 128)
    "model.finetune": "lora", "model.lora_rank": 32, "model.lora_alpha": 64,   # LoraConfig(r=32, lora_alpha=64)
    "sampling.num_steps": 4, "sampling.guidance_scale": 1.0,          # sample.num_steps, sample.guidance_scale
    "eval_sampling.num_steps": 4,                                     # sample.eval_num_steps
    "objective.name": "tdm_r1",
    "objective.num_train_timesteps": 2, "objective.trunc_steps": 4,   # num_train_timesteps; the OCR preset's 4
    "objective.tdm_weight": 0.3,                                      # train.tdm_weight
    "objective.cfg_reward_scale": 3.5,                                # cfg_revised_x0 = model_x0 + 3.5 * (...)
    "objective.real_guidance_scale": 4.5,                             # predict_v(..., cfg_scale=4.5)
    "objective.surrogate_guidance_scale": 4.5,                        # rl_cfg
    "objective.beta_dpo": 10.0, "objective.reference_beta": 0.001,    # train.beta_dpo (OCR), train.beta
    "objective.reference_threshold": 0.05, "objective.clip_range": 1e-3,   # reg_threshold, clip_range
    "objective.slow_decay_min": 0.001, "objective.slow_decay_max": 0.3,    # ema_old_decay_min / max
    "objective.reward_time_floor": 0.3, "objective.surrogate_time_floor": 0.3,   # t_min_dgpo(_reward) 300 (OCR)
    "objective.time_weighting": True, "objective.fake_reg": 0.02,     # use_tweight; loss_fake + 0.02 * loss_reg_fake
    "objective.surrogate_betas": (0.9, 0.999),                        # rl_adam_beta1 / rl_adam_beta2
    "advantage.global_std": True, "advantage.std_eps": 1e-4, "advantage.clip": 5.0,   # stat tracker; clip(-5, 5)
    "train.prompts_per_epoch": 48, "train.group_size": 24,            # 8 GPUs x 12 x 12 batches / 24 a prompt
    "train.rollout_batch_size": 12,                                   # sample.train_batch_size
    "train.optimizer_steps_per_epoch": 1, "train.inner_epochs": 1,    # one accumulation window an epoch
    "train.lr": 7.5e-5,                                               # the generator's learning_rate / 4
    "train.adam_betas": (0.0, 0.999),                                 # train.adam_beta1 = 0
    "train.weight_decay": 1e-4, "train.adam_eps": 1e-8, "train.max_grad_norm": 1.0,   # base.py train.*
    "train.ema_decay": 0.9, "train.seed": 42,                         # ema_decay_g; base.py seed
}


def test_sd35_tdm_r1_is_the_release_field_by_field():
    flat = flat_dict(load_config(REPO / "configs" / "sd35_tdm_r1.yaml").model_dump())
    for key, value in RELEASE.items():
        assert flat[key] == value, (key, flat[key], value)
    # the fake score and the surrogate at the release's 3e-4: unset, 4 x the generator's learning rate
    assert flat["objective.fake_lr"] is None and flat["objective.surrogate_lr"] is None
    assert 4 * flat["train.lr"] == 3e-4
