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

The client needs ``httpx`` (``pip install "flowgrpo[server]"``).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import math
import random
import struct
import time
import warnings

import numpy as np
import torch

from flowgrpo.images import to_uint8
from flowgrpo.rewards.base import check_reward_inputs

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


def images_to_png_b64(images: torch.Tensor, compress_level: int = 1) -> list[str]:
    """Base64 strings of the 8-bit RGB PNG encodings of ``images`` (B, 3, H, W) float in [0, 1].

    Pixels are ``round(255·clamp(x, 0, 1))``; PNG is lossless, so :func:`png_b64_to_images` returns exactly
    these 8-bit values (over 255). ``compress_level`` (0–9) trades size for speed; it never changes pixels.
    """
    from PIL import Image

    out = []
    for a in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(a, mode="RGB").save(buf, format="PNG", compress_level=compress_level)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_header_size(raw: bytes, i: int) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, read without PIL (PNG spec, section 11.2.2: the first chunk)."""
    if raw[:8] != PNG_SIGNATURE or raw[12:16] != b"IHDR" or len(raw) < 26:
        raise ValueError(f"images[{i}] is not a PNG image (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", raw[16:24])
    if raw[24:26] != b"\x08\x02":  # bit depth 8, colour type 2 (truecolour): 8-bit RGB
        depth, colour = raw[24], raw[25]
        kind = {0: "greyscale", 2: "RGB", 3: "palette", 4: "greyscale+alpha", 6: "RGBA"}.get(colour, f"type {colour}")
        raise ValueError(f"images[{i}] is a {depth}-bit {kind} PNG (its header); only 8-bit 'RGB' is accepted")
    return width, height


def decode_png_b64(items: list, max_pixels: int = 4096 * 4096) -> np.ndarray:
    """(B, H, W, 3) uint8 pixels of base64 8-bit RGB PNG strings, all of one size.

    The declared size is read from the PNG header and checked against ``max_pixels`` before PIL opens the
    image, so a small PNG that declares a huge image (a decompression bomb) is refused cheaply; any failure to
    open or decode a client's bytes is a ``ValueError`` (the server answers it with 400), never another error.
    :func:`read_png_headers` then :func:`decode_pngs`: the server checks its decoded-pixel budgets in between.

    Raises:
        ValueError: not a list of base64 strings, not a PNG, not 8-bit RGB, more than ``max_pixels`` pixels
            (width·height, the message names the limit), corrupt data, or sizes that differ (the message names
            the index and what is allowed).
    """
    raws, width, height = read_png_headers(items, max_pixels)
    return decode_pngs(raws, width, height)


def read_png_headers(items: list, max_pixels: int = 4096 * 4096) -> tuple[list[bytes], int, int]:
    """(the PNG bytes, width, height) of base64 8-bit RGB PNG strings, all of one size, from their headers alone
    (nothing is decoded: B·width·height is what decoding them would take, 3 bytes a pixel).

    Raises:
        ValueError: as :func:`decode_png_b64`, except for what only decoding finds (mode, corrupt data).
    """
    if not isinstance(items, list) or not items:
        raise ValueError("'images' must be a non-empty list of base64-encoded PNG strings")
    raws = []
    size = None
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"images[{i}] must be a base64 string, got {type(s).__name__}")
        try:
            raw = base64.b64decode(s, validate=True)
        except ValueError as err:
            raise ValueError(f"images[{i}] is not valid base64: {err}") from None
        width, height = _png_header_size(raw, i)
        if width * height > max_pixels:
            raise ValueError(f"images[{i}] declares {width}x{height} = {width * height} pixels, over the limit of "
                             f"{max_pixels} pixels (width·height; the server's --max-image-pixels)")
        if size is None:
            size = (width, height)
        elif (width, height) != size:
            raise ValueError(f"images[{i}] is {width}x{height} but images[0] is {size[0]}x{size[1]}")
        raws.append(raw)
    return raws, size[0], size[1]


def decode_pngs(raws: list[bytes], width: int, height: int) -> np.ndarray:
    """(B, height, width, 3) uint8 of PNGs whose headers :func:`read_png_headers` checked, decoded one at a time
    into one array (the decoded pixels are held once). Raises ``ValueError`` for a PNG that is not 8-bit RGB or
    is corrupt."""
    out = np.empty((len(raws), height, width, 3), dtype=np.uint8)
    for i, raw in enumerate(raws):
        out[i] = _decode_png(raw, i)
    return out


def _decode_png(raw: bytes, i: int) -> np.ndarray:
    """(H, W, 3) uint8 of one PNG whose header has been checked; every decoding failure is a ValueError."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # the size is checked against our own limit already
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw), formats=["PNG"])
            if img.mode != "RGB":
                raise ValueError(f"images[{i}] has PNG mode {img.mode!r}; only 8-bit 'RGB' is accepted")
            return np.asarray(img, dtype=np.uint8)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever PIL raises on a client's bytes is bad input, not a crash
        raise ValueError(f"images[{i}] is a truncated or corrupt PNG: {type(err).__name__}: {err}") from None


def pixels_to_images(pixels: np.ndarray) -> torch.Tensor:
    """(B, 3, H, W) float32 in [0, 1] (value/255) from (B, H, W, 3) uint8 pixels."""
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2).float().div_(255.0)  # one copy


def png_b64_to_images(items: list, max_pixels: int = 4096 * 4096) -> torch.Tensor:
    """(B, 3, H, W) float32 in [0, 1] from base64 8-bit RGB PNG strings, all of one size.

    Raises:
        ValueError: as :func:`decode_png_b64`.
    """
    return pixels_to_images(decode_png_b64(items, max_pixels))


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


class RemoteReward:
    """A reward served by ``flowgrpo-reward-server`` at ``url`` (see the module docstring for the protocol).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8765``.
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

    def __init__(self, url: str, timeout: float = 120.0, retries: int | None = None, backoff: float = 0.5,
                 batch_size: int = 16, name: str = "remote", compress_level: int = 1,
                 max_backoff: float = 30.0, deadline: float = 900.0) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
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
        self.url = url.rstrip("/")
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
        self._client = None
        self._down_since: float | None = None  # monotonic start of the request that found the server down
        # Jitter must differ between the processes of one run (seeded alike, they would retry in lockstep), so it
        # comes from the OS, not from the run's seed; it never affects a score.
        self._jitter = random.SystemRandom()

    # ------------------------------------------------------------------ connection
    def _http(self):
        if self._client is None:
            try:
                import httpx
            except ImportError as err:
                raise ImportError(f"the remote reward needs httpx: {_INSTALL}") from err
            self._client = httpx.Client(timeout=self.timeout)
        return self._client

    def setup(self, device: torch.device | str | None = None) -> None:
        """Check the server's ``/health`` (with the same retries) and read its request size limit.

        ``device`` is unused: the server chose its own device. Records the reply in :attr:`server_info`.

        Raises:
            RemoteRewardError: the server did not answer ``/health`` after the retries, or answered malformed data.
        """
        info = self._request("GET", "/health", None)
        if not isinstance(info, dict) or info.get("status") != "ok":
            raise RemoteRewardError(f"remote reward at {self.url}: /health replied {str(info)[:200]!r}")
        self.server_info = info
        limit = info.get("max_request_bytes")
        self.max_request_bytes = int(limit) if isinstance(limit, int) and limit > 0 else None
        logger.info("remote reward %s: serving %r from %s", self.url, info.get("reward"), info.get("origin"))

    def close(self) -> None:
        """Close the HTTP connection pool (reopened on the next call)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def retry_wait(self, k: int, retry_after: float | None) -> float:
        """Seconds to wait before retry ``k`` (0-based): see :func:`retry_wait`."""
        return retry_wait(k, retry_after, self.backoff, self.max_backoff, self._jitter)

    def _request(self, method: str, path: str, body: bytes | None):
        """One logical request with retries until :attr:`deadline`; returns the decoded JSON reply of a 200.

        The deadline is one for an outage, not one per request: once a request has failed for good, the requests
        after it (the other requests of a batch, the batches queued behind it) count theirs from that request's
        start, so past it each ends after one failed attempt; any answer from the server ends the outage."""
        url = self.url + path
        headers = {"Content-Type": "application/json"} if body is not None else None
        stats = RetryStats()
        start = time.monotonic()
        try:
            r = send_with_retries(self._http(), method, url, content=body, headers=headers, retries=self.retries,
                                  backoff=self.backoff, max_backoff=self.max_backoff, deadline=self.deadline,
                                  rng=self._jitter, stats=stats, started=self._down_since)
        except RemoteRewardError:
            if self._down_since is None:
                self._down_since = start
            raise
        finally:
            self.waited_s += stats.waited_s
            self.retried += stats.retries
        self._down_since = None  # the server answered
        if r.status_code != 200:
            self._raise_for_error(r, url)
        try:
            return r.json()
        except ValueError:
            raise RemoteRewardError(
                f"remote reward at {url} sent a malformed reply (not JSON): {r.text[:200]!r}"
            ) from None

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
        for start, n, body in self._chunks(encoded, list(prompts), list(metadata)):
            reply = self._request("POST", "/score", body)
            out[start : start + n] = self._parse_scores(reply, n)
        return out

    def _parse_scores(self, reply, n: int) -> torch.Tensor:
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"{str(reply)[:200]!r}"
            raise RemoteRewardError(f"remote reward at {self.url} sent a malformed reply: expected {n} scores, "
                                    f"got {got}")
        vals = []
        for s in scores:
            if s is None:
                vals.append(math.nan)
            elif isinstance(s, int | float) and not isinstance(s, bool):
                vals.append(float(s))
            else:
                raise RemoteRewardError(
                    f"remote reward at {self.url} sent a malformed reply: score {s!r} is not a number or null"
                )
        return torch.tensor(vals, dtype=torch.float32)

    def __getstate__(self):  # the HTTP pool is not picklable; a copy reconnects lazily
        state = dict(self.__dict__)
        state["_client"] = None
        return state
