"""How ``flowgrpo-reward-server`` holds load: an admission queue, cross-request batching, scoring workers, metrics.

A request passes three stages (all on the server's event loop unless said otherwise):

1. **Admission** (:class:`Admission`): at most ``max_concurrency`` requests are *in flight* (decoded, batched or
   scored) and at most ``max_queue`` more *wait* for a slot, each for at most ``max_queue_wait`` seconds. A
   request that finds the queue full, or waits longer, is answered 503 with ``Retry-After``: an estimate of
   when a slot frees, from the recent service time. Nothing else is ever refused for load.
2. **Batching** (:class:`Batcher`): the in-flight requests' images are cut into pieces of at most ``batch_size``
   images; with cross-request batching on, pieces of the same image size from different requests are merged
   into one reward call of at most ``batch_size`` images (dynamic batching, as GPU model servers do: the batcher
   takes what has arrived when a worker frees, waiting at most ``batch_wait_s`` for more), and the scores are
   split back per request. A reward error in a merged call is attributed by scoring its requests one by one.
3. **Scoring** (:class:`ThreadScorer` or :class:`ProcessScorer`): one thread that owns the reward (rewards need
   not be thread-safe; a GPU model runs one batch at a time), or ``workers`` processes that each build and set
   up their own copy of the reward, for CPU rewards.

Memory: a waiting request holds its raw body, so the server holds at most (``max_concurrency`` + ``max_queue``)
bodies of at most ``max_request_bytes`` each; decoded pixels exist only for in-flight requests.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import multiprocessing
import os
import time

import numpy as np
import torch

from flowgrpo.rewards.registry import load_reward
from flowgrpo.rewards.wire import pixels_to_images


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Load settings of the reward server (the ``flowgrpo-reward-server`` flags of the same names).

    Attributes:
        max_concurrency: requests in flight at once (decoding, batched or being scored). >= 1.
        max_queue: requests that may wait for an in-flight slot; one more is answered 503. >= 0.
        max_queue_wait: seconds a request may wait for a slot before it is answered 503. > 0.
        cross_request_batching: merge pieces of different requests into one reward call.
        batch_wait_s: with cross-request batching, how long a free worker waits for more images. >= 0.
        workers: scoring processes (> 1: each builds its own reward; needs a reward spec). >= 1.
        max_request_pixels: decoded pixels (images · width · height, from the PNG headers) one request may hold;
            a request over it is answered 413 before anything is decoded. >= 1.
        max_request_images: images one request may hold; a request with more is answered 413 once its JSON is
            parsed, before any image is read (100,000 1×1 images took 21-57 s to answer). >= 1.
        max_pixels_in_flight: decoded pixels all requests in flight may hold together; a request that would pass
            it is answered 503 (``Retry-After``) before it is decoded. >= ``max_request_pixels``. With both, the
            server's decoded images take at most ``max_pixels_in_flight`` · 3 bytes (uint8), and the float32
            images a reward call gets at most ``max_pixels_in_flight`` · 12 bytes more.

    Raises:
        ValueError: a value out of range (the message names it and the range).
    """

    max_concurrency: int = 16
    max_queue: int = 256
    max_queue_wait: float = 60.0
    cross_request_batching: bool = True
    batch_wait_s: float = 0.005
    workers: int = 1
    max_request_pixels: int = 2**26
    max_pixels_in_flight: int = 2**28
    max_request_images: int = 1024

    def __post_init__(self) -> None:
        for key, low in (("max_concurrency", 1), ("max_queue", 0), ("workers", 1), ("max_request_pixels", 1),
                         ("max_pixels_in_flight", self.max_request_pixels), ("max_request_images", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                why = " (max_request_pixels: one request must fit)" if key == "max_pixels_in_flight" else ""
                raise ValueError(f"{key} must be an integer >= {low}{why}, got {value!r}")
        if not (isinstance(self.max_queue_wait, int | float) and self.max_queue_wait > 0):
            raise ValueError(f"max_queue_wait must be > 0 seconds, got {self.max_queue_wait!r}")
        if not (isinstance(self.batch_wait_s, int | float) and self.batch_wait_s >= 0):
            raise ValueError(f"batch_wait_s must be >= 0 seconds, got {self.batch_wait_s!r}")


# ------------------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------------------


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own (several servers may share a process).

    Exported (``GET /metrics``, text format 0.0.4): ``flowgrpo_reward_queue_depth`` and
    ``flowgrpo_reward_in_flight`` (gauges, requests), ``flowgrpo_reward_requests_total{code}``,
    ``flowgrpo_reward_refusals_total{reason}`` (``queue_full``, ``queue_timeout``, ``too_large``, ``too_many_pixels``,
    ``pixels_in_flight``,
    ``unsupported_media``, ``bad_request``, ``reward_failed``, ``disconnected``),
    ``flowgrpo_reward_images_scored_total``,
    ``flowgrpo_reward_request_seconds`` and ``flowgrpo_reward_queue_wait_seconds`` (histograms, seconds),
    ``flowgrpo_reward_batch_images`` (histogram of images per reward call) and
    ``flowgrpo_reward_recent_latency_seconds{quantile}`` (p50/p90/p99 of the last 1024 answered requests).

    Raises:
        ImportError: prometheus_client is not installed (the message gives the pip command).
    """

    def __init__(self, queue_depth, in_flight) -> None:
        try:
            import prometheus_client as prom
        except ImportError as err:
            raise ImportError('the reward server needs prometheus_client: pip install "flowgrpo[server]"') from err
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=True)
        reg, ns = self.registry, "flowgrpo_reward"
        prom.Gauge(f"{ns}_queue_depth", "requests waiting for an in-flight slot", registry=reg).set_function(
            queue_depth)
        prom.Gauge(f"{ns}_in_flight", "requests being decoded, batched or scored", registry=reg).set_function(
            in_flight)
        self.requests = prom.Counter(f"{ns}_requests", "answered /score requests by HTTP status", ["code"],
                                     registry=reg)
        self.refusals = prom.Counter(f"{ns}_refusals", "refused /score requests by reason", ["reason"], registry=reg)
        self.images = prom.Counter(f"{ns}_images_scored", "images scored", registry=reg)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.latency = prom.Histogram(f"{ns}_request_seconds", "time from a request's arrival to its answer",
                                      buckets=buckets, registry=reg)
        self.queue_wait = prom.Histogram(f"{ns}_queue_wait_seconds", "time a request waited for a slot",
                                         buckets=buckets, registry=reg)
        self.batch_images = prom.Histogram(f"{ns}_batch_images", "images per reward call",
                                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=reg)
        self._recent: collections.deque[float] = collections.deque(maxlen=1024)
        reg.register(_RecentLatency(self._recent, f"{ns}_recent_latency_seconds"))

    def answered(self, code: int, seconds: float, reason: str | None = None) -> None:
        """Count one answered request with its status, latency (seconds) and refusal reason (None: not refused)."""
        self.requests.labels(code=str(code)).inc()
        if reason is not None:
            self.refusals.labels(reason=reason).inc()
        self.latency.observe(seconds)
        self._recent.append(seconds)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class _RecentLatency:
    """A collector of latency quantiles over a sliding window (the nearest-rank percentile of the window)."""

    def __init__(self, window, name: str) -> None:
        self.window, self.name = window, name

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        fam = GaugeMetricFamily(self.name, "latency quantiles of the last 1024 answered /score requests",
                                labels=["quantile"])
        values = sorted(self.window)
        for q in (0.5, 0.9, 0.99):
            fam.add_metric([str(q)], nearest_rank(values, q) if values else math.nan)
        yield fam


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of ascending values: the ceil(q·n)-th smallest (q in (0, 1], n >= 1)."""
    return sorted_values[max(math.ceil(q * len(sorted_values)), 1) - 1]


# ------------------------------------------------------------------------------------------------------------
# admission
# ------------------------------------------------------------------------------------------------------------


class PixelBudget:
    """The decoded pixels of the requests in flight, bounded (used on the event loop only): a request takes its
    pixels (from its PNG headers) before it decodes them and gives them back once answered."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def try_take(self, n: int) -> bool:
        """Take ``n`` pixels (True), or refuse (False) when they would pass the limit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give_back(self, n: int) -> None:
        self.used -= n


class QueueTimeout(Exception):
    """A request waited ``max_queue_wait`` seconds without getting an in-flight slot."""


class Admission:
    """The in-flight limit and the bounded waiting queue in front of it (used on the event loop only).

    ``pending`` counts every admitted request (waiting or in flight). :meth:`try_enter` admits one unless
    ``pending`` has reached ``max_concurrency + max_queue``; :meth:`slot` waits for an in-flight slot, at most
    ``max_queue_wait`` seconds (then :class:`QueueTimeout`).
    """

    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        self.pending = 0
        self.in_flight = 0
        self._slots: asyncio.Semaphore | None = None
        self._service_s = 0.0  # exponential moving average of a request's in-flight time (seconds)

    def queue_depth(self) -> int:
        """Requests admitted but not yet in flight."""
        return self.pending - self.in_flight

    def try_enter(self) -> bool:
        """Admit one request (True), or refuse it because the queue is full (False)."""
        if self.pending >= self.config.max_concurrency + self.config.max_queue:
            return False
        self.pending += 1
        return True

    def leave(self) -> None:
        """The request admitted by :meth:`try_enter` is answered."""
        self.pending -= 1

    @contextlib.asynccontextmanager
    async def slot(self):
        """Hold an in-flight slot; yields the seconds waited for it. Raises QueueTimeout after max_queue_wait."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._slots.acquire(), self.config.max_queue_wait)
        except TimeoutError:
            raise QueueTimeout(f"waited {time.monotonic() - t0:.1f} s for a slot") from None
        t1 = time.monotonic()
        self.in_flight += 1
        try:
            yield t1 - t0
        finally:
            self.in_flight -= 1
            self._slots.release()
            self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - t1)

    def retry_after(self) -> int:
        """Whole seconds after which a refused client may find a slot: the recent service time times the
        number of slot turnovers the waiting requests need, clamped to [1, 60]."""
        turns = self.queue_depth() / self.config.max_concurrency + 1.0
        return int(min(max(math.ceil(self._service_s * turns), 1), 60))


# ------------------------------------------------------------------------------------------------------------
# scoring executors
# ------------------------------------------------------------------------------------------------------------


class RewardFailed(RuntimeError):
    """The served reward raised something other than ValueError; ``kind`` is the original exception's type name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def score_pixels(reward, pixels: np.ndarray, prompts: list[str], metadata: list[dict]) -> list[float | None]:
    """Scores of one reward call: ``reward`` on (B, H, W, 3) uint8 ``pixels`` as (B, 3, H, W) float32 value/255.

    Returns B floats, None for NaN ("not applicable").

    Raises:
        RuntimeError: the reward returned another shape than (B,), or an infinite score (not sendable as JSON).
        Anything the reward raises.
    """
    b = pixels.shape[0]
    with torch.no_grad():
        scores = torch.as_tensor(reward(pixels_to_images(pixels), prompts, metadata), dtype=torch.float32)
    if scores.shape != (b,):
        raise RuntimeError(f"the reward returned shape {tuple(scores.shape)}, expected ({b},)")
    values = scores.cpu().tolist()
    bad = [i for i, v in enumerate(values) if math.isinf(v)]
    if bad:
        raise RuntimeError(f"the reward returned an infinite score for image {bad[0]} of its batch")
    return [None if math.isnan(v) else v for v in values]


class ThreadScorer:
    """Scores on one thread that owns the already set-up ``reward`` (one reward call at a time)."""

    workers = 1

    def __init__(self, reward) -> None:
        self.reward = reward
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flowgrpo-reward")

    async def start(self) -> None:
        """Nothing to start: the caller set the reward up."""

    async def score(self, pixels: np.ndarray, prompts: list[str], metadata: list[dict]) -> list[float | None]:
        """:func:`score_pixels` on the scoring thread; exceptions other than ValueError become RewardFailed."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, score_pixels, self.reward, pixels, prompts, metadata)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - any reward failure is reported to the client as a 500
            raise RewardFailed(type(err).__name__, str(err)) from err

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_WORKER_REWARD = None
_WORKER_READY: dict = {}


def _init_worker(spec: str, kwargs: dict, device: str, barrier) -> None:
    """Build and set up the reward in a scoring process (one torch thread: the processes are the parallelism)."""
    global _WORKER_REWARD
    torch.set_num_threads(1)
    reward, _ = load_reward(spec, **kwargs)
    reward.setup(torch.device(device))
    _WORKER_REWARD = reward
    _WORKER_READY["barrier"] = barrier


def _worker_ready(timeout: float) -> int:
    """Block until every worker runs one of these (so each has finished its setup); returns this worker's pid."""
    _WORKER_READY["barrier"].wait(timeout)
    return os.getpid()


def _worker_score(pixels, prompts, metadata):
    """:func:`score_pixels` in a scoring process; errors come back as values (any exception type pickles)."""
    try:
        return "ok", score_pixels(_WORKER_REWARD, pixels, prompts, metadata)
    except ValueError as err:
        return "ValueError", str(err)
    except Exception as err:  # noqa: BLE001 - reported to the client as a 500 naming the type
        return type(err).__name__, str(err)


class ProcessScorer:
    """Scores in ``workers`` spawned processes, each of which builds ``spec`` with ``kwargs`` and sets it up on
    ``device`` at :meth:`start` (for CPU rewards that hold the GIL). Pixels travel to the workers through
    multiprocessing pipes between the server's own processes; clients still send only JSON and PNG.
    """

    def __init__(self, spec: str, kwargs: dict, device: str, workers: int, startup_timeout: float = 300.0) -> None:
        self.spec, self.kwargs, self.device, self.workers = spec, dict(kwargs), device, workers
        self.startup_timeout = startup_timeout
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def start(self) -> None:
        """Spawn the workers and wait until every one has set its reward up.

        Raises:
            RuntimeError: a worker failed to build or set up the reward, or took longer than startup_timeout.
        """
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(self.workers)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=ctx, initializer=_init_worker,
            initargs=(self.spec, self.kwargs, self.device, barrier))
        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(self._pool, _worker_ready, self.startup_timeout) for _ in range(self.workers)]
        try:
            pids = await asyncio.gather(*calls)
        except Exception as err:  # BrokenProcessPool, BrokenBarrierError
            self.close()
            raise RuntimeError(f"the reward server's {self.workers} scoring processes did not start: "
                               f"{type(err).__name__}: {err}") from err
        assert len(set(pids)) == self.workers, pids

    async def score(self, pixels: np.ndarray, prompts: list[str], metadata: list[dict]) -> list[float | None]:
        """:func:`score_pixels` in a free worker process."""
        loop = asyncio.get_running_loop()
        kind, value = await loop.run_in_executor(self._pool, _worker_score, pixels, prompts, metadata)
        if kind == "ok":
            return value
        if kind == "ValueError":
            raise ValueError(value)
        raise RewardFailed(kind, value)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------------------------
# cross-request batching
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Piece:
    """At most batch_size images of one request, waiting for a reward call."""

    pixels: np.ndarray  # (n, H, W, 3) uint8
    prompts: list[str]
    metadata: list[dict]
    future: asyncio.Future

    @property
    def n(self) -> int:
        return self.pixels.shape[0]


class Batcher:
    """Cuts requests into pieces, merges pieces into reward calls and runs them on ``scorer``'s workers.

    Args:
        scorer: a started :class:`ThreadScorer` or :class:`ProcessScorer`.
        config: cross_request_batching and batch_wait_s are read.
        batch_size: at most this many images per reward call (>= 1).
        on_batch: called with the image count of every reward call (for metrics).
    """

    def __init__(self, scorer, config: ServingConfig, batch_size: int, on_batch=None) -> None:
        self.scorer, self.config, self.batch_size = scorer, config, batch_size
        self.on_batch = on_batch or (lambda n: None)
        self._pieces: collections.deque[_Piece] = collections.deque()
        self._arrived = asyncio.Event()
        self._free = asyncio.Semaphore(scorer.workers)
        self._task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="flowgrpo-reward-batcher")

    async def stop(self) -> None:
        for task in [self._task, *self._calls]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._task, *self._calls] if t is not None], return_exceptions=True)

    async def score(self, pixels: np.ndarray, prompts: list[str], metadata: list[dict]) -> list[float | None]:
        """Scores of one request's (B, H, W, 3) uint8 ``pixels`` (B floats or None), in order.

        Raises:
            ValueError: the reward refused the input. RewardFailed: the reward failed.
        """
        loop = asyncio.get_running_loop()
        futures = []
        for s in range(0, pixels.shape[0], self.batch_size):
            e = s + self.batch_size
            fut = loop.create_future()
            self._pieces.append(_Piece(pixels[s:e], prompts[s:e], metadata[s:e], fut))
            futures.append(fut)
        self._arrived.set()
        out: list[float | None] = []
        for part in await asyncio.gather(*futures):
            out.extend(part)
        return out

    async def _next_piece(self, deadline: float | None) -> _Piece | None:
        """The oldest waiting piece; waits for one until ``deadline`` (loop time; None: no limit)."""
        loop = asyncio.get_running_loop()
        while not self._pieces:
            self._arrived.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            try:  # waiting on an Event (not on a queue's get) loses no piece when the wait times out
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return None
        return self._pieces.popleft()

    async def _collect(self) -> list[_Piece]:
        """One reward call's pieces: the oldest, plus (when merging) later ones of its image size up to batch_size."""
        first = await self._next_piece(None)
        batch, n = [first], first.n
        if not self.config.cross_request_batching:
            return batch
        deadline = asyncio.get_running_loop().time() + self.config.batch_wait_s
        while n < self.batch_size:
            piece = await self._next_piece(deadline)
            if piece is None:
                break
            if piece.pixels.shape[1:] != first.pixels.shape[1:] or n + piece.n > self.batch_size:
                self._pieces.appendleft(piece)  # it starts the next call
                break
            batch.append(piece)
            n += piece.n
        return batch

    async def _run(self) -> None:
        while True:
            await self._free.acquire()  # collect only when a worker is free, so batches fill up under load
            batch = await self._collect()
            task = asyncio.get_running_loop().create_task(self._call(batch))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[_Piece]) -> None:
        try:
            if len(batch) == 1:
                await self._call_one(batch[0])
                return
            pixels = np.concatenate([p.pixels for p in batch])
            try:
                self.on_batch(pixels.shape[0])
                scores = await self.scorer.score(pixels, [x for p in batch for x in p.prompts],
                                                 [m for p in batch for m in p.metadata])
            except Exception:  # noqa: BLE001 - whose input was it? score each request's piece alone
                for piece in batch:
                    await self._call_one(piece)
                return
            start = 0
            for piece in batch:
                _resolve(piece.future, scores[start : start + piece.n])
                start += piece.n
        finally:
            self._free.release()

    async def _call_one(self, piece: _Piece) -> None:
        try:
            self.on_batch(piece.n)
            _resolve(piece.future, await self.scorer.score(piece.pixels, piece.prompts, piece.metadata))
        except Exception as err:  # noqa: BLE001 - every failure reaches the waiting request, none hangs it
            if not piece.future.done():
                piece.future.set_exception(err)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():  # a request whose client went away may have been cancelled
        future.set_result(value)
