"""A policy loss registered from outside the package trains without any trainer edit; every registered loss and the
GFPO filter run one epoch end to end on the tiny FLUX pipeline (CPU, no downloads)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.algo.policy_losses import POLICY_LOSSES, clipped_terms
from flowgrpo.config import build_config
from flowgrpo.writing.metrics import read_metrics


def _config(tmp_path, tiny_flux_dir, policy_loss="clipped", group_filter="none", **advantage):
    prompts = tmp_path / "train.txt"
    prompts.write_text("a red cube\na blue ball\n")
    return build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": advantage.pop("group_size", 2),
                  "rollout_batch_size": 2, "lr": 1e-2},
        "rewards": advantage.pop("rewards", [{"name": "jpeg_incompressibility"}]),
        "objective": {"policy_loss": policy_loss}, "group_filter": group_filter, "advantage": advantage,
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
        return clipped_terms(inp, settings.kl_beta, loss, torch.exp(delta.mean(1)),
                             torch.zeros_like(loss, dtype=torch.bool))

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

    with pytest.raises(ConfigError, match="objective.policy_loss.name: unknown policy loss 'grpo_gaurd'.*did you mean "
                                          "'grpo_guard'"):
        _config(tmp_path, tiny_flux_dir, policy_loss="grpo_gaurd")


def test_grpo_guard_rejects_non_gaussian_log_probs(tmp_path, tiny_flux_dir):
    from flowgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="grpo_guard needs sampling.logprob_reduction=mean"):
        build_config({"objective": {"policy_loss": "grpo_guard"}, "sampling": {"logprob_reduction": "sum"}})
    cfg = _config(tmp_path, tiny_flux_dir, policy_loss="grpo_guard")
    with pytest.raises(ValueError, match="grpo_guard needs sampling.logprob_reduction=mean"):
        cfg.sampling.logprob_reduction = "sum"
        cfg.objective.policy_loss.check(cfg)  # the loss's own check, which the schema calls


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


@pytest.fixture
def toy_objective():
    """An objective of the forward-process kind, registered by the test as a plugin would (and removed after): an
    ODE rollout whose final latents x0 are trained by advantage-weighted flow matching at fresh (t, ε) per sample,
    x_t = (1 − t)·x0 + t·ε, loss = mean_b A_b·mean_d (v(x_t, t) − (ε − x0))², one optimizer step a micro-batch, run by
    the trainer's update loop (the objective hands it its steps and a loss sum per micro-batch)."""
    from dataclasses import dataclass
    from typing import Literal

    from pydantic import Field

    from flowgrpo.algo.microbatches import micro_batches
    from flowgrpo.algo.objectives import OBJECTIVES, BaseObjective, ObjectiveConfig, UpdateStep
    from flowgrpo.sampling.rollout import rollout

    calls = []

    class ToyFlowMatchingConfig(ObjectiveConfig):
        name: Literal["toy_flow_matching"] = "toy_flow_matching"
        weight: float = Field(1.0, gt=0, description="scale of the loss")

    @dataclass(frozen=True)
    class ToyWork:
        traj: object
        adv: object
        epoch: int
        recompute: bool = False

        @property
        def metrics(self):
            return {"plan/toy_samples": float(self.traj.batch_size)}

    class ToyFlowMatching(BaseObjective):
        Config = ToyFlowMatchingConfig

        def rollout(self, adapter, request):
            calls.append("rollout")
            return rollout(adapter, request, torch.zeros(request.settings.num_steps, dtype=torch.bool))  # ODE

        def plan(self, traj, adv, keep, epoch):
            calls.append("plan")
            return ToyWork(traj, adv, epoch)

        def recompute(self, adapter, work):
            raise AssertionError("a plan without recompute must not be recomputed")

        # the update: one optimizer step a micro-batch, its loss the sum over its rows (the loop takes the mean)
        def update_steps(self, work):
            calls.append("update")
            return [UpdateStep(rows, len(rows)) for rows in micro_batches(work.traj.batch_size,
                                                                          self.cfg.train_batch_size)]

        def update_state(self, work):
            return {"losses": [], "gen": torch.Generator().manual_seed(work.epoch)}

        def micro_batches(self, work, step, inner):
            return [step.plan]

        def loss(self, adapter, work, rows, state, at):
            traj, dev = work.traj, adapter.device
            x0 = traj.latents[rows, -1].to(dev)  # (n, …) the final latents
            t = torch.rand(len(rows), generator=state["gen"])  # (n,) fresh per sample
            eps = torch.randn(x0.shape, generator=state["gen"]).to(dev)
            tt = t.to(dev).reshape(-1, *[1] * (x0.ndim - 1))
            v = adapter.velocity((1 - tt) * x0 + tt * eps, t.to(dev), traj.embeds.index(rows.to(dev)),
                                 traj.guidance_scale)
            per_sample = ((v.float() - (eps - x0)) ** 2).flatten(1).mean(dim=1)
            loss = self.cfg.objective.weight * (work.adv.values[rows].to(dev) * per_sample).sum()
            state["losses"].append(float(loss.detach()) / len(rows))
            return loss

        def update_metrics(self, adapter, work, state):
            return {"toy/loss": sum(state["losses"]) / len(state["losses"])}

    OBJECTIVES.register("toy_flow_matching")(ToyFlowMatching)
    yield calls
    OBJECTIVES.unregister("toy_flow_matching")


@pytest.mark.slow
def test_an_outside_objective_trains_one_epoch_through_the_trainer(tmp_path, tiny_flux_dir, toy_objective):
    from flowgrpo.config import ConfigError
    from flowgrpo.runner import run

    with pytest.raises(ConfigError, match="unknown config key 'objective.wieght' for objective 'toy_flow_matching'.*"
                                          "did you mean 'weight'"):
        build_config({"objective": {"name": "toy_flow_matching", "wieght": 2.0}})
    cfg = _config(tmp_path, tiny_flux_dir)
    cfg.objective = {"name": "toy_flow_matching", "weight": 2.0}
    assert cfg.objective.weight == 2.0
    summary = run(cfg)
    assert toy_objective == ["rollout", "plan", "update"]  # the loop's phases, in order, recompute skipped
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["toy/loss"] != 0 and rec["policy/grad_norm"] > 0 and rec["plan/toy_samples"] == 4
    assert "timing/recompute" not in rec and {"timing/reward", "timing/filter", "timing/advantage"} <= set(rec)
    assert "jpeg_incompressibility_mean_after" in summary  # evaluation and the final save ran as for any objective
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
