"""Identity of a refactor: train the main job (the embedded default) and every shipped digits config in this
checkout, and record what they learned (metrics without timings, and the sha256 of every weight file), so two
checkouts' records can be compared to the bit.

    python bench/identity.py record OUT.json [--main-epochs 90] [--config-epochs 3]
    python bench/identity.py compare BEFORE.json AFTER.json

``record`` runs each job in its own process through the CLI (``flowgrpo train``), one thread, in a temporary folder;
a config that the checkout cannot load is recorded with its error line. ``compare`` prints one row per job (same, or
the first metric or file that differs) and exits 1 if any differs. What it depends on: the machine (its CPU's
float rounding) and the digits base model in the cache, so compare records made on one machine with one cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
#: metric keys that measure the machine, not the training (dropped before comparing)
#: the teacher of digits_opd.yaml: the digits base model's pipeline folder in the cache (built by the main job)
TEACHER = Path(os.environ.get("FLOWGRPO_CACHE", Path.home() / ".cache" / "flowgrpo")) / "digits-v3-seed0"
TIMING_WORDS = ("second", "time", "timing", "mem", "rss", "per_s", "throughput", "_ms")


def _jobs(main_epochs: int, config_epochs: int) -> list[tuple[str, list[str]]]:
    jobs = [("main job", [f"train.num_epochs={main_epochs}"] if main_epochs != 90 else [])]
    for path in sorted((ROOT / "configs").glob("digits*.yaml")):
        extra = [f"objective.teacher={TEACHER}"] if path.name == "digits_opd.yaml" else []
        jobs.append((path.name, [str(path), f"train.num_epochs={config_epochs}", *extra]))
    return jobs


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of each weight file's content outside ``checkpoints/``: its metadata (sorted) and every tensor's name,
    dtype, shape and bytes in name order. Not the file's bytes: safetensors writes a header's metadata keys in a
    per-process order (a LoRA file's ``format`` and ``lora_adapter_metadata`` swap between two runs of one job)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.rglob("*.safetensors")):
        if "checkpoints" in path.relative_to(folder).parts:
            continue
        digest = hashlib.sha256()
        with safe_open(path, "pt") as f:
            digest.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[str(path.relative_to(folder))] = digest.hexdigest()
    return out


def _metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({k: v for k, v in row.items() if not any(w in k.lower() for w in TIMING_WORDS)})
    return rows


def _run(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "flowgrpo.cli", "train", *args[:1], f"output_dir={out}", "logging.progress=false",
           *args[1:]] if args and args[0].endswith(".yaml") else [
        sys.executable, "-m", "flowgrpo.cli", "train", f"output_dir={out}", "logging.progress=false", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return {"metrics": _metrics(out / "metrics.jsonl"), "weights": _digest(out)}


def record(dest: str, main_epochs: int, config_epochs: int) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, args) in enumerate(_jobs(main_epochs, config_epochs)):
            results[name] = _run(args, Path(tmp) / f"run{i}")
            print(f"{name}: {'error: ' + results[name]['error'] if 'error' in results[name] else 'done'}",
                  flush=True)
    Path(dest).write_text(json.dumps(results, indent=1))


def _first_difference(a: dict, b: dict) -> str | None:
    if "error" in a or "error" in b:
        return None if a == b else f"error: {a.get('error')!r} vs {b.get('error')!r}"
    if a["weights"] != b["weights"]:
        names = sorted(set(a["weights"]) ^ set(b["weights"])) or [
            k for k in a["weights"] if a["weights"][k] != b["weights"].get(k)]
        return f"weights differ: {names[0]}"
    for i, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"], strict=False)):
        for key in sorted(set(ra) | set(rb)):
            if ra.get(key) != rb.get(key) and not any(w in key.lower() for w in TIMING_WORDS):
                return f"record {i}: {key} {ra.get(key)!r} vs {rb.get(key)!r}"
    if len(a["metrics"]) != len(b["metrics"]):
        return f"{len(a['metrics'])} vs {len(b['metrics'])} records"
    return None


def compare(before: str, after: str) -> int:
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    bad = 0
    print("| job | identical |\n|---|---|")
    for name in sorted(set(a) | set(b)):
        diff = "missing" if name not in a or name not in b else _first_difference(a[name], b[name])
        bad += diff is not None
        print(f"| {name} | {'yes' if diff is None else 'no: ' + diff} |")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out")
    rec.add_argument("--main-epochs", type=int, default=90)
    rec.add_argument("--config-epochs", type=int, default=3)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    if args.verb == "record":
        record(args.out, args.main_epochs, args.config_epochs)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
