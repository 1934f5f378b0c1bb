"""``remote``: a reward computed by a reward server over HTTP (``flowgrpo-reward-server``, :mod:`.server`).

Heavy rewards (a detector, a VLM judge) can live in another process or on another machine; the trainer's config
names them as::

    rewards:
      - name: remote
        weight: 1.0
        kwargs: {url: "http://127.0.0.1:8765", timeout: 60, retries: 3, backoff: 0.5, batch_size: 16}

Wire format (version 1; JSON both ways, never pickle):

* ``POST /score`` with ``Content-Type: application/json`` and the body
  ``{"images": [<base64 PNG>, …], "prompts": [str, …], "metadata": [{…}, …]}``: B 8-bit RGB PNG images of one
  size, each ``round(255·x)`` of the (3, H, W) float image (the same quantisation as saving the image), B prompts
  and B JSON objects. Reply ``200 {"scores": [float | null, …], "reward": name}``, ``null`` meaning NaN ("not
  applicable"). Errors reply ``{"error": message, "error_type": name}`` with 400 (bad input; ``error_type``
  ``ValueError`` is re-raised here as ``ValueError``), 413 (request too large), 415 (not JSON) or 500 (the reward
  failed).
* ``GET /health``: ``{"status": "ok", "reward": name, "origin": {…}, "max_request_bytes": n, …}``.

A batch is sent in requests of at most ``batch_size`` images, and smaller when the server's request size limit
(read from ``/health`` at setup) needs it. Timeouts, connection errors and replies 429/502/503/504 are retried
``retries`` times with exponential backoff (``min(backoff·2^k, max_backoff)`` seconds before retry k+1); then
:class:`RemoteRewardError` names the URL, the attempts and the last error. A malformed reply or another error
status is not retried.

The client needs ``httpx`` (``pip install "flowgrpo[server]"``).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import time

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


def send_with_retries(http, method: str, url: str, *, content: bytes | None = None, headers: dict | None = None,
                      retries: int, backoff: float, max_backoff: float, retry_status=RETRY_STATUS,
                      what: str = "remote reward", error_cls: type[Exception] = RemoteRewardError):
    """Send one HTTP request, retrying timeouts, connection errors and ``retry_status`` replies ``retries`` times
    with exponential backoff (``min(backoff·2^k, max_backoff)`` seconds before retry k+1; the loop is bounded).

    Args:
        http: an ``httpx.Client`` (its timeout applies to each attempt).

    Returns:
        the first ``httpx.Response`` whose status is not in ``retry_status`` (the caller checks it).

    Raises:
        error_cls: every attempt failed; the message names ``what``, the URL, the attempts and the last error.
    """
    import httpx

    attempts = retries + 1
    last = ""
    for k in range(attempts):
        if k:
            time.sleep(min(backoff * 2 ** (k - 1), max_backoff))
        try:
            r = http.request(method, url, content=content, headers=headers)
        except httpx.TimeoutException as err:
            last = f"timed out after {http.timeout.read:g} s ({type(err).__name__})"
            continue
        except httpx.TransportError as err:
            last = f"{type(err).__name__}: {err}"
            continue
        if r.status_code in retry_status:
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            continue
        return r
    raise error_cls(f"{what} at {url} failed after {attempts} attempts; last error: {last}")


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


def png_b64_to_images(items: list, max_pixels: int = 4096 * 4096) -> torch.Tensor:
    """(B, 3, H, W) float32 in [0, 1] from base64 8-bit RGB PNG strings, all of one size.

    The image header is checked before any pixel is decoded, so a small PNG that would expand to a huge image
    (a decompression bomb) is refused cheaply.

    Raises:
        ValueError: not a list of base64 strings, not a PNG, not 8-bit RGB, more than ``max_pixels`` pixels,
            or sizes that differ (the message names the index and what is allowed).
    """
    from PIL import Image, UnidentifiedImageError

    if not isinstance(items, list) or not items:
        raise ValueError("'images' must be a non-empty list of base64-encoded PNG strings")
    arrays = []
    size = None
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"images[{i}] must be a base64 string, got {type(s).__name__}")
        try:
            raw = base64.b64decode(s, validate=True)
        except ValueError as err:
            raise ValueError(f"images[{i}] is not valid base64: {err}") from None
        try:
            img = Image.open(io.BytesIO(raw), formats=["PNG"])
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"images[{i}] is not a PNG image: {err}") from None
        if img.mode != "RGB":
            raise ValueError(f"images[{i}] has PNG mode {img.mode!r}; only 8-bit 'RGB' is accepted")
        if img.width * img.height > max_pixels:
            raise ValueError(f"images[{i}] is {img.width}x{img.height}, over the limit of {max_pixels} pixels")
        if size is None:
            size = img.size
        elif img.size != size:
            raise ValueError(f"images[{i}] is {img.size[0]}x{img.size[1]} but images[0] is {size[0]}x{size[1]}")
        try:
            arrays.append(np.asarray(img, dtype=np.uint8))
        except (OSError, SyntaxError) as err:
            raise ValueError(f"images[{i}] is a truncated or corrupt PNG: {err}") from None
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # (B, 3, H, W) uint8
    return batch.float() / 255.0


class RemoteReward:
    """A reward served by ``flowgrpo-reward-server`` at ``url`` (see the module docstring for the protocol).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8765``.
        timeout: seconds allowed for each phase of a request (connect, send, wait for the reply). > 0.
        retries: how many times a timed-out, refused or 429/502/503/504 request is retried (>= 0).
        backoff: seconds before the first retry; doubled before each next one (>= 0).
        batch_size: at most this many images per request (>= 1).
        name: the reward's name in metrics (default ``"remote"``; the config's key is what the trainer uses).
        compress_level: PNG compression 0–9 (pixels are the same at every level; 1 is fast).
        max_backoff: the longest wait between two attempts, in seconds (default 30).

    Raises:
        ValueError: a kwarg out of range (at construction; nothing is contacted before :meth:`setup`).
    """

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 batch_size: int = 16, name: str = "remote", compress_level: int = 1,
                 max_backoff: float = 30.0) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"remote reward timeout must be > 0 seconds, got {timeout!r}")
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"remote reward retries must be an integer >= 0, got {retries!r}")
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
        self.retries = retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.batch_size = batch_size
        self.name = name
        self.compress_level = compress_level
        self.server_info: dict | None = None  # the server's /health reply, after setup
        self.max_request_bytes: int | None = None
        self._client = None

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

    def _request(self, method: str, path: str, body: bytes | None):
        """One logical request with retries; returns the decoded JSON reply of a 200."""
        url = self.url + path
        headers = {"Content-Type": "application/json"} if body is not None else None
        r = send_with_retries(self._http(), method, url, content=body, headers=headers, retries=self.retries,
                              backoff=self.backoff, max_backoff=self.max_backoff)
        if r.status_code != 200:
            self._raise_for_error(r, url)
        try:
            return r.json()
        except ValueError:
            raise RemoteRewardError(f"remote reward at {url} sent a malformed reply (not JSON): {r.text[:200]!r}") \
                from None

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
