"""The forward-process objectives keep each tensor on one device: the real trainer runs an epoch of dgpo, the family's
widest update, with SA-Solver's noisy rollout (solver rollout, rewards, advantages, plan, update with the old copy and
the reference, group sums, EMA, evaluation, checkpoint) with the model on the fake accelerator of
:mod:`tests.training.fake_device`, where an operation mixing accelerator and host tensors fails as on CUDA; and the
update reads the device back once per optimizer step (the gradient-norm guard) and once for its statistics, however many
micro-batches and sigmas."""

from __future__ import annotations

import pytest

from tests.training.test_devices import _config, _run_on_fake_accelerator


@pytest.mark.slow
@pytest.mark.parametrize("objective", [
    # the old copy and the reference, group sums, shared noise, the clip, and SA-Solver's noisy rollout
    {"name": "dgpo", "trunc_steps": 2, "num_train_timesteps": 2, "solver": "sa_solver", "solver_noise_level": 0.4},
], ids=["dgpo_sa_solver"])
def test_forward_objective_epoch_keeps_each_tensor_on_one_device(tmp_path, tiny_flux_dir, monkeypatch, objective):
    cfg = _config(tmp_path, tiny_flux_dir, objective["name"], chunker={"name": "per_step"},
                  train={"inner_epochs": 1}, kl_beta=0.0, recompute_old_log_probs=False)
    cfg.objective = objective
    mode = _run_on_fake_accelerator(monkeypatch, cfg)
    assert mode.syncs
    assert mode.update_reads == [cfg.train.optimizer_steps_per_epoch + 1], mode.update_reads
