"""``remote``: a reward computed by a reward server over HTTP (``flowgrpo-reward-server``, :mod:`.server`).

Heavy rewards (a detector, a VLM judge) can live in another process or on another machine; the trainer's config
names them as::

    rewards:
      - name: remote
        weight: 1.0
        kwargs: {url: "http://127.0.0.1:8765", timeout: 120, deadline: 900, batch_size: 16}

Wire format (version 1; JSON both ways, never pickle):

* ``POST /score`` with ``Content-Type: application/json`` and the body
  ``{"images": [<base64 PNG>, …], "prompts": [str, …], "metadata": [{…}, …]}``: B 8-bit RGB PNG images of one
  size, each ``round(255·x)`` of the (3, H, W) float image (the same quantisation as saving the image), B prompts
  and B JSON objects. Reply ``200 {"scores": [float | null, …], "reward": name}``, ``null`` meaning NaN ("not
  applicable"). Errors reply ``{"error": message, "error_type": name}`` with 400 (bad input, every image that
  cannot be decoded included; ``error_type`` ``ValueError`` is re-raised here as ``ValueError``), 413 (request too
  large), 415 (not JSON), 503 with ``Retry-After`` (the server's queue is full) or 500 (the reward failed).
* ``GET /health``: ``{"status": "ok", "reward": name, "origin": {…}, "max_request_bytes": n, …}``.
* ``GET /metrics``: the server's load in the Prometheus text format.

A batch is sent in requests of at most ``batch_size`` images, and smaller when the server's request size limit
(read from ``/health`` at setup) needs it. Timeouts, connection errors and replies 429/502/503/504 are retried
with jittered exponential backoff that honours the server's ``Retry-After`` (:meth:`RemoteReward.retry_wait`),
until the request's total ``deadline`` (900 s by default: a shared server may be busy for minutes) or an
optional count of ``retries``; then :class:`RemoteRewardError` names the URL, the attempts, how long they took
and waited, and the last error. The deadline bounds a whole outage, not each request: the requests after one that
failed for good share its deadline (:meth:`RemoteReward._request`), and the background scorer cancels the batches
queued behind a failed one, so a run that loses its server stops after one deadline. A malformed reply or another
error status is not retried.

Several servers: ``url`` may be a list (``url: ["http://10.0.0.1:8765", "http://10.0.0.2:8765"]``). The
requests of a batch then go out concurrently, each to the least-loaded server (fewest requests in flight, ties in
turn); a request whose server fails (timeout, connection error, a retried status) is sent at once to another one,
and the failed server is left out for ``max_backoff`` seconds before it is tried again. Only when every server has
failed it does the request wait (the backoff above), so the deadline bounds an outage of all of them. Each
server's latency is reported (:meth:`RemoteReward.server_metrics`, logged as ``reward/<name>/server/<i>/…``).

The client needs ``httpx`` (``pip install "flowgrpo[server]"``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import random
import threading
import time
import urllib.parse

import torch

from flowgrpo.rewards.base import check_reward_inputs
from flowgrpo.rewards.wire import images_to_png_b64

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
RETRY_STATUS = frozenset({429, 502, 503, 504})
_INSTALL = 'pip install "flowgrpo[server]"'


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached after the retries, replied malformed data, or reported a failure."""


@dataclasses.dataclass
class RetryStats:
    """What :func:`send_with_retries` did: retries made and seconds waited before them."""

    retries: int = 0
    waited_s: float = 0.0


def retry_wait(k: int, retry_after: float | None, backoff: float, max_backoff: float, rng=random) -> float:
    """Seconds before retry ``k`` (0-based): ``max(Retry-After, min(backoff·2^k, max_backoff))·(1 + U/2)``.

    U is uniform in [0, 1) from ``rng``. The jitter spreads clients that were refused together (exponential
    backoff with jitter, AWS Architecture Blog "Exponential Backoff and Jitter"); the wait is never shorter than
    the server's ``Retry-After`` (RFC 9110 §10.2.3).
    """
    base = max(retry_after or 0.0, min(backoff * 2**k, max_backoff))
    return base * (1.0 + 0.5 * rng.random())


def _attempt(http, method: str, url: str, content, headers, retry_status):
    """One HTTP attempt: ``(reply, None, None)``, or ``(None, why, Retry-After seconds)`` when it may be retried."""
    import httpx

    try:
        r = http.request(method, url, content=content, headers=headers)
    except httpx.TimeoutException as err:
        return None, f"timed out after {http.timeout.read:g} s ({type(err).__name__})", None
    except httpx.TransportError as err:
        return None, f"{type(err).__name__}: {err}", None
    if r.status_code in retry_status:
        return None, f"HTTP {r.status_code}: {r.text[:200]}", parse_retry_after(r.headers.get("retry-after"))
    return r, None, None


def send_with_retries(http, method: str, url: str, *, content: bytes | None = None, headers: dict | None = None,
                      retries: int | None, backoff: float, max_backoff: float, deadline: float | None = None,
                      retry_status=RETRY_STATUS, what: str = "remote reward",
                      error_cls: type[Exception] = RemoteRewardError, rng=None, stats: RetryStats | None = None,
                      started: float | None = None):
    """Send one HTTP request, retrying timeouts, connection errors and ``retry_status`` replies with jittered
    exponential backoff that honours ``Retry-After`` (:func:`retry_wait`), at most ``retries`` times (None: no
    count) and while the next wait ends within ``deadline`` seconds of the start (None: no deadline). At least one
    of the two bounds must be given, so the loop is bounded. ``started``: the ``time.monotonic()`` the deadline
    counts from (default: now; a caller whose server is already known to be down passes when it went down, so
    every request of an outage shares one deadline: past it, one failed attempt ends the request).

    Args:
        http: an ``httpx.Client`` (its timeout applies to each attempt).
        rng: the jitter's source (default: the OS's, so processes seeded alike do not retry in lockstep).
        stats: filled with the retries made and the seconds waited.

    Returns:
        the first ``httpx.Response`` whose status is not in ``retry_status`` (the caller checks it).

    Raises:
        error_cls: every attempt failed; the message names ``what``, the URL, the attempts, the last error, the
            elapsed time and the time spent waiting.
        ValueError: neither ``retries`` nor ``deadline`` given.
    """
    if retries is None and deadline is None:
        raise ValueError("send_with_retries needs retries or a deadline")
    rng = rng or random.SystemRandom()
    stats = stats if stats is not None else RetryStats()
    t0 = time.monotonic() if started is None else started
    while True:
        r, last, retry_after = _attempt(http, method, url, content, headers, retry_status)
        if r is not None:
            if stats.retries:
                logger.info("%s %s: answered after %d retries; waited %.1f s for a busy or unreachable server",
                            what, url, stats.retries, stats.waited_s)
            return r
        k, elapsed = stats.retries, time.monotonic() - t0
        wait = retry_wait(k, retry_after, backoff, max_backoff, rng)
        if (retries is not None and k >= retries) or (deadline is not None and elapsed + wait > deadline):
            limit = f"; deadline {deadline:g} s" if deadline is not None else ""
            raise error_cls(f"{what} at {url} failed after {k + 1} attempts; last error: {last} ({elapsed:.1f} s "
                            f"in all, {stats.waited_s:.1f} s of it waiting to retry{limit})")
        log = logger.warning if (k + 1) & k == 0 else logger.debug  # retries 1, 2, 4, 8, ...: not every one
        log("%s %s: %s; retry %d in %.1f s", what, url, last, k + 1, wait)
        time.sleep(wait)
        stats.retries += 1
        stats.waited_s += wait


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (RFC 9110 §10.2.3: delay-seconds or an HTTP-date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        from email.utils import parsedate_to_datetime

        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def check_server_urls(url) -> list[str]:
    """The server base URLs of a remote reward's ``url`` (one string or a non-empty list of them), without a
    trailing ``/``.

    Raises:
        ValueError: not a string or list of strings, an empty list, a URL that is not ``http(s)://host[:port]``
            (the message names the value), or the same server twice.
    """
    items = [url] if isinstance(url, str) else url
    if not isinstance(items, list | tuple) or not items:
        raise ValueError(f"remote reward url must be a URL or a non-empty list of URLs, got {url!r}")
    out = []
    for i, u in enumerate(items):
        name = "url" if isinstance(url, str) else f"url[{i}]"
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ValueError(f"remote reward {name} must start with http:// or https://, got {u!r}")
        try:
            parts = urllib.parse.urlsplit(u)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0..65535
        except ValueError as err:
            raise ValueError(f"remote reward {name} is not a valid URL ({err}), got {u!r}") from None
        if not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"remote reward {name} must be http(s)://host[:port][/path] with a host and no query, "
                             f"got {u!r}")
        u = u.rstrip("/")
        if u in out:
            raise ValueError(f"remote reward {name} names the server {u!r} twice")
        out.append(u)
    return out


class _Server:
    """One reward server of a :class:`RemoteReward`: its connection pool, load and latency."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout
        self.client = None
        self.in_flight = 0
        self.left_out_until = 0.0  # monotonic time before which it is tried only when no other server is left
        self.latencies: list[float] = []  # seconds of the answered requests since the last metrics read
        self.failures = 0  # failed attempts since the last metrics read
        self.health: dict | None = None

    def http(self):
        if self.client is None:
            try:
                import httpx
            except ImportError as err:
                raise ImportError(f"the remote reward needs httpx: {_INSTALL}") from err
            self.client = httpx.Client(timeout=self.timeout)
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


@dataclasses.dataclass
class _Tries:
    """The state of one logical request's attempts (:meth:`RemoteReward._send`): ``start`` and ``t0`` (the
    outage's start: the deadline counts from it) in ``time.monotonic`` seconds, rounds waited, attempts made,
    seconds waited, the largest ``Retry-After`` of the round, the last error, and the servers tried this round."""

    start: float
    t0: float
    rounds: int = 0
    attempts: int = 0
    waited: float = 0.0
    retry_after: float | None = None
    last: str | None = None
    tried: set = dataclasses.field(default_factory=set)


class RemoteReward:
    """A reward served by ``flowgrpo-reward-server`` at ``url`` (see the module docstring for the protocol).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8765``, or a list of the base URLs of several servers
            of the same reward (requests are spread over them and fail over between them; module docstring).
        timeout: seconds allowed for each phase of one attempt (connect, send, wait for the reply). > 0. A busy
            server keeps a request in its queue for up to its ``--max-queue-wait`` (60 s by default) before it
            answers, so keep this above that.
        deadline: seconds one request may take in all, retries and waits included (> 0; default 900). Retrying
            stops when the next wait would pass it.
        retries: at most this many retries (>= 0); ``None`` (default): as many as the deadline allows.
        backoff: seconds before the first retry; doubled before each next one, up to ``max_backoff`` (>= 0).
        batch_size: at most this many images per request (>= 1).
        name: the reward's name in metrics (default ``"remote"``; the config's key is what the trainer uses).
        compress_level: PNG compression 0–9 (pixels are the same at every level; 1 is fast).
        max_backoff: the longest wait between two attempts, in seconds (default 30), except where the
            server's ``Retry-After`` asks for longer.

    Attributes:
        waited_s: seconds spent waiting before retries since construction (a busy server shows here).
        retried: how many retries were made since construction.

    Raises:
        ValueError: a kwarg out of range (at construction; nothing is contacted before :meth:`setup`).
    """

    def __init__(self, url: str | list[str], timeout: float = 120.0, retries: int | None = None,
                 backoff: float = 0.5, batch_size: int = 16, name: str = "remote", compress_level: int = 1,
                 max_backoff: float = 30.0, deadline: float = 900.0) -> None:
        urls = check_server_urls(url)
        for key, value in (("timeout", timeout), ("deadline", deadline)):
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"remote reward {key} must be > 0 seconds, got {value!r}")
        if not (retries is None or (isinstance(retries, int) and retries >= 0)):
            raise ValueError(f"remote reward retries must be an integer >= 0 or None, got {retries!r}")
        if not (isinstance(backoff, int | float) and backoff >= 0):
            raise ValueError(f"remote reward backoff must be >= 0 seconds, got {backoff!r}")
        if not (isinstance(max_backoff, int | float) and max_backoff >= backoff):
            raise ValueError(f"remote reward max_backoff must be >= backoff ({backoff}), got {max_backoff!r}")
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"remote reward batch_size must be an integer >= 1, got {batch_size!r}")
        if not (isinstance(compress_level, int) and 0 <= compress_level <= 9):
            raise ValueError(f"remote reward compress_level must be in 0..9, got {compress_level!r}")
        self.urls = urls
        self.url = urls[0]
        self.timeout = float(timeout)
        self.deadline = float(deadline)
        self.retries = retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.batch_size = batch_size
        self.name = name
        self.compress_level = compress_level
        self.server_info: dict | None = None  # the server's /health reply, after setup
        self.max_request_bytes: int | None = None
        self.waited_s = 0.0
        self.retried = 0
        self._servers = [_Server(u, self.timeout) for u in urls]
        self._lock = threading.Lock()
        self._turn = 0  # round-robin tie break between equally loaded servers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._down_since: float | None = None  # monotonic start of the request that found every server down
        # Jitter must differ between the processes of one run (seeded alike, they would retry in lockstep), so it
        # comes from the OS, not from the run's seed; it never affects a score.
        self._jitter = random.SystemRandom()

    # ------------------------------------------------------------------ connection
    def setup(self, device: torch.device | str | None = None) -> None:
        """Check the servers' ``/health`` and read their request size limit (the smallest of them).

        ``device`` is unused: the servers chose their own device. With one server its ``/health`` is asked with
        the retries; with several each is asked once, and those that do not answer are left out for
        ``max_backoff`` seconds (the retries apply only when none answers). Records the first answer in
        :attr:`server_info`.

        Raises:
            RemoteRewardError: no server answered ``/health`` after the retries, or one answered malformed data.
        """
        answered = []
        if len(self._servers) > 1:
            for srv in self._servers:
                try:
                    srv.health = self._request("GET", "/health", None, only=srv)
                    answered.append(srv)
                except RemoteRewardError as err:
                    logger.warning("remote reward %s: left out for now: %s", srv.url, err)
                    srv.left_out_until = time.monotonic() + self.max_backoff
            self._down_since = None
        if not answered:
            srv, srv.health = self._send("GET", "/health", None)
            answered.append(srv)
        for srv in answered:
            info = srv.health
            if not isinstance(info, dict) or info.get("status") != "ok":
                raise RemoteRewardError(f"remote reward at {srv.url}: /health replied {str(info)[:200]!r}")
            logger.info("remote reward %s: serving %r from %s", srv.url, info.get("reward"), info.get("origin"))
        self.server_info = answered[0].health
        limits = [s.health.get("max_request_bytes") for s in answered]
        limits = [int(v) for v in limits if isinstance(v, int) and v > 0]
        self.max_request_bytes = min(limits) if limits else None

    def close(self) -> None:
        """Close the HTTP connection pools (reopened on the next call)."""
        for srv in self._servers:
            srv.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def retry_wait(self, k: int, retry_after: float | None) -> float:
        """Seconds to wait before retry ``k`` (0-based): see :func:`retry_wait`."""
        return retry_wait(k, retry_after, self.backoff, self.max_backoff, self._jitter)

    def _pick(self, servers: list[_Server], tried: set) -> _Server | None:
        """The server of ``servers`` for the next attempt: of those not ``tried`` in this round, one not left out
        if any, the least loaded, ties in turn; None when every server was tried. Counts it in flight."""
        with self._lock:
            now = time.monotonic()
            free = [s for s in servers if id(s) not in tried]
            if not free:
                return None
            up = [s for s in free if s.left_out_until <= now] or free
            n = len(self._servers)
            best = min(up, key=lambda s: (s.in_flight, (self._servers.index(s) - self._turn) % n))
            self._turn = (self._servers.index(best) + 1) % n
            best.in_flight += 1
            return best

    def _request(self, method: str, path: str, body: bytes | None, only: _Server | None = None):
        """The decoded JSON reply of a 200 to one logical request (:meth:`_send`)."""
        return self._send(method, path, body, only)[1]

    def _send(self, method: str, path: str, body: bytes | None, only: _Server | None = None):
        """(the server that answered, its decoded JSON reply of a 200) of one logical request, with retries until
        :attr:`deadline`.

        Each attempt goes to a server picked by :meth:`_pick`; a failed attempt is sent at once to a server not
        yet tried in this round, and only when all have failed does the request wait (jittered exponential
        backoff, ``Retry-After`` honoured) and start a new round. ``only``: ask that server alone, once (no retry).

        The deadline is one for an outage, not one per request: once a request has failed for good, the requests
        after it (the other requests of a batch, the batches queued behind it) count theirs from that request's
        start, so past it each ends after one failed round; any answer from a server ends the outage."""
        headers = {"Content-Type": "application/json"} if body is not None else None
        servers = [only] if only is not None else self._servers
        start = time.monotonic()
        tries = _Tries(start=start, t0=self._down_since if (self._down_since is not None and only is None) else start)
        while True:
            srv = self._pick(servers, tries.tried)
            if srv is None:  # every server failed in this round
                self._end_round(servers, path, only, tries)
                continue
            tries.attempts += 1
            sent = time.monotonic()
            try:
                r, why, after = _attempt(srv.http(), method, srv.url + path, body, headers, RETRY_STATUS)
            finally:
                with self._lock:
                    srv.in_flight -= 1
            if r is None:
                self._failed_attempt(srv, servers, path, tries, why, after)
                continue
            return srv, self._answered(srv, r, path, only, tries, time.monotonic() - sent)

    def _end_round(self, servers: list[_Server], path: str, only: _Server | None, tries: _Tries) -> None:
        """After a round in which every server of ``servers`` failed: give up (past the deadline or the retries,
        or for ``only``), or wait the round's backoff and start the next round (``tries`` updated).

        Raises:
            RemoteRewardError: giving up, naming the attempts, the last error and the seconds spent.
        """
        elapsed = time.monotonic() - tries.t0
        wait = self.retry_wait(tries.rounds, tries.retry_after)
        if (only is not None or (self.retries is not None and tries.rounds >= self.retries)
                or elapsed + wait > self.deadline):
            if self._down_since is None and only is None:
                self._down_since = tries.start
            where = ", ".join(s.url + path for s in servers)
            raise RemoteRewardError(
                f"remote reward at {where} failed after {tries.attempts} attempts; last error: {tries.last} "
                f"({elapsed:.1f} s in all, {tries.waited:.1f} s of it waiting to retry; deadline {self.deadline:g} s)"
            )
        log = logger.warning if (tries.rounds + 1) & tries.rounds == 0 else logger.debug  # retries 1, 2, 4, ...
        log("remote reward %s: %s; retry %d in %.1f s", ", ".join(s.url + path for s in servers), tries.last,
            tries.rounds + 1, wait)
        time.sleep(wait)
        tries.rounds += 1
        tries.waited += wait
        with self._lock:
            self.retried += 1
            self.waited_s += wait
        tries.tried.clear()
        tries.retry_after = None

    def _failed_attempt(self, srv: _Server, servers: list[_Server], path: str, tries: _Tries, why: str,
                        after: float | None) -> None:
        """Record a failed attempt at ``srv`` (error ``why``, ``Retry-After`` seconds ``after`` or None): in
        ``tries``, in the server's failure count, and with several servers leave it out for ``max_backoff``."""
        tries.tried.add(id(srv))
        tries.last = why if len(servers) == 1 else f"{srv.url}: {why}"
        tries.retry_after = max(tries.retry_after or 0.0, after or 0.0) or None
        with self._lock:
            srv.failures += 1
            if len(self._servers) > 1:
                srv.left_out_until = time.monotonic() + self.max_backoff
        if len(tries.tried) < len(servers):
            logger.warning("remote reward %s%s: %s; sending the request to another server", srv.url, path, why)

    def _answered(self, srv: _Server, r, path: str, only: _Server | None, tries: _Tries, latency: float):
        """The decoded JSON of the reply ``r`` that ``srv`` sent after ``latency`` seconds; an answer ends the
        outage.

        Raises:
            RemoteRewardError: a status other than 200 (:meth:`_raise_for_error`) or a reply that is not JSON.
        """
        with self._lock:
            if path == "/score":
                srv.latencies.append(latency)
            srv.left_out_until = 0.0
        if only is None:
            self._down_since = None  # a server answered
        if tries.attempts > 1:
            logger.info("remote reward %s%s: answered after %d attempts; waited %.1f s", srv.url, path,
                        tries.attempts, tries.waited)
        url = srv.url + path
        if r.status_code != 200:
            self._raise_for_error(r, url)
        try:
            return r.json()
        except ValueError:
            raise RemoteRewardError(
                f"remote reward at {url} sent a malformed reply (not JSON): {r.text[:200]!r}"
            ) from None

    def server_metrics(self) -> dict[str, float]:
        """Per server ``i`` (its position in ``url``), since the last call: ``server/<i>/latency_s`` (mean seconds
        of an answered ``/score`` request, NaN if none), ``server/<i>/requests`` (answered ``/score`` requests) and
        ``server/<i>/failures``
        (failed attempts, each sent to another server or retried). Resets the counts."""
        out = {}
        with self._lock:
            for i, srv in enumerate(self._servers):
                n = len(srv.latencies)
                out[f"server/{i}/latency_s"] = sum(srv.latencies) / n if n else math.nan
                out[f"server/{i}/requests"] = float(n)
                out[f"server/{i}/failures"] = float(srv.failures)
                srv.latencies, srv.failures = [], 0
        return out

    @staticmethod
    def _raise_for_error(r, url: str):
        try:
            payload = r.json()
            msg, kind = str(payload.get("error", payload)), payload.get("error_type")
        except (ValueError, AttributeError):
            msg, kind = r.text[:200], None
        if r.status_code == 400 and kind == "ValueError":
            raise ValueError(f"remote reward at {url}: {msg}")
        hint = " (lower batch_size, or raise the server's --max-request-mb)" if r.status_code == 413 else ""
        raise RemoteRewardError(f"remote reward at {url} replied HTTP {r.status_code}: {msg}{hint}")

    # ------------------------------------------------------------------ scoring
    def _chunks(self, encoded: list[str], prompts: list[str], metadata: list[dict]) -> list[tuple[int, int, bytes]]:
        """(first index, image count, JSON body) per request: <= batch_size images, <= max_request_bytes."""
        limit = self.max_request_bytes
        items = []
        for i, (img, p, m) in enumerate(zip(encoded, prompts, metadata, strict=True)):
            try:
                items.append((img, json.dumps(p), json.dumps(m, allow_nan=False)))
            except (TypeError, ValueError) as err:
                raise ValueError(f"metadata[{i}] cannot be sent as JSON: {err}") from None
        chunks: list[tuple[int, int, bytes]] = []
        start = 0
        while start < len(items):
            end = min(start + self.batch_size, len(items))
            while True:
                body = self._body(items[start:end])
                if limit is None or len(body) <= limit:
                    break
                if end - start == 1:
                    raise RemoteRewardError(
                        f"one image makes a request of {len(body)} bytes, over the server's limit of {limit} "
                        f"bytes at {self.url}; raise the server's --max-request-mb"
                    )
                end = start + (end - start) // 2
            chunks.append((start, end - start, body))
            start = end
        return chunks

    @staticmethod
    def _body(items) -> bytes:
        imgs = ",".join(f'"{i}"' for i, _, _ in items)
        prompts = ",".join(p for _, p, _ in items)
        meta = ",".join(m for _, _, m in items)
        return f'{{"images":[{imgs}],"prompts":[{prompts}],"metadata":[{meta}]}}'.encode()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores (B,) float32 CPU of ``images`` (B, 3, H, W) float in [0, 1], computed by the server.

        Raises:
            ValueError: bad input, found here (shapes, lengths, metadata that is not JSON) or by the server's
                reward (e.g. a missing metadata field; the server's message is kept).
            RemoteRewardError: unreachable after the retries, a malformed reply, or the server's reward failed.
        """
        check_reward_inputs(images, prompts, metadata, self.name)
        if self.server_info is None:
            self.setup()
        encoded = images_to_png_b64(images, self.compress_level)
        out = torch.empty(images.shape[0], dtype=torch.float32)
        chunks = self._chunks(encoded, list(prompts), list(metadata))
        if len(self._servers) == 1 or len(chunks) == 1:
            for start, n, body in chunks:
                out[start : start + n] = self._parse_scores(self._request("POST", "/score", body), n)
            return out
        if self._pool is None:  # the requests of a batch in flight together, one per server at a time
            self._pool = concurrent.futures.ThreadPoolExecutor(len(self._servers), thread_name_prefix="remote")
        futures = [(start, n, self._pool.submit(self._request, "POST", "/score", body)) for start, n, body in chunks]
        try:
            for start, n, fut in futures:
                out[start : start + n] = self._parse_scores(fut.result(), n)
        finally:
            for _, _, fut in futures:
                fut.cancel()
            with contextlib.suppress(Exception):
                concurrent.futures.wait([f for _, _, f in futures])
        return out

    def _parse_scores(self, reply, n: int) -> torch.Tensor:
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"{str(reply)[:200]!r}"
            raise RemoteRewardError(f"remote reward at {', '.join(self.urls)} sent a malformed reply: expected {n} "
                                    f"scores, got {got}")
        vals = []
        for s in scores:
            if s is None:
                vals.append(math.nan)
            elif isinstance(s, int | float) and not isinstance(s, bool):
                vals.append(float(s))
            else:
                raise RemoteRewardError(
                    f"remote reward at {', '.join(self.urls)} sent a malformed reply: score {s!r} is not a number "
                    "or null"
                )
        return torch.tensor(vals, dtype=torch.float32)

    def __getstate__(self):  # the HTTP pools, lock, threads and OS jitter source are not picklable; a copy
        # reconnects lazily
        state = dict(self.__dict__)
        state["_servers"] = [_Server(srv.url, self.timeout) for srv in self._servers]
        state["_lock"], state["_pool"], state["_jitter"] = None, None, None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._jitter = random.SystemRandom()


def server_metrics(rewards) -> dict[str, float]:
    """``reward/<name>/server/<i>/…`` of every remote reward of a composed reward (``rewards.rewards``: name →
    reward): :meth:`RemoteReward.server_metrics`, for rewards served by more than one server."""
    out = {}
    for name, reward in getattr(rewards, "rewards", {}).items():
        if isinstance(reward, RemoteReward) and len(reward.urls) > 1:
            out.update({f"reward/{name}/{k}": v for k, v in reward.server_metrics().items()})
    return out
