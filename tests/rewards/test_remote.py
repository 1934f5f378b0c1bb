"""Reward infrastructure: weighted composition with NaN (flowgrpo.rewards.compose), background scoring, the remote
reward and its server. Reward discovery (entry points, ``module:attr``, load errors) is specified in
tests/rewards/test_registry.py.

Remote tests start real
servers on 127.0.0.1 at a free port: ``flowgrpo-reward-server``'s app on a thread, the command itself in a
subprocess, and a scripted stdlib HTTP server for replies our server never sends (malformed, 503). Expected
scores come from the in-process reward (the PNG wire format is lossless on the 8-bit grid the JPEG reward
quantises to) and from weighted sums written out by hand.
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
from types import SimpleNamespace

import httpx
import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility, jpeg_size_kb

from flowgrpo.rewards.background import AsyncRewardScorer, RewardError
from flowgrpo.rewards.base import BaseReward
from flowgrpo.rewards.compose import ComposedReward, compose_rewards
from flowgrpo.rewards.registry import load_reward
from flowgrpo.rewards.remote import RemoteReward, RemoteRewardError, images_to_png_b64, png_b64_to_images
from flowgrpo.rewards.server import ServerThread, create_app
from flowgrpo.testing.rewards import RewardConformance

# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------


def images_8bit(n: int, h: int = 32, w: int = 32, seed: int = 0, noise: float = 0.3) -> torch.Tensor:
    """(n, 3, H, W) float32 on the 8-bit grid with per-image detail, so JPEG sizes differ."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    x = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    amp = torch.linspace(0, noise, n).view(n, 1, 1, 1)
    x = x + amp * (torch.rand(n, 3, h, w, generator=g) - 0.5)
    return (x.clamp(0, 1) * 255).round() / 255


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


class CatNotApplicable(BaseReward):
    """0.5 for every prompt, except NaN ("not applicable") for prompts that mention a cat."""

    name = "cat_na"

    def score(self, images, prompts, metadata):
        return torch.tensor([math.nan if "cat" in p else 0.5 for p in prompts], dtype=torch.float32)


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
# weighted composition (NaN: not applicable), and background scoring
# ------------------------------------------------------------------------------------------------------------


def test_nan_components_are_left_out_of_the_weighted_sum():
    nan = float("nan")
    a = torch.tensor([1.0, nan, 3.0, nan, -2.0])
    b = torch.tensor([2.0, 4.0, nan, nan, 0.5])
    out = compose_rewards({"a": a, "b": b}, {"a": 1.0, "b": 3.0})
    # sample 0: 1·1 + 3·2 = 7; 1: only b → 3·4 = 12; 2: only a → 1·3 = 3; 3: none → NaN;
    # 4: 1·(−2) + 3·0.5 = −0.5
    assert out.total[:3].tolist() == [7.0, 12.0, 3.0]
    assert math.isnan(out.total[3])
    assert out.total[4].item() == pytest.approx(-0.5)
    assert out.total.dtype == torch.float32
    torch.testing.assert_close(out.components["a"], a, equal_nan=True)
    assert out.weights == {"a": 1.0, "b": 3.0}
    # the same through ComposedReward with a plugin and a reward that is NaN ("not applicable") for cat prompts
    images = images_8bit(4)
    prompts = ["a cat", "a dog", "a cat on a mat", "a tree"]
    composed = ComposedReward({"jpeg": JpegCompressibility(), "cat_na": CatNotApplicable()},
                              {"jpeg": 2.0, "cat_na": 1.0})
    out = composed(images, prompts, [{}] * 4)
    j = -jpeg_size_kb(images)
    # by hand: cat prompts have only the JPEG component present (2·j); the others add both, 2·j + 1·0.5
    expected = torch.stack([2 * j[0], 2 * j[1] + 0.5, 2 * j[2], 2 * j[3] + 0.5])
    torch.testing.assert_close(out.total, expected)
    assert torch.isnan(out.components["cat_na"]).tolist() == [True, False, True, False]
    # no component present: the composed reward is NaN
    alone = ComposedReward({"cat_na": CatNotApplicable()}, {"cat_na": 1.0})(images, prompts, [{}] * 4)
    assert torch.isnan(alone.total).tolist() == [True, False, True, False]
    assert alone.total[1].item() == 0.5
    out = ComposedReward({"ok": _Const([1.0, float("nan")])}, {"ok": 1.0})(torch.zeros(2, 3, 4, 4), ["a", "b"],
                                                                         [{}, {}])
    assert out.total[0] == 1.0 and torch.isnan(out.total[1])


@pytest.mark.parametrize("weights, expected", [
    # a penalty: the weighted mean's denominator 1 − 1 = 0 made every total NaN
    ({"quality": 1.0, "penalty": -1.0}, [0.5 - 0.25, 0.75 - 1.0]),
    # 0.5·q − 1.0·p: the weighted mean divided by −0.5 and flipped the sign of every total
    ({"quality": 0.5, "penalty": -1.0}, [0.25 - 0.25, 0.375 - 1.0]),
])
def test_negative_weights_are_penalties_not_nan_or_sign_flips(weights, expected):
    q = torch.tensor([0.5, 0.75])
    p = torch.tensor([0.25, 1.0])
    out = compose_rewards({"quality": q, "penalty": p}, weights)
    assert out.total.tolist() == pytest.approx(expected)


def test_one_reward_composes_to_its_weighted_score():
    r = torch.tensor([0.25, -1.5, 7.0])
    assert torch.equal(compose_rewards({"r": r}, {"r": 1.0}).total, r)
    assert compose_rewards({"r": r}, {"r": 2.5}).total.tolist() == [0.625, -3.75, 17.5]


def test_composition_rejects_mismatched_names_and_shapes():
    with pytest.raises(ValueError, match="differ"):
        compose_rewards({"a": torch.zeros(2)}, {"b": 1.0})
    with pytest.raises(ValueError, match="shapes"):
        compose_rewards({"a": torch.zeros(2), "b": torch.zeros(3)}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="shapes"):
        compose_rewards({"a": torch.zeros(2, 2)}, {"a": 1.0})


class _Const:
    name = "const"

    def __init__(self, values):
        self.values = values

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        return torch.tensor(self.values)


class _List(_Const):
    def __call__(self, images, prompts, metadata):
        return list(self.values)


def test_composed_reward_scores_each_and_checks_shapes():
    composed = ComposedReward({"x": _Const([1.0, 2.0]), "y": _Const([3.0, float("nan")])}, {"x": 1.0, "y": 1.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert out.total.tolist() == [4.0, 2.0]  # 1 + 3, and 2 + (y not applicable)
    bad = ComposedReward({"x": _Const([1.0, 2.0, 3.0])}, {"x": 1.0})
    from flowgrpo.rewards.compose import RewardError

    with pytest.raises(RewardError, match="'x' returned shape"):
        bad.score_components(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_an_infinite_reward_is_an_error_naming_the_reward():
    from flowgrpo.rewards.compose import RewardError

    composed = ComposedReward({"bad": _Const([1.0, float("inf")])}, {"bad": 1.0})
    with pytest.raises(RewardError, match=r"reward 'bad' returned an infinite score for sample\(s\) \[1\]"):
        composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_none_is_not_applicable():
    composed = ComposedReward({"x": _Const([0.5, 1.0]), "maybe": _List([None, 2.0])}, {"x": 1.0, "maybe": 2.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert torch.isnan(out.components["maybe"][0]) and out.total.tolist() == [0.5, 5.0]


def test_composed_reward_shows_the_training_prompts_to_the_rewards_that_ask():
    """The optional ``check_training_prompts`` hook (flowgrpo.rewards.base) reaches every component that has it."""
    seen = []

    class Asks(_Const):
        def check_training_prompts(self, prompts):
            seen.append((self.values, prompts))

    prompts = SimpleNamespace(prompts=["a"], metadata=[{}], source="p.txt")
    ComposedReward({"x": _Const([1.0]), "y": Asks([2.0]), "z": Asks([3.0])}, {"x": 1.0, "y": 1.0, "z": 1.0}) \
        .check_training_prompts(prompts)
    assert seen == [([2.0], prompts), ([3.0], prompts)]


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


class JpegUnlessCat(JpegCompressibility):
    """JPEG compressibility, documented as NaN ("not applicable") for prompts that mention a cat."""

    name = "jpeg_unless_cat"

    def score(self, images, prompts, metadata):
        s = super().score(images, prompts, metadata)
        return torch.where(torch.tensor(["cat" in p for p in prompts]), torch.nan, s)


class TestDocumentedNanConformance(RewardConformance):
    """A reward with a documented NaN case passes the suite, which checks NaN exactly where documented."""

    reward_factory = JpegUnlessCat
    prompt_factory = staticmethod(lambda n: [f"a dog, picture {i}" for i in range(n)])
    nan_case = staticmethod(lambda: (images_8bit(3), ["a cat", "a dog", "two cats"], [{}] * 3, [True, False, True]))
