"""Throughput of the JPEG reward in-process vs through the remote path (client → flowgrpo-reward-server).

    python bench/rewards_remote.py [--sizes 64 256] [--batch 32] [--seconds 3]

The server runs as a separate process (``python -m flowgrpo.rewards.server``) on 127.0.0.1, as it would in
training; the remote path pays PNG encoding and base64 on the client, JSON and HTTP over loopback, PNG decoding
on the server, and then the same JPEG scoring. Prints images/s for both and the mean request size. Images are
smooth random colour fields with per-image noise (the conformance suite's inputs), on the 8-bit grid.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time

import torch
from flowgrpo_rewards.jpeg import JpegCompressibility

from flowgrpo.rewards.conformance import default_images
from flowgrpo.rewards.remote import RemoteReward, images_to_png_b64


def rate(fn, n_images: int, seconds: float) -> float:
    """Images per second of ``fn()`` (which scores ``n_images``), repeated for at least ``seconds``."""
    fn()  # warm-up
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= seconds and calls >= 3:
            return calls * n_images / dt


def start_server() -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "flowgrpo.rewards.server", "--reward", "jpeg_compressibility", "--port", "0",
           "--device", "cpu", "--log-level", "info", "--no-access-log"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    proc, url = start_server()
    try:
        remotes = {lvl: RemoteReward(url, batch_size=args.batch, retries=30, backoff=0.2, compress_level=lvl)
                   for lvl in (1, 0)}
        for r in remotes.values():
            r.setup("cpu")
        local = JpegCompressibility()
        rows = []
        for s in args.sizes:
            images = default_images(args.batch, s, s, torch.Generator().manual_seed(s))
            prompts, meta = ["a prompt"] * args.batch, [{}] * args.batch
            for r in remotes.values():  # the wire format is lossless on the 8-bit grid: identical scores
                assert torch.equal(r(images, prompts, meta), local(images, prompts, meta))
            row = {"size": s, "in-process": rate(lambda: local(images, prompts, meta), args.batch, args.seconds)}  # noqa: B023
            for lvl, r in remotes.items():
                row[f"remote, PNG level {lvl}"] = rate(lambda: r(images, prompts, meta), args.batch, args.seconds)  # noqa: B023
                t0 = time.perf_counter()
                enc = images_to_png_b64(images, compress_level=lvl)
                row[f"encode ms/img, level {lvl}"] = (time.perf_counter() - t0) / args.batch * 1000
                row[f"kB/img, level {lvl}"] = sum(len(x) for x in enc) / args.batch / 1000
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"JPEG compressibility reward (images/s), batch {args.batch}, server on 127.0.0.1 in another process, "
          f"{torch.get_num_threads()} torch thread in the client; base64 PNG sizes on the wire")
    keys = [k for k in rows[0] if k != "size"]
    print(f"{'size':>9} | " + " | ".join(f"{k:>{max(len(k), 8)}}" for k in keys))
    for row in rows:
        cells = [f"{row[k]:>{max(len(k), 8)}.{1 if 'ms' in k or 'kB' in k else 0}f}" for k in keys]
        print(f"{row['size']:>4}x{row['size']:<4} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
