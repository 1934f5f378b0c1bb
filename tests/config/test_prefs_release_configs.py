"""The shipped Diffusion-DPO release config reproduces its release's settings, field by field (the table is written
from Flow-Factory's examples/dpo/lora/sd3_5/default.yaml at a0b2bc5 and the files it names, line per value, not
from our config); the objectives' settings models default to the releases' settings; the digits configs
of the preference and supervised objectives are valid and name their embedded datasets."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.config import build_config, load_config
from tests.config.test_release_configs import _get

REPO = Path(__file__).resolve().parents[2]

FLOW_FACTORY_DPO_SD35 = {
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",   # 51
    "model.dtype": "bfloat16",                                        # 33
    "model.height": 512, "model.width": 512,                          # 93
    "model.finetune": "lora", "model.lora_rank": 32, "model.lora_alpha": 64,   # 47-49
    "model.lora_target_modules": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                                  "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"],   # sd3_5.py 75-80
    "sampling.num_steps": 40, "sampling.guidance_scale": 1.0,         # 95, 97
    "eval_sampling.num_steps": 40, "eval_sampling.guidance_scale": 1.0,   # 147, 145
    "objective.name": "dpo", "objective.solver": "euler",             # trainer_type dpo (67); ODE (139)
    "objective.beta_dpo": 100.0,                                      # 71
    "objective.pairs": "best_worst",                                  # trainers/dpo.py 355-356
    "objective.num_train_timesteps": 1,                               # 81
    "objective.weighting_scheme": "logit_normal", "objective.logit_mean": 0.0, "objective.logit_std": 1.0,  # 75-77
    "objective.train_guidance_scale": 1.0,                            # 96
    "advantage.global_std": False,                                         # 88
    "train.prompts_per_epoch": 48, "train.group_size": 4,             # 106, 103
    "train.rollout_batch_size": 24, "train.train_batch_size": 24,     # 101
    "train.optimizer_steps_per_epoch": 1, "train.inner_epochs": 1,    # 109, 111
    "train.lr": 1e-5, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
    "train.max_grad_norm": 1.0,                                       # 115-123
    "train.ema_decay": 0.99, "train.seed": 42,                        # 126, 134
    "logging.eval_every": 60, "logging.save_every": 60,               # 149, 61
}


def test_sd35_dpo_reproduces_flow_factorys_example():
    cfg = load_config(REPO / "configs" / "sd35_dpo.yaml")
    wrong = {k: (_get(cfg, k), v) for k, v in FLOW_FACTORY_DPO_SD35.items()
             if (tuple(_get(cfg, k)) if isinstance(v, tuple) else _get(cfg, k)) != v}
    assert not wrong, f"(ours, release) {wrong}"
    assert [(r.name, r.weight) for r in cfg.rewards] == [("pickscore", 1.0)]   # 155-156


@pytest.mark.parametrize("name", ["dpo", "dpo_offline", "sft"])
def test_objective_settings_models_default_to_the_release_settings(name):
    """The objectives' settings models default to the releases' values (written from the sources, not from the
    models): K = 1 and the logit-normal (0, 1) density of diffusers' SD3 DreamBooth script (``--weighting_scheme``
    logit_normal, ``--logit_mean`` 0, ``--logit_std`` 1, ``--mode_scale`` 1.29) and Flow-Factory's DPO; DPO's β of
    flow_grpo's ``pickscore_sd3`` (100) and Flow-Factory's ``best_worst`` pairs; SFT without a KL."""
    cfg = build_config({"objective": name, "train": {"group_size": 2, "rollout_batch_size": 4}})
    o = cfg.objective
    assert (o.num_train_timesteps, o.weighting_scheme, o.logit_mean, o.logit_std, o.mode_scale) == \
        (1, "logit_normal", 0.0, 1.0, 1.29)
    if name == "sft":
        assert o.kl_beta == 0.0
    else:
        assert o.beta_dpo == 100.0 and getattr(o, "pairs", "best_worst") == "best_worst"


@pytest.mark.parametrize(("config", "objective", "prompts"), [
    ("digits_sft", "sft", "digits_real"), ("digits_dpo", "dpo", "digits"),
    ("digits_dpo_offline", "dpo_offline", "digits_pairs")])
def test_digits_configs(config, objective, prompts):
    cfg = load_config(REPO / "configs" / f"{config}.yaml")
    assert cfg.objective.name == objective and cfg.data.train_prompts == prompts
    assert cfg.model.pretrained == "digits"
