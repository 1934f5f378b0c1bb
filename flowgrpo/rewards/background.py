"""Background reward scoring: score one batch while the next is being sampled.

The trainer submits each rollout micro-batch's decoded images as soon as they exist and collects the scores once
the rollout is done, so reward time (PNG encoding and HTTP for a remote reward, CPU-bound scorers, Python
overhead) overlaps with sampling, in the manner of the asynchronous reward workers of verl and OpenRLHF::

    scorer = AsyncRewardScorer(composed)           # composed.setup(device) already called
    handles = []
    for batch in micro_batches:
        images = sample(batch)                     # (b, 3, H, W) in [0, 1]
        handles.append(scorer.submit(images, prompts_of(batch), metadata_of(batch)))
    components = scorer.gather(handles)            # name -> (B,) float32, in submission order
    scorer.close()

One worker thread scores the batches one after another, in submission order. A reward that raises is re-raised
in the thread that asks for the result as :class:`RewardError`, which names the reward (the original exception
is its ``__cause__``). The first failure stops the scorer: the batches still waiting are cancelled (their handles
raise :class:`RewardError` naming the batch that failed) and nothing more is accepted, so a run that stops on a
lost reward server waits for one retry chain, not one per queued batch (the worker thread would otherwise work
through the queue before the interpreter could exit). A GPU reward runs on the device's default stream, so its
kernels queue behind the sampler's and never read images before they are written; what overlaps is the host-side
work.

The images passed to :meth:`AsyncRewardScorer.submit` are read later, from the worker: do not modify them in
place before their result has been collected.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import torch

from flowgrpo.rewards.base import check_reward_inputs
from flowgrpo.rewards.compose import ComposedReward, RewardError, score_components_named

logger = logging.getLogger(__name__)

__all__ = ["AsyncRewardScorer", "RewardError", "ScoreHandle", "score_components_named"]


class ScoreHandle:
    """The pending scores of one submitted batch (returned by :meth:`AsyncRewardScorer.submit`).

    Attributes:
        index: submission number (0, 1, …) within its scorer.
        batch_size: B, the number of images submitted.
    """

    def __init__(self, future: Future, index: int, batch_size: int, scorer: AsyncRewardScorer | None = None) -> None:
        self._future = future
        self.index = index
        self.batch_size = batch_size
        self._scorer = scorer

    def done(self) -> bool:
        """Whether scoring has finished (successfully or not); never blocks."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Block until scored; name → (B,) float32 CPU scores of each component.

        Raises:
            RewardError: the reward named in it failed on this batch, or the batch was cancelled because an
                earlier one failed (the message names that failure).
            TimeoutError: not done within ``timeout`` seconds.
        """
        try:
            components, _ = self._future.result(timeout)
        except CancelledError:
            raise self._scorer.stopped_error(self.index) from None
        return components

    @classmethod
    def scored(cls, components: dict[str, torch.Tensor], batch_size: int, seconds: float = 0.0) -> ScoreHandle:
        """A handle already done with ``components`` (name → (B,) float32), scored elsewhere (a Ray reward
        worker: docs/async.md), so that :meth:`AsyncRewardScorer.gather` takes it with the others."""
        future: Future = Future()
        future.set_result((components, seconds))
        return cls(future, -1, batch_size)

    @property
    def seconds(self) -> float:
        """Wall-clock seconds the worker spent scoring this batch (blocks until it is done)."""
        return self._future.result()[1]


class AsyncRewardScorer:
    """Scores batches with a :class:`~flowgrpo.rewards.compose.ComposedReward` on one background thread.

    Args:
        composed: the rewards, already ``setup`` on their device.
        max_pending: at most this many submitted batches not yet scored; :meth:`submit` blocks beyond it (bounds
            the images held in memory). None: no bound.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, composed: ComposedReward, *, max_pending: int | None = None) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 or None, got {max_pending}")
        self.composed = composed
        self.weights = composed.weights
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowgrpo-reward")
        self._slots = threading.BoundedSemaphore(max_pending) if max_pending else None
        self._count = 0
        self._closed = False
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._failure: tuple[int, BaseException] | None = None  # (batch index, error) of the first failure

    def _work(self, index, images, prompts, metadata):
        try:
            if self._failure is not None:  # taken by the worker just before the cancellation reached it
                raise self.stopped_error(index)
            t0 = time.perf_counter()
            try:
                comps = score_components_named(self.composed, images, prompts, metadata)
            except BaseException as err:
                self._stop(index, err)
                raise
            return comps, time.perf_counter() - t0
        finally:
            if self._slots is not None:
                self._slots.release()

    def _stop(self, index: int, err: BaseException) -> None:
        """After the first failure: cancel every batch still waiting (releasing its slot)."""
        with self._lock:
            if self._failure is None:
                self._failure = (index, err)
            pending, self._pending = self._pending, []
        for fut in pending:
            if fut.cancel() and self._slots is not None:
                self._slots.release()

    def stopped_error(self, index: int) -> RewardError:
        """The error of batch ``index``, not scored because an earlier batch's reward failed (named in it)."""
        first, err = self._failure
        name = getattr(err, "reward_name", "reward")
        return RewardError(name, f"batch {index} was not scored: the reward failed on batch {first} first ({err})")

    def submit(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> ScoreHandle:
        """Queue a batch for scoring and return at once (or after a slot frees, with ``max_pending``).

        Args:
            images: (B, 3, H, W) float in [0, 1] (or videos (B, F, 3, H, W)), any device; not to be modified until
                its result is collected.
            prompts: B strings. metadata: B dicts.

        Raises:
            ValueError: lengths differ from B or the images are not (B, 3, H, W) or (B, F, 3, H, W) (checked here,
                at once).
            RuntimeError: the scorer is closed.
            RewardError: an earlier batch's reward failed (the scorer stopped).
        """
        if self._closed:
            raise RuntimeError("AsyncRewardScorer is closed")
        check_reward_inputs(images, prompts, metadata, "reward scorer", ("image", "video"))
        if self._failure is not None:
            raise self.stopped_error(self._count)
        if self._slots is not None:
            self._slots.acquire()
        try:
            fut = self._executor.submit(self._work, self._count, images.detach(), list(prompts), list(metadata))
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        handle = ScoreHandle(fut, self._count, images.shape[0], self)
        self._count += 1
        return handle

    def gather(self, handles: list[ScoreHandle], timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Concatenate the components of ``handles`` in the order given: name → (ΣB,) float32.

        Raises:
            RewardError: from the first (in the order given) batch whose reward failed.
            ValueError: ``handles`` is empty.
        """
        if not handles:
            raise ValueError("gather() needs at least one handle")
        parts = [h.result(timeout) for h in handles]
        return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """Submit and wait: the same as ``ComposedReward.score_components`` with named errors."""
        return self.submit(images, prompts, metadata).result()

    def close(self, wait: bool = True) -> None:
        """Stop the worker; with ``wait`` finish the batches already submitted. Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> AsyncRewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=exc[0] is None)
