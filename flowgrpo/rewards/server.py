"""``flowgrpo-reward-server``: serve any registered reward over HTTP for :class:`~flowgrpo.rewards.remote.RemoteReward`.

::

    pip install "flowgrpo[server]"
    flowgrpo-reward-server --reward geneval --kwargs '{"detector": "/ckpt/mask2former"}' --port 8765 --device cuda

The wire format is in :mod:`flowgrpo.rewards.remote`: JSON with base64 PNG images, never pickle. The server
binds 127.0.0.1 unless ``--host`` says otherwise; it has no authentication, so bind another address only on a
trusted network. The reward is built from the registry (entry-point name or ``module:attr``) and ``setup`` on
``--device`` once at startup, before the first request is accepted.

Requests are checked before their bodies are read: a content type other than ``application/json`` (a pickle,
``application/octet-stream``, a form) gets 415, a declared or streamed body over ``--max-request-mb`` gets 413,
and more than ``--max-concurrency`` requests in flight get 503 (which the client retries). Decoding and scoring
run on a worker thread, one request at a time, in slices of at most ``--batch-size`` images, so ``/health``
answers while a batch is being scored.

Built on FastAPI (Starlette) and uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import math
import socket
import threading
import time

import torch

from flowgrpo.rewards.remote import WIRE_VERSION, png_b64_to_images

logger = logging.getLogger(__name__)

_INSTALL = 'pip install "flowgrpo[server]"'


def _require_server_deps():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ImportError(f"the reward server needs FastAPI and uvicorn: {_INSTALL}") from err


class _Scorer:
    """Decodes a request's payload and scores it, serialised by a lock (rewards need not be thread-safe)."""

    def __init__(self, reward, batch_size: int, max_image_pixels: int) -> None:
        self.reward = reward
        self.batch_size = batch_size
        self.max_image_pixels = max_image_pixels
        self.lock = threading.Lock()

    def __call__(self, payload) -> list[float | None]:
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
        images = png_b64_to_images(payload["images"], self.max_image_pixels)
        b = images.shape[0]
        if len(prompts) != b or len(metadata) != b:
            raise ValueError(f"the request has {b} images but {len(prompts)} prompts and {len(metadata)} metadata")
        out = []
        with self.lock, torch.no_grad():
            for s in range(0, b, self.batch_size):
                e = min(s + self.batch_size, b)
                scores = torch.as_tensor(self.reward(images[s:e], prompts[s:e], metadata[s:e]), dtype=torch.float32)
                if scores.shape != (e - s,):
                    raise RuntimeError(f"the reward returned shape {tuple(scores.shape)}, expected ({e - s},)")
                out.extend(scores.cpu().tolist())
        return [None if math.isnan(v) else v for v in out]


def create_app(reward, *, reward_name: str, origin: dict | None = None, device: str | None = "cpu",
               max_request_bytes: int = 64 * 2**20, batch_size: int = 64, max_image_pixels: int = 4096 * 4096):
    """The FastAPI app serving ``reward`` (not yet set up: ``setup(device)`` runs at startup unless device is None).

    Args:
        reward: an object of the Reward protocol.
        reward_name: reported by ``/health`` and in every reply.
        origin: provenance reported by ``/health`` (a :class:`~flowgrpo.rewards.registry.RewardOrigin` as dict).
        device: the device for ``reward.setup``; None: the caller has set it up already.
        max_request_bytes: larger bodies get 413 (checked on Content-Length, and while streaming).
        batch_size: the reward is called on at most this many images at a time.
        max_image_pixels: larger images (width·height) get 400 before their pixels are decoded.

    Raises:
        ImportError: FastAPI is not installed (the message gives the pip command).
        ValueError: a limit below 1.
    """
    _require_server_deps()
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    for k, v in (("max_request_bytes", max_request_bytes), ("batch_size", batch_size),
                 ("max_image_pixels", max_image_pixels)):
        if int(v) < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")
    scorer = _Scorer(reward, int(batch_size), int(max_image_pixels))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if device is not None:
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(reward.setup, torch.device(device))
            logger.info("reward %r set up on %s in %.1f s", reward_name, device, time.perf_counter() - t0)
        yield

    app = FastAPI(title="flowgrpo reward server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": message, "error_type": kind}, status_code=status)

    try:
        from importlib.metadata import version

        flowgrpo_version = version("flowgrpo")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        flowgrpo_version = None

    @app.get("/health")
    async def health():
        return {"status": "ok", "reward": reward_name, "origin": origin, "wire_version": WIRE_VERSION,
                "max_request_bytes": int(max_request_bytes), "batch_size": int(batch_size),
                "max_image_pixels": int(max_image_pixels), "flowgrpo_version": flowgrpo_version}

    async def score(request: Request) -> JSONResponse:  # a plain Starlette route: the body is read by hand
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return error(415, f"Content-Type must be application/json, got {ctype or 'none'!r}; the wire format "
                              "is JSON with base64 PNG images (pickle is never accepted)", "UnsupportedMediaType")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return error(400, f"invalid Content-Length {declared!r}", "ValueError")
            if int(declared) > max_request_bytes:
                return error(413, f"request of {int(declared)} bytes is over the limit of {max_request_bytes} "
                                  "bytes", "RequestTooLarge")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                return error(413, f"request body is over the limit of {max_request_bytes} bytes", "RequestTooLarge")
            chunks.append(chunk)
        try:
            payload = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            return error(400, f"the request body is not valid JSON: {str(err)[:200]}", "ValueError")
        try:
            scores = await anyio.to_thread.run_sync(scorer, payload)
        except ValueError as err:
            return error(400, str(err), "ValueError")
        except Exception as err:  # the reward failed: report it, keep serving
            logger.exception("reward %r failed", reward_name)
            return error(500, f"reward {reward_name!r} failed: {type(err).__name__}: {err}", type(err).__name__)
        return JSONResponse({"scores": scores, "reward": reward_name})

    app.add_route("/score", score, methods=["POST"])
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (read it with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Run an app under uvicorn on a background thread, e.g. for tests and benchmarks::

        with ServerThread(create_app(reward, reward_name="jpeg")) as srv:
            RemoteReward(srv.url)(images, prompts, metadata)

    Args:
        app: an ASGI app. host: bind address (default loopback). port: 0 picks a free port.
        max_concurrency: requests in flight beyond this get 503. startup_timeout: seconds to wait for startup.

    Raises:
        RuntimeError: the server did not start (e.g. the reward's setup failed) within ``startup_timeout``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, max_concurrency: int = 16,
                 startup_timeout: float = 30.0) -> None:
        _require_server_deps()
        import uvicorn

        self._sock = bind_socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", limit_concurrency=max_concurrency,
                                timeout_graceful_shutdown=2, access_log=False)
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
    p = argparse.ArgumentParser(
        prog="flowgrpo-reward-server",
        description="Serve a registered flowgrpo reward over HTTP (JSON with base64 PNG images; never pickle).",
    )
    p.add_argument("--reward", required=True, help="entry-point name in 'flowgrpo.rewards', or module:attr")
    p.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (0: pick a free one; default 8765)")
    p.add_argument("--device", default=None, help="device for the reward's setup (default: cuda if available)")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body in MiB (default 64)")
    p.add_argument("--batch-size", type=int, default=64, help="images per reward call (default 64)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="largest image, width·height")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight before 503 (default 16)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every request (default on)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``flowgrpo-reward-server``; runs until interrupted (Ctrl-C / SIGTERM)."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _require_server_deps()
    import uvicorn

    from flowgrpo.rewards.registry import RewardLoadError, load_reward

    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as err:
        raise SystemExit(f"--kwargs must be a JSON object: {err}") from None
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    if args.max_request_mb <= 0:
        raise SystemExit(f"--max-request-mb must be > 0, got {args.max_request_mb}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        reward, origin = load_reward(args.reward, **kwargs)
    except (RewardLoadError, ValueError) as err:
        raise SystemExit(f"flowgrpo-reward-server: {err}") from None
    app = create_app(reward, reward_name=args.reward, origin=origin.__dict__, device=device,
                     max_request_bytes=int(args.max_request_mb * 2**20), batch_size=args.batch_size,
                     max_image_pixels=args.max_image_pixels)
    with contextlib.suppress(ValueError):
        if not ipaddress.ip_address(args.host).is_loopback:
            logger.warning("binding %s: the reward server has no authentication; anyone who can reach this "
                           "address can use it", args.host)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        raise SystemExit(f"flowgrpo-reward-server: cannot listen on {args.host}:{args.port}: {err}") from None
    port = sock.getsockname()[1]
    logger.info("flowgrpo-reward-server: serving %r (%s) on http://%s:%d", args.reward, origin.target,
                f"[{args.host}]" if ":" in args.host else args.host, port)
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", limit_concurrency=args.max_concurrency,
                            timeout_graceful_shutdown=5, access_log=args.access_log)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
