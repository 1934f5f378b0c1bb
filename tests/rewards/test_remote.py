"""The remote reward (flowgrpo.rewards.remote) and its server (flowgrpo.rewards.server): the PNG wire format,
scores equal to the in-process reward's, refusals that leave the server up, retries, timeouts and malformed replies,
the ``flowgrpo-reward-server`` command. Composition is specified in test_compose.py, background scoring in
test_background.py, reward discovery in test_registry.py, the server under load in test_server.py.

The tests start real servers on 127.0.0.1 at a free port: ``flowgrpo-reward-server``'s app on a thread, the
command itself in a subprocess, and a scripted stdlib HTTP server for replies our server never sends (malformed,
503). Expected scores come from the in-process reward (the PNG wire format is lossless on the 8-bit grid the JPEG
reward quantises to).
"""

from __future__ import annotations

import http.server
import json
import math
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility, jpeg_size_kb

from flowgrpo.rewards.base import BaseReward
from flowgrpo.rewards.registry import load_reward
from flowgrpo.rewards.remote import RemoteReward, RemoteRewardError
from flowgrpo.rewards.server import ServerThread, create_app
from flowgrpo.rewards.wire import images_to_png_b64, png_b64_to_images
from flowgrpo.testing.rewards import RewardConformance
from tests.rewards.stubs import CatNotApplicable, images_8bit

# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------


class Recording(BaseReward):
    """Wraps a reward and records the batch size of every call."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.calls = inner, inner.name, []
        self.setup_devices = []

    def setup(self, device) -> None:
        self.setup_devices.append(str(device))
        self.inner.setup(device)

    def score(self, images, prompts, metadata):
        self.calls.append(images.shape[0])
        return self.inner(images, prompts, metadata)


class NeedsTag(JpegCompressibility):
    """JPEG compressibility that requires a ``tag`` metadata field (bad input when absent)."""

    name = "needs_tag"

    def score(self, images, prompts, metadata):
        for m in metadata:
            if "tag" not in m:
                raise ValueError("metadata field 'tag' is required by needs_tag")
        return super().score(images, prompts, metadata)


class Slow(BaseReward):
    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def score(self, images, prompts, metadata):
        time.sleep(self.seconds)
        return torch.zeros(images.shape[0])


class Crashes(BaseReward):
    name = "crashes"

    def score(self, images, prompts, metadata):
        raise RuntimeError("detector exploded")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_ok(url: str) -> bool:
    return httpx.get(url + "/health", timeout=5).json()["status"] == "ok"


# ------------------------------------------------------------------------------------------------------------
# wire format
# ------------------------------------------------------------------------------------------------------------


def test_png_wire_format_is_lossless_on_the_8bit_grid_and_refuses_bad_images():
    images = images_8bit(3, 16, 24)
    back = png_b64_to_images(images_to_png_b64(images))
    assert back.shape == (3, 3, 16, 24) and torch.equal(back, images)
    small = images_to_png_b64(images_8bit(1, 8, 8))
    with pytest.raises(ValueError, match=r"images\[1\] is 8x8 but images\[0\] is 24x16"):
        png_b64_to_images(images_to_png_b64(images)[:1] + small)
    with pytest.raises(ValueError, match="over the limit of 100 pixels"):
        png_b64_to_images(small + images_to_png_b64(images), max_pixels=100)
    with pytest.raises(ValueError, match="not valid base64"):
        png_b64_to_images(["not base64!"])
    import base64

    with pytest.raises(ValueError, match="not a PNG"):
        png_b64_to_images([base64.b64encode(pickle.dumps({"a": 1})).decode()])


# ------------------------------------------------------------------------------------------------------------
# remote reward against real servers on 127.0.0.1
# ------------------------------------------------------------------------------------------------------------

LIMIT = 200_000  # bytes per request for the served JPEG reward


@pytest.fixture(scope="module")
def jpeg_server():
    served = Recording(JpegCompressibility())
    app = create_app(served, reward_name="jpeg_compressibility", max_request_bytes=LIMIT, batch_size=4,
                     origin={"name": "jpeg_compressibility", "distribution": "flowgrpo-rewards"})
    with ServerThread(app) as srv:
        srv.served = served
        yield srv


def test_remote_scores_equal_in_process_and_respect_batch_sizes(jpeg_server):
    images = images_8bit(7)
    prompts, meta = [f"p{i}" for i in range(7)], [{"i": i} for i in range(7)]
    remote = RemoteReward(jpeg_server.url, batch_size=3)
    assert remote.server_info is None  # nothing contacted at construction
    remote.setup("cpu")
    assert remote.server_info["reward"] == "jpeg_compressibility" and remote.max_request_bytes == LIMIT
    assert jpeg_server.served.setup_devices == ["cpu"]  # set up once, at server startup
    jpeg_server.served.calls.clear()
    scores = remote(images, prompts, meta)
    assert scores.dtype == torch.float32 and scores.shape == (7,)
    assert torch.equal(scores, JpegCompressibility()(images, prompts, meta))
    assert jpeg_server.served.calls == [3, 3, 1]
    # a request is cut by the server's byte limit too: four noisy 160x160 images are over it together
    big = images_8bit(4, 160, 160, noise=1.0)
    jpeg_server.served.calls.clear()
    scores = remote(big, ["p"] * 4, [{}] * 4)
    assert torch.equal(scores, JpegCompressibility()(big, ["p"] * 4, [{}] * 4))
    sizes = [len(s) for s in images_to_png_b64(big)]
    assert sum(sizes) > LIMIT and len(jpeg_server.served.calls) > 1, (sizes, jpeg_server.served.calls)


def test_remote_oversized_requests_get_413_and_the_server_stays_up(jpeg_server):
    url = jpeg_server.url + "/score"
    r = httpx.post(url, content=b"x" * (LIMIT + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def stream():  # no Content-Length: refused while streaming, once past the limit
        for _ in range(2 * LIMIT // 10_000):
            yield b"y" * 10_000

    r = httpx.post(url, content=stream(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert health_ok(jpeg_server.url)
    huge = images_8bit(2, 300, 300, noise=1.0)[1:]  # one noisy image whose request alone is over the limit
    with pytest.raises(RemoteRewardError, match="over the server's limit.*--max-request-mb"):
        RemoteReward(jpeg_server.url)(huge, ["p"], [{}])


def test_remote_refuses_pickle_and_the_server_stays_up(jpeg_server, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    payload = pickle.dumps(Exploit())
    url = jpeg_server.url + "/score"
    for ctype in ("application/python-pickle", "application/octet-stream", "application/x-www-form-urlencoded"):
        r = httpx.post(url, content=payload, headers={"Content-Type": ctype})
        assert r.status_code == 415 and "application/json" in r.json()["error"]
    for body in (payload, b"[" * 100_000):  # a pickle sent as JSON; JSON nested past the parser's recursion limit
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(url, json={"images": [images_to_png_b64(images_8bit(1))[0]], "prompts": ["a", "b"],
                              "metadata": [{}]})
    assert r.status_code == 400 and "1 images but 2 prompts" in r.json()["error"]
    assert not marker.exists()
    assert health_ok(jpeg_server.url)
    assert torch.equal(RemoteReward(jpeg_server.url)(images_8bit(2), ["a", "b"], [{}, {}]),
                       -jpeg_size_kb(images_8bit(2)))


def test_remote_nan_errors_and_bad_input():
    with ServerThread(create_app(CatNotApplicable(), reward_name="cat_na")) as srv:
        scores = RemoteReward(srv.url)(images_8bit(3), ["a cat", "a dog", "cat"], [{}] * 3)
        assert torch.isnan(scores).tolist() == [True, False, True] and scores[1].item() == 0.5
    with ServerThread(create_app(NeedsTag(), reward_name="needs_tag")) as srv:
        remote = RemoteReward(srv.url, retries=3)
        with pytest.raises(ValueError, match="'tag'"):  # the server's ValueError is the client's ValueError
            remote(images_8bit(2), ["a", "b"], [{"tag": 1}, {}])
        with pytest.raises(ValueError, match="cannot be sent as JSON"):
            remote(images_8bit(1), ["a"], [{"tag": object()}])
        with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
            remote(images_8bit(2)[:, :1], ["a", "b"], [{}, {}])
    with ServerThread(create_app(Crashes(), reward_name="crashes")) as srv:
        t0 = time.perf_counter()
        with pytest.raises(RemoteRewardError, match="HTTP 500.*detector exploded"):
            RemoteReward(srv.url, retries=3, backoff=1.0)(images_8bit(1), ["a"], [{}])
        assert time.perf_counter() - t0 < 1.0  # a reward failure is not retried
        assert health_ok(srv.url)


def test_remote_slower_than_timeout_fails_after_bounded_retries():
    with ServerThread(create_app(Slow(1.5), reward_name="slow")) as srv:
        remote = RemoteReward(srv.url, timeout=0.15, retries=1, backoff=0.05)
        remote.setup("cpu")  # /health answers at once
        t0 = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=r"failed after 2 attempts; last error: timed out after 0.15 s"):
            remote(images_8bit(1), ["a"], [{}])
        assert time.perf_counter() - t0 < 1.2  # two attempts of 0.15 s and a 0.05 s backoff, not the 1.5 s reward
        assert health_ok(srv.url)  # the event loop is free while the reward works on a thread


def test_remote_server_down_fails_clearly_after_retries_with_backoff():
    url = f"http://127.0.0.1:{free_port()}"
    remote = RemoteReward(url, timeout=1.0, retries=2, backoff=0.1)
    t0 = time.perf_counter()
    pattern = rf"{re.escape(url)}/health failed after 3 attempts; last error: Connect.*to retry; deadline 900 s\)"
    with pytest.raises(RemoteRewardError, match=pattern):
        remote.setup("cpu")
    assert time.perf_counter() - t0 >= 0.1 + 0.2  # backoff before retries 1 and 2


class Scripted:
    """A stdlib HTTP server on 127.0.0.1 replying a fixed script of (status, body) to successive requests."""

    def __init__(self, script: list[tuple[int, bytes]]) -> None:
        self.script, self.requests = list(script), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests += 1
                status, body = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _reply

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


HEALTH = json.dumps({"status": "ok", "reward": "scripted", "max_request_bytes": 10**6}).encode()


@pytest.mark.parametrize("body, match", [
    (b"<html>502 bad gateway</html>", "not JSON"),
    (json.dumps({"scores": [1.0]}).encode(), "expected 2 scores, got 1"),
    (json.dumps({"scores": [1.0, "high"]}).encode(), "'high' is not a number"),
    (json.dumps([1.0, 2.0]).encode(), "expected 2 scores"),
])
def test_remote_malformed_reply_is_a_clear_error_and_not_retried(body, match):
    with Scripted([(200, HEALTH), (200, body)]) as srv:
        remote = RemoteReward(srv.url, retries=3, backoff=0.01)
        with pytest.raises(RemoteRewardError, match=f"malformed reply.*{match}"):
            remote(images_8bit(2), ["a", "b"], [{}, {}])
        assert srv.requests == 2  # /health, then one /score


def test_remote_retries_busy_servers_then_succeeds():
    ok = json.dumps({"scores": [0.25, None]}).encode()
    with Scripted([(200, HEALTH), (503, b"{}"), (429, b"{}"), (200, ok)]) as srv:
        scores = RemoteReward(srv.url, retries=2, backoff=0.01)(images_8bit(2), ["a", "b"], [{}, {}])
        assert scores[0].item() == 0.25 and math.isnan(scores[1].item()) and srv.requests == 4
    with Scripted([(200, HEALTH), (503, b"{}"), (503, b"{}"), (200, ok)]) as srv:
        with pytest.raises(RemoteRewardError, match="after 2 attempts; last error: HTTP 503"):
            RemoteReward(srv.url, retries=1, backoff=0.01)(images_8bit(2), ["a", "b"], [{}, {}])


def test_remote_kwargs_are_checked_at_construction():
    for kwargs, match in (({"url": "127.0.0.1:80"}, "http://"), ({"timeout": 0}, "timeout"),
                          ({"retries": -1}, "retries"), ({"backoff": -1}, "backoff"), ({"batch_size": 0}, "batch"),
                          ({"deadline": 0}, "deadline"),
                          ({"backoff": 2.0, "max_backoff": 1.0}, "max_backoff")):
        with pytest.raises(ValueError, match=match):
            RemoteReward(**{"url": "http://127.0.0.1:1", **kwargs})
    reward, origin = load_reward("remote", url="http://127.0.0.1:1", batch_size=2)
    assert isinstance(reward, RemoteReward) and origin.distribution == "flowgrpo"


def test_reward_server_command_serves_a_registered_reward():
    cmd = [sys.executable, "-m", "flowgrpo.rewards.server", "--reward", "jpeg_compressibility", "--kwargs",
           '{"quality": 80}', "--port", "0", "--device", "cpu", "--max-request-mb", "0.5", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url, lines, deadline = None, [], time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"serving 'jpeg_compressibility' .* on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        remote = RemoteReward(url, retries=20, backoff=0.1)  # the server may still be setting up
        remote.setup("cpu")
        assert remote.server_info["origin"]["distribution"] == "flowgrpo-rewards"
        assert remote.max_request_bytes == int(0.5 * 2**20)
        images = images_8bit(3)
        assert torch.equal(remote(images, ["a"] * 3, [{}] * 3), -jpeg_size_kb(images, quality=80))
    finally:
        proc.terminate()
        proc.wait(20)


class TestRemoteRewardConformance(RewardConformance):
    """The remote reward passes the same protocol suite as an in-process reward."""

    reward_factory = staticmethod(lambda: RemoteReward("http://127.0.0.1:9", batch_size=2))
    metadata_factory = staticmethod(lambda n: [{"tag": i} for i in range(n)])
    required_metadata_fields = ("tag",)

    @pytest.fixture(scope="class")
    def reward(self):
        with ServerThread(create_app(NeedsTag(), reward_name="needs_tag")) as srv:
            r = RemoteReward(srv.url, batch_size=2)
            r.setup("cpu")
            yield r
