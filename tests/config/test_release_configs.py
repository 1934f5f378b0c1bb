"""Every shipped FLUX / SD3.5 / Wan config reproduces its release's settings, field by field.

The table below is written from the releases' own files (named per value), not from our configs: a config that
drifts from its release fails here. Settings that deliberately differ are not in the table; they are listed, with
the reason, in the fidelity tables (docs/fidelity.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.config import load_config

REPO = Path(__file__).resolve().parents[2]

# every release here trains the SDE-ratio objective with PPO's clipped surrogate and no group filter
SDE_RATIO_CLIPPED = {"objective.name": "sde_ratio", "objective.policy_loss.name": "clipped",
                     "group_filter.name": "none"}

# what Flow-Factory's two Wan image-to-video LoRA examples share (examples/grpo/lora/wan2{1,2}/i2v.yaml)
_FLOW_FACTORY_I2V = {
    "model.num_frames": 5, "model.finetune": "lora", "model.lora_rank": 64, "model.lora_alpha": 128,
    "sampling.sde_kind": "flow_sde", "sampling.noise_level": 0.9, "eval_sampling.num_steps": 28,
    "advantage.name": "grpo", "advantage.global_std": False, "advantage.clip": 5.0, "objective.clip_range": 1e-4,
    "objective.kl_beta": 0.0, "train.group_size": 16, "batch_size": 48 * 16, "train.rollout_batch_size": 1,
    "train.optimizer_steps_per_epoch": 2, "train.lr": 1e-4, "train.weight_decay": 1e-4,
    "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8, "train.max_grad_norm": 1.0, "train.ema_decay": 0.9,
    "train.seed": 42,
}

# dotted config key -> value in the release (source in the comment)
RELEASES: dict[str, dict[str, object]] = {
    # yifan123/flow_grpo: config/grpo.py pickscore_flux, config/base.py, scripts/train_flux.py
    "flux_grpo": {
        **SDE_RATIO_CLIPPED,
        "model.pretrained": "black-forest-labs/FLUX.1-dev",
        "model.height": 512, "model.width": 512,                 # resolution
        "model.max_sequence_length": 128,                        # compute_text_embeddings(max_sequence_length=128)
        "model.finetune": "lora", "model.lora_rank": 64, "model.lora_alpha": 128,   # LoraConfig(r=64, alpha=128)
        "sampling.num_steps": 6, "eval_sampling.num_steps": 28,
        "sampling.guidance_scale": 3.5, "eval_sampling.guidance_scale": 3.5,
        "sampling.sde_kind": "flow_sde", "sampling.noise_level": 0.9,
        "sampling.same_noise_in_group": False,                   # sample.same_latent
        "sampling.final_decode": "sample",
        "advantage.name": "grpo", "advantage.global_std": True, "advantage.std_ddof": 0, "advantage.std_eps": 1e-4,
        "advantage.clip": 5.0, "objective.clip_range": 1e-4, "objective.kl_beta": 0.0,
        "train.group_size": 24, "batch_size": 48 * 24, "train.rollout_batch_size": 3, "train_batch_size": 3,
        "train.optimizer_steps_per_epoch": 2, "train.inner_epochs": 1,
        "train.lr": 3e-4, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
        "train.max_grad_norm": 1.0, "train.ema_decay": 0.9, "train.seed": 42,
        "objective.chunker.name": "per_step", "objective.timestep_fraction": 0.99,
        "objective.chunker.drop_last_step": False,
        "objective.chunker.step_selection": "first", "sampling.sigma_one_guard": "grid",
    },
    # yifan123/flow_grpo: config/grpo.py geneval_sd3, config/base.py, scripts/train_sd3.py
    "sd35_grpo": {
        **SDE_RATIO_CLIPPED,
        "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
        "model.height": 512, "model.width": 512, "model.max_sequence_length": 128,
        "model.finetune": "lora", "model.lora_rank": 32, "model.lora_alpha": 64,
        "sampling.num_steps": 10, "eval_sampling.num_steps": 40,
        "sampling.guidance_scale": 4.5, "eval_sampling.guidance_scale": 4.5,
        "sampling.sde_kind": "flow_sde", "sampling.noise_level": 0.7, "sampling.same_noise_in_group": False,
        "sampling.final_decode": "sample",
        "advantage.name": "grpo", "advantage.global_std": True, "advantage.std_ddof": 0, "advantage.std_eps": 1e-4,
        "advantage.clip": 5.0, "objective.clip_range": 1e-4, "objective.kl_beta": 0.04,
        "objective.kl_form": "flow_grpo",
        "train.group_size": 24, "batch_size": 48 * 24, "train.rollout_batch_size": 9, "train_batch_size": 9,
        "train.optimizer_steps_per_epoch": 2, "train.inner_epochs": 1,
        "train.lr": 3e-4, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
        "train.max_grad_norm": 1.0, "train.ema_decay": 0.9, "train.seed": 42,
        "objective.chunker.name": "per_step", "objective.timestep_fraction": 0.99,
        "objective.chunker.drop_last_step": False,
        "objective.chunker.step_selection": "first",
    },
    # xingzhejun/GCPO: scripts/finetune/finetune_hpsv3_chunk.sh, fastvideo/train_grpo_flux_hpsv3.py
    "flux_chunk": {
        **SDE_RATIO_CLIPPED,
        "model.pretrained": "black-forest-labs/FLUX.1-dev", "model.height": 720, "model.width": 720,
        "model.finetune": "full", "model.scheduler_shift": 3.0,
        "sampling.num_steps": 17, "sampling.guidance_scale": 3.5,
        "sampling.sde_kind": "flow_sde", "sampling.noise_level": 0.7,   # --grpo_step_mode flow --eta 0.7
        "sampling.same_noise_in_group": True, "sampling.final_decode": "x0_pred",
        "advantage.name": "grpo", "advantage.global_std": False, "advantage.std_ddof": 1, "advantage.std_eps": 1e-8,
        "advantage.clip": 5.0, "objective.clip_range": 5e-5, "objective.kl_beta": 0.0,
        "train.group_size": 12, "batch_size": 16 * 12, "train.optimizer_steps_per_epoch": 2,
        "train.lr": 1e-5, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
        "train.max_grad_norm": 0.01, "train.warmup_steps": 0, "train.seed": 42, "train.num_epochs": 151,
        "objective.chunker.name": "chunk", "objective.chunker.chunk_sizes": [2, 3, 4, 7],
        "objective.chunker.drop_last_step": True,
        "objective.chunker.chunk_fraction": 0.5, "objective.chunker.chunk_selection": "uniform",
    },
    # Tencent-Hunyuan/MixGRPO: scripts/finetune/finetune_flux_grpo_MixGRPO.sh, fastvideo/train_grpo_flux.py
    "flux_mix": {
        **SDE_RATIO_CLIPPED,
        "model.pretrained": "black-forest-labs/FLUX.1-dev", "model.height": 720, "model.width": 720,
        "model.finetune": "full", "model.scheduler_shift": 3.0,
        "sampling.num_steps": 25, "sampling.guidance_scale": 3.5,
        "sampling.sde_kind": "flow_sde", "sampling.noise_level": 0.7,   # --flow_grpo_sampling, eta=0.7
        "sampling.same_noise_in_group": True, "sampling.final_decode": "x0_pred",
        "advantage.name": "grpo", "advantage.multi_reward": "normalize_then_sum",   # advantage_aggr
        "advantage.std_ddof": 1, "advantage.std_eps": 1e-8, "advantage.clip": 5.0, "objective.clip_range": 1e-4,
        "objective.kl_beta": 0.0,
        "train.group_size": 12, "batch_size": 32 * 12, "train.optimizer_steps_per_epoch": 4,
        "train.lr": 1e-5, "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,
        "train.max_grad_norm": 1.0, "train.warmup_steps": 0, "train.seed": 714, "train.num_epochs": 300,
        "objective.chunker.name": "window", "objective.chunker.window_size": 4, "objective.chunker.window_stride": 1,
        "objective.chunker.window_shift_every": 25, "objective.chunker.window_end": "roll_back",
    },
    # shengjun-zhang/VisualGRPO: fastvideo/config/config.yaml, algorithm/grpo_merge.yaml,
    # workers/sampler/flux_sampler.py, workers/rollout_buffer.py, scripts/finetune/finetune_g2rpo_hps_merge.sh
    "flux_egrpo": {
        **SDE_RATIO_CLIPPED,
        "model.pretrained": "black-forest-labs/FLUX.1-dev", "model.height": 720, "model.width": 720,
        "model.finetune": "full", "model.scheduler_shift": 3.0,
        "sampling.num_steps": 16, "sampling.guidance_scale": 3.5,
        "sampling.sde_kind": "flow_sde", "sampling.noise_level": 0.7,
        "sampling.same_noise_in_group": True, "sampling.final_decode": "x0_pred",
        "advantage.name": "grpo", "advantage.std_ddof": 1, "advantage.std_eps": 1e-8, "advantage.clip": 5.0,
        "objective.clip_range": 1e-4, "objective.kl_beta": 0.0,
        "train.group_size": 12, "train.lr": 2e-6, "train.weight_decay": 1e-4, "train.max_grad_norm": 1.0,
        "train.warmup_steps": 0, "train.seed": 42, "objective.chunker.name": "entropy_merge",
        "objective.chunker.ode_after_jump": "next_step", "sampling.sigma_one_guard": "grid",
    },
    # XueZeyue/DanceGRPO: scripts/finetune/finetune_wan_2_1_grpo.sh, fastvideo/train_grpo_wan_2_1.py
    "wan21_t2v_1.3b_dance": {
        "model.pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "model.height": 512, "model.width": 512,
        "model.num_frames": 1, "model.finetune": "full", "model.scheduler_shift": 3.0,   # --t 1, --shift 3
        "sampling.num_steps": 20, "sampling.guidance_scale": 5.0,                      # --cfg_infer 5.0
        "sampling.sde_kind": "dance_sde", "sampling.noise_level": 0.3, "sampling.same_noise_in_group": True,
        "sampling.final_decode": "x0_pred",                                              # pred_original
        "objective.chunker.name": "per_step", "objective.timestep_fraction": 0.6,
        "objective.chunker.step_selection": "random",
        "objective.chunker.drop_last_step": True,
        "advantage.name": "grpo", "advantage.std_ddof": 1, "advantage.std_eps": 1e-8, "advantage.clip": 5.0,
        "objective.clip_range": 1e-4, "objective.kl_beta": 0.0,
        "train.group_size": 12, "batch_size": 16 * 12, "train.optimizer_steps_per_epoch": 1,
        "train.lr": 1e-5, "train.weight_decay": 1e-4, "train.max_grad_norm": 1.0, "train.warmup_steps": 0,
        "train.seed": 42, "train.num_epochs": 1000,
    },
    # verl-project/verl-omni: examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh (GPU)
    "wan22_5b_dance": {
        "model.pretrained": "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "model.height": 704, "model.width": 1280,
        "model.num_frames": 9, "model.max_sequence_length": 1024,   # num_frames=8, rounded by WanPipeline to 9
        "sampling.num_steps": 10, "sampling.guidance_scale": 5.0, "eval_sampling.num_steps": 50,
        "sampling.sde_kind": "dance_sde", "sampling.noise_level": 1.2, "objective.chunker.window_size": 2,
        "train.group_size": 8, "batch_size": 64 * 8, "train.optimizer_steps_per_epoch": 4,   # 64 / mini-batch 16
        "train.lr": 1e-5, "train.weight_decay": 1e-4, "train.seed": 42, "train.num_epochs": 120,
    },
    # X-GenGroup/Flow-Factory: examples/grpo/lora/wan21/i2v.yaml (sampling shift: Wan2.1 generate.py, 480p I2V)
    "wan21_i2v_14b": {
        **SDE_RATIO_CLIPPED, **_FLOW_FACTORY_I2V,
        "model.pretrained": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "model.height": 240, "model.width": 240,
        "model.scheduler_shift": 3.0, "sampling.num_steps": 10, "sampling.guidance_scale": 5.0,
        "eval_sampling.guidance_scale": 5.0, "model.gradient_checkpointing": False,
    },
    # X-GenGroup/Flow-Factory: examples/grpo/lora/wan22/i2v.yaml (shift, second scale: Wan2.2 wan_i2v_A14B.py)
    "wan22_i2v_a14b": {
        **SDE_RATIO_CLIPPED, **_FLOW_FACTORY_I2V,
        "model.pretrained": "Wan-AI/Wan2.2-I2V-A14B-Diffusers", "model.height": 256, "model.width": 256,
        "model.scheduler_shift": 5.0, "model.guidance_scale_2": 3.5, "model.trained_expert": "transformer",
        "sampling.num_steps": 8, "sampling.guidance_scale": 3.5, "eval_sampling.guidance_scale": 3.5,
    },
    # X-GenGroup/Flow-Factory: examples/grpo/lora/ltx2/i2av.yaml (commit 5f6cda1; guidance and rewards differ:
    # docs/fidelity.md)
    "ltx2_i2v": {
        **SDE_RATIO_CLIPPED,
        "model.pretrained": "Lightricks/LTX-2", "model.dtype": "bfloat16", "model.height": 512, "model.width": 768,
        "model.num_frames": 121, "model.finetune": "lora", "model.lora_rank": 64, "model.lora_alpha": 128,
        "model.gradient_checkpointing": True, "sampling.num_steps": 30, "sampling.sde_kind": "flow_sde",
        "sampling.noise_level": 0.7, "eval_sampling.num_steps": 50, "advantage.name": "grpo",
        "advantage.multi_reward": "gdpo", "advantage.global_std": True, "advantage.clip": 5.0,
        "objective.clip_range": 1e-4,
        "objective.kl_beta": 0.0, "train.group_size": 16, "batch_size": 16 * 16, "train.rollout_batch_size": 1,
        "train.optimizer_steps_per_epoch": 2, "train.lr": 1e-4, "train.weight_decay": 1e-4,
        "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8, "train.max_grad_norm": 1.0,
        "train.ema_decay": 0.9, "train.latents_on_cpu": True, "train.seed": 42, "logging.eval_every": 60,
        "logging.save_every": 60,
    },
}

REWARDS = {  # reward names (and kwargs that matter) of each release
    "flux_grpo": [("pickscore", {})],
    "sd35_grpo": [("geneval", {})],
    "flux_mix": [("hpsv2", {"version": "v2.1"}), ("image_reward", {}), ("pickscore", {})],
    "flux_egrpo": [("hpsv2", {"version": "v2.1"})],
    "wan21_t2v_1.3b_dance": [("video_frames", {"base": "hpsv2", "base_kwargs": {"version": "v2.1"},
                                                "frames": "first"})],
    "wan22_5b_dance": [("video_frames", {"base": "hpsv3", "frames": [0, 4, 8]})],   # every 4th of 9 frames
    "wan21_i2v_14b": [("video_frames", {"base": "pickscore"})],   # Flow-Factory's PickScore, mean over frames
    "wan22_i2v_a14b": [("video_frames", {"base": "pickscore"})],
}


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_config_reproduces_its_release(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    wrong = {k: (_get(cfg, k), v) for k, v in RELEASES[name].items()
             if (tuple(_get(cfg, k)) if isinstance(v, tuple) else _get(cfg, k)) != v}
    assert not wrong, f"{name}: (ours, release) {wrong}"


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_config_rewards_are_the_releases(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    got = [(r.name, {k: r.kwargs[k] for k in want if k in r.kwargs}) for r, (_, want) in
           zip(cfg.rewards, REWARDS[name], strict=False)]
    weights = {"wan22_5b_dance": 0.1}  # verl-omni's compute_score_hpsv3(reward_scale=0.1)
    assert got == REWARDS[name] and all(r.weight == weights.get(name, 1.0) for r in cfg.rewards)
