"""The heavier mesh runs of issue 41 (cases 2, 4, 5, 6) on CPU processes under gloo, beyond the representatives in
``tests/training/test_mesh.py``:

    python bench/mesh_runs.py OUT_DIR            # about 10 minutes on 2 idle cores

Prints one markdown row per comparison: the largest difference of the trained weights relative to each tensor's
largest value (max over tensors), the log-prob mismatch of every update (0.0: on-policy), and the reduce-scatters
counted per FSDP2 unit. Rows:

* ``2x2 LoRA``: HSDP LoRA on 4 processes (``parallel.replicate: 2``) against one process;
* ``1x4 -> 2x2``: a checkpoint written by 4 processes with one replica group resumed by a 2 x 2 mesh, the next
  epoch against the one-process run that never stopped;
* ``Wan2.2 experts``: the tiny two-expert Wan2.2 model fully fine-tuned on 2 processes, the untrained expert
  sharded (``parallel.experts: shard``, with sharded text encoders) or offloaded (``offload``) against it whole on
  the device (the frozen expert's forwards must run in the same order on both processes: the update's chunk plan);
* ``step vs micro_batch``: gradient sync per optimizer step against per pack, on 4 packs a step.

Each run is ``tests/training/mesh_train.py`` (its collective counts) or ``flowgrpo.runner.run`` in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from flowgrpo.checkpoints.save_load import whole_tensors

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO}/rewards"}


def _write(root: Path, name: str, cfg: dict) -> Path:
    cfg = {**cfg, "output_dir": str(root / name)}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _merge(base: dict, **sections) -> dict:
    out = dict(base)
    for key, value in sections.items():
        out[key] = {**out.get(key, {}), **value}
    return out


def _torchrun(n: int, configs: list[Path]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", _port(),
           str(REPO / "tests/training/mesh_train.py"), *map(str, configs)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])


def _port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _one(config: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "flowgrpo/train.py"), str(config)], cwd=REPO, env=ENV, check=True,
                   capture_output=True)


def _gap(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp(min=1e-30))
               for k in a)


def _weights(run: Path, epoch: int | None = None) -> dict[str, torch.Tensor]:
    if epoch is not None:
        return whole_tensors(run / "checkpoints" / f"epoch_{epoch}")["trainable"]
    lora = run / "lora" / "pytorch_lora_weights.safetensors"
    return load_file(lora)


def _mismatch(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["policy/logprob_mismatch_max"] for r in rows if "policy/logprob_mismatch_max" in r]


def _counts(run: Path) -> str:
    c = json.loads((run / "collectives_0.json").read_text())
    return f"{c['reduce_scatter'] / max(c['units'], 1):g} per unit ({c['backward']} packs, {c['steps']} steps)"


def main(out: Path) -> None:
    from flowgrpo.models.tiny import build_tiny_flux
    from flowgrpo.models.wan import build_tiny_wan

    out.mkdir(parents=True, exist_ok=True)
    flux = out / "flux" if (out / "flux").exists() else build_tiny_flux(out / "flux")
    wan = out / "wan22" if (out / "wan22").exists() else Path(build_tiny_wan(out / "wan22", variant="wan22"))
    prompts = out / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\na white cat\n")
    base = {"model": {"pretrained": str(flux), "max_sequence_length": 16, "height": 32, "width": 32, "lora_rank": 4},
            "sampling": {"num_steps": 4}, "eval_sampling": {"num_steps": 2},
            "train": {"num_epochs": 2, "prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 2, "lr": 1.0,
                      "adam_eps": 1.0e3, "weight_decay": 0.0},
            "objective": {"clip_range": 1e-2}, "rewards": [{"name": "jpeg_incompressibility"}],
            "data": {"train_prompts": str(prompts), "eval_num_prompts": 4},
            "logging": {"progress": False, "plot_every": 0, "save_every": 1}}
    rows = []

    one = _write(out, "one_lora", base)
    grid = _write(out, "grid_lora", _merge(base, parallel={"sharding": "fsdp2", "replicate": 2}))
    flat = _write(out, "flat_lora", _merge(base, parallel={"sharding": "fsdp2"}, train={**base["train"],
                                                                                       "num_epochs": 1}))
    moved = _write(out, "moved_lora", _merge(base, parallel={"sharding": "fsdp2", "replicate": 2}, train={
        **base["train"], "resume_from": str(out / "flat_lora" / "checkpoints" / "epoch_0")}))
    _one(one)
    _torchrun(4, [grid, flat, moved])
    rows.append(("2x2 LoRA vs 1 process", _gap(_weights(out / "one_lora"), _weights(out / "grid_lora")),
                 _mismatch(out / "grid_lora"), _counts(out / "grid_lora")))
    rows.append(("1x4 -> 2x2 resume vs 1 process", _gap(_weights(out / "one_lora"), _weights(out / "moved_lora")),
                 _mismatch(out / "moved_lora"), _counts(out / "moved_lora")))

    video = _merge(base, model={"pretrained": str(wan), "height": 32, "width": 32, "num_frames": 5,
                                "max_sequence_length": 16, "finetune": "full"},
                   sampling={"num_steps": 3, "guidance_scale": 4.0},
                   train={**base["train"], "num_epochs": 1, "prompts_per_epoch": 2, "lr": 0.1, "adam_eps": 0.1},
                   data={"train_prompts": str(prompts), "eval_num_prompts": 2})
    video["rewards"] = [{"name": "video_frames", "kwargs": {"base": "jpeg_incompressibility"}}]
    video["model"].pop("lora_rank", None)  # full fine-tuning reads no LoRA setting (refused when set)
    runs = {rule: _write(out, f"wan_{rule}", _merge(video, parallel={
        "sharding": "fsdp2", "experts": rule, **({"text_encoders": "shard"} if rule == "shard" else {})}))
        for rule in ("device", "shard", "offload")}
    _torchrun(2, list(runs.values()))
    for rule in ("shard", "offload"):
        rows.append((f"Wan2.2 experts={rule} vs device", _gap(_weights(out / "wan_device", 0),
                                                              _weights(out / f"wan_{rule}", 0)),
                     _mismatch(out / f"wan_{rule}"), _counts(out / f"wan_{rule}")))

    sync = _merge(base, train={**base["train"], "num_epochs": 1, "optimizer_steps_per_epoch": 1},
                  parallel={"sharding": "fsdp2"})
    per = {g: _write(out, f"sync_{g}", _merge(sync, parallel={"sharding": "fsdp2", "gradient_sync": g}))
           for g in ("micro_batch", "step")}
    _torchrun(2, list(per.values()))
    rows.append(("gradient_sync step vs micro_batch", _gap(_weights(out / "sync_micro_batch"),
                                                           _weights(out / "sync_step")),
                 _mismatch(out / "sync_step"), _counts(out / "sync_step") + "; micro_batch: "
                 + _counts(out / "sync_micro_batch")))

    print("| comparison | max relative weight difference | log-prob mismatch per update | reduce-scatters |")
    print("|---|---|---|---|")
    for name, gap, mismatch, counts in rows:
        print(f"| {name} | {gap:.1e} | {mismatch} | {counts} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/mesh_runs.py OUT_DIR")
    main(Path(sys.argv[1]))
