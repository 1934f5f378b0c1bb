"""The reward server under concurrent clients: images/s, p50/p99 latency and failures per configuration.

    python bench/rewards_remote.py [--clients 1 8 32 128] [--images 8] [--size 128] [--quick]

Each configuration starts ``flowgrpo-reward-server`` as a separate process on 127.0.0.1 (as in training) and
runs C concurrent ``remote`` reward clients (threads of this process, each with its own HTTP connection), each
scoring ``max(3, 96 // C)`` batches of ``--images`` images of ``--size``² (smooth colour fields with noise, on
the 8-bit grid). Each client PNG-encodes its batches before the clock starts (the client's cost, 7 ms per 128²
image on the 2-core machine, is left out so that the table measures the server) and sends them through the
``remote`` reward's own request path: retries, backoff and deadline. A latency is one call: the HTTP round trip,
queueing, decoding and scoring; images/s is all images over the wall time of the run; a failure is a call that
raised. Configurations: the JPEG reward (one scoring thread, without and with cross-request batching, and two worker
processes) and the HPSv2 reward on its tiny stand-in (``flowgrpo_rewards.tiny_models``; a batched model, one
scoring thread), without and with cross-request batching. The first call of each client checks that the
remote score equals the in-process reward's (JPEG) or is within 1e-5 of it (HPS, whose float sums may depend on
the batch it is merged into).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from flowgrpo.rewards.remote import RemoteReward, images_to_png_b64
from flowgrpo.rewards.serving import nearest_rank
from flowgrpo.testing.rewards import default_images


def start_server(reward: str, kwargs: dict, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """``flowgrpo-reward-server`` in a subprocess on a free loopback port; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "flowgrpo.rewards.server", "--reward", reward, "--kwargs", json.dumps(kwargs),
           "--port", "0", "--device", "cpu", "--log-level", "info", "--no-access-log", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r" on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("the reward server did not start")


def run_clients(url: str, clients: int, images: int, size: int, local, exact: bool) -> dict:
    """C concurrent clients; returns images/s, p50/p99 latency (ms) and the number of failed calls."""
    batches = max(3, 96 // clients)
    start = threading.Barrier(clients, timeout=300)

    def client(c: int) -> tuple[list[float], int, float, float]:
        remote = RemoteReward(url, batch_size=images, deadline=600)
        remote.setup("cpu")
        data = [default_images(images, size, size, torch.Generator().manual_seed(1000 * c + b))
                for b in range(batches)]
        prompts, meta = [f"a photo of object {c}"] * images, [{}] * images
        bodies = [json.dumps({"images": images_to_png_b64(x), "prompts": prompts, "metadata": meta}).encode()
                  for x in data]
        start.wait()
        t_start, latencies, failures = time.perf_counter(), [], 0
        for b, (x, body) in enumerate(zip(data, bodies, strict=True)):
            t0 = time.perf_counter()
            try:  # the remote reward's own request path (retries, backoff, deadline) on a pre-encoded body
                got = remote._parse_scores(remote._request("POST", "/score", body), images)
            except Exception:  # noqa: BLE001 - a failed call is what the benchmark counts
                failures += 1
                continue
            latencies.append(time.perf_counter() - t0)
            if b == 0 and local is not None:
                want = local(x, prompts, meta)
                assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5), (got, want)
        t_end = time.perf_counter()
        remote.close()
        return latencies, failures, t_start, t_end

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    wall = max(r[3] for r in results) - min(r[2] for r in results)  # from the start signal to the last answer
    lat = sorted(x for r in results for x in r[0])
    failures = sum(r[1] for r in results)
    return {"images/s": len(lat) * images / wall, "p50 ms": 1000 * nearest_rank(lat, 0.5) if lat else float("nan"),
            "p99 ms": 1000 * nearest_rank(lat, 0.99) if lat else float("nan"), "failures": failures}


def configurations(root: Path, quick: bool):
    """(label, reward name, kwargs, server flags, in-process reward, exact) of every configuration."""
    from flowgrpo_rewards import tiny_models as tm
    from flowgrpo_rewards.hps import HPSv2Reward
    from flowgrpo_rewards.jpeg import JpegCompressibility

    tm.save_tiny_hps_checkpoint(root / "hps" / "HPS_v2.1_compressed.pt", seed=1)
    hps_kwargs = {"checkpoint": str(root / "hps"), "architecture": tm.TINY_OPEN_CLIP, "batch_size": 64}
    hps = HPSv2Reward(**hps_kwargs)
    hps.setup(torch.device("cpu"))
    jpeg = JpegCompressibility()
    configs = [
        ("jpeg, 1 thread, no cross-request batching", "jpeg_compressibility", {}, ["--no-cross-request-batching"],
         jpeg, True),
        ("jpeg, 1 thread, cross-request batching", "jpeg_compressibility", {}, [], jpeg, True),
        ("jpeg, 2 worker processes, batching", "jpeg_compressibility", {}, ["--workers", "2"], jpeg, True),
        ("hpsv2 tiny, no cross-request batching", "hpsv2", hps_kwargs, ["--no-cross-request-batching"], hps, False),
        ("hpsv2 tiny, cross-request batching", "hpsv2", hps_kwargs, [], hps, False),
    ]
    return configs[1:2] + configs[4:5] if quick else configs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--images", type=int, default=8, help="images per client call (default 8)")
    p.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    p.add_argument("--batch-size", type=int, default=64, help="the server's --batch-size (default 64)")
    p.add_argument("--quick", action="store_true", help="only the two batched configurations")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, reward, kwargs, flags, local, exact in configurations(Path(tmp), args.quick):
            proc, url = start_server(reward, kwargs, [*flags, "--batch-size", str(args.batch_size)])
            try:
                for c in args.clients:
                    rows.append({"configuration": label, "clients": c,
                                 **run_clients(url, c, args.images, args.size, local, exact)})
                    print(f"{label:<45} {c:>4} clients: {rows[-1]}", file=sys.stderr, flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    print(f"{args.images} images of {args.size}x{args.size} per call, server --batch-size {args.batch_size}, "
          f"server and clients on 127.0.0.1 of one machine")
    print("| configuration | clients | images/s | p50 ms | p99 ms | failures |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['configuration']} | {r['clients']} | {r['images/s']:.0f} | {r['p50 ms']:.0f} | "
              f"{r['p99 ms']:.0f} | {r['failures']} |")


if __name__ == "__main__":
    main()
