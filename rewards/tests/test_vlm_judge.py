"""The ``vlm_judge`` reward against local stand-in servers on 127.0.0.1 that speak the OpenAI chat-completions API
(no network): a correct one, a slow one, a failing one, and none at all.

The stand-in answers from the image itself: with m the mean of the decoded 8-bit pixels it gives the answer token
the top log-probabilities " Yes": log(0.6·m), "yes": log(0.4·m), "No": log(1 − m), "Maybe": log(0.01), so the
expected score p_yes / (p_yes + p_no) = m is computed here from the PNG the server received.
"""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("httpx")

from flowgrpo_rewards.vlm_judge import VlmJudgeError, VlmJudgeReward  # noqa: E402

MODEL = "stand-in-vlm"


class StandIn:
    """A threaded stand-in server; ``delay`` seconds before each chat reply, ``fail_first`` replies of HTTP 500,
    ``status`` forces every chat reply's status; records prompts and the peak number of requests in flight."""

    def __init__(self, delay: float = 0.0, fail_first: int = 0, status: int | None = None, logprobs: bool = True):
        self.delay, self.fail_left, self.status, self.logprobs = delay, fail_first, status, logprobs
        self.questions: list[str] = []
        self.in_flight = self.peak = self.chat_calls = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _reply(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.chat_calls += 1
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                    fail = outer.fail_left > 0
                    outer.fail_left -= 1 if fail else 0
                try:
                    time.sleep(outer.delay)
                    if outer.status is not None or fail:
                        code, payload = outer.status or 500, {"error": {"message": "stand-in failure"}}
                    else:
                        code, payload = 200, outer.answer(body)
                finally:
                    # out of flight before the reply leaves: once the client has it, it may send its next request,
                    # which must not meet this one still counted (a race that read 3 for a limit of 2)
                    with outer.lock:
                        outer.in_flight -= 1
                self._reply(code, payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, body: dict) -> dict:
        assert body["model"] == MODEL and body["max_tokens"] == 1 and body["logprobs"] is True
        content = body["messages"][0]["content"]
        image_url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        question = next(c["text"] for c in content if c["type"] == "text")
        with self.lock:
            self.questions.append(question)
        png = base64.b64decode(image_url.split(",", 1)[1])
        m = float(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64).mean() / 255)
        top = [{"token": " Yes", "logprob": math.log(0.6 * m)}, {"token": "yes", "logprob": math.log(0.4 * m)},
               {"token": "No", "logprob": math.log(1 - m)}, {"token": "Maybe", "logprob": math.log(0.01)}]
        choice = {"index": 0, "message": {"role": "assistant", "content": "Yes"}, "finish_reason": "length"}
        if self.logprobs:
            choice["logprobs"] = {"content": [{"token": " Yes", "logprob": top[0]["logprob"], "top_logprobs": top}]}
        return {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [choice]}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _images(means):
    return torch.stack([torch.full((3, 8, 8), v) for v in means])


def _judge(url, **kw):
    kw.setdefault("backoff", 0.01)
    return VlmJudgeReward(base_url=url, **kw)


def test_scores_are_the_renormalised_yes_probability():
    means = [0.2, 0.5, 0.9, 0.75]
    with StandIn() as srv:
        judge = _judge(srv.url)
        judge.setup("cpu")
        assert judge.model == MODEL  # the only served model
        scores = judge(_images(means), ["a cat", "a dog", "a car", "a tree"], [{}] * 4)
    expected = torch.tensor([round(255 * v) / 255 for v in means])  # the 8-bit PNG the server saw
    torch.testing.assert_close(scores, expected, atol=1e-6, rtol=0)
    assert sorted(srv.questions) == sorted(f'Does this image show "{p}"? Answer yes or no.'
                                           for p in ["a cat", "a dog", "a car", "a tree"])


def test_concurrency_is_bounded():
    with StandIn(delay=0.2) as srv:
        judge = _judge(srv.url, model=MODEL, max_concurrency=2)
        judge.setup("cpu")
        t0 = time.perf_counter()
        judge(_images([0.5] * 6), ["p"] * 6, [{}] * 6)
        elapsed = time.perf_counter() - t0
    assert srv.peak == 2, f"peak in flight {srv.peak}"
    assert elapsed >= 3 * 0.2 - 0.05  # six requests, two at a time


def test_a_slow_server_times_out_with_a_clear_error():
    with StandIn(delay=1.5) as srv:
        judge = _judge(srv.url, model=MODEL, timeout=0.3, retries=1)
        judge.setup("cpu")
        with pytest.raises(VlmJudgeError, match=r"failed after 2 attempts; last error: timed out after 0.3 s"):
            judge(_images([0.5]), ["p"], [{}])
        assert srv.chat_calls == 2


def test_a_failing_server_is_retried_then_reported():
    with StandIn(fail_first=2) as srv:
        judge = _judge(srv.url, model=MODEL, retries=2)
        judge.setup("cpu")
        assert float(judge(_images([0.4]), ["p"], [{}])) == pytest.approx(round(0.4 * 255) / 255, abs=1e-6)
        assert srv.chat_calls == 3
    with StandIn(status=500) as srv:
        judge = _judge(srv.url, model=MODEL, retries=1)
        judge.setup("cpu")
        with pytest.raises(VlmJudgeError, match="failed after 2 attempts; last error: HTTP 500"):
            judge(_images([0.4]), ["p"], [{}])
    with StandIn(status=400) as srv:  # a client error is not retried
        judge = _judge(srv.url, model=MODEL, retries=3)
        judge.setup("cpu")
        with pytest.raises(VlmJudgeError, match="HTTP 400"):
            judge(_images([0.4]), ["p"], [{}])
        assert srv.chat_calls == 1


def test_an_endpoint_that_is_down_fails_at_setup_naming_it():
    with socket.socket() as s:  # a free port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = _judge(f"http://127.0.0.1:{port}/v1", model=MODEL, retries=1, timeout=1.0)
    with pytest.raises(VlmJudgeError, match=rf"127.0.0.1:{port}/v1/models failed after 2 attempts.*ConnectError"
                                            r".*vllm serve"):
        judge.setup("cpu")


def test_wrong_model_missing_logprobs_and_bad_settings():
    with StandIn() as srv:
        with pytest.raises(VlmJudgeError, match="does not serve 'other'.*stand-in-vlm"):
            _judge(srv.url, model="other").setup("cpu")
    with StandIn(logprobs=False) as srv:
        judge = _judge(srv.url, model=MODEL)
        judge.setup("cpu")
        with pytest.raises(VlmJudgeError, match="support logprobs"):
            judge(_images([0.4]), ["p"], [{}])
    with pytest.raises(ValueError, match="prompt"):
        VlmJudgeReward(question="Is it good?")
    with pytest.raises(ValueError, match="top_logprobs"):
        VlmJudgeReward(top_logprobs=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        VlmJudgeReward(max_concurrency=0)


def test_conformance_against_the_stand_in():
    """The plugin conformance suite's clauses, run here with a live stand-in."""
    from flowgrpo.testing.rewards import RewardConformance

    with StandIn() as srv:
        class Suite(RewardConformance):
            reward_factory = staticmethod(lambda: _judge(srv.url, model=MODEL))

        suite = Suite()
        reward = suite.make_reward()
        reward.setup("cpu")
        suite.test_follows_protocol()
        for n in (1, 3):
            suite.test_output_shape_dtype_device(reward, n)
        suite.test_batch_order_equivariance(reward)
        suite.test_scores_do_not_depend_on_batch(reward)
        suite.test_deterministic(reward)
        suite.test_callable_from_worker_thread(reward)
        suite.test_does_not_modify_inputs(reward)
        suite.test_length_mismatch_raises_value_error(reward)
