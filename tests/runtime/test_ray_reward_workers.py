"""``runtime.reward_workers``: Ray actors that build the rewards once and score each rollout's decoded images,
handed to them by Ray straight from the rollout worker (docs/async.md). With ``max_staleness: 0`` the run equals
the run scored in the training process bit for bit, a remote (HTTP) reward included; a reward worker killed with
SIGKILL mid-run is replaced and its scoring issued again, so no group is lost or scored into the run twice."""

from __future__ import annotations

import json
import os
import signal

import pytest

from flowgrpo.runtime import ray_engine
from tests.runtime.test_ray_identity import REPO, _compare, _no_ray_left, _train
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse: one torch thread (the workers take the same)

pytest.importorskip("ray")

CONFIG = REPO / "configs" / "tiny_jpeg.yaml"
SMALL = ["train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=2",
         "data.eval_num_prompts=2"]  # two micro-batches a rollout: two scored parts to put back in order


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trainer_scoring(monkeypatch) -> list:
    """A list that grows by one each time the training process scores rollout images itself: a micro-batch
    handed to its background scorer, or a rollout scored after it (what the trainer falls back to when the
    scores it holds do not cover the rollout: a part lost, or one twice)."""
    from flowgrpo.rewards.background import AsyncRewardScorer
    from flowgrpo.training import loop

    calls = []
    submit, score = AsyncRewardScorer.submit, loop.score_components_named
    monkeypatch.setattr(AsyncRewardScorer, "submit", lambda *a, **k: calls.append(1) or submit(*a, **k))
    monkeypatch.setattr(loop, "score_components_named", lambda *a, **k: calls.append(1) or score(*a, **k))
    return calls


@pytest.mark.slow
def test_a_remote_reward_scored_on_a_reward_worker_equals_the_trainers_scoring(tmp_path, monkeypatch):
    """The served JPEG reward scored through the ``remote`` client: by the training process (torchrun), and by a
    reward worker of a Ray run, the training process scoring no rollout itself (neither in the background nor
    afterwards); two epochs, every metric, the saved rollouts and the final weights equal."""
    from flowgrpo.rewards.registry import load_reward
    from flowgrpo.rewards.server import ServerThread, create_app

    jpeg, _ = load_reward("jpeg_compressibility")
    with ServerThread(create_app(jpeg, reward_name="jpeg_compressibility")) as srv:
        remote = [*SMALL, "train.num_epochs=2", f"rewards=[{{name: remote, kwargs: {{url: '{srv.url}'}}}}]"]
        plain = _train(CONFIG, tmp_path / "torchrun", "torchrun", *remote)
        scored_here = _trainer_scoring(monkeypatch)
        on_ray = _train(CONFIG, tmp_path / "ray", "ray", *remote, "runtime.reward_workers=1")
    _no_ray_left()
    assert scored_here == []
    _compare(plain, on_ray, 2, "checkpoints/epoch_1/trainable.safetensors")
    records = _records(on_ray)
    assert all(r["runtime/reward_seconds"] > 0 for r in records)  # the worker scored each epoch
    assert all(r["runtime/reward_wait_seconds"] >= 0 for r in records)
    assert all("runtime/reward_seconds" not in r for r in _records(plain))


@pytest.mark.slow
def test_a_killed_reward_worker_is_replaced_and_its_scoring_issued_once(tmp_path, monkeypatch):
    engines = []
    collect = ray_engine.RayRollouts._collect

    def kill_then_collect(self, trainer, epoch):
        """SIGKILL the reward worker with epoch 1's scoring issued (waiting for its images), then collect."""
        if epoch == 1:
            os.kill(self.reward_pids[0], signal.SIGKILL)
            engines.append(self)
        return collect(self, trainer, epoch)

    monkeypatch.setattr(ray_engine.RayRollouts, "_collect", kill_then_collect)
    small = [*SMALL, "train.num_epochs=3"]
    plain = _train(CONFIG, tmp_path / "torchrun", "torchrun", *small)
    scored_here = _trainer_scoring(monkeypatch)
    on_ray = _train(CONFIG, tmp_path / "ray", "ray", *small, "runtime.reward_workers=1")
    _no_ray_left()
    assert scored_here == []  # every part scored by the reward workers, none lost, none twice
    assert len(engines) == 1 and engines[0].reward_replaced == 1 and engines[0].replaced == 0
    # every group scored once into the run: the rewards, the advantages and the weights are the torchrun run's
    _compare(plain, on_ray, 3, "transformer/diffusion_pytorch_model.safetensors")
