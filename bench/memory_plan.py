"""Tables of the per-GPU memory plan (``bench/memory.py --plan``): the computation is
:mod:`flowgrpo.memory_plan.estimate` (what
``flowgrpo plan CONFIG --gpus N`` prints for one config), whose docstring states what each part holds.

* :func:`reference_table`: FLUX.1-dev, SD3.5-Medium, Qwen-Image and Wan2.2 A14B, LoRA / full × 1 / 8 / 16 GPUs ×
  gradient checkpointing off / on, on a reference workload;
* :func:`config_table`: the peak per GPU of every shipped config of a planned model at 1 to 64 GPUs, as shipped
  and with FSDP2 (and the text encoders offloaded) where that differs;
* :func:`host_table`: what a rank of every shipped config of a planned model holds in host memory at start-up,
  steady state, save and export on one node of 8 GPUs, as shipped;
* :func:`one_gpu`: the shipped configs that fit one GPU as shipped, and those that do not (docs/many_gpus.md's
  list, which ``tests/test_plan.py`` checks against it).
"""

from __future__ import annotations

import dataclasses

from flowgrpo.memory_plan.estimate import GIB, Workload, plan, workload_of
from flowgrpo.memory_plan.families import FAMILIES, PRETRAINED


def reference_workload(family: str, finetune: str, gradient_checkpointing: bool, sharding: str) -> Workload:
    """The table's workload: 1024² (Wan2.2 A14B: 720×1280×81 frames), one row per transformer call, LoRA r64 on
    the attention projections, no KL or EMA, guidance without a second branch, text encoders offloaded, latents
    on the host; ``max_sequence_length`` 512 (SD3.5: 256)."""
    video = FAMILIES[family].video
    return Workload(family=family, finetune=finetune, dtype="bfloat16", height=720 if video else 1024,
                    width=1280 if video else 1024, frames=81 if video else 1,
                    max_sequence_length=256 if family == "sd3" else 512, train_rows=1, rollout_rows=1, samples=0,
                    steps=16, gradient_checkpointing=gradient_checkpointing, latents_on_cpu=True, sharding=sharding,
                    text_encoders="offload")


COLUMNS = ("weights", "masters", "grads", "optimizer", "reference", "ema", "other_expert", "text_encoders", "vae",
           "activations", "transient")


def _row(label: list[str], p) -> str:
    cells = label + [f"{p.device[k] / GIB:.1f}" for k in COLUMNS] + [f"{p.peak / GIB:.1f}",
                                                                    "yes" if p.fits else "**no**"]
    return "| " + " | ".join(cells) + " |"


def reference_table() -> str:
    """GiB per GPU by part for LoRA / full × 1 / 8 / 16 GPUs × checkpointing off / on (one GPU: no sharding;
    several: FSDP2)."""
    cols = ["model", "train", "GPUs", "ckpt", "frozen", "masters", "grads", "optim.", "ref.", "EMA", "other expert",
            "text enc.", "VAE", "activ.", "transient", "peak", "fits 80 GB"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for family in ("flux", "sd3", "qwenimage", "wan22_a14b"):
        for finetune in ("lora", "full"):
            for gpus in (1, 8, 16):
                for ckpt in (False, True):
                    w = reference_workload(family, finetune, ckpt, "none" if gpus == 1 else "fsdp2")
                    lines.append(_row([FAMILIES[family].name, finetune, str(gpus), "yes" if ckpt else "no"],
                                      plan(w, gpus)))
    return "\n".join(lines)


def config_table(paths, gpu_counts=(1, 2, 4, 8, 16, 64)) -> str:
    """Peak GiB per GPU of each shipped config of a planned model: as shipped, and with the other placements
    (FSDP2; FSDP2 with the text encoders offloaded) where they differ from it; bold where it does not fit 80 GB."""
    from flowgrpo.config import load_config

    lines = ["| config | parallel | " + " | ".join(f"{n} GPU{'s' * (n > 1)}" for n in gpu_counts) + " |",
             "|---|---|" + "---|" * len(gpu_counts)]
    for path in paths:
        cfg = load_config(path)
        if cfg.model.pretrained not in PRETRAINED:
            continue
        shipped = workload_of(cfg)
        variants = list(dict.fromkeys([shipped, dataclasses.replace(shipped, sharding="fsdp2"),
                                       dataclasses.replace(shipped, sharding="fsdp2", text_encoders="offload")]))
        for w in variants:
            label = f"{w.sharding}, encoders on {w.text_encoders}" + (" (shipped)" if w == shipped else "")
            peaks = [plan(w, n) for n in gpu_counts]
            cells = [f"{p.peak / GIB:.0f}" if p.fits else f"**{p.peak / GIB:.0f}**" for p in peaks]
            lines.append(f"| {path.name} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def one_gpu(paths) -> tuple[list[str], list[str]]:
    """(names of the configs of ``paths`` of a planned model whose shipped layout fits one 80 GB GPU, names of
    those that do not), each in the order of ``paths``: the "1 GPU" cell of :func:`config_table`'s shipped row."""
    from flowgrpo.config import load_config

    fit, over = [], []
    for path in paths:
        cfg = load_config(path)
        if cfg.model.pretrained in PRETRAINED:
            (fit if plan(workload_of(cfg), 1).fits else over).append(path.name)
    return fit, over


def host_table(paths, gpus: int = 8) -> str:
    """GiB of host memory of each shipped config of a planned model on ``gpus`` GPUs (one node), as shipped: each
    stage's rank 0 / each other rank (one figure where they are equal), and the node's largest total."""
    from flowgrpo.config import load_config

    head = ["config", "parallel", "start-up", "steady state", "save", "export", f"node peak ({gpus} ranks)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path in paths:
        cfg = load_config(path)
        if cfg.model.pretrained not in PRETRAINED:
            continue
        p = plan(workload_of(cfg), gpus)
        cells = []
        for st in p.stages.values():
            r0, other = f"{st.rank0 / GIB:.1f}", f"{st.other / GIB:.1f}"
            cells.append(r0 if r0 == other else f"{r0} / {other}")
        top = max(st.node(p.ranks_per_node) for st in p.stages.values())
        parallel = p.workload.sharding + (f", {p.workload.finetune}")
        lines.append(f"| {path.name} | {parallel} | " + " | ".join(cells) + f" | {top / GIB:.0f} |")
    return "\n".join(lines)
