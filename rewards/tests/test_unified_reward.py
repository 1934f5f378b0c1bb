"""The UnifiedReward judges (and the VLM judge on videos) against a local stand-in OpenAI-compatible server.

The stand-in reads the images it is sent (data URLs), takes the mean m of each one's decoded 8-bit pixels, and
answers as the released prompts ask: ``Final Score: 1+4m`` to Flow-GRPO's question, ``Alignment Score (1-5): 1+4m``
/ ``Coherence Score (1-5): 5−4m`` / ``Style Score (1-5): 3`` to the UnifiedReward-2.0 ones, and, to a pairwise
question, the brighter sample as the better one (``<answer>Image 1 is better</answer>`` for UnifiedReward-Think,
the sentence alone for pair_rank, a tie for equal means). Expected scores are computed here from the pixels the
server received and, for win rates, by hand.
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("httpx")

from flowgrpo_rewards.unified_reward import (  # noqa: E402
    FINAL_SCORE,
    THINK_IMAGE,
    THINK_VIDEO,
    UnifiedRewardPairwise,
    UnifiedRewardScore,
)
from flowgrpo_rewards.vlm_judge import VlmJudgeReward  # noqa: E402

from flowgrpo.testing.rewards import RewardConformance  # noqa: E402

MODEL = "UnifiedReward"


def _decode(url: str) -> tuple[str, tuple[int, int], float]:
    """(format, (H, W), mean pixel in [0, 1]) of a data-URL image."""
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    return img.format, (img.height, img.width), float(np.asarray(img.convert("RGB"), dtype=np.float64).mean() / 255)


class StandIn:
    """A threaded stand-in; records every chat request as (question, [(format, size, mean), ...])."""

    def __init__(self):
        self.requests: list[tuple[str, list]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self):
                self._reply(outer.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, body: dict) -> dict:
        content = body["messages"][0]["content"]
        images = [_decode(c["image_url"]["url"]) for c in content if c["type"] == "image_url"]
        question = next(c["text"] for c in content if c["type"] == "text")
        with self.lock:
            self.requests.append((question, images))
        if body.get("logprobs"):  # the yes/no judge: p_yes = the mean of every image sent
            m = float(np.mean([i[2] for i in images]))
            top = [{"token": "Yes", "logprob": math.log(m)}, {"token": "No", "logprob": math.log(1 - m)}]
            choice = {"message": {"content": "Yes"}, "logprobs": {"content": [{"token": "Yes", "top_logprobs": top}]}}
            return {"choices": [choice]}
        means = [i[2] for i in images]
        noun = "Video" if "Video 1" in question else "Image"
        if "is better" in question:  # pairwise: the first half of the images against the second
            a, b = np.mean(means[: len(means) // 2]), np.mean(means[len(means) // 2 :])
            verdict = f"{noun} 1 is better" if a > b else f"{noun} 2 is better" if b > a else "Both are equally good"
            text = f"<think>1. Semantic consistency: ...</think>\n<answer>{verdict}</answer>" if "<answer>" in \
                question else f"{verdict}."
        elif "mute" in question:
            text = "I cannot tell."
        elif "Final Score" in question:
            text = f"The image is fine.\nFinal Score: {1 + 4 * means[0]:.4f}"
        else:
            m = float(np.mean(means))
            text = (f"Alignment Score (1-5): {1 + 4 * m:.4f}\nCoherence Score (1-5): {5 - 4 * m:.4f}\n"
                    "Style Score (1-5): 3\nPhysics Score (1-5): 2.5")
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def server():
    with StandIn() as srv:
        yield srv


def _flat(values, size: int = 8) -> torch.Tensor:
    return torch.stack([torch.full((3, size, size), v) for v in values])


def _ready(reward):
    reward.setup("cpu")
    return reward


def test_final_score_is_flow_grpos(server):
    """Flow-GRPO's question, the image resized to 512² and sent as PNG, Final Score / 5."""
    server.requests.clear()
    r = _ready(UnifiedRewardScore(base_url=server.url))
    assert r.model == MODEL and r.name == "unifiedreward"
    scores = r(_flat([0.2, 0.7]), ["a cat", "a dog"], [{}, {}])
    got = sorted(server.requests)
    assert [q for q, _ in got] == sorted(FINAL_SCORE.format(prompt=p) for p in ["a cat", "a dog"])
    assert all(imgs[0][:2] == ("PNG", (512, 512)) for _, imgs in got)
    m = torch.tensor([round(255 * v) / 255 for v in (0.2, 0.7)])
    torch.testing.assert_close(scores, (1 + 4 * m) / 5, atol=1e-4, rtol=0)  # the reply's 4 decimals


def test_unifiedreward_2_dimension_scores_and_unparsed_replies(server):
    server.requests.clear()
    r = _ready(UnifiedRewardScore(template="alignment_coherence_style", dimension="coherence", base_url=server.url))
    assert r.name == "unifiedreward_coherence"
    scores = r(_flat([0.3]), ["a cat"], [{}])
    (question, images), = server.requests
    assert images[0][0] == "JPEG" and images[0][1] == (8, 8) and "Text Caption: [a cat]" in question
    torch.testing.assert_close(scores, torch.tensor([5 - 4 * images[0][2]]), atol=1e-4, rtol=0)
    assert torch.isnan(r(_flat([0.3]), ["mute"], [{}])).all()
    zero = _ready(UnifiedRewardScore(template="alignment_coherence_style", unparsed="zero", base_url=server.url))
    assert float(zero(_flat([0.3]), ["mute"], [{}])) == 0.0
    with pytest.raises(ValueError, match="asks for"):
        UnifiedRewardScore(template="final_score", dimension="style")
    with pytest.raises(ValueError, match="template must be"):
        UnifiedRewardScore(template="nope")


def test_video_point_score_sends_the_chosen_frames_in_order(server):
    server.requests.clear()
    r = _ready(UnifiedRewardScore(template="alignment_physics_style", dimension="physics", frames=3,
                                  base_url=server.url))
    video = _flat([0.1, 0.3, 0.5, 0.9]).unsqueeze(0)  # (1, F=4, 3, 8, 8)
    assert float(r(video, ["a ball falls"], [{}])) == pytest.approx(2.5)
    (question, images), = server.requests
    assert "generated video" in question
    assert [round(m * 255) for _, _, m in images] == [round(255 * v) for v in (0.1, 0.3, 0.9)]  # frames 0, 1, 3
    with pytest.raises(ValueError, match="unifiedreward_physics: scores videos"):
        r(_flat([0.5]), ["p"], [{}])


def test_pairwise_think_win_rates_by_hand(server):
    """Four samples of distinct brightness: each beats the darker ones, 6 requests, win rates k/3 rounded."""
    server.requests.clear()
    r = _ready(UnifiedRewardPairwise(base_url=server.url))
    scores = r(_flat([0.6, 0.2, 0.9, 0.4]), ["a cat"] * 4, [{}] * 4)
    assert scores.tolist() == pytest.approx([0.667, 0.0, 1.0, 0.333], abs=1e-7)
    assert len(server.requests) == 6 and all(q == THINK_IMAGE.format(prompt="a cat") for q, _ in server.requests)
    assert all(len(imgs) == 2 for _, imgs in server.requests)


def test_pairwise_ties_count_half_and_videos_send_both_frame_lists(server):
    r = _ready(UnifiedRewardPairwise(template="pair_rank", round_digits=None, base_url=server.url))
    torch.testing.assert_close(r(_flat([0.5, 0.5, 0.1]), ["p"] * 3, [{}] * 3), torch.tensor([0.75, 0.75, 0.0]))
    with pytest.raises(ValueError, match="use 'think' for videos"):
        r(_flat([0.1, 0.2]).unsqueeze(1), ["p"] * 2, [{}] * 2)
    server.requests.clear()
    think = _ready(UnifiedRewardPairwise(frames=2, base_url=server.url))
    videos = torch.stack([_flat([0.2, 0.3]), _flat([0.7, 0.8]), _flat([0.4, 0.5])])  # (3, 2, 3, 8, 8)
    assert think(videos, ["p"] * 3, [{}] * 3).tolist() == pytest.approx([0.0, 1.0, 0.5])
    assert all(q == THINK_VIDEO.format(prompt="p") and len(imgs) == 4 for q, imgs in server.requests)


def test_vlm_judge_scores_videos_through_their_frames(server):
    server.requests.clear()
    judge = _ready(VlmJudgeReward(base_url=server.url, frames="all"))
    video = _flat([0.2, 0.4, 0.9]).unsqueeze(0)
    expected = np.mean([round(255 * v) / 255 for v in (0.2, 0.4, 0.9)])
    assert float(judge(video, ["p"], [{}])) == pytest.approx(expected, abs=1e-6)
    assert len(server.requests[0][1]) == 3


_URL: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _url(server):
    _URL["url"] = server.url


class TestUnifiedRewardScoreConformance(RewardConformance):
    reward_factory = staticmethod(lambda: UnifiedRewardScore(base_url=_URL["url"], model=MODEL))
    image_size = (16, 16)


class TestUnifiedRewardPairwiseConformance(RewardConformance):
    reward_factory = staticmethod(lambda: UnifiedRewardPairwise(base_url=_URL["url"], model=MODEL))
    image_size = (16, 16)


class TestUnifiedRewardVideoConformance(RewardConformance):
    reward_factory = staticmethod(lambda: UnifiedRewardScore(template="alignment_physics_style", frames=2,
                                                             base_url=_URL["url"], model=MODEL))
    image_size = (16, 16)
