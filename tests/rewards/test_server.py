"""The reward server under load: admission queue, complete refusals, client recovery, cross-request batching,
worker processes, ``/metrics``, and image-decoding refusals.

Every server binds 127.0.0.1 at a free port; every loop is bounded in count and time. Expected scores come from
the in-process reward (the PNG wire format is lossless on the 8-bit grid the JPEG reward quantises to) or, for
the batching tests, from a reward whose score is the request's own ``metadata["i"]``, so a score split back to
the wrong request is seen. Waits are made deterministic with a reward that blocks on an event the test releases.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import json
import struct
import threading
import time
import zlib

import httpx
import numpy as np
import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from flowgrpo.rewards.base import BaseReward
from flowgrpo.rewards.remote import RemoteReward, RemoteRewardError, images_to_png_b64, parse_retry_after
from flowgrpo.rewards.server import ServerThread, create_app
from flowgrpo.rewards.serving import ServingConfig, nearest_rank


def images_8bit(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    """(n, 3, size, size) float32 on the 8-bit grid, different per seed, with noise so JPEG sizes differ."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    x = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    x = x + torch.linspace(0, 0.4, n).view(n, 1, 1, 1) * (torch.rand(n, 3, size, size, generator=g) - 0.5)
    return (x.clamp(0, 1) * 255).round() / 255


def body_of(n: int, seed: int = 0, first_index: int = 0) -> bytes:
    images = images_to_png_b64(images_8bit(n, seed=seed))
    meta = [{"i": first_index + k} for k in range(n)]
    return json.dumps({"images": images, "prompts": ["p"] * n, "metadata": meta}).encode()


def post(url: str, body, timeout: float = 30.0) -> httpx.Response:
    """One POST /score on a fresh connection; a dropped connection raises (httpx.TransportError)."""
    return httpx.post(url + "/score", content=body, headers={"Content-Type": "application/json"}, timeout=timeout)


def metrics_of(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} parsed from /metrics by prometheus_client's own parser."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_until(cond, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class GatedIndex(BaseReward):
    """Score = ``metadata["i"]``; the first ``gated_calls`` calls block until :attr:`gate` is set. Records calls."""

    name = "gated_index"

    def __init__(self, gated_calls: int = 1) -> None:
        self.gate, self.gated_calls, self.calls, self.started = threading.Event(), gated_calls, [], threading.Event()

    def score(self, images, prompts, metadata):
        self.calls.append(images.shape[0])
        self.started.set()
        if len(self.calls) <= self.gated_calls:
            assert self.gate.wait(60), "the test never opened the gate"
        return torch.tensor([float(m["i"]) for m in metadata])


# ------------------------------------------------------------------------------------------------------------
# 128 clients
# ------------------------------------------------------------------------------------------------------------


def test_128_concurrent_clients_3_batches_each_all_scored_exactly():
    """The issue's load (32 clients lost 16 of 96 batches to 503): 128 clients × 3 batches, no failure."""
    clients, batches, n = 128, 3, 4
    app = create_app(JpegCompressibility(), reward_name="jpeg_compressibility", batch_size=32)
    local = JpegCompressibility()
    with ServerThread(app) as srv:
        start = threading.Barrier(clients, timeout=60)

        def client(c: int):
            remote = RemoteReward(srv.url, deadline=120)
            remote.setup("cpu")
            start.wait()
            out = []
            for b in range(batches):
                images = images_8bit(n, seed=1000 * c + b)
                got = remote(images, ["p"] * n, [{}] * n)
                out.append(torch.equal(got, local(images, ["p"] * n, [{}] * n)))
            remote.close()
            return out

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            results = [f.result(timeout=240) for f in [pool.submit(client, c) for c in range(clients)]]
        assert time.monotonic() - t0 < 240
        assert all(all(r) for r in results), "a remote score differs from the in-process reward's"
        m = metrics_of(srv.url)
        assert m[("flowgrpo_reward_images_scored_total", ())] == clients * batches * n
        assert m[("flowgrpo_reward_requests_total", (("code", "200"),))] == clients * batches
        assert not any(k[0] == "flowgrpo_reward_refusals_total" and v for k, v in m.items())
        assert m[("flowgrpo_reward_queue_depth", ())] == 0 and m[("flowgrpo_reward_in_flight", ())] == 0


# ------------------------------------------------------------------------------------------------------------
# the queue: waits, 503 with Retry-After when full, recovery, no dropped connection
# ------------------------------------------------------------------------------------------------------------


def test_small_queue_waits_then_refuses_with_retry_after_and_the_client_recovers():
    reward = GatedIndex()
    serving = ServingConfig(max_concurrency=1, max_queue=2, max_queue_wait=60)
    app = create_app(reward, reward_name="gated", serving=serving, max_request_bytes=2**20)
    admission = app.state.admission
    with ServerThread(app) as srv, concurrent.futures.ThreadPoolExecutor(8) as pool:
        # 1 in flight (blocked in the reward), 2 waiting: the server is full
        first = pool.submit(post, srv.url, body_of(2, first_index=0))
        assert reward.started.wait(20)
        waiting = []
        for k in (1, 2):
            waiting.append(pool.submit(post, srv.url, body_of(2, first_index=10 * k)))
            wait_until(lambda k=k: admission.pending == 1 + k, f"{k} waiting requests")
        # a full queue answers 503 with Retry-After, a complete answer even while the body is still arriving
        def slow_body():
            payload = body_of(2, first_index=99)
            for s in range(0, len(payload), 1000):
                time.sleep(0.002)
                yield payload[s : s + 1000]

        for body in (body_of(2), slow_body()):
            r = post(srv.url, body)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error_type"] == "ServerBusy" and "2 waiting" in r.json()["error"]
        # a remote client retries, honouring Retry-After, until a slot frees
        remote = RemoteReward(srv.url, backoff=0.05)
        remote.setup("cpu")
        recovering = pool.submit(remote, images_8bit(2), ["p", "p"], [{"i": 7}, {"i": 8}])
        wait_until(lambda: metrics_of(srv.url)[("flowgrpo_reward_refusals_total", (("reason", "queue_full"),))]
                   >= 3, "the client's first refused attempt")
        t_open = time.monotonic()
        reward.gate.set()
        assert first.result(30).json()["scores"] == [0.0, 1.0]
        assert [w.result(30).json()["scores"] for w in waiting] == [[10.0, 11.0], [20.0, 21.0]]
        assert recovering.result(60).tolist() == [7.0, 8.0]
        assert remote.retried >= 1 and remote.waited_s >= 1.0  # Retry-After is at least 1 s
        assert time.monotonic() - t_open < 30
        m = metrics_of(srv.url)
        assert m[("flowgrpo_reward_queue_wait_seconds_count", ())] == 4  # every admitted request waited for a slot
        assert m[("flowgrpo_reward_queue_wait_seconds_sum", ())] > 0.1  # the two queued ones waited for the gate
        assert m[("flowgrpo_reward_refusals_total", (("reason", "queue_full"),))] >= 3


def test_a_request_that_waits_longer_than_max_queue_wait_gets_503_with_retry_after():
    reward = GatedIndex()
    app = create_app(reward, reward_name="gated", serving=ServingConfig(max_concurrency=1, max_queue=4,
                                                                         max_queue_wait=0.3))
    with ServerThread(app) as srv, concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, srv.url, body_of(1))
        assert reward.started.wait(20)
        t0 = time.monotonic()
        r = post(srv.url, body_of(1))
        assert r.status_code == 503 and "Retry-After" in r.headers and "waited 0.3 s" in r.json()["error"]
        assert 0.3 <= time.monotonic() - t0 < 5
        reward.gate.set()
        assert first.result(30).status_code == 200


def test_refusals_read_the_whole_body_so_the_client_always_gets_the_answer():
    """415 and 413 after a body was sent in full or streamed: the answer arrives, the connection is not reset."""
    app = create_app(JpegCompressibility(), reward_name="jpeg", max_request_bytes=50_000)
    with ServerThread(app) as srv:
        big = b"x" * 150_000  # over the limit, under 4× the limit: read and discarded

        def stream():
            for s in range(0, len(big), 5000):
                yield big[s : s + 5000]

        for body in (big, stream()):
            r = httpx.post(srv.url + "/score", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "50000 bytes" in r.json()["error"]
        r = httpx.post(srv.url + "/score", content=big, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 415
        m = metrics_of(srv.url)
        assert m[("flowgrpo_reward_refusals_total", (("reason", "too_large"),))] == 2
        assert m[("flowgrpo_reward_refusals_total", (("reason", "unsupported_media"),))] == 1


# ------------------------------------------------------------------------------------------------------------
# cross-request batching and worker processes
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("merge", [True, False])
def test_concurrent_requests_are_merged_into_one_reward_call_and_split_back(merge):
    reward = GatedIndex()
    serving = ServingConfig(max_concurrency=8, cross_request_batching=merge)
    app = create_app(reward, reward_name="gated", batch_size=8, serving=serving)
    with ServerThread(app) as srv, concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, srv.url, body_of(1, first_index=0))
        assert reward.started.wait(20)
        sizes = {1: 3, 2: 2, 3: 3}  # request k has sizes[k] images, metadata i = 10k, 10k+1, ...
        later = {k: pool.submit(post, srv.url, body_of(n, seed=k, first_index=10 * k)) for k, n in sizes.items()}
        wait_until(lambda: app.state.admission.in_flight == 4, "3 requests decoded and waiting for the reward")
        time.sleep(0.2)  # they are queued in the batcher behind the gated call
        reward.gate.set()
        assert first.result(30).json()["scores"] == [0.0]
        for k, n in sizes.items():
            assert later[k].result(30).json()["scores"] == [float(10 * k + j) for j in range(n)]
        # merged: the three requests (3 + 2 + 3 = 8 images, in whatever order they arrived) make one call of 8
        assert sorted(reward.calls[1:]) == ([8] if merge else [2, 3, 3]), reward.calls
        m = metrics_of(srv.url)
        assert m[("flowgrpo_reward_batch_images_count", ())] == len(reward.calls)


def test_a_request_larger_than_batch_size_is_cut_into_reward_calls():
    reward = GatedIndex(gated_calls=0)
    app = create_app(reward, reward_name="gated", batch_size=3)
    with ServerThread(app) as srv:
        r = post(srv.url, body_of(7, first_index=0))
        assert r.json()["scores"] == [float(i) for i in range(7)]
        assert reward.calls == [3, 3, 1]


def test_a_bad_request_merged_with_good_ones_fails_alone():
    class NeedsTag(GatedIndex):
        def score(self, images, prompts, metadata):
            if any("tag" not in m for m in metadata):
                super().score(images, prompts, [{"i": 0}] * len(metadata))
                raise ValueError("metadata field 'tag' is required")
            return super().score(images, prompts, metadata)

    reward = NeedsTag()
    app = create_app(reward, reward_name="needs_tag", batch_size=16)
    good = json.dumps({"images": images_to_png_b64(images_8bit(2)), "prompts": ["a", "b"],
                       "metadata": [{"i": 1, "tag": 1}, {"i": 2, "tag": 1}]}).encode()
    with ServerThread(app) as srv, concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, srv.url, good)
        assert reward.started.wait(20)
        bad = pool.submit(post, srv.url, body_of(2))
        good2 = pool.submit(post, srv.url, good)
        wait_until(lambda: app.state.admission.in_flight == 3, "two requests waiting for the reward")
        time.sleep(0.2)
        reward.gate.set()
        assert first.result(30).json()["scores"] == [1.0, 2.0]
        assert good2.result(30).json()["scores"] == [1.0, 2.0]
        r = bad.result(30)
        assert r.status_code == 400 and "'tag'" in r.json()["error"]
        assert reward.calls == [2, 4, 2, 2]  # the merged call failed; each request was then scored alone


def test_worker_processes_score_exactly_like_the_in_process_reward():
    serving = ServingConfig(workers=2)
    app = create_app(None, reward_name="jpeg", serving=serving, batch_size=4,
                     worker_spec=("flowgrpo_rewards.jpeg:JpegCompressibility", {"quality": 80}))
    local = JpegCompressibility(quality=80)
    with ServerThread(app, startup_timeout=300) as srv:
        assert httpx.get(srv.url + "/health").json()["workers"] == 2
        remote = RemoteReward(srv.url, batch_size=5)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [(images_8bit(5, seed=s), pool) for s in range(4)]
            got = list(pool.map(lambda x: remote(x[0], ["p"] * 5, [{}] * 5), jobs))
        for (images, _), scores in zip(jobs, got, strict=True):
            assert torch.equal(scores, local(images, ["p"] * 5, [{}] * 5))
    with pytest.raises(ValueError, match="worker_spec"):
        create_app(None, reward_name="jpeg", serving=serving)


# ------------------------------------------------------------------------------------------------------------
# image-decoding refusals are 4xx naming the limit
# ------------------------------------------------------------------------------------------------------------


def png_declaring(width: int, height: int, mode: int = 2, idat: bytes | None = None, depth: int = 8) -> str:
    """A base64 PNG whose IHDR declares width×height (colour type ``mode``: 2 RGB, 6 RGBA; bit ``depth``), with a
    tiny IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, depth, mode, 0, 0, 0)
    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat or zlib.compress(b"\0" * 64))
           + chunk(b"IEND", b""))
    return base64.b64encode(raw).decode()


def test_decompression_bombs_and_undecodable_images_are_400_naming_the_problem():
    app = create_app(JpegCompressibility(), reward_name="jpeg", max_image_pixels=4096 * 4096)
    rgba = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 4), np.uint8), mode="RGBA").save(rgba, format="PNG")
    truncated = base64.b64decode(images_to_png_b64(images_8bit(1, size=64))[0])[:-40]
    cases = [
        (png_declaring(20000, 20000), "declares 20000x20000 = 400000000 pixels, over the limit of 16777216 pixels"),
        (png_declaring(4096, 4097), "over the limit of 16777216 pixels"),
        (png_declaring(64, 64), "truncated or corrupt PNG"),  # a valid header, pixel data missing
        (base64.b64encode(truncated).decode(), "truncated or corrupt PNG"),
        (base64.b64encode(rgba.getvalue()).decode(), "only 8-bit 'RGB'"),
        (base64.b64encode(b"GIF89a" + b"\0" * 40).decode(), "not a PNG image"),
        # PIL opens 16-bit RGB as mode 'RGB' (cut to 8 bits): the header's bit depth and colour type are checked
        (png_declaring(8, 8, idat=zlib.compress(b"\0" * 8 * 49), depth=16), "16-bit RGB PNG (its header); only 8-bit"),
        (png_declaring(8, 8, mode=0), "8-bit greyscale PNG (its header); only 8-bit 'RGB'"),
    ]
    with ServerThread(app) as srv:
        for image, message in cases:
            r = post(srv.url, json.dumps({"images": [image], "prompts": ["p"], "metadata": [{}]}).encode())
            assert r.status_code == 400, (message, r.status_code, r.text)
            assert message in r.json()["error"] and r.json()["error_type"] == "ValueError"
        assert post(srv.url, body_of(1)).status_code == 200  # the server is fine afterwards
        m = metrics_of(srv.url)
        assert m[("flowgrpo_reward_refusals_total", (("reason", "bad_request"),))] == len(cases)
        assert ("flowgrpo_reward_requests_total", (("code", "500"),)) not in m


# ------------------------------------------------------------------------------------------------------------
# the client: backoff, Retry-After, deadline
# ------------------------------------------------------------------------------------------------------------


class Busy:
    """A stdlib HTTP server on 127.0.0.1: /health is ok, /score answers 503 with ``Retry-After`` (or no header)."""

    def __init__(self, retry_after: str | None) -> None:
        self.times: list[float] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, json.dumps({"status": "ok", "max_request_bytes": 10**6}).encode(), {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.times.append(time.monotonic())
                self._send(503, b"{}", {"Retry-After": retry_after} if retry_after else {})

            def _send(self, status, body, headers):
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_client_honours_retry_after_and_stops_at_its_deadline_saying_how_long_it_waited():
    srv = Busy("1")
    try:
        remote = RemoteReward(srv.url, backoff=0.01, deadline=2.5)
        t0 = time.monotonic()
        pattern = r"failed after [23] attempts; last error: HTTP 503: \{\} \([\d.]+ s in all, [\d.]+ s of it waiting"
        with pytest.raises(RemoteRewardError, match=pattern + r" to retry; deadline 2.5 s\)"):
            remote(images_8bit(1), ["p"], [{}])
        assert time.monotonic() - t0 <= 2.5 + 1.0
        gaps = np.diff(srv.times)
        assert len(gaps) >= 1 and (gaps >= 1.0).all() and (gaps <= 1.5 + 0.5).all()  # Retry-After · (1 + U/2)
    finally:
        srv.close()


def test_backoff_without_retry_after_is_exponential_with_jitter_up_to_max_backoff():
    remote = RemoteReward("http://127.0.0.1:1", backoff=0.5, max_backoff=4.0)
    for k, base in enumerate([0.5, 1.0, 2.0, 4.0, 4.0]):
        waits = [remote.retry_wait(k, None) for _ in range(200)]
        assert base <= min(waits) and max(waits) <= 1.5 * base and np.std(waits) > 0
    assert all(remote.retry_wait(0, 7.0) >= 7.0 for _ in range(50))  # Retry-After wins over a shorter backoff
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: retry now


def test_nearest_rank_quantiles():
    values = [float(v) for v in range(1, 101)]  # 1..100: the q-quantile is the ceil(100q)-th value
    assert nearest_rank(values, 0.5) == 50.0 and nearest_rank(values, 0.99) == 99.0
    assert nearest_rank([3.0], 0.99) == 3.0


def test_a_body_that_parses_into_many_json_values_is_charged_against_the_pixel_budgets_before_parsing():
    # 60 KB of "[]," in a metadata dict parses into 20000 Python lists (~67 bytes each): each JSON separator past
    # the first 2**14 is charged 5 pixels against --max-request-pixels before json.loads runs, like the decoded
    # pixels; strings' commas do not count, and an ordinary request filling the budget exactly is not charged
    serving = ServingConfig(max_request_pixels=4 * 16 * 16 + 5000, max_pixels_in_flight=4 * 16 * 16 + 5000)
    app = create_app(JpegCompressibility(), reward_name="jpeg", serving=serving)
    image = images_to_png_b64(images_8bit(1))
    nested = json.dumps({"images": image, "prompts": ["p"], "metadata": [{"x": [[]] * 20000}]}).encode()
    commas = json.dumps({"images": image, "prompts": ["a, b, [c], {d: e}" * 20000], "metadata": [{}]}).encode()
    with ServerThread(app) as srv:
        r = post(srv.url, nested)
        assert r.status_code == 413, r.text
        assert r.json()["error"].startswith(
            "the request's JSON holds up to 40012 values, charged as 118140 decoded pixels (5 each past the first "
            "16384), over the per-request budget of 6024 decoded pixels (the server's --max-request-pixels)")
        assert post(srv.url, commas).status_code == 200
        assert post(srv.url, body_of(4)).status_code == 200  # the refused request gave its charge back
        m = metrics_of(srv.url)
        assert m[("flowgrpo_reward_refusals_total", (("reason", "too_many_pixels"),))] == 1


# ------------------------------------------------------------------------------------------------------------
# images per request; refused bodies released at once (issue 54)
# ------------------------------------------------------------------------------------------------------------


def test_more_images_than_max_request_images_is_413_before_any_image_is_read(monkeypatch):
    """100,000 1×1 images in one request were answered 200 after 21-57 s: a request over --max-request-images
    (default 1024) is refused with 413 naming the count, the limit and its flag, before any PNG header is read."""
    import flowgrpo.rewards.server as server

    assert ServingConfig().max_request_images == 1024
    assert server._parse_args(["--reward", "jpeg_compressibility"]).max_request_images == 1024
    with pytest.raises(ValueError, match="max_request_images must be an integer >= 1"):
        ServingConfig(max_request_images=0)
    reads = []
    real = server.read_png_headers
    monkeypatch.setattr(server, "read_png_headers", lambda *a: reads.append(1) or real(*a))
    app = create_app(JpegCompressibility(), reward_name="jpeg", serving=ServingConfig(max_request_images=4))
    with ServerThread(app) as srv:
        r = post(srv.url, body_of(5))
        assert r.status_code == 413 and r.json()["error_type"] == "RequestTooLarge", r.text
        assert r.json()["error"].startswith("the request holds 5 images, over the limit of 4 per request (the "
                                            "server's --max-request-images)")
        assert not reads
        assert post(srv.url, body_of(4)).status_code == 200
        assert metrics_of(srv.url)[("flowgrpo_reward_refusals_total", (("reason", "too_many_images"),))] == 1


@pytest.mark.parametrize("kind", ["not_json", "missing_fields", "too_many_images"])
def test_refused_bodies_are_released_at_once_not_when_the_garbage_collector_runs(kind):
    """Each refused 50 MB body stayed in memory until the garbage collector ran (RSS 725 MB -> 2.12 GB over 17
    requests): the refusal's exception, raised in anyio's worker thread, sat in a reference cycle with the frames
    that held the body and its decoded text. With the collector off, the memory Python holds (tracemalloc, server
    and client in this process) grows by less than four bodies' worth over 16 more refused 2 MB bodies (it grew by
    16 bodies or more, one per request). Four, not one: under load the server's thread may still hold a request or
    two when the client reads the count (a CI run saw two bodies held after 8)."""
    import gc
    import tracemalloc

    size = 2 << 20
    bodies = {"not_json": b"x" * size,
              "missing_fields": b'{"images": [], "padding": "' + b"y" * size + b'"}',
              "too_many_images": json.dumps({"images": ["z" * 1024] * (size // 1030), "prompts": [],
                                             "metadata": []}).encode()}
    body = bodies[kind]
    app = create_app(JpegCompressibility(), reward_name="jpeg", max_request_bytes=4 * size,
                     serving=ServingConfig(max_request_images=16))
    with ServerThread(app) as srv:
        assert post(srv.url, body).status_code in (400, 413)  # warm up: the first request's one-off allocations
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            codes = {post(srv.url, body).status_code for _ in range(4)}
            base = tracemalloc.get_traced_memory()[0]  # after 4 refusals: what one request leaves in flight
            codes |= {post(srv.url, body).status_code for _ in range(16)}
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            gc.enable()
    assert codes == ({413} if kind == "too_many_images" else {400})
    assert held < 4 * len(body), f"{held / 2**20:.1f} MiB more held after 16 more refused bodies of " \
                                 f"{len(body) / 2**20:.1f} MiB"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_the_metadata_are_400_in_one_line(constant):
    """Python's json reads NaN, Infinity and -Infinity by default, JSON (RFC 8259) has no such numbers: a request
    whose metadata holds one once reached the reward as a float; now 400, one line naming it, and nothing scored."""
    app = create_app(JpegCompressibility(), reward_name="jpeg")
    image = images_to_png_b64(images_8bit(1))[0]
    # json.dumps writes a float nan / inf / -inf as these very words (allow_nan, its default)
    body = json.dumps({"images": [image], "prompts": ["p"], "metadata": [{"weight": float(constant)}]}).encode()
    assert constant.encode() in body
    with ServerThread(app) as srv:
        r = post(srv.url, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert f"holds {constant}, which is not a JSON number" in error and "\n" not in error
        good = json.dumps({"images": [image], "prompts": ["p"], "metadata": [{"weight": 1.5}]}).encode()
        assert post(srv.url, good).status_code == 200


@pytest.mark.parametrize(("argv", "line"), [
    (["--kwargs", "[1]"], "--kwargs must be a JSON object, got '[1]'"),
    (["--kwargs", "{"], "--kwargs must be a JSON object: "),
    (["--max-request-mb", "0"], "--max-request-mb must be > 0, got 0.0"),
    (["--reward", "no_such_reward_anywhere"], "no_such_reward_anywhere"),
])
def test_the_server_refuses_its_options_with_one_error_line_and_exit_status_2(capsys, argv, line):
    """Its refusals once exited 1 with a bare message (``SystemExit(message)``), without the ``error:`` and the
    status 2 of every other flowgrpo command's."""
    from flowgrpo.rewards.server import main

    args = ["--reward", "jpeg", *argv] if "--reward" not in argv else argv
    with pytest.raises(SystemExit) as err:
        main(args)
    out = capsys.readouterr().err.splitlines()
    assert err.value.code == 2 and len(out) == 1 and out[0].startswith("flowgrpo-reward-server: error: ")
    assert line in out[0], out
