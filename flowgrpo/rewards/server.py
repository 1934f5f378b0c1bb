"""``flowgrpo-reward-server``: serve any registered reward over HTTP for :class:`~flowgrpo.rewards.remote.RemoteReward`.

::

    pip install "flowgrpo[server]"
    flowgrpo-reward-server --reward geneval --kwargs '{"detector": "/ckpt/mask2former"}' --port 8765 --device cuda

The wire format is in :mod:`flowgrpo.rewards.remote`: JSON with base64 PNG images, never pickle. The server
binds 127.0.0.1 unless ``--host`` says otherwise; it has no authentication, so bind another address only on a
trusted network. The reward is built from the registry (entry-point name or ``module:attr``) and ``setup`` on
``--device`` once at startup (once in each of ``--workers`` processes), before the first request is accepted.

Checks, in order, each answered with a complete HTTP response: a content type other than ``application/json``
(a pickle, ``application/octet-stream``, a form) gets 415; a declared or streamed body over
``--max-request-mb`` gets 413; a request that finds ``--max-concurrency`` requests in flight and ``--max-queue``
waiting, or that waits ``--max-queue-wait`` seconds, gets 503 with ``Retry-After``; bad JSON, bad fields and any
image that cannot be decoded (not a PNG, corrupt, over ``--max-image-pixels`` by its header) get 400, and more
images than ``--max-request-images`` 413, before any image is read. The
decoded pixels are bounded by construction, checked from the PNG headers before anything is decoded: a request
whose images (count · width · height) exceed ``--max-request-pixels`` gets 413, and one that would take the
requests in flight past ``--max-pixels-in-flight`` gets 503 with ``Retry-After``; each message names the budget
and its flag. Before a
refusal the server reads the rest of the body and discards it, so the client always reads the answer (a client
that keeps sending past 4× the size limit is answered and disconnected). Admission, cross-request batching and
the scoring workers are in :mod:`flowgrpo.rewards.serving`; ``GET /metrics`` exports the load in the Prometheus
text format.

Built on FastAPI (Starlette) and uvicorn; docs/reward_server.md says why not a serving framework.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import logging
import re
import socket
import sys
import threading
import time
import traceback
from typing import NoReturn

import torch

from flowgrpo.argtypes import OneLineParser, int_in
from flowgrpo.rewards.registry import RewardLoadError, check_reward_kwargs, load_reward
from flowgrpo.rewards.remote import WIRE_VERSION
from flowgrpo.rewards.serving import (
    Admission,
    Batcher,
    PixelBudget,
    ProcessScorer,
    QueueTimeout,
    RewardFailed,
    ServerMetrics,
    ServingConfig,
    ThreadScorer,
)
from flowgrpo.rewards.wire import decode_pngs, read_png_headers

logger = logging.getLogger(__name__)

_INSTALL = 'pip install "flowgrpo[server]"'
#: a refused request's body is read and discarded up to this many times the size limit, then the connection closes
DRAIN_FACTOR = 4
# Each JSON separator (``,`` ``:`` ``[`` ``{`` outside strings) stands for at most one Python object that parsing
# makes, and its slot: measured with tracemalloc, up to 64 bytes (a list of two-letter strings; a list of ``[]``: 67
# bytes a value, two separators each). A decoded pixel is budgeted 15 bytes (3 uint8 + 12 as float32), so each is
# charged as 5 pixels against the decoded-pixel budgets, before the body is parsed (a 64 MiB body of ``"ab",`` would
# parse into ~830 MB). The first JSON_FREE_VALUES separators of a request are free (at most ~1 MiB of objects
# a request in flight), so an ordinary request's metadata takes nothing from the budgets.
JSON_VALUE_PIXELS = 5
JSON_FREE_VALUES = 2**14
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_values_bound(body: bytes) -> int:
    """An upper bound on the Python objects (JSON values and object keys) parsing ``body`` makes, without parsing
    it: the separators ``,`` ``:`` ``[`` ``{`` outside strings, plus one. Strings are cut out first, so a prompt's
    commas do not count."""
    bare = _JSON_STRING.sub(b'""', body)
    return 1 + sum(bare.count(c) for c in (b",", b":", b"[", b"{"))


def _require_server_deps():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ImportError(f"the reward server needs FastAPI and uvicorn: {_INSTALL}") from err


def parse_score_request(body: bytes, max_image_pixels: int):
    """(pixels (B, H, W, 3) uint8, prompts, metadata) of a ``POST /score`` body.

    Raises:
        ValueError: not JSON (``NaN``, ``Infinity`` and ``-Infinity`` included: Python's ``json`` reads them by
            default, JSON has no such numbers, :func:`_refuse_constant`), a missing or mistyped field, lengths that
            differ, or an image that cannot be decoded (see :func:`~flowgrpo.rewards.wire.decode_png_b64`).
    """
    request = read_score_request(body, max_image_pixels)
    return decode_pngs(request.raws, request.width, request.height), request.prompts, request.metadata


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """A ``POST /score`` body read up to its PNG headers, nothing decoded: ``raws`` the B PNG files (bytes),
    each ``width`` × ``height``; ``prompts`` and ``metadata`` B each. ``pixels``: what decoding takes, B·W·H."""

    raws: list
    width: int
    height: int
    prompts: list
    metadata: list

    @property
    def pixels(self) -> int:
        return len(self.raws) * self.width * self.height


class _NotJsonNumber(ValueError):
    """A ``NaN`` / ``Infinity`` / ``-Infinity`` in a request body (:func:`_refuse_constant`)."""


def _refuse_constant(name: str):
    """``json.loads``' ``parse_constant``: Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity`` by
    default, which JSON (RFC 8259) does not allow and a reward's metadata would pass on as a float. Raises
    :class:`_NotJsonNumber` (a ``ValueError``: the server answers 400) naming it."""
    raise _NotJsonNumber(f"the request body holds {name}, which is not a JSON number (RFC 8259 has no NaN or "
                         "Infinity); send finite numbers, or null for a missing value")


def read_score_request(body: bytes, max_image_pixels: int, max_images: int | None = None) -> ScoreRequest:
    """The :class:`ScoreRequest` of a ``POST /score`` body; its images' sizes come from their PNG headers
    (:func:`~flowgrpo.rewards.wire.read_png_headers`), so the server can check its decoded-pixel budgets before
    it decodes anything.

    Raises:
        TooManyImages: more than ``max_images`` images (None: no limit), before any image is read.
        ValueError: not JSON (``NaN``, ``Infinity`` and ``-Infinity`` included: Python's ``json`` reads them by
            default, JSON has no such numbers, :func:`_refuse_constant`), a missing or mistyped field, lengths that
            differ, or an image header that is not a PNG's, over ``max_image_pixels``, or of another size than the
            first.
    """
    try:
        payload = json.loads(body, parse_constant=_refuse_constant)
    except _NotJsonNumber as err:
        raise ValueError(str(err)) from None
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"the request body is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(payload, dict):
        raise ValueError("the request body must be a JSON object with 'images', 'prompts' and 'metadata'")
    missing = [k for k in ("images", "prompts", "metadata") if k not in payload]
    if missing:
        raise ValueError(f"the request is missing {missing}; it needs 'images', 'prompts' and 'metadata'")
    prompts, metadata = payload["prompts"], payload["metadata"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("'metadata' must be a list of JSON objects")
    images = payload["images"]
    if max_images is not None and isinstance(images, list) and len(images) > max_images:
        raise TooManyImages(f"the request holds {len(images)} images, over the limit of {max_images} per request "
                            "(the server's --max-request-images); send them in several requests (RemoteReward's "
                            "batch_size)")
    raws, width, height = read_png_headers(images, max_image_pixels)
    b = len(raws)
    if len(prompts) != b or len(metadata) != b:
        raise ValueError(f"the request has {b} images but {len(prompts)} prompts and {len(metadata)} metadata")
    return ScoreRequest(raws, width, height, prompts, metadata)


class _Refusal(Exception):
    """An answer other than 200: HTTP status, message, error type, metrics reason, extra headers."""

    def __init__(self, status: int, message: str, kind: str, reason: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.reason, self.headers = status, message, kind, reason, headers


class TooManyImages(ValueError):
    """A request with more images than the server takes in one request (``--max-request-images``)."""


def _freed(err: BaseException) -> str:
    """``err``'s message, after the locals of the finished frames its traceback holds are cleared: the exception
    of a refused body (bad JSON, raised in anyio's worker thread) sits in a reference cycle with those frames, which
    hold the body and its decoded text, so each refused body stayed in memory until the garbage collector ran (RSS
    725 MB -> 2.12 GB over 17 refused 50 MB bodies, issue 54)."""
    message = str(err)
    traceback.clear_frames(err.__traceback__)  # the frames still running (the handler's own) are left alone
    err.__traceback__ = None
    return message


class _ClientGone(Exception):
    """The client disconnected before its body arrived."""


async def read_body(receive, limit: int, drain_limit: int) -> bytes | None:
    """The request body from ASGI ``receive``; None if it is over ``limit`` bytes (then read on and discarded up to
    ``drain_limit`` bytes, so the answer can be read by the client). Raises _ClientGone on a disconnect."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        data = message.get("body", b"")
        size += len(data)
        if size <= limit:
            chunks.append(data)
        if not message.get("more_body", False) or size > drain_limit:
            return b"".join(chunks) if size <= limit else None


class _ScoreEndpoint:
    """``POST /score``: checks, admission, decoding, batching; every answer counted in the metrics."""

    def __init__(self, *, reward_name, admission, batcher, metrics, max_request_bytes, max_image_pixels) -> None:
        self.reward_name, self.admission, self.batcher, self.metrics = reward_name, admission, batcher, metrics
        self.limit, self.max_image_pixels = max_request_bytes, max_image_pixels
        self.drain_limit = DRAIN_FACTOR * max_request_bytes
        self.pixels = PixelBudget(admission.config.max_pixels_in_flight)

    async def __call__(self, request):
        from fastapi.responses import JSONResponse

        t0 = time.monotonic()
        try:
            scores = await self._handle(request)
        except _Refusal as ref:
            self.metrics.answered(ref.status, time.monotonic() - t0, ref.reason)
            return JSONResponse({"error": ref.message, "error_type": ref.kind}, status_code=ref.status,
                                headers=ref.headers)
        self.metrics.answered(200, time.monotonic() - t0)
        return JSONResponse({"scores": scores, "reward": self.reward_name})

    async def _refuse_after_drain(self, request, refusal: _Refusal) -> None:
        with contextlib.suppress(_ClientGone):
            await read_body(request.receive, 0, self.drain_limit)
        raise refusal

    def _busy(self, message: str, reason: str) -> _Refusal:
        retry_after = self.admission.retry_after()
        return _Refusal(503, f"{message}; retry after {retry_after} s", "ServerBusy", reason,
                        {"Retry-After": str(retry_after)})

    async def _check_headers(self, request) -> None:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            await self._refuse_after_drain(request, _Refusal(
                415, f"Content-Type must be application/json, got {ctype or 'none'!r}; the wire format is JSON "
                     "with base64 PNG images (pickle is never accepted)", "UnsupportedMediaType", "unsupported_media"))
        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise _Refusal(400, f"invalid Content-Length {declared!r}", "ValueError", "bad_request")
        if declared is not None and int(declared) > self.limit:
            refusal = _Refusal(413, f"request of {int(declared)} bytes is over the limit of {self.limit} bytes",
                               "RequestTooLarge", "too_large")
            if int(declared) > self.drain_limit:
                raise refusal  # answered without reading: uvicorn closes the connection after the answer
            await self._refuse_after_drain(request, refusal)

    def _take_pixels(self, what: str, pixels: int, held: int = 0) -> None:
        """Take ``pixels`` more from the in-flight budget for a request that holds ``held`` already, or refuse it:
        413 when the request's total is over the per-request budget (it never fits), 503 with ``Retry-After`` when
        the requests in flight hold too many now."""
        cfg = self.admission.config
        if held + pixels > cfg.max_request_pixels:
            raise _Refusal(413, f"{what}, over the per-request budget of {cfg.max_request_pixels} decoded pixels "
                                "(the server's --max-request-pixels); send fewer or smaller images per request",
                           "RequestTooLarge", "too_many_pixels")
        if not self.pixels.try_take(pixels):
            raise self._busy(f"the server is busy: {what}, and the requests in flight hold {self.pixels.used}; "
                             f"together over the budget of {self.pixels.limit} decoded pixels in flight (the "
                             "server's --max-pixels-in-flight)", "pixels_in_flight")

    def _check_json(self, values: int) -> int:
        """Take the parsed JSON's charge (``values`` past JSON_FREE_VALUES, · JSON_VALUE_PIXELS) before the body is
        parsed; returns it."""
        charge = max(0, values - JSON_FREE_VALUES) * JSON_VALUE_PIXELS
        if not charge:
            return 0
        self._take_pixels(f"the request's JSON holds up to {values} values, charged as {charge} decoded pixels "
                          f"({JSON_VALUE_PIXELS} each past the first {JSON_FREE_VALUES})", charge)
        return charge

    def _check_pixels(self, req: ScoreRequest, held: int = 0) -> None:
        """Take the request's decoded pixels from the in-flight budget, or refuse it (see :meth:`_take_pixels`)."""
        what = f"{len(req.raws)} images of {req.width}x{req.height} decode to {req.pixels} pixels"
        if held:
            what += f" (its JSON is charged {held} more)"
        self._take_pixels(what, req.pixels, held)

    async def _handle(self, request) -> list:
        import anyio

        await self._check_headers(request)
        if not self.admission.try_enter():
            cfg = self.admission.config
            await self._refuse_after_drain(request, self._busy(
                f"the server is busy: {cfg.max_concurrency} requests in flight and {cfg.max_queue} waiting",
                "queue_full"))
        try:
            try:
                body = await read_body(request.receive, self.limit, self.drain_limit)
            except _ClientGone:
                raise _Refusal(400, "the client disconnected", "ClientDisconnected", "disconnected") from None
            if body is None:
                raise _Refusal(413, f"request body is over the limit of {self.limit} bytes", "RequestTooLarge",
                               "too_large")
            async with self.admission.slot() as waited:
                self.metrics.queue_wait.observe(waited)
                held = self._check_json(await anyio.to_thread.run_sync(json_values_bound, body))
                try:
                    req = await anyio.to_thread.run_sync(read_score_request, body, self.max_image_pixels,
                                                         self.admission.config.max_request_images)
                    del body
                    self._check_pixels(req, held)
                    held += req.pixels
                    pixels = await anyio.to_thread.run_sync(decode_pngs, req.raws, req.width, req.height)
                    scores = await self.batcher.score(pixels, req.prompts, req.metadata)
                    del pixels
                finally:
                    self.pixels.give_back(held)
                self.metrics.images.inc(len(scores))
                return scores
        except QueueTimeout as err:
            raise self._busy(f"the server is busy: {err}", "queue_timeout") from None
        except TooManyImages as err:
            raise _Refusal(413, _freed(err), "RequestTooLarge", "too_many_images") from None
        except ValueError as err:
            raise _Refusal(400, _freed(err), "ValueError", "bad_request") from None
        except RewardFailed as err:
            logger.error("reward %r failed: %s: %s", self.reward_name, err.kind, err)
            raise _Refusal(500, f"reward {self.reward_name!r} failed: {err.kind}: {err}", err.kind,
                           "reward_failed") from None
        finally:
            self.admission.leave()


def create_app(reward, *, reward_name: str, origin: dict | None = None, device: str | None = "cpu",
               max_request_bytes: int = 64 * 2**20, batch_size: int = 64, max_image_pixels: int = 4096 * 4096,
               serving: ServingConfig | None = None, worker_spec: tuple[str, dict] | None = None):
    """The FastAPI app serving ``reward`` (not yet set up: ``setup(device)`` runs at startup unless device is None).

    Args:
        reward: an object of the Reward protocol (unused when ``serving.workers > 1``: the workers build theirs).
        reward_name: reported by ``/health`` and in every reply.
        origin: provenance reported by ``/health`` (a :class:`~flowgrpo.rewards.registry.RewardOrigin` as dict).
        device: the device for ``reward.setup``; None: the caller has set it up already.
        max_request_bytes: larger bodies get 413 (checked on Content-Length, and while streaming).
        batch_size: the reward is called on at most this many images at a time.
        max_image_pixels: larger images (width·height, read from the PNG header) get 400 before decoding.
        serving: in-flight limit, queue, cross-request batching and workers (default :class:`ServingConfig`).
        worker_spec: ``(registry name or module:attr, kwargs)`` each worker process builds; needed when
            ``serving.workers > 1``.

    Raises:
        ImportError: FastAPI or prometheus_client is not installed (the message gives the pip command).
        ValueError: a limit below 1, or workers > 1 without a worker_spec.
    """
    _require_server_deps()
    from fastapi import FastAPI

    for k, v in (("max_request_bytes", max_request_bytes), ("batch_size", batch_size),
                 ("max_image_pixels", max_image_pixels)):
        if int(v) < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")
    serving = serving or ServingConfig()
    if serving.workers > 1 and worker_spec is None:
        raise ValueError(f"workers={serving.workers} needs worker_spec=(reward name or module:attr, kwargs)")
    admission = Admission(serving)
    metrics = ServerMetrics(admission.queue_depth, lambda: admission.in_flight)
    endpoint = _ScoreEndpoint(reward_name=reward_name, admission=admission, batcher=None, metrics=metrics,
                              max_request_bytes=int(max_request_bytes), max_image_pixels=int(max_image_pixels))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scorer = await _start_scorer(reward, reward_name, device, serving, worker_spec)
        endpoint.batcher = Batcher(scorer, serving, int(batch_size), on_batch=metrics.batch_images.observe)
        endpoint.batcher.start()
        try:
            yield
        finally:
            await endpoint.batcher.stop()
            scorer.close()

    app = FastAPI(title="flowgrpo reward server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    info = {"status": "ok", "reward": reward_name, "origin": origin, "wire_version": WIRE_VERSION,
            "max_request_bytes": int(max_request_bytes), "batch_size": int(batch_size),
            "max_image_pixels": int(max_image_pixels), "flowgrpo_version": _flowgrpo_version(),
            **dataclasses.asdict(serving)}
    _add_routes(app, info, metrics, endpoint)
    app.state.admission, app.state.metrics = admission, metrics
    return app


def _add_routes(app, info: dict, metrics: ServerMetrics, endpoint: _ScoreEndpoint) -> None:
    """``GET /health`` (``info``), ``GET /metrics`` (Prometheus text) and ``POST /score`` (``endpoint``)."""
    from fastapi.responses import Response

    @app.get("/health")
    async def health():
        return info

    @app.get("/metrics")
    async def prometheus_metrics():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    async def score(request):  # a plain Starlette route: the body is read by hand
        return await endpoint(request)

    app.add_route("/score", score, methods=["POST"])


async def _start_scorer(reward, reward_name: str, device, serving: ServingConfig, worker_spec):
    """A started ThreadScorer (the reward set up here) or ProcessScorer (set up in each worker)."""
    import anyio

    t0 = time.perf_counter()
    if serving.workers > 1:
        scorer = ProcessScorer(worker_spec[0], worker_spec[1], str(device or "cpu"), serving.workers)
        await scorer.start()
    else:
        if device is not None:
            await anyio.to_thread.run_sync(reward.setup, torch.device(device))
        scorer = ThreadScorer(reward)
    logger.info("reward %r set up on %s in %.1f s (%d worker%s)", reward_name, device, time.perf_counter() - t0,
                serving.workers, "s" if serving.workers > 1 else "")
    return scorer


def _flowgrpo_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("flowgrpo")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (read it with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # many training processes may connect at once
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app, *, log_level: str, access_log: bool, graceful_s: float):
    """uvicorn settings shared by the command and :class:`ServerThread`.

    No ``limit_concurrency``: uvicorn's own 503 answers before the body is read and then closes the connection,
    which the client sees as a reset; the app's admission queue answers instead. Keep-alive (75 s) outlives the
    HTTP client's pooled connections (httpx: 5 s), so a client never reuses a connection the server is closing.
    """
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, lifespan="on", limit_concurrency=None, backlog=2048,
                          timeout_keep_alive=75, timeout_graceful_shutdown=graceful_s, access_log=access_log)


class ServerThread:
    """Run an app under uvicorn on a background thread, e.g. for tests and benchmarks::

        with ServerThread(create_app(reward, reward_name="jpeg")) as srv:
            RemoteReward(srv.url)(images, prompts, metadata)

    Args:
        app: an ASGI app (admission limits are the app's: :func:`create_app`'s ``serving``).
        host: bind address (default loopback). port: 0 picks a free port.
        startup_timeout: seconds to wait for startup (worker processes included).

    Raises:
        RuntimeError: the server did not start (e.g. the reward's setup failed) within ``startup_timeout``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 120.0) -> None:
        _require_server_deps()
        import uvicorn

        self._sock = bind_socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn_config(app, log_level="warning", access_log=False, graceful_s=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="flowgrpo-reward-server")
        self._startup_timeout = startup_timeout

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the reward server on {self.url} did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for the thread (at most ``timeout`` seconds)."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _parse_args(argv):
    p = OneLineParser(
        prog="flowgrpo-reward-server",
        description="Serve a registered flowgrpo reward over HTTP (JSON with base64 PNG images; never pickle).",
    )
    p.add_argument("--reward", required=True, help="entry-point name in 'flowgrpo.rewards', or module:attr")
    p.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int_in(0, 65535, "0: pick a free one"), default=8765,
                    help="TCP port (0: pick a free one; default 8765)")
    p.add_argument("--device", default=None, help="device for the reward's setup (default: cuda if available)")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body in MiB (default 64)")
    p.add_argument("--batch-size", type=int_in(1), default=64, help="images per reward call (default 64)")
    p.add_argument("--max-image-pixels", type=int_in(1), default=4096 * 4096, help="largest image, width·height")
    p.add_argument("--max-request-pixels", type=int_in(1), default=2**26,
                   help="decoded pixels (images·width·height, read from the PNG headers before decoding) one request "
                        "may hold; more: 413 (default 2**26 = 64 images of 1024², ~200 MB as uint8)")
    p.add_argument("--max-request-images", type=int_in(1), default=1024,
                   help="images one request may hold; more: 413, before any image is read (default 1024)")
    p.add_argument("--max-pixels-in-flight", type=int_in(1), default=2**28,
                   help="decoded pixels all requests in flight may hold together; more: 503 with Retry-After "
                        "(default 2**28, ~0.8 GB as uint8 and ~3.2 GB as the rewards' float32)")
    p.add_argument("--max-concurrency", type=int_in(1), default=16,
                   help="requests in flight (decoded, batched or scored) at once (default 16)")
    p.add_argument("--max-queue", type=int_in(0), default=256,
                   help="requests that may wait beyond --max-concurrency; one more gets 503 (default 256)")
    p.add_argument("--max-queue-wait", type=float, default=60.0,
                   help="seconds a request may wait for a slot before 503 (default 60)")
    p.add_argument("--cross-request-batching", action=argparse.BooleanOptionalAction, default=True,
                   help="merge concurrent requests into reward calls of up to --batch-size images (default on)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a free worker waits for more images to merge (default 5)")
    p.add_argument("--workers", type=int_in(1), default=1,
                   help="scoring processes, each with its own reward (for CPU rewards; default 1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every request (default on)")
    return p.parse_args(argv)


def _refuse(line: str) -> NoReturn:
    """End the server's start with one line, ``flowgrpo-reward-server: error: …``, exit status 2 (as every
    flowgrpo command refuses its input)."""
    sys.stderr.write(f"flowgrpo-reward-server: error: {line}\n")
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``flowgrpo-reward-server``; runs until interrupted (Ctrl-C / SIGTERM)."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _require_server_deps()
    import uvicorn

    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as err:
        _refuse(f"--kwargs must be a JSON object: {err}")
    if not isinstance(kwargs, dict):
        _refuse(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    if args.max_request_mb <= 0:
        _refuse(f"--max-request-mb must be > 0, got {args.max_request_mb}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_reward_kwargs(args.reward, kwargs, "--kwargs")  # the check flowgrpo train makes: a typo's nearest
        reward, origin = load_reward(args.reward, **kwargs)
    except (RewardLoadError, ValueError) as err:
        _refuse(str(err))
    try:
        serving = ServingConfig(max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                                max_queue_wait=args.max_queue_wait, cross_request_batching=args.cross_request_batching,
                                batch_wait_s=args.batch_wait_ms / 1000.0, workers=args.workers,
                                max_request_pixels=args.max_request_pixels,
                                max_request_images=args.max_request_images,
                                max_pixels_in_flight=args.max_pixels_in_flight)
        app = create_app(reward, reward_name=args.reward, origin=origin.__dict__, device=device,
                         max_request_bytes=int(args.max_request_mb * 2**20), batch_size=args.batch_size,
                         max_image_pixels=args.max_image_pixels, serving=serving, worker_spec=(args.reward, kwargs))
    except ValueError as err:
        _refuse(str(err))
    with contextlib.suppress(ValueError):
        if not ipaddress.ip_address(args.host).is_loopback:
            logger.warning("binding %s: the reward server has no authentication; anyone who can reach this "
                           "address can use it", args.host)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        _refuse(f"cannot listen on {args.host}:{args.port}: {err}")
    port = sock.getsockname()[1]
    logger.info("flowgrpo-reward-server: serving %r (%s) on http://%s:%d", args.reward, origin.target,
                f"[{args.host}]" if ":" in args.host else args.host, port)
    config = uvicorn_config(app, log_level=args.log_level, access_log=args.access_log, graceful_s=5)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
