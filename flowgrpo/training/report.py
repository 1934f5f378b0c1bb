"""What a run reports at its end: ``summary.json`` (every evaluation figure before and after, the time of each
phase, where each product went), ``before_after.png``, the model card, and the console report
(:func:`format_report`). A task adds its per-group figures through a reward's ``report_table(summary)`` hook
(a :class:`~flowgrpo.records.GroupTable`) and its own summary figures through ``summary_figures(summary, records)``
(e.g. the digits task's time to quality); the core knows no task. The summary also names the base model the run
started from (:func:`base_model_record`: its weights' sha256, the numerics it was built with, this machine's).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from flowgrpo.distributed import dist
from flowgrpo.plots import before_after, edits_before_after
from flowgrpo.records import GroupTable
from flowgrpo.sampling.rollout import load_condition_images
from flowgrpo.training.model_card import pipeline_call, write_model_card
from flowgrpo.writing.metrics import read_metrics
from flowgrpo.writing.outputs import replace_file, write_text_file

#: the order the phases run in (the summary's ``phase_seconds`` and the report list them so)
PHASES = ("rollout", "reward", "filter", "advantage", "plan", "recompute", "update", "plots", "eval", "save")


def report_tables(composed_rewards, summary: dict) -> list[GroupTable]:
    """The per-group tables the rewards of ``composed_rewards`` (ComposedReward or None each) hand for
    ``summary``, through their optional ``report_table(summary) -> GroupTable | None``."""
    tables = []
    for composed in composed_rewards:
        for reward in (composed.rewards.values() if composed is not None else ()):
            hook = getattr(reward, "report_table", None)
            table = hook(summary) if hook is not None else None
            if table is not None:
                tables.append(table)
    return tables


def summary_figures(composed_rewards, summary: dict, records: list[dict]) -> dict:
    """The figures the rewards of ``composed_rewards`` (ComposedReward or None each) add to ``summary``, through
    their optional ``summary_figures(summary, records) -> dict`` (``records``: the run's ``metrics.jsonl``)."""
    out: dict = {}
    for composed in composed_rewards:
        for reward in (composed.rewards.values() if composed is not None else ()):
            hook = getattr(reward, "summary_figures", None)
            if hook is not None:
                out.update(hook(summary, records))
    return out


#: base weights above this many bytes are not hashed (a 12B model's transformer would take minutes)
DIGEST_MAX_BYTES = 2 * 2**30


def base_model_record(pretrained: str) -> dict:
    """``summary["base_model"]``: ``name`` (``model.pretrained``) and ``machine`` (this process's
    :func:`~flowgrpo.builds.repeatable.numerics`: the numerics the run trained with); for a local folder (an embedded
    model's
    cache folder, or a path) also ``path``, ``sha256`` (:func:`~flowgrpo.builds.repeatable.weights_digest` of its
    transformer and VAE, or None above :data:`DIGEST_MAX_BYTES`) and ``built_with``, the ``numerics`` of a build record
    ``flowgrpo_*.json`` beside the weights (an embedded model's builder writes one, e.g. the digits model's marker)."""
    from flowgrpo.builds.repeatable import DIGEST_COMPONENTS, numerics, weights_digest
    from flowgrpo.models import EMBEDDED_MODELS, resolve_pretrained

    record: dict = {"name": pretrained}
    folder = Path(resolve_pretrained(pretrained)) if pretrained in EMBEDDED_MODELS else Path(pretrained)
    if folder.is_dir():
        record["path"] = str(folder)
        size = sum(f.stat().st_size for c in DIGEST_COMPONENTS for f in (folder / c).glob("*.safetensors"))
        record["sha256"] = weights_digest(folder) if size <= DIGEST_MAX_BYTES else None
        for marker in sorted(folder.glob("flowgrpo_*.json")):
            built = json.loads(marker.read_text()).get("numerics")
            if built is not None:
                record["built_with"] = built
                break
    record["machine"] = numerics()
    return record


def outputs(out: Path, weights_dir: Path) -> dict[str, str]:
    """The run's products by name: path (as strings)."""
    names = {"run folder": "", "weights": weights_dir.name, "model card": f"{weights_dir.name}/README.md",
             "checkpoints": "checkpoints", "config": "config.yaml", "metrics": "metrics.jsonl",
             "summary": "summary.json", "reward curve": "reward_curve.png", "before/after": "before_after.png",
             "last rollout": "samples_latest.png"}
    return {k: str(out / v) if v else str(out) for k, v in names.items()}


def summarize(before: dict, after: dict, records: list[dict], epochs: int, extra_seconds: dict[str, float]) -> dict:
    """The summary's figures: every evaluation figure before and after (``<name>_before`` / ``_after``; reference
    figures such as ``diversity_real`` once), ``epochs``, ``train_seconds`` (the epochs' phases) and
    ``phase_seconds`` (wall seconds per phase over the run, evaluation and the final save included, in
    :data:`PHASES` order)."""
    summary: dict = {}
    for key in sorted(set(before) | set(after)):
        short = key.removeprefix("eval/").replace("/", "_")
        if short.endswith("_real"):  # a reference figure of real data: the same before and after
            summary[short] = after.get(key, before.get(key))
            continue
        if key in before:
            summary[f"{short}_before"] = before[key]
        if key in after:
            summary[f"{short}_after"] = after[key]
    summary["epochs"] = epochs
    phases: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("timing/") and v is not None:
                phases[k.removeprefix("timing/")] = phases.get(k.removeprefix("timing/"), 0.0) + v
    summary["train_seconds"] = sum(v for k, v in phases.items() if k != "eval")
    for k, v in extra_seconds.items():
        phases[k] = phases.get(k, 0.0) + v
    rank = {p: i for i, p in enumerate(PHASES)}
    summary["phase_seconds"] = dict(sorted(phases.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))
    return summary


def write_summary(run, before, after, img_before, img_after, captions, *, extra_seconds: dict[str, float],
                  main: bool, composed_rewards=(), eval_metadata: list[dict] = ()) -> tuple[dict, list[GroupTable]]:
    """Write ``summary.json`` (:func:`summarize`, the rewards' :func:`summary_figures`, ``base_model``
    (:func:`base_model_record`), ``outputs``),
    ``eval_images_after.pt`` and
    ``before_after.png`` into the run folder ``run`` (a :class:`~flowgrpo.training.run_folder.RunFolder`; only
    the ``main`` process writes). Returns the summary and the rewards' per-group tables of it. Every process
    calls it (a collective): the base model's weights are hashed by the main process alone and its record sent
    to the others (on 8 processes the whole transformer and VAE were read 8 times)."""
    records = read_metrics(run.out / "metrics.jsonl") if main else []
    summary = summarize(before, after, records, run.cfg.train.num_epochs, extra_seconds)
    summary.update(summary_figures(composed_rewards, summary, records))
    summary["base_model"] = dist.broadcast_object(base_model_record(run.cfg.model.pretrained) if main else None)
    summary["outputs"] = outputs(run.out, run.weights_dir)
    tables = report_tables(composed_rewards, summary)
    if main:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
        write_text_file(run.out / "summary.json", json.dumps(clean, indent=1))
        if img_after.numel():  # what `flowgrpo sample --run` reproduces
            replace_file(run.out / "eval_images_after.pt", lambda tmp: torch.save(img_after, tmp))
        if img_before.numel():
            _write_before_after(run.out / "before_after.png", img_before, img_after, captions, eval_metadata, tables)
    return summary, tables


def _write_before_after(path: Path, img_before, img_after, captions, meta: list[dict], tables) -> None:
    """``before_after.png``, with the first table's panels under the columns; for an editing model (evaluation
    records with ``images``) one column per prompt with its source image on top of its before and after
    images."""
    if not all(m.get("images") for m in meta):
        table = next((t for t in tables if t.panels), None)
        before_after(img_before, img_after, captions, path, footer=list(table.panels) if table else None,
                     alerts=list(table.alerts) if table else None)
        return
    sources = [torch.from_numpy(np.asarray(load_condition_images(m["images"][:1])[0]).copy()) for m in meta[:10]]
    edits_before_after(sources, img_before, img_after, captions, path)


def write_card(run, summary: dict, *, adapter, prompt: str, tables=()) -> None:
    """The model card beside the saved weights (:func:`~flowgrpo.training.model_card.write_model_card`), its figures
    table without the keys the per-group tables report."""
    write_model_card(run.cfg, summary, run.weights_dir, run.out, pipeline_class=type(adapter.pipe).__name__,
                     prompt=prompt, call=pipeline_call(run.cfg, adapter.height, adapter.width),
                     exclude=frozenset().union(*(t.keys for t in tables)))


def _cell(v, fmt: str = ">10.4f") -> str:
    return format(v, fmt) if isinstance(v, float | int) else format("-", fmt[0] + fmt[1:].split(".")[0])


def _table_lines(table: GroupTable) -> list[str]:
    """A per-group table on the console: headers right-aligned to their columns, two spaces apart."""
    widths = [int(re.match(r"[<>^=]?(\d+)", spec).group(1)) for _, spec in table.columns]
    lines = ["  ".join(f"{h:>{w}}" for (h, _), w in zip(table.columns, widths, strict=True))]
    for row, note in zip(table.rows, table.notes, strict=True):
        cells = "  ".join(_cell(v, spec) for v, (_, spec) in zip(row, table.columns, strict=True))
        lines.append(cells + (f"  {note}" if note else ""))
    return lines


def _quality_lines(summary: dict) -> list[str]:
    """``time to quality (<quality_bar>):`` and one line per ``quality_<r>_epoch`` of ``summary``: ``r: epoch N,
    S s of RL`` or ``r: not reached``; ``time to quality: <quality_skipped>`` when a task measured none and says
    why; empty without such figures."""
    if summary.get("quality_skipped"):
        return [f"time to quality: {summary['quality_skipped']}"]
    labels = [k.removeprefix("quality_").removesuffix("_epoch") for k in summary
              if k.startswith("quality_") and k.endswith("_epoch")]
    if not labels:
        return []
    lines = [f"time to quality ({summary.get('quality_bar', '')}):"]
    for label in labels:
        epoch, seconds = summary[f"quality_{label}_epoch"], summary.get(f"quality_{label}_rl_seconds")
        lines.append(f"  r = {label}: " + ("not reached" if epoch is None else
                                             f"epoch {epoch}, {seconds:.1f} s of RL"))
    return lines


def _numerics_line(n: dict) -> str:
    """One line of a :func:`~flowgrpo.builds.repeatable.numerics` record: CPU, torch's and MKL's instruction sets, the
    BLAS library and versions, threads, whether pinned."""
    cpu = n.get("cpu") or {}
    parts = [cpu.get("model") or cpu.get("vendor") or n.get("machine", "?")]
    if cpu.get("vendor"):
        parts[0] += f" ({cpu['vendor']})"
    parts.append(f"torch {n.get('torch', '?')} kernels {n.get('cpu_capability', '?')}")
    if n.get("blas"):
        parts.append(f"BLAS {n['blas']}" + (f" {n['mkl']}" if n.get("mkl") else ""))
    if n.get("mkl_cbwr_branch"):
        parts.append(f"MKL CNR branch {n['mkl_cbwr_branch']}, auto branch {n.get('mkl_auto_branch', '?')}")
    if n.get("onednn"):
        parts.append(f"oneDNN {n['onednn']}")
    parts.append(f"{n.get('threads', '?')} thread{'s' if n.get('threads') != 1 else ''}"
                 + (", pinned" if n.get("pinned") else ""))
    return ", ".join(parts)


def _base_lines(base: dict) -> list[str]:
    """The report's base-model block: name and folder, the weights' sha256, the build's and this machine's
    numerics (:func:`base_model_record`)."""
    lines = [f"base model {base['name']}" + (f" ({base['path']})" if base.get("path", base["name"]) != base["name"]
                                            else "")]
    if "sha256" in base:
        digests = base["sha256"]
        lines += ([f"  {k} sha256 {v}" for k, v in digests.items()] if digests is not None
                  else ["  sha256 not computed (weights over 2 GiB)"])
    if base.get("built_with"):
        lines.append(f"  built with: {_numerics_line(base['built_with'])}")
    if base.get("machine"):
        lines.append(f"  this run:   {_numerics_line(base['machine'])}")
    return lines


def format_report(summary: dict, tables: list[GroupTable] = (), *, written: bool = True) -> str:
    """The end-of-run report: where everything was written, the before/after table of the evaluation figures
    (reference figures such as real-data diversity in both columns), each per-group table (``tables``, the
    rewards' :func:`report_tables`; their keys are left out of the main table), the time to quality (a task's
    ``quality_<r>_epoch`` / ``quality_<r>_rl_seconds`` figures, under its ``quality_bar``), the base model (its
    weights' sha256, the numerics it was built and trained with) and the wall time of each phase. ``summary`` is
    what :func:`write_summary` returns; ``written=False`` (a run that had already finished: this command wrote
    nothing) heads the files "the run's files, unchanged" instead of "written"."""
    blocks = []
    taken = frozenset().union(*(t.keys for t in tables))
    outs = summary.get("outputs", {})
    if outs:
        width = max(map(len, outs))
        head = "written:" if written else "the run's files, unchanged (it had already finished):"
        blocks.append(head + "\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in outs.items()))
    metrics = sorted({k.rsplit("_", 1)[0] for k in summary if k.endswith(("_before", "_after")) and k not in taken})
    if metrics:
        refs = [k for k in summary if k.endswith("_real") and k not in taken]
        width = max(len(m) for m in metrics + refs)
        lines = [f"{'metric':<{width}}  {'before':>10}  {'after':>10}"]
        lines += [f"{m:<{width}}  {_cell(summary.get(f'{m}_before'))}  {_cell(summary.get(f'{m}_after'))}"
                  for m in metrics]
        lines += [f"{r:<{width}}  {_cell(summary[r])}  {_cell(summary[r])}" for r in refs]
        blocks.append("\n".join(lines))
    blocks += ["\n".join(_table_lines(t)) for t in tables if t.rows]
    quality = _quality_lines(summary)
    if quality:
        blocks.append("\n".join(quality))
    if summary.get("base_model"):
        blocks.append("\n".join(_base_lines(summary["base_model"])))
    phases = summary.get("phase_seconds", {})
    if phases:
        total = sum(phases.values())
        lines = ["phase       seconds   share"]
        lines += [f"{k:<10}  {v:>7.1f}  {v / total if total else 0:>6.1%}" for k, v in phases.items()]
        lines.append(f"{'all':<10}  {total:>7.1f}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
