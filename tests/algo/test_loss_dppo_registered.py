"""Flow-DPPO as the registered policy loss ``flow_dppo`` of the SDE-ratio objective: its settings model carries
verl-omni's defaults, its knobs reach the loss, it reads the transition moments (the rollout means are recomputed
before its update), and it trains an epoch of the tiny FLUX through the training command."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algo.policy_losses import POLICY_LOSSES, PolicyLossInput, needs_moments
from flowgrpo.config import ConfigError, build_config
from flowgrpo.writing.metrics import read_metrics


def test_settings_are_verl_omnis_and_knobs_reach_the_loss():
    cfg = build_config({"objective": {"policy_loss": {"name": "flow_dppo"}}})
    assert (cfg.objective.policy_loss.kl_mask_threshold, cfg.objective.policy_loss.add_kl_coefficient) == (1e-5, True)
    assert needs_moments(POLICY_LOSSES.get("flow_dppo"))
    with pytest.raises(ConfigError, match="kl_mask_treshold"):
        build_config({"objective": {"policy_loss": {"name": "flow_dppo", "kl_mask_treshold": 1e-3}}})
    # one pair moving away (A > 0, ratio e^0.2 > 1) with D = drift / (2 std^2) = 1e-6 / (2 * 0.01) = 5e-5
    inp = PolicyLossInput(torch.tensor([[0.2]]), torch.tensor([[0.0]]), torch.tensor([1.0]),
                          std=torch.tensor([[0.1]]), dt=torch.tensor([[-0.1]]), mean_drift_sq=torch.tensor([[1e-6]]))
    loss = POLICY_LOSSES.get("flow_dppo")
    for threshold, masked in ((1e-5, True), (1e-4, False)):  # D >= threshold: masked; else -A * rho
        settings = build_config({"objective": {"policy_loss": {  # the section the loss reads
            "name": "flow_dppo", "kl_mask_threshold": threshold}}}).objective
        terms = loss(inp, settings)
        assert bool(terms.clipped[0]) is masked
        assert float(terms.loss[0]) == pytest.approx(0.0 if masked else -math.exp(0.2), rel=1e-6)
    # without the exact-KL coefficient D = drift / 2 = 5e-7 < 1e-5: kept
    settings = build_config({"objective": {"policy_loss": {
        "name": "flow_dppo", "add_kl_coefficient": False}}}).objective
    assert not bool(loss(inp, settings).clipped[0])


@pytest.mark.slow
def test_flow_dppo_trains_an_epoch_through_the_command(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    run(build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 2, "lr": 1e-2,
                  "optimizer_steps_per_epoch": 2},
        "objective": {"policy_loss": {"name": "flow_dppo"}},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts), "eval_num_prompts": 2},
        "logging": {"progress": False},
    }))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["policy/pairs"] > 0 and rec["policy/logprob_mismatch_max"] == 0.0
    assert "timing/recompute" in rec  # the moments' recompute ran
    assert "policy_later/clipfrac" in rec  # the second, off-policy step's mask fraction
