"""GenEval's folder layout, ``results.jsonl`` and the summary table (used by ``eval/geneval.py``).

**Image folder** (GenEval's ``generation/diffusers_generate.py`` layout, read by its ``evaluate_images.py``)::

    <folder>/<index>/metadata.jsonl    one JSON object: the prompt's spec (tag, include, [exclude], prompt)
    <folder>/<index>/samples/NNNN.png  the images of that prompt, numbered from 0000

``<index>`` is the prompt's row in ``evaluation_metadata.jsonl``; written zero-padded to five digits, read as
any all-digit folder name.

**results.jsonl**: one line per image with ``filename``, ``index``, ``tag``, ``prompt``, ``correct``,
``reason`` (the failed checks, newline-separated), ``metadata`` and ``details`` (both JSON strings, as the
original: details maps each detected class to ``[x1, y1, x2, y2, score]`` lists).

**Summary** (:func:`summarize`, after GenEval's ``summary_scores.py``): accuracy per task = the share of its
images judged correct; overall = the unweighted mean of the task accuracies; also the share of all images
correct and the share of prompts with at least one correct image (prompts identified by their metadata).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from flowgrpo.writing.outputs import replace_file, write_text_file
from flowgrpo_rewards.geneval.rules import TASKS, validate_metadata

_SAMPLE = re.compile(r"(\d+)\.png")


@dataclass(frozen=True)
class PromptFolder:
    """One prompt's folder: its index, spec and image paths (ordered by sample number)."""

    index: int
    metadata: dict
    images: list[Path]


def prompt_dir(folder: str | Path, index: int) -> Path:
    """``<folder>/<index as 5 digits>``."""
    return Path(folder) / f"{index:05d}"


def write_metadata(folder: str | Path, index: int, metadata: Mapping) -> Path:
    """Write ``<folder>/<index>/metadata.jsonl`` (one JSON object) and create ``samples/``; return the
    prompt's folder.

    Raises:
        ValueError: an invalid spec or a spec without ``prompt``.
    """
    validate_metadata(metadata, f"prompt {index}")
    if "prompt" not in metadata:
        raise ValueError(f"prompt {index}: missing field 'prompt'")
    d = prompt_dir(folder, index)
    (d / "samples").mkdir(parents=True, exist_ok=True)
    write_text_file(d / "metadata.jsonl", json.dumps(dict(metadata)) + "\n")
    return d


def write_sample(folder: str | Path, index: int, sample: int, image: Image.Image) -> Path:
    """Save ``image`` as ``<folder>/<index>/samples/<sample as 4 digits>.png``; returns its path."""
    path = prompt_dir(folder, index) / "samples" / f"{sample:04d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda tmp: image.save(tmp, format="PNG"))
    return path


def read_metadata(path: Path) -> dict:
    """The spec in a ``metadata.jsonl`` file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not one JSON object, an invalid spec, or no ``prompt``; the message names the file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"missing {path} (each prompt folder needs metadata.jsonl)")
    text = path.read_text(encoding="utf-8")
    try:
        metadata = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed metadata, not one JSON object ({e})") from None
    validate_metadata(metadata, str(path))
    if "prompt" not in metadata:
        raise ValueError(f"{path}: missing field 'prompt'")
    return metadata


def read_folder(folder: str | Path) -> list[PromptFolder]:
    """Every prompt folder of an image folder in GenEval's layout, by increasing index.

    Raises:
        FileNotFoundError: ``folder`` missing; a prompt folder without ``metadata.jsonl`` or ``samples/``;
            no ``samples/0000.png``; or a gap in the sample numbers (names the first missing file).
        ValueError: no prompt folder at all, or a malformed ``metadata.jsonl`` (names the file).
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    if not dirs:
        raise ValueError(
            f"{root} has no prompt folders (expected <index>/metadata.jsonl and <index>/samples/)"
        )
    out = []
    for d in dirs:
        metadata = read_metadata(d / "metadata.jsonl")
        samples = d / "samples"
        if not samples.is_dir():
            raise FileNotFoundError(f"missing {samples}/ (expected {samples / '0000.png'})")
        numbered = {}
        for f in samples.iterdir():
            m = _SAMPLE.fullmatch(f.name)
            if m and f.is_file():
                numbered[int(m.group(1))] = f
        expected = range(max(numbered) + 1) if numbered else range(1)
        for n in expected:
            if n not in numbered:
                raise FileNotFoundError(f"missing image {samples / f'{n:04d}.png'}")
        out.append(PromptFolder(int(d.name), metadata, [numbered[n] for n in expected]))
    return out


def load_image(path: str | Path) -> Image.Image:
    """An RGB image with its EXIF orientation applied, as the original scorer reads it.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable image (names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing image {path}")
    try:
        with Image.open(path) as im:
            return ImageOps.exif_transpose(im).convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{path}: not a readable image ({e})") from None


def result_row(filename: str | Path, index: int, metadata: Mapping, correct: bool, reason: str,
               details: Mapping) -> dict:
    """One ``results.jsonl`` record (see the module doc)."""
    return {
        "filename": str(filename),
        "index": int(index),
        "tag": metadata["tag"],
        "prompt": metadata["prompt"],
        "correct": bool(correct),
        "reason": reason,
        "metadata": json.dumps(dict(metadata)),
        "details": json.dumps(dict(details)),
    }


def write_results(path: str | Path, rows: Iterable[Mapping]) -> None:
    """Write ``rows`` as JSON lines, a new file (:func:`flowgrpo.writing.outputs.write_text_file`)."""
    write_text_file(path, "".join(json.dumps(dict(row)) + "\n" for row in rows))


def read_results(path: str | Path) -> list[dict]:
    """The records of a ``results.jsonl``.

    Raises:
        ValueError: a line that is not a JSON object with ``tag`` and a boolean ``correct`` (names the file
            and line).
    """
    from flowgrpo.data.text_files import iter_jsonl

    rows = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or "tag" not in row or not isinstance(row.get("correct"), bool):
            raise ValueError(f"{path}:{lineno}: a result needs 'tag' and a boolean 'correct'")
        rows.append(row)
    return rows


def summarize(rows: Sequence[Mapping]) -> dict:
    """GenEval's summary of per-image results.

    Returns:
        ``{"images", "prompts", "correct_images" (share of images correct), "prompts_any_correct" (share of
        prompts with >= 1 correct image), "tasks": {tag: {"accuracy", "correct", "images"}} in GenEval's task
        order, "overall" (unweighted mean of the task accuracies), "missing_tasks"}``. With tasks missing, the
        overall is the mean over those present (as the original) and they are listed in ``missing_tasks``.
        Prompts are told apart by their ``metadata`` string, else by ``(tag, prompt)``.

    Raises:
        ValueError: no rows, or a tag that is not one of the six GenEval tasks.
    """
    if not rows:
        raise ValueError("no results to summarise")
    per_task: dict[str, list[bool]] = {}
    per_prompt: dict[str, bool] = {}
    for row in rows:
        tag = row["tag"]
        if tag not in TASKS:
            raise ValueError(f"unknown tag {tag!r} in results; allowed: {list(TASKS)}")
        per_task.setdefault(tag, []).append(bool(row["correct"]))
        key = row.get("metadata") or json.dumps([tag, row.get("prompt")])
        per_prompt[key] = per_prompt.get(key, False) or bool(row["correct"])
    tasks = {
        t: {"accuracy": sum(v) / len(v), "correct": sum(v), "images": len(v)}
        for t in TASKS
        if (v := per_task.get(t))
    }
    n_correct = sum(t["correct"] for t in tasks.values())
    return {
        "images": len(rows),
        "prompts": len(per_prompt),
        "correct_images": n_correct / len(rows),
        "prompts_any_correct": sum(per_prompt.values()) / len(per_prompt),
        "tasks": tasks,
        # the original's np.mean over the task accuracies in order of first appearance in the results: for
        # at most 7 values NumPy adds them one by one, as sum() does (fsum or another order can differ by an ulp)
        "overall": sum(tasks[t]["accuracy"] for t in per_task) / len(tasks),
        "missing_tasks": [t for t in TASKS if t not in tasks],
    }


def format_summary(summary: Mapping) -> str:
    """The summary as a markdown table."""
    lines = ["| task | accuracy | correct / images |", "|---|---:|---:|"]
    for tag in TASKS:
        t = summary["tasks"].get(tag)
        if t:
            lines.append(f"| {tag} | {t['accuracy']:.4f} | {t['correct']} / {t['images']} |")
        else:
            lines.append(f"| {tag} | – | – |")
    lines.append(f"| **overall** (mean of tasks) | **{summary['overall']:.4f}** | |")
    lines.append("")
    lines.append(f"images: {summary['images']}, correct: {summary['correct_images']:.2%}; "
                 f"prompts: {summary['prompts']}, with at least one correct image: "
                 f"{summary['prompts_any_correct']:.2%}")
    if summary["missing_tasks"]:
        missing = ", ".join(summary["missing_tasks"])
        lines.append(f"missing tasks (overall is the mean over the others): {missing}")
    return "\n".join(lines)
