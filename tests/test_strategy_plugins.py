"""A policy loss registered from outside the package trains without any trainer edit; every registered loss and the
GFPO filter run one epoch end to end on the tiny FLUX pipeline (CPU, no downloads)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.algo.losses import POLICY_LOSSES, clipped_terms
from flowgrpo.config import build_config
from flowgrpo.metrics import read_metrics


def _config(tmp_path, tiny_flux_dir, **algo):
    prompts = tmp_path / "train.txt"
    prompts.write_text("a red cube\na blue ball\n")
    return build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": algo.pop("group_size", 2),
                  "rollout_batch_size": 2, "lr": 1e-2},
        "rewards": algo.pop("rewards", [{"name": "jpeg_incompressibility"}]),
        "algo": algo,
        "data": {"train_prompts": str(prompts)},
        "logging": {"progress": False},
    })


@pytest.fixture
def toy_loss():
    """REINFORCE without a ratio, −A·mean_t Δ_t: registered by the test, as a plugin would, and removed after."""
    calls = []

    def reinforce(inp, settings):
        calls.append(inp.new_log_probs.shape)
        delta = inp.new_log_probs - inp.old_log_probs
        loss = -inp.advantages * delta.mean(dim=1)
        return clipped_terms(inp, settings, loss, torch.exp(delta.mean(1)), torch.zeros_like(loss, dtype=torch.bool))

    POLICY_LOSSES.register("toy_reinforce")(reinforce)
    yield calls
    POLICY_LOSSES.unregister("toy_reinforce")


@pytest.mark.slow
def test_an_outside_policy_loss_trains_one_epoch(tmp_path, tiny_flux_dir, toy_loss):
    from flowgrpo.runner import run

    cfg = _config(tmp_path, tiny_flux_dir, policy_loss="toy_reinforce")
    run(cfg)
    assert toy_loss, "the registered loss was never called"
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["policy/pairs"] > 0 and rec["policy/grad_norm"] > 0


def test_unknown_policy_loss_fails_in_the_schema(tmp_path, tiny_flux_dir):
    from flowgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="algo.policy_loss.name: unknown policy loss 'grpo_gaurd'.*did you mean "
                                          "'grpo_guard'"):
        _config(tmp_path, tiny_flux_dir, policy_loss="grpo_gaurd")


def test_grpo_guard_rejects_non_gaussian_log_probs(tmp_path, tiny_flux_dir):
    from flowgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="grpo_guard needs sampling.logprob_reduction=mean"):
        build_config({"algo": {"policy_loss": "grpo_guard"}, "sampling": {"logprob_reduction": "sum"}})
    cfg = _config(tmp_path, tiny_flux_dir, policy_loss="grpo_guard")
    with pytest.raises(ValueError, match="grpo_guard needs sampling.logprob_reduction=mean"):
        cfg.sampling.logprob_reduction = "sum"
        cfg.algo.policy_loss.check(cfg)  # the loss's own check, which the schema calls


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dual_clip", "sapo", "grpo_guard"])
def test_each_registered_loss_trains_one_epoch(tmp_path, tiny_flux_dir, name):
    from flowgrpo.runner import run

    run(_config(tmp_path, tiny_flux_dir, policy_loss=name))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["policy/pairs"] > 0 and rec["policy/grad_norm"] > 0
    # grpo_guard recomputes the rollout means first, so its first ratio is exactly 1 as well
    assert rec["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
def test_gfpo_draws_more_and_trains_only_the_kept(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    cfg = _config(tmp_path, tiny_flux_dir, group_size=4, group_filter={"name": "gfpo", "keep": 2},
                  rewards=[{"name": "jpeg_incompressibility"}])
    cfg.logging.save_rollout_stats = True
    run(cfg)
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["filter/drawn_per_group"] == 4 and rec["filter/kept_per_group"] == 2
    assert rec["filter/extra_sample_frac"] == pytest.approx(1.0)
    assert rec["filter/reward_mean_kept"] >= rec["filter/reward_mean_drawn"]  # top-2 by the reward itself
    assert rec["adv/kept_frac"] == pytest.approx(0.5)
    assert rec["adv/learning_frac"] == pytest.approx(0.5)  # the kept half, each in a group with spread
    assert rec["policy/pairs"] == 2 * 2 * 3  # P·G kept samples × 3 steps: the rejected are not forwarded


@pytest.mark.slow
def test_a_group_wise_reward_trains_with_gdpo(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    rewards = [{"name": "flowgrpo_rewards.group:GroupRank", "kwargs": {"base": "jpeg_incompressibility"}},
               {"name": "jpeg_incompressibility", "weight": 0.5}]
    run(_config(tmp_path, tiny_flux_dir, group_size=3, multi_reward="gdpo", rewards=rewards))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    # the ranks of each complete group average 0.5 (scored after the rollout, not per micro-batch)
    assert rec["reward/GroupRank/mean"] == pytest.approx(0.5)
    assert rec["reward/GroupRank/nan_frac"] == 0.0 and rec["policy/pairs"] > 0


def test_a_group_split_over_processes_is_refused_for_group_wise_rewards():
    from flowgrpo.training.loop import _check_whole_groups

    _check_whole_groups(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), ["rank"])
    # this process holds samples 0-2 of a 4-sample layout whose group 1 continues on the next process
    with pytest.raises(ValueError, match="split over processes.*prompts_per_epoch"):
        _check_whole_groups(torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1, 1, 2, 2]), ["rank"])

