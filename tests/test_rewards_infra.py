"""Reward plugin infrastructure: the entry-point registry, NaN composition, background scoring, the remote reward.

Registry tests install throw-away plugin distributions (a ``*.dist-info`` folder with ``entry_points.txt`` and
a module beside it) on ``sys.path``, so the real ``importlib.metadata`` discovery runs. Remote tests start real
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
import textwrap
import threading
import time
import uuid
from importlib.metadata import entry_points, version
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility, jpeg_size_kb

from flowgrpo.rewards.background import AsyncRewardScorer, RewardError
from flowgrpo.rewards.base import BaseReward
from flowgrpo.rewards.compose import ComposedReward
from flowgrpo.rewards.conformance import RewardConformance
from flowgrpo.rewards.registry import (
    RewardLoadError,
    load_reward,
    registered_rewards,
    resolve_reward_factory,
)
from flowgrpo.rewards.remote import RemoteReward, RemoteRewardError, images_to_png_b64, png_b64_to_images
from flowgrpo.rewards.server import ServerThread, create_app

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
# registry
# ------------------------------------------------------------------------------------------------------------


def install_fake_dist(root, dist: str, ver: str, eps: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution under ``root``: METADATA, entry_points.txt, and top-level modules."""
    info = root / f"{dist.replace('-', '_')}-{ver}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {ver}\n")
    lines = "\n".join(f"{k} = {v}" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[flowgrpo.rewards]\n{lines}\n")
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))


GOOD_PLUGIN = """
    import torch
    from flowgrpo.rewards.base import BaseReward

    class Mean(BaseReward):
        name = "mean"

        def __init__(self, scale=1.0):
            self.scale = scale

        def score(self, images, prompts, metadata):
            return self.scale * images.mean(dim=(1, 2, 3))

    def factory(scale=1.0):
        return Mean(scale)

    class Holder:
        make = staticmethod(factory)

    class NoSetup:
        def __init__(self):
            pass
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Two fake distributions: one with a working and a broken plugin, one that reuses a name of the first."""
    tag = uuid.uuid4().hex[:8]
    good, broken, other = f"good_{tag}", f"broken_{tag}", f"other_{tag}"
    install_fake_dist(
        tmp_path / "a", "fake-plugins-a", "1.2.3",
        {f"mean_{tag}": f"{good}:Mean", f"broken_{tag}": f"{broken}:Reward", f"dup_{tag}": f"{good}:factory"},
        {good: GOOD_PLUGIN, broken: "raise ImportError('needs the missing package frobnicate')\n"},
    )
    install_fake_dist(
        tmp_path / "b", "fake-plugins-b", "0.9", {f"dup_{tag}": f"{other}:Other"},
        {other: "raise RuntimeError('must not be imported')\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    return SimpleNamespace(tag=tag, good=good, broken=broken, other=other)


def test_entry_point_plugin_loads_lazily_with_provenance(plugins):
    t = plugins.tag
    reward, origin = load_reward(f"mean_{t}", scale=2.0)
    images = torch.rand(3, 3, 8, 8)
    torch.testing.assert_close(reward(images, ["a"] * 3, [{}] * 3), 2.0 * images.mean(dim=(1, 2, 3)))
    assert (origin.name, origin.target) == (f"mean_{t}", f"{plugins.good}:Mean")
    assert (origin.distribution, origin.version) == ("fake-plugins-a", "1.2.3")
    # the broken plugin and the other distribution's module were never imported
    assert plugins.broken not in sys.modules and plugins.other not in sys.modules


def test_a_plugin_that_fails_to_import_breaks_only_runs_that_name_it(plugins):
    from flowgrpo.runner import build_rewards

    t = plugins.tag
    composed, origins = build_rewards([SimpleNamespace(name=f"mean_{t}", weight=1.0, kwargs={})])
    assert list(composed.rewards) == [f"mean_{t}"] and origins[0].distribution == "fake-plugins-a"
    with pytest.raises(RewardLoadError, match=rf"broken_{t}.*fake-plugins-a 1\.2\.3.*frobnicate"):
        load_reward(f"broken_{t}")


def test_module_attr_names(plugins):
    reward, origin = load_reward(f"{plugins.good}:Holder.make", scale=3.0)
    images = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(reward(images, ["a", "b"], [{}, {}]), 3.0 * images.mean(dim=(1, 2, 3)))
    assert origin.target == f"{plugins.good}:Holder.make"
    # an installed package's module:attr records its distribution and version
    _, origin = load_reward("flowgrpo_rewards.jpeg:JpegCompressibility")
    assert (origin.distribution, origin.version) == ("flowgrpo-rewards", version("flowgrpo-rewards"))
    with pytest.raises(RewardLoadError, match="Nope"):
        load_reward(f"{plugins.good}:Nope")
    with pytest.raises(RewardLoadError, match="frobnicate"):
        load_reward(f"{plugins.broken}:Reward")
    with pytest.raises(RewardLoadError, match="both parts"):
        load_reward(":Mean")


def test_unknown_name_lists_registered_names_and_closest_match(plugins):
    with pytest.raises(RewardLoadError) as info:
        load_reward("jpeg_compresibility")
    msg = str(info.value)
    assert "did you mean 'jpeg_compressibility'" in msg
    for name in ("jpeg_compressibility", "jpeg_incompressibility", "remote", f"mean_{plugins.tag}"):
        assert repr(name) in msg
    assert "module:attr" in msg


def test_duplicate_name_is_an_error_naming_both_packages(plugins):
    t = plugins.tag
    with pytest.raises(RewardLoadError) as info:
        resolve_reward_factory(f"dup_{t}")
    msg = str(info.value)
    assert "fake-plugins-a 1.2.3" in msg and "fake-plugins-b 0.9" in msg and "registered twice" in msg
    with pytest.raises(RewardLoadError, match="registered twice"):
        registered_rewards()
    # names nobody else registers still load while the clash exists
    load_reward(f"mean_{t}")
    assert plugins.other not in sys.modules


def test_bad_kwargs_and_non_rewards_are_load_errors(plugins):
    with pytest.raises(RewardLoadError, match="rejected its kwargs"):
        load_reward(f"mean_{plugins.tag}", colour="red")
    with pytest.raises(RewardLoadError, match="without setup"):
        load_reward(f"{plugins.good}:NoSetup")


def test_the_readme_example_plugin_declares_and_loads_its_reward(monkeypatch):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1] / "examples" / "reward_plugin"
    eps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["flowgrpo.rewards"]
    assert eps == {"colorfulness": "flowgrpo_colorfulness.reward:Colorfulness"}
    monkeypatch.syspath_prepend(str(root))  # as if installed: the same target through module:attr
    reward, _ = load_reward(eps["colorfulness"], scale=2.0)
    reward.setup("cpu")
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1.0  # solid red: 0.3 * sqrt(255² + 127.5²) (Hasler & Süsstrunk M^(3)), halved by scale 2
    assert math.isclose(reward(red, ["r"], [{}]).item(), 0.3 * math.hypot(255, 127.5) / 2, rel_tol=1e-6)


def test_core_registers_the_remote_reward_and_the_server_command():
    assert registered_rewards()["remote"].value == "flowgrpo.rewards.remote:RemoteReward"
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("flowgrpo-reward-server") == "flowgrpo.rewards.server:main"


# ------------------------------------------------------------------------------------------------------------
# composition with NaN, and background scoring
# ------------------------------------------------------------------------------------------------------------


def test_composed_reward_with_a_nan_component_is_the_weighted_sum_of_present_components():
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

        def score(self, images, prompts, metadata):
            self.n += 1
            if self.n == 2:
                raise RuntimeError("CUDA out of memory (simulated)")
            return torch.ones(images.shape[0])

    class WrongShape(BaseReward):
        name = "wrong"

        def score(self, images, prompts, metadata):
            return torch.ones(images.shape[0] + 1)

    composed = ComposedReward({"jpeg": JpegCompressibility(), "fragile": FailsOnSecond()},
                              {"jpeg": 1.0, "fragile": 1.0})
    with AsyncRewardScorer(composed) as scorer:
        handles = [scorer.submit(images_8bit(2, seed=s), ["p"] * 2, [{}] * 2) for s in range(3)]
        assert handles[0].result()["fragile"].tolist() == [1.0, 1.0]
        with pytest.raises(RewardError, match="'fragile'.*out of memory") as info:
            handles[1].result()
        assert info.value.reward_name == "fragile" and isinstance(info.value.__cause__, RuntimeError)
        assert handles[2].result()["fragile"].tolist() == [1.0, 1.0]  # later batches are still scored
        with pytest.raises(RewardError, match="fragile"):
            scorer.gather(handles)
        with pytest.raises(ValueError, match="2 images but 1 prompts"):
            scorer.submit(images_8bit(2), ["p"], [{}, {}])
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
