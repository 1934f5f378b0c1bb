"""The reward server's decoded memory is bounded by construction (issue 42, case 3): a request whose images
decode to more than ``--max-request-pixels`` is refused with 413, and one that would take the requests in flight
past ``--max-pixels-in-flight`` with 503, both from the PNG headers before anything is decoded.

The server runs as its own process (``python -m flowgrpo.rewards.server``, as a user starts it) and its peak
resident memory is read from ``/proc/<pid>/status`` (``VmHWM``, Linux). The requests are small bodies of all-zero
2048×2048 PNGs (~10 KB each) that decode to 12 MiB each (3 bytes a pixel) and 48 MiB as the float32 images a
reward gets.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from flowgrpo.rewards.base import BaseReward

REPO = Path(__file__).resolve().parents[2]
SIDE = 2048
PIXELS = SIDE * SIDE


class SlowMean(BaseReward):
    """The mean pixel value, after half a second: keeps requests in flight together."""

    name = "slow_mean"

    def score(self, images, prompts, metadata):
        time.sleep(0.5)
        return images.mean(dim=(1, 2, 3)).float()


def _zero_png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((SIDE, SIDE, 3), dtype=np.uint8)).save(buf, format="PNG", compress_level=9)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def server():
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads peak memory from /proc (Linux)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowgrpo.rewards.server", "--reward", "tests.rewards.test_server_memory:SlowMean",
         "--port", str(port), "--device", "cpu", "--max-request-pixels", str(2 * PIXELS), "--max-pixels-in-flight",
         str(4 * PIXELS), "--log-level", "warning", "--no-access-log", "--batch-size", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {proc.stdout.read()[-2000:]}")
        time.sleep(0.2)
    yield url, proc.pid
    proc.terminate()
    proc.wait(30)


def _post(url: str, n: int, png: str) -> httpx.Response:
    body = json.dumps({"images": [png] * n, "prompts": ["p"] * n, "metadata": [{}] * n})
    return httpx.post(url + "/score", content=body, headers={"Content-Type": "application/json"}, timeout=120)


def test_decoded_pixels_are_refused_before_decoding_and_peak_memory_stays_within_the_budget(server):
    url, pid = server
    png = _zero_png_b64()
    small = _post(url, 1, png)  # warm up: imports, the first reward call
    assert small.status_code == 200 and small.json()["scores"] == [0.0]
    base = _peak_mb(pid)

    # one request of 8 small PNGs (~80 KB of body) that would decode to 8 x 12 MiB: refused from the headers
    r = _post(url, 8, png)
    assert r.status_code == 413
    assert r.json()["error"] == (f"8 images of {SIDE}x{SIDE} decode to {8 * PIXELS} pixels, over the per-request "
                                 f"budget of {2 * PIXELS} decoded pixels (the server's --max-request-pixels); send "
                                 "fewer or smaller images per request")
    assert _peak_mb(pid) - base < 40  # nothing decoded (the body itself is ~0.1 MB)

    # 8 requests of 2 images each at once: two fit the in-flight budget, the others are refused with 503
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: _post(url, 2, png), range(8)))
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 2 and set(codes) <= {200, 503}
    busy = [r for r in replies if r.status_code == 503]
    assert busy, codes
    assert all("over the budget of 16777216 decoded pixels in flight (the server's --max-pixels-in-flight)"
               in r.json()["error"] and r.headers["Retry-After"] for r in busy)
    # at most 4 images in flight: 4 x (12 MiB uint8 + 48 MiB float32) = 240 MiB bounds it (measured: 174 MiB; the
    # same 8 requests without the budgets: 359 MiB)
    peak = _peak_mb(pid) - base
    assert peak < 260, f"peak grew by {peak:.0f} MiB"
    torch.testing.assert_close(torch.tensor([r.json()["scores"] for r in replies if r.status_code == 200]).sum(),
                               torch.tensor(0.0))
