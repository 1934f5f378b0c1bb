"""Every shipped forward-process config (DiffusionNFT, AWM, DGPO) reproduces its release's settings, field by field, in
tests/config/test_release_configs.py's way: the table below is written from the releases' own files (named per value),
not from our configs. Deliberate differences are not in the table; each config's header and docs/fidelity_forward.md
list them."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.config import load_config
from tests.config.test_release_configs import _get

REPO = Path(__file__).resolve().parents[2]
SD35 = {"model.pretrained": "stabilityai/stable-diffusion-3.5-medium", "model.height": 512, "model.width": 512,
        "model.max_sequence_length": 128, "model.finetune": "lora",
        "model.lora_target_modules": ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                                      "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"],
        "advantage.name": "grpo", "advantage.std_ddof": 0, "advantage.std_eps": 1e-4, "advantage.clip": 5.0,
        "group_filter.name": "none", "train.inner_epochs": 1, "train.optimizer_steps_per_epoch": 1,
        "train.lr": 3e-4, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
        "train.max_grad_norm": 1.0, "train.seed": 42, "objective.adv_clip_max": 5.0,
        "objective.train_guidance_scale": 1.0}

RELEASES: dict[str, dict[str, object]] = {
    # NVlabs/DiffusionNFT: config/nft.py sd3_geneval, config/base.py, scripts/train_nft_sd3.py
    "sd35_nft": {
        **SD35, "objective.name": "nft",
        "model.lora_rank": 32, "model.lora_alpha": 64,                        # script 419-432
        "sampling.num_steps": 10, "sampling.guidance_scale": 1.0,             # nft.py 20, 64
        "eval_sampling.num_steps": 40, "eval_sampling.guidance_scale": 1.0,   # nft.py 21
        "objective.solver": "dpmpp_2m",                                       # nft.py 66: dpm2
        "objective.beta": 1.0, "objective.kl_beta": 1e-4, "objective.adv_mode": "all",   # nft.py 61, 24, 62
        "objective.adaptive_weight_min": 1e-5, "objective.timestep_fraction": 0.99,      # script 945; base.py 87
        "objective.decay_flat": 0, "objective.decay_ramp": 0.001, "objective.decay_cap": 0.5,   # decay_type 1
        "advantage.global_std": True,                                              # base.py 57
        "train.prompts_per_epoch": 48, "train.group_size": 24, "batch_size": 48 * 24,
        "train.rollout_batch_size": 9, "train_batch_size": 9, "train.ema_decay": 0.9,
        "logging.eval_every": 10, "logging.save_every": 30,
    },
    # scxue/advantage_weighted_matching: config/dgx_awm.py geneval_sd3_no_cfg_1node, config/base_awm.py
    "sd35_awm": {
        **SD35, "objective.name": "awm",
        "model.lora_rank": 32, "model.lora_alpha": 64,
        "sampling.num_steps": 14, "sampling.guidance_scale": 1.0,             # 37, 39
        "eval_sampling.num_steps": 40, "eval_sampling.guidance_scale": 1.0,
        "objective.solver": "sa_solver", "objective.solver_noise_level": 0.4,  # base_awm.py 71; 48
        "objective.advantage_max": 1.0, "objective.weighting": "ghuber", "objective.ghuber_power": 0.25,
        "objective.clip_range": 1.0, "objective.kl_beta": 0.001, "objective.kl_weight": "uniform",
        "objective.ema_beta": 1.0, "objective.kl_ema_weight": "uniform",
        "objective.decay_flat": 0, "objective.decay_ramp": 0.001, "objective.decay_cap": 0.3,
        "objective.decay_constant": None,
        "objective.train_timesteps": 6, "objective.timestep_fraction": 0.9, "objective.time_type": "discrete_wo_init",
        "advantage.global_std": True,                                              # 72
        "train.prompts_per_epoch": 72, "train.group_size": 24, "train.rollout_batch_size": 6, "train_batch_size": 3,
        "train.ema_decay": 0.99, "logging.eval_every": 50, "logging.save_every": 50,
    },
    # Luo-Yihong/DGPO: config/dgpo.py geneval_sd3_4gpu (mode 1), config/base.py, scripts/train_sd3_dgpo.py
    "sd35_dgpo": {
        **SD35, "objective.name": "dgpo",
        "model.lora_rank": 64, "model.lora_alpha": 128,                       # script 611-616
        "sampling.num_steps": 10, "sampling.guidance_scale": 4.5,             # 56
        "eval_sampling.num_steps": 14, "eval_sampling.guidance_scale": 4.5,   # 55
        "objective.solver": "dpmpp_2m", "objective.grid": "flow_shift", "objective.grid_shift": 3.0,   # 557-559
        "objective.beta_dpo": 100.0, "objective.kl_beta": 0.02, "objective.clip_range": 1e-2,   # 88, 63, 59
        "objective.clip_dsm": True, "objective.clip_kl": False, "objective.use_ema_ref": False,
        "objective.kl_cfg": 1.0, "objective.num_train_timesteps": 4, "objective.trunc_steps": 4,
        "objective.shared_noise": True, "objective.switch_ema_ref": 500, "objective.timestep_rounding": True,
        "objective.decay_flat": 0, "objective.decay_ramp": 0.001, "objective.decay_cap": 0.3,   # script 1176
        "advantage.global_std": False,                                             # 78
        "train.prompts_per_epoch": 8, "train.group_size": 16, "train.rollout_batch_size": 16, "train_batch_size": 16,
        "train.ema_decay": 0.9, "logging.eval_every": 60, "logging.save_every": 60,
    },
    # X-GenGroup/Flow-Factory: examples/nft/lora/flux1/default.yaml (the port; the authors ship SD3.5 only)
    "flux_nft": {
        "objective.name": "nft", "model.pretrained": "black-forest-labs/FLUX.1-dev", "model.finetune": "lora",
        "model.height": 384, "model.width": 384, "model.lora_rank": 64, "model.lora_alpha": 128,
        "sampling.num_steps": 8, "sampling.guidance_scale": 1.0, "eval_sampling.num_steps": 28,
        "eval_sampling.guidance_scale": 1.0, "objective.solver": "euler", "objective.train_guidance_scale": 1.0,
        "objective.beta": 1.0, "objective.kl_beta": 0.0, "objective.adv_clip_max": 5.0,
        "objective.decay_flat": 0, "objective.decay_ramp": 0.001, "objective.decay_cap": 0.5,
        "advantage.global_std": False, "train.prompts_per_epoch": 48, "train.group_size": 16,
        "train.rollout_batch_size": 1, "train_batch_size": 1, "train.optimizer_steps_per_epoch": 1,
        "train.lr": 3e-4, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
        "train.max_grad_norm": 1.0, "train.seed": 42, "logging.eval_every": 20, "logging.save_every": 20,
    },
}

REWARDS = {"sd35_nft": "geneval", "sd35_awm": "geneval", "sd35_dgpo": "geneval", "flux_nft": "pickscore"}


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_config_reproduces_its_release(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    wrong = {k: (_get(cfg, k), v) for k, v in RELEASES[name].items()
             if (tuple(_get(cfg, k)) if isinstance(v, tuple) else _get(cfg, k)) != v}
    assert not wrong, f"{name}: (ours, release) {wrong}"
    assert [(r.name, r.weight) for r in cfg.rewards] == [(REWARDS[name], 1.0)]


def test_flux_nft_trains_two_sigmas_a_sample():
    """Flow-Factory's num_train_timesteps = 2 on the 8-step grid: int(8 * 0.25) = 2 (the release's count)."""
    import torch

    from flowgrpo.algo.objectives import build_objective

    obj = build_objective(load_config(REPO / "configs" / "flux_nft.yaml"))
    assert obj.sigmas_per_sample(torch.linspace(1, 0, 9)) == 2
