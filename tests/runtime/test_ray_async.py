"""Ray rollouts beyond the bit-exact case: ``max_staleness: 1`` samples epoch e+1 while epoch e trains (the lag,
the importance ratio against the stale behaviour log-probs, no group dropped), and a rollout worker killed with
SIGKILL mid-epoch is replaced and its request issued again (none lost, none trained twice: the run still equals
the torchrun run bit for bit)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from flowgrpo.runtime import ray_engine
from tests.runtime.test_ray_identity import REPO, _compare, _no_ray_left, _train
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse: one torch thread (the worker takes the same)

pytest.importorskip("ray")

CONFIG = REPO / "configs" / "tiny_jpeg.yaml"
SMALL = ["train.num_epochs=3", "train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=4",
         "data.eval_num_prompts=2"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_staleness_one_trains_each_epoch_on_the_previous_version(tmp_path, monkeypatch):
    def ours(signum, frame):  # the run's own stop handler (launch.stop_on_signals) stands in
        raise AssertionError("not called")

    during, collect = [], ray_engine.RayRollouts._collect
    monkeypatch.setattr(ray_engine.RayRollouts, "_collect", lambda self, trainer, epoch: (
        during.append(signal.getsignal(signal.SIGTERM)), collect(self, trainer, epoch))[1])
    kept = signal.signal(signal.SIGTERM, ours)
    try:
        out = _train(CONFIG, tmp_path / "stale", "ray", *SMALL, "runtime.max_staleness=1",
                     "runtime.rollout_workers=2")
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, kept)
    # ray.init's own SIGTERM handler (it exits) never replaces the run's, during the run or after it
    assert during and all(h is ours for h in during) and after is ours
    _no_ray_left()
    records = _records(out)
    assert [r["runtime/lag"] for r in records] == [0.0, 1.0, 1.0]  # epoch 0 from the start weights, then one behind
    assert [r["rollout/trajectories"] for r in records] == [8.0] * 3  # no group dropped: the rollout waited
    # on-policy the first step's ratio is exactly 1; a group one version stale is weighted by pi_theta / pi_behaviour
    assert records[0]["runtime/ratio_mean"] == 1.0 and records[0]["runtime/logprob_gap"] == 0.0
    for r in records[1:]:
        assert r["runtime/ratio_mean"] != 1.0 and r["runtime/logprob_gap"] > 0.0
    # the weights went out once per epoch (each epoch's request found its worker behind the version it may lag)
    assert all(r["runtime/sync_bytes"] > 0 for r in records[:2])


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_request_sampled_once(tmp_path, monkeypatch):
    engines = []
    collect = ray_engine.RayRollouts._collect

    def kill_then_collect(self, trainer, epoch):
        """SIGKILL the first worker with epoch 1's request in flight, then collect as ever."""
        if epoch == 1:
            os.kill(self.pids[0], signal.SIGKILL)
            engines.append(self)
        return collect(self, trainer, epoch)

    monkeypatch.setattr(ray_engine.RayRollouts, "_collect", kill_then_collect)
    plain = _train(CONFIG, tmp_path / "torchrun", "torchrun", *SMALL)
    on_ray = _train(CONFIG, tmp_path / "ray", "ray", *SMALL)
    _no_ray_left()
    assert len(engines) == 1 and engines[0].replaced == 1
    _compare(plain, on_ray, 3, "transformer/diffusion_pytorch_model.safetensors")


@pytest.mark.slow
def test_ray_is_shut_down_when_the_run_fails(tmp_path, monkeypatch):
    def fail(self, upd, work):
        raise RuntimeError("a fault in the first update")

    monkeypatch.setattr(ray_engine.RayRollouts, "after_update", fail)
    with pytest.raises(RuntimeError, match="a fault in the first update"):
        _train(CONFIG, tmp_path / "ray", "ray", *SMALL)
    import ray

    assert not ray.is_initialized()
    _no_ray_left()
