"""Prompt files for the shipped configs, built from a local copy of the public prompt sets they come from.

``flowgrpo prompts SET SOURCE... --out FILE`` reads the dataset's own files (downloaded by the user, e.g. with
``hf download``; nothing is fetched here) and writes one prompt a line (``.txt``), the format
``data.train_prompts`` / ``data.eval_prompts`` read. Prompts are stripped, empty ones dropped, duplicates
dropped keeping the first, and the order of the source kept, so the output is deterministic.

* ``hpd`` — HPDv2 (the ``ymhao/HPDv2`` dataset, Wu et al. 2023, arXiv 2306.09341): ``train.json`` /
  ``test.json``, a JSON list of records with ``prompt`` (plus ``human_preference`` and ``file_path``, or
  ``image_path``, ``rank`` and ``raw_annotations``), or the HPSv2 benchmark files (``anime.json`` …), JSON lists
  of prompt strings. Output: every record's ``prompt``.
* ``pickapic`` — Pick-a-Pic (``yuvalkirstain/pickapic_v1`` / ``_v2``, Kirstain et al. 2023, arXiv 2305.01569):
  parquet shards (reading them needs ``pyarrow``), or JSONL / CSV exports, with a ``caption`` column. One row is
  one pair of images, so captions repeat: each is kept once.
* ``ocr`` — text-rendering prompts, one a line (``.txt``) or JSONL with ``prompt`` or ``caption``: the prompts
  that quote a non-blank target text in double quotes, straight ``"…"`` or typographic ``“…”`` (and the other
  forms of :func:`flowgrpo.text.quoted_text`, the one rule the ``ocr`` reward reads its target by); the others are
  dropped and counted in a warning.
* ``geneval`` — no source files: GenEval-style training prompts with metadata from the generator of
  ``flowgrpo_rewards.geneval.prompts`` (``flowgrpo prompts geneval --out data/geneval_train.jsonl``), never an
  evaluation prompt.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from flowgrpo.data.text_files import iter_jsonl, read_text, read_text_lines
from flowgrpo.strategies.registry import Registry
from flowgrpo.text import quoted_text
from flowgrpo.writing.outputs import write_text_file

logger = logging.getLogger(__name__)

PROMPT_SETS: Registry[Callable[[list[Path]], list[str]]] = Registry("prompt set")

#: sets ``flowgrpo prompts`` makes without source files (a generator, not a reader of :data:`PROMPT_SETS`)
GENERATED_SETS = ("geneval",)


def prompt_set_names() -> list[str]:
    """Every set ``flowgrpo prompts SET`` takes: the registered readers, then the generated sets."""
    return [*PROMPT_SETS.names(), *GENERATED_SETS]


def _unique(prompts: Iterable) -> list[str]:
    seen, out, nulls = set(), [], 0
    for p in prompts:
        if p is None:  # a null field (checked by _records: anything else that is not a string is an error)
            nulls += 1
            continue
        p = " ".join(p.split())
        if p and p not in seen:
            seen.add(p)
            out.append(p)
    if nulls:
        logger.warning("dropped %d records whose prompt field is null", nulls)
    return out


def _read_json(path: Path):
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def _records(path: Path, fields: tuple[str, ...]) -> list[str]:
    """The first of ``fields`` present in each record of a JSON list, JSONL, CSV or parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(path)
        field = next((f for f in fields if f in table.column_names), None)
        if field is None:
            raise ValueError(f"{path}: no column {' or '.join(fields)} (columns: {table.column_names})")
        rows = [{field: v} for v in table.column(field).to_pylist()]
    elif suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(read_text(path), newline="")))
    elif suffix == ".jsonl":
        rows = [row for _, row in iter_jsonl(path)]
    elif suffix == ".json":
        rows = _read_json(path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(rows).__name__}")
    else:
        return read_text_lines(path)
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, str):  # HPSv2 benchmark files: a list of prompt strings
            out.append(row)
            continue
        field = next((f for f in fields if isinstance(row, dict) and f in row), None)
        if field is None:
            raise ValueError(f"{path}: record {i} has no field {' or '.join(fields)}")
        if not isinstance(row[field], str | None):
            raise ValueError(f"{path}: record {i}: field {field!r} must be a string (or null: no prompt), "
                             f"got {type(row[field]).__name__} {row[field]!r}")
        out.append(row[field])
    return out


@PROMPT_SETS.register("hpd")
def hpd_prompts(sources: list[Path]) -> list[str]:
    """HPDv2 prompts from ``train.json`` / ``test.json`` (records with ``prompt``) or benchmark string lists."""
    return _unique(p for s in sources for p in _records(s, ("prompt",)))


@PROMPT_SETS.register("pickapic")
def pickapic_prompts(sources: list[Path]) -> list[str]:
    """Pick-a-Pic captions (``caption`` column of parquet shards, JSONL or CSV), each once."""
    return _unique(p for s in sources for p in _records(s, ("caption",)))


@PROMPT_SETS.register("ocr")
def ocr_prompts(sources: list[Path]) -> list[str]:
    """Text-rendering prompts that quote a non-empty target text in double quotes of any form
    (:func:`flowgrpo.text.quoted_text`, the rule the ``ocr`` reward reads its target by)."""
    prompts = _unique(p for s in sources for p in _records(s, ("prompt", "caption")))
    kept = [p for p in prompts if quoted_text(p) is not None]
    if len(kept) < len(prompts):
        logger.warning("ocr: dropped %d of %d prompts without a quoted target text", len(prompts) - len(kept),
                       len(prompts))
    return kept


#: the file formats (suffixes) each public set's sources come in; a set not listed reads any (a text file: one
#: prompt a line, or a JSON list, JSONL, CSV or parquet by suffix)
SOURCE_FORMATS = {"hpd": (".json",), "pickapic": (".parquet", ".jsonl", ".csv")}
#: what each set's sources are, for the refusal of another file
SOURCE_KINDS = {"hpd": "HPDv2 JSON (train.json / test.json)", "pickapic": "Pick-a-Pic parquet shards, JSONL or CSV"}


def check_sources(name: str, paths: list[Path]) -> None:
    """Refuse, in one line naming the path, a source of set ``name`` that is a folder, absent, or not of the set's
    format (:data:`SOURCE_FORMATS`, by suffix: a plain text file is not HPDv2 JSON). Reads no file. Raises
    ``ValueError``."""
    if not paths:
        raise ValueError(f"prompt set {name!r} needs at least one source file")
    folders = [str(p) for p in paths if p.is_dir()]
    if folders:
        raise ValueError(f"prompt set {name!r}: {folders[0]!r} is a folder, not a file; give the dataset's files "
                         f"themselves (e.g. {folders[0].rstrip('/')}/*{SOURCE_FORMATS.get(name, ('.txt',))[0]})")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"prompt set {name!r}: no such file {missing}")
    formats = SOURCE_FORMATS.get(name)
    wrong = [p for p in paths if formats and p.suffix.lower() not in formats]
    if wrong:
        raise ValueError(f"prompt set {name!r}: {str(wrong[0])!r} is not a {name!r} source; allowed: "
                         f"{SOURCE_KINDS[name]}, a file ending in {' / '.join(formats)}")


def build_prompt_file(name: str, sources: list[str | Path], out: str | Path) -> int:
    """Write the prompts of set ``name`` (:data:`PROMPT_SETS`) read from ``sources`` to ``out``, one a line.
    Returns the number written. Raises ``ValueError`` for a missing source file, a folder or a file not of the
    set's format (:func:`check_sources`), a file without the set's
    field, no prompts at all, or an ``out`` that cannot be written (the OS's reason); ``KeyError`` (with the valid
    names) for an unknown set."""
    build = PROMPT_SETS.get(name)
    if Path(out).is_dir():
        raise ValueError(f"--out {str(out)!r} is a folder; give the prompt file to write (e.g. data/train.txt)")
    paths = [Path(s) for s in sources]
    check_sources(name, paths)
    prompts = build(paths)
    if not prompts:
        raise ValueError(f"prompt set {name!r}: no prompts found in {[str(p) for p in paths]}")
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_file(out, "".join(p + "\n" for p in prompts))  # replaced whole: a hard link keeps the old text
    except OSError as err:  # no permission, a read-only or virtual file system (/sys, /proc)
        raise ValueError(f"--out {str(out)!r} cannot be written: {err.strerror or err} ({err.filename or out}); "
                         "choose a file in a folder you can write to") from None
    logger.info("wrote %d %s prompts to %s", len(prompts), name, out)
    return len(prompts)
