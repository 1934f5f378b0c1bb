"""A lost reward server: the remote reward's ``deadline`` bounds the whole run's wait, not each queued batch's.

A stand-in server on 127.0.0.1 answers ``/health`` (and, for the training run, the "before" evaluation's
``/score``), then dies: it drops the next connection and stops listening. The batches queued behind the first
failed one are cancelled, later requests share its deadline, and the training command stops with one line.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flowgrpo.rewards.background import AsyncRewardScorer
from flowgrpo.rewards.compose import ComposedReward, RewardError
from flowgrpo.rewards.remote import RemoteReward, RemoteRewardError

REPO = Path(__file__).resolve().parents[2]


class Dying:
    """A stdlib HTTP server that answers ``answers`` requests (``/health`` ok; ``/score`` 0.5 each image), then
    dies: it drops the connection of the next request and closes its listening socket."""

    def __init__(self, answers: int) -> None:
        self.answers, self.died_at = answers, None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if outer.answers == 0:
                    outer.died_at = time.monotonic()
                    threading.Thread(target=outer.die, daemon=True).start()
                    self.close_connection = True
                    return  # no reply: the client sees the connection drop
                outer.answers -= 1
                if self.path == "/health":
                    data = {"status": "ok", "reward": "stand-in", "max_request_bytes": 10**7}
                else:
                    data = {"scores": [0.5] * len(json.loads(body)["images"]), "reward": "stand-in"}
                raw = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _reply

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def die(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.died_at is None:
            self.die()


def _images(n: int) -> torch.Tensor:
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(n))


def test_the_deadline_bounds_the_outage_and_queued_batches_are_cancelled():
    deadline = 1.5
    with Dying(answers=1) as srv:  # /health, then gone
        remote = RemoteReward(srv.url, deadline=deadline, backoff=0.1, max_backoff=0.3, timeout=5)
        remote.setup("cpu")
        scorer = AsyncRewardScorer(ComposedReward({"remote": remote}, {"remote": 1.0}))
        t0 = time.monotonic()
        handles = [scorer.submit(_images(2), ["a", "b"], [{}, {}]) for _ in range(4)]
        with pytest.raises(RewardError, match=rf"remote reward at {srv.url}/score failed after \d+ attempts.*"
                                              rf"deadline {deadline:g} s"):
            scorer.gather(handles)
        first = time.monotonic() - t0
        scorer.close()  # waits for the worker, as the interpreter's exit does
        total = time.monotonic() - t0
    assert first <= deadline + 0.5, first
    assert total - first < 0.5, (first, total)  # not one more retry chain per queued batch
    for h in handles[1:]:
        with pytest.raises(RewardError, match=f"batch {h.index} was not scored: the reward failed on batch 0 first"):
            h.result()
    # a later request shares the outage's deadline: it ends within it (plus an attempt), not a deadline later
    with pytest.raises(RemoteRewardError, match=rf"deadline {deadline:g} s"):
        remote(_images(2), ["a", "b"], [{}, {}])
    assert time.monotonic() - t0 < deadline + 0.5
    time.sleep(max(0.0, t0 + deadline - time.monotonic()))  # past the deadline: one failed attempt ends a request
    with pytest.raises(RemoteRewardError, match=r"failed after 1 attempts"):
        remote(_images(2), ["a", "b"], [{}, {}])


@pytest.mark.slow
def test_a_training_run_that_loses_its_reward_server_stops_in_one_line_within_the_deadline(tmp_path, tiny_flux_dir):
    """The whole command: four rollout micro-batches are queued when the server dies; the run stops one deadline
    after the death (plus an attempt's own time) with one line and no traceback, and retries nothing after it (the
    queued batches would each have run their own retry chain while the interpreter exits)."""
    deadline = 4.0
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    with Dying(answers=2) as srv:  # /health and the "before" evaluation's one /score, then gone
        reward = json.dumps([{"name": "remote", "kwargs": {"url": srv.url, "deadline": deadline, "backoff": 0.2,
                                                           "max_backoff": 0.5, "timeout": 10}}])
        cmd = [sys.executable, "flowgrpo/train.py", f"output_dir={tmp_path / 'run'}",
               f"model.pretrained={tiny_flux_dir}", "model.height=32", "model.width=32",
               "model.max_sequence_length=16", "sampling.num_steps=2", "eval_sampling.num_steps=2",
               "train.num_epochs=1", "train.prompts_per_epoch=2", "train.group_size=4",
               "train.rollout_batch_size=2", "train.train_batch_size=2", "objective.chunker={name: per_step}",
               "objective.kl_beta=0", f"rewards={reward}", "eval_rewards=[]", f"data.train_prompts={prompts}",
               "data.eval_prompts=null", "data.eval_num_prompts=2", "logging.progress=false"]
        proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
        lines = [(time.monotonic(), line.rstrip("\n")) for line in proc.stderr]  # each line as it is written
        proc.wait(timeout=600)
    text = "\n".join(line for _, line in lines)
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [(t, line) for t, line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], text[-3000:]  # nothing after it: no retries at exit
    when, last = errors[0]
    assert last.startswith("error: reward 'remote' failed on a batch of 2: RemoteRewardError: remote reward at "), last
    assert f"deadline {deadline:g} s" in last
    assert srv.died_at is not None and when - srv.died_at < deadline + 3.0, when - srv.died_at
