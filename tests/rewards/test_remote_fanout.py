"""A remote reward over several servers: requests spread over them, a server killed mid-run loses no batch, the
latency of each is reported, bad URLs are refused in one line naming the value."""

from __future__ import annotations

import math
import time

import pytest
import torch

from flowgrpo.images import to_uint8
from flowgrpo.rewards.compose import ComposedReward
from flowgrpo.rewards.remote import RemoteReward, RemoteRewardError, server_metrics
from flowgrpo.rewards.server import ServerThread, create_app
from tests.rewards.test_remote import free_port


class MeanPixel:
    """Scores an image by the mean of its 8-bit pixels over 255; counts the images it scored."""

    def __init__(self) -> None:
        self.scored = 0

    def setup(self, device) -> None:
        pass

    def __call__(self, images, prompts, metadata):
        self.scored += images.shape[0]
        time.sleep(0.02)  # slow enough that the requests of a batch overlap
        return images.flatten(1).mean(1)


def _expected(images: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(to_uint8(images)).double().flatten(1).mean(1).float() / 255


def _server():
    reward = MeanPixel()
    srv = ServerThread(create_app(reward, reward_name="mean_pixel", batch_size=4)).start()
    srv.reward = reward
    return srv


def test_two_servers_share_the_batches_and_one_killed_mid_run_loses_none():
    a, b = _server(), _server()
    try:
        remote = RemoteReward([a.url, b.url], batch_size=2, backoff=0.05, max_backoff=0.2, deadline=20, timeout=5)
        composed = ComposedReward({"mean_pixel": remote}, {"mean_pixel": 1.0})
        remote.setup("cpu")
        g = torch.Generator().manual_seed(0)
        images = torch.rand(12, 3, 8, 8, generator=g)
        got = remote(images, ["p"] * 12, [{}] * 12)
        torch.testing.assert_close(got, _expected(images), rtol=0, atol=1e-6)
        assert a.reward.scored > 0 and b.reward.scored > 0 and a.reward.scored + b.reward.scored == 12
        first = server_metrics(composed)
        assert first["reward/mean_pixel/server/0/requests"] + first["reward/mean_pixel/server/1/requests"] == 6
        assert first["reward/mean_pixel/server/0/latency_s"] > 0.02  # the reward's own 0.02 s and the round trip
        assert first["reward/mean_pixel/server/1/failures"] == 0
        a.stop()  # killed mid-run: every later batch is scored, by the other server
        scored_a = a.reward.scored
        for _ in range(3):
            images = torch.rand(10, 3, 8, 8, generator=g)
            got = remote(images, ["p"] * 10, [{}] * 10)
            torch.testing.assert_close(got, _expected(images), rtol=0, atol=1e-6)
        assert a.reward.scored == scored_a and b.reward.scored == 12 - scored_a + 30
        after = server_metrics(composed)
        assert after["reward/mean_pixel/server/0/failures"] >= 1 and after["reward/mean_pixel/server/0/requests"] == 0
        assert math.isnan(after["reward/mean_pixel/server/0/latency_s"])
        assert after["reward/mean_pixel/server/1/requests"] == 15
    finally:
        a.stop()
        b.stop()


def test_a_request_in_flight_on_a_dying_server_is_sent_to_the_other():
    from tests.rewards.test_remote_outage import Dying

    b = _server()
    try:
        with Dying(answers=2) as dying:  # /health and one /score, then it drops the next request and dies
            remote = RemoteReward([dying.url, b.url], batch_size=1, backoff=0.05, max_backoff=0.2, timeout=5)
            remote.setup("cpu")
            images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
            got = remote(images, ["p"] * 6, [{}] * 6)
            assert dying.died_at is not None
            stand_in = (got == 0.5).sum().item()  # the one batch the stand-in answered scores 0.5
            assert stand_in <= 1
            real = got != 0.5
            torch.testing.assert_close(got[real], _expected(images)[real], rtol=0, atol=1e-6)
            assert b.reward.scored == 6 - stand_in
    finally:
        b.stop()


def test_a_server_down_at_setup_is_left_out_at_once_and_the_reward_pickles():
    import pickle

    b = _server()
    try:
        down = f"http://127.0.0.1:{free_port()}"
        remote = RemoteReward([down, b.url], backoff=0.05, max_backoff=30, deadline=60, timeout=5)
        t0 = time.monotonic()
        remote.setup("cpu")
        assert time.monotonic() - t0 < 2.0  # one attempt at the down server, not retries until the 60 s deadline
        assert remote.server_metrics()["server/0/failures"] == 1  # that attempt
        images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
        got = remote(images, ["p"] * 4, [{}] * 4)
        torch.testing.assert_close(got, _expected(images), rtol=0, atol=1e-6)
        assert remote.server_metrics()["server/0/failures"] == 0  # left out: not even tried for these requests
        copy = pickle.loads(pickle.dumps(remote))
        torch.testing.assert_close(copy(images, ["p"] * 4, [{}] * 4), got, rtol=0, atol=0)
    finally:
        b.stop()


def test_every_server_down_fails_after_the_deadline_naming_them():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    remote = RemoteReward(urls, backoff=0.05, max_backoff=0.1, deadline=0.5, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"{urls[0]}/health, {urls[1]}/health failed after \d+ attempts"):
        remote.setup("cpu")
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("url, match", [
    (["http://127.0.0.1:1", "127.0.0.1:2"], r"url\[1\] must start with http:// or https://, got '127.0.0.1:2'"),
    (["http://127.0.0.1:1", "http://127.0.0.1:1/"], r"url\[1\] names the server 'http://127.0.0.1:1' twice"),
    ([], r"url must be a URL or a non-empty list of URLs, got \[\]"),
    ("http://:80", r"url must be http\(s\)://host\[:port\]\[/path\] with a host and no query, got 'http://:80'"),
    ("http://host:99999", r"url is not a valid URL \(.*\), got 'http://host:99999'"),
    ([3], r"url\[0\] must start with http:// or https://, got 3"),
])
def test_bad_urls_are_refused_in_one_line_naming_the_value(url, match):
    with pytest.raises(ValueError, match=match) as err:
        RemoteReward(url)
    assert "\n" not in str(err.value)
