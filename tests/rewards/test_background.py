"""Background scoring (flowgrpo.rewards.background): scoring runs behind the caller in submission order and
matches the in-process scores, a failure is re-raised naming the reward and stops the batches queued behind it, and
``max_pending`` bounds the queue."""

from __future__ import annotations

import threading

import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility, jpeg_size_kb

from flowgrpo.rewards.background import AsyncRewardScorer, RewardError
from flowgrpo.rewards.base import BaseReward
from flowgrpo.rewards.compose import ComposedReward
from tests.rewards.stubs import images_8bit


def test_background_scorer_overlaps_preserves_order_and_matches_in_process():
    release = threading.Event()
    worker_threads = []

    class Gate(BaseReward):
        """Scores only once the main thread has moved on: submit() must return before scoring ends."""

        name = "gate"

        def score(self, images, prompts, metadata):
            worker_threads.append(threading.get_ident())
            if not release.wait(10):
                raise TimeoutError("submit() blocked the caller")
            return images.mean(dim=(1, 2, 3))

    composed = ComposedReward({"jpeg": JpegCompressibility(), "gate": Gate()}, {"jpeg": 1.0, "gate": 1.0})
    batches = [images_8bit(n, seed=s) for n, s in ((3, 1), (1, 2), (4, 3))]
    with AsyncRewardScorer(composed) as scorer:
        handles = [scorer.submit(b, ["p"] * len(b), [{}] * len(b)) for b in batches]
        assert not handles[0].done()  # still waiting on the gate: scoring runs behind the caller
        release.set()
        got = scorer.gather(handles)
    everything = torch.cat(batches)
    torch.testing.assert_close(got["jpeg"], -jpeg_size_kb(everything), rtol=0, atol=0)
    torch.testing.assert_close(got["gate"], everything.mean(dim=(1, 2, 3)))
    assert threading.get_ident() not in worker_threads and len(set(worker_threads)) == 1
    assert [h.index for h in handles] == [0, 1, 2] and [h.batch_size for h in handles] == [3, 1, 4]


def test_background_scorer_reraises_with_the_reward_name():
    class FailsOnSecond(BaseReward):
        name = "fragile"

        def __init__(self):
            self.n = 0
            self.all_submitted = threading.Event()

        def score(self, images, prompts, metadata):
            self.all_submitted.wait(30)  # the three batches are queued before the first is scored
            self.n += 1
            if self.n == 2:
                raise RuntimeError("CUDA out of memory (simulated)")
            return torch.ones(images.shape[0])

    class WrongShape(BaseReward):
        name = "wrong"

        def score(self, images, prompts, metadata):
            return torch.ones(images.shape[0] + 1)

    fragile = FailsOnSecond()
    composed = ComposedReward({"jpeg": JpegCompressibility(), "fragile": fragile}, {"jpeg": 1.0, "fragile": 1.0})
    with AsyncRewardScorer(composed) as scorer:
        handles = [scorer.submit(images_8bit(2, seed=s), ["p"] * 2, [{}] * 2) for s in range(3)]
        fragile.all_submitted.set()
        assert handles[0].result()["fragile"].tolist() == [1.0, 1.0]
        with pytest.raises(RewardError, match="'fragile'.*out of memory") as info:
            handles[1].result()
        assert info.value.reward_name == "fragile" and isinstance(info.value.__cause__, RuntimeError)
        # the first failure stops the scorer: the batches queued behind it are not scored (issue 38: a lost
        # reward server must not cost one more retry chain per queued batch)
        with pytest.raises(RewardError, match="batch 2 was not scored: the reward failed on batch 1 first"):
            handles[2].result()
        with pytest.raises(RewardError, match="fragile"):
            scorer.gather(handles)
        with pytest.raises(ValueError, match="2 images but 1 prompts"):
            scorer.submit(images_8bit(2), ["p"], [{}, {}])
        with pytest.raises(RewardError, match="batch 3 was not scored: the reward failed on batch 1 first"):
            scorer.submit(images_8bit(2), ["p"] * 2, [{}] * 2)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(images_8bit(2), ["p"] * 2, [{}] * 2)
    with AsyncRewardScorer(ComposedReward({"wrong": WrongShape()}, {"wrong": 1.0})) as scorer:
        with pytest.raises(RewardError, match=r"'wrong' returned shape \(3,\), expected \(2,\)"):
            scorer.score(images_8bit(2), ["p"] * 2, [{}] * 2)


def test_background_scorer_max_pending_bounds_the_queue():
    release = threading.Event()

    class Blocked(BaseReward):
        name = "blocked"

        def score(self, images, prompts, metadata):
            release.wait(10)
            return torch.zeros(images.shape[0])

    with AsyncRewardScorer(ComposedReward({"b": Blocked()}, {"b": 1.0}), max_pending=1) as scorer:
        first = scorer.submit(images_8bit(1), ["p"], [{}])
        second_submitted = threading.Event()
        t = threading.Thread(target=lambda: (scorer.submit(images_8bit(1), ["p"], [{}]), second_submitted.set()))
        t.start()
        assert not second_submitted.wait(0.3)  # blocked: one batch already pending
        release.set()
        assert second_submitted.wait(10)
        t.join(10)
        assert first.result()["b"].tolist() == [0.0]
