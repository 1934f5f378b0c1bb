"""GenEval-style training prompts that never repeat an evaluation prompt, and an overlap check for trainers.

The generator follows GenEval's own prompt templates (``prompts/create_prompts.py`` in djghosh13/geneval,
Ghosh et al. 2023, arXiv 2310.11513) over the 80 COCO object names, GenEval's ten colours, counts 2..4 and the
four relations:

=============  ==========================================  ===========================================
task           prompt                                      metadata ``include`` (+ ``exclude``)
=============  ==========================================  ===========================================
single_object  a photo of a/an A                           A×1
two_object     a photo of a/an A and a/an B                A×1, B×1
counting       a photo of N As                             A×N; exclude A×(N+1)
colors         a photo of a/an C A                         A×1 colour C
position       a photo of a/an A <relation> a/an B         B×1, A×1 position (relation, 0)
color_attr     a photo of a/an C1 A and a/an C2 B          A×1 colour C1, B×1 colour C2
=============  ==========================================  ===========================================

As in GenEval, colour prompts never use "person", and plurals add "es" after an "s" and "s" otherwise.

**Overlap** (:func:`prompt_key`): two specs overlap when they have the same task and the same multiset of
(object, count, colour) clauses, **ignoring object order and the position relation**: "a cat and a dog"
overlaps "a dog and a cat", and "a dog left of a cat" overlaps every relation between a dog and a cat. Every
one of GenEval's 80 single-object prompts is in the evaluation set, so no single-object training prompt
exists.

    python -m flowgrpo_rewards.geneval.prompts OUT.jsonl --per-task 1000 --seed 0
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from flowgrpo.argtypes import OneLineParser
from flowgrpo.text import fold_text
from flowgrpo.writing.outputs import OutputRefused, check_file, write_text_file
from flowgrpo_rewards.geneval.rules import COLORS, RELATIONS, TASKS, evaluation_metadata, object_names

logger = logging.getLogger(__name__)

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
#: Tasks the generator can produce (every single-object prompt is an evaluation prompt).
TRAINING_TASKS: tuple[str, ...] = ("two_object", "counting", "colors", "position", "color_attr")


def with_article(word: str) -> str:
    """"an apple", "a bench": GenEval's article rule (an before a vowel letter)."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def plural(name: str) -> str:
    """GenEval's plural rule: "es" after a final "s" ("buses"), else "s" ("knifes", as in GenEval)."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


def prompt_key(metadata: Mapping) -> tuple:
    """The overlap key of a GenEval spec: (tag, sorted (class, count, colour) of the include clauses).

    Object order and position relations do not enter the key (see the module doc).

    Raises:
        ValueError: ``metadata`` lacks ``tag`` or ``include``.
    """
    for field in ("tag", "include"):
        if field not in metadata:
            raise ValueError(f"GenEval metadata needs {field!r}, got keys {sorted(metadata)}")
    clauses = sorted((c["class"], int(c["count"]), c.get("color", "")) for c in metadata["include"])
    return (metadata["tag"], tuple(clauses))


def normalize_text(prompt: str) -> str:
    """The form in which prompt texts are compared: Unicode-canonical (:func:`flowgrpo.text.fold_text`: every
    whitespace form a single space, quote/dash/full-width forms unified, case-folded), no trailing full stop."""
    return fold_text(prompt).rstrip(".").strip()


@functools.cache
def _patterns() -> list[tuple[str, re.Pattern]]:
    names = sorted(object_names(), key=len, reverse=True)
    name = "(" + "|".join(re.escape(n) for n in names) + ")"
    plurals = "(" + "|".join(re.escape(plural(n)) for n in names) + ")"
    color = "(" + "|".join(COLORS) + ")"
    rel = "(" + "|".join(RELATIONS) + ")"
    number = "(" + "|".join(NUMBERS[2:]) + ")"
    art = "an? "
    head = "a photo of "
    return [
        ("color_attr", re.compile(f"{head}{art}{color} {name} and {art}{color} {name}")),
        ("colors", re.compile(f"{head}{art}{color} {name}")),
        ("position", re.compile(f"{head}{art}{name} {rel} {art}{name}")),
        ("two_object", re.compile(f"{head}{art}{name} and {art}{name}")),
        ("counting", re.compile(f"{head}{number} {plurals}")),
        ("single_object", re.compile(f"{head}{art}{name}")),
    ]


def parse_prompt(prompt: str) -> dict | None:
    """The GenEval spec of a prompt written with one of the six templates, or None for any other text.

    Example: ``parse_prompt("a photo of three buses")`` → ``{"tag": "counting", "include": [{"class": "bus",
    "count": 3}], "exclude": [{"class": "bus", "count": 4}], "prompt": ...}``.
    """
    text = normalize_text(prompt)
    for tag, pattern in _patterns():
        m = pattern.fullmatch(text)
        if not m:
            continue
        g = m.groups()
        if tag == "single_object":
            return _spec(tag, text, [{"class": g[0], "count": 1}])
        if tag == "two_object":
            return _spec(tag, text, [{"class": g[0], "count": 1}, {"class": g[1], "count": 1}])
        if tag == "counting":
            n = NUMBERS.index(g[0])
            cls = next(c for c in object_names() if plural(c) == g[1])
            return _spec(tag, text, [{"class": cls, "count": n}], [{"class": cls, "count": n + 1}])
        if tag == "colors":
            return _spec(tag, text, [{"class": g[1], "count": 1, "color": g[0]}])
        if tag == "position":
            return _spec(tag, text, [{"class": g[2], "count": 1},
                                     {"class": g[0], "count": 1, "position": [g[1], 0]}])
        return _spec(tag, text, [{"class": g[1], "count": 1, "color": g[0]},
                                 {"class": g[3], "count": 1, "color": g[2]}])
    return None


def _spec(tag: str, prompt: str, include: list[dict], exclude: list[dict] | None = None) -> dict:
    spec = {"tag": tag, "include": include}
    if exclude:
        spec["exclude"] = exclude
    spec["prompt"] = prompt
    return spec


@functools.cache
def _evaluation_index() -> tuple[frozenset, frozenset]:
    specs = evaluation_metadata()
    return frozenset(prompt_key(m) for m in specs), frozenset(normalize_text(m["prompt"]) for m in specs)


def overlaps_evaluation(item: str | Mapping) -> bool:
    """Whether a training prompt (text, or a JSONL record with ``prompt`` and optionally ``tag``/``include``)
    overlaps GenEval's evaluation set: same normalised text, or the same :func:`prompt_key` (taken from the
    record's metadata when present, else parsed from the text)."""
    keys, texts = _evaluation_index()
    if isinstance(item, Mapping):
        text = item.get("prompt", "")
        spec = item if ("tag" in item and "include" in item) else parse_prompt(text)
    elif isinstance(item, str):
        text, spec = item, parse_prompt(item)
    else:
        raise TypeError(f"a prompt must be a string or a mapping with 'prompt', got {type(item).__name__}")
    if normalize_text(text) in texts:
        return True
    return spec is not None and prompt_key(spec) in keys


def check_overlap(prompts: Iterable[str | Mapping]) -> list[str]:
    """The training prompts that overlap GenEval's 553 evaluation prompts (see :func:`overlaps_evaluation`).

    Args:
        prompts: prompt texts, or JSONL records (dicts with ``prompt``; GenEval metadata used when present).

    Returns:
        the overlapping prompt texts, each once, in input order; empty when there is no overlap.
    """
    out: dict[str, None] = {}
    for item in prompts:
        if overlaps_evaluation(item):
            out[item["prompt"] if isinstance(item, Mapping) else item] = None
    return list(out)


# --------------------------------------------------------------------------------------------------
# Generator


def _sample(task: str, rng: np.random.Generator, max_count: int) -> dict:
    names = object_names()
    colorable = [n for n in names if n != "person"]  # GenEval asks no colour of a person
    if task == "single_object":
        a = names[rng.integers(len(names))]
        return _spec(task, f"a photo of {with_article(a)}", [{"class": a, "count": 1}])
    if task == "two_object":
        a, b = (names[i] for i in rng.choice(len(names), size=2, replace=False))
        return _spec(task, f"a photo of {with_article(a)} and {with_article(b)}",
                     [{"class": a, "count": 1}, {"class": b, "count": 1}])
    if task == "counting":
        a = names[rng.integers(len(names))]
        n = int(rng.integers(2, max_count + 1))
        return _spec(task, f"a photo of {NUMBERS[n]} {plural(a)}", [{"class": a, "count": n}],
                     [{"class": a, "count": n + 1}])
    if task == "colors":
        a = colorable[rng.integers(len(colorable))]
        c = COLORS[rng.integers(len(COLORS))]
        return _spec(task, f"a photo of {with_article(c)} {a}", [{"class": a, "count": 1, "color": c}])
    if task == "position":
        a, b = (names[i] for i in rng.choice(len(names), size=2, replace=False))
        rel = RELATIONS[rng.integers(len(RELATIONS))]
        return _spec(task, f"a photo of {with_article(a)} {rel} {with_article(b)}",
                     [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}])
    if task == "color_attr":
        a, b = (colorable[i] for i in rng.choice(len(colorable), size=2, replace=False))
        ca, cb = (COLORS[i] for i in rng.choice(len(COLORS), size=2, replace=False))
        return _spec(task, f"a photo of {with_article(ca)} {a} and {with_article(cb)} {b}",
                     [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}])
    raise ValueError(f"unknown task {task!r}; allowed: {list(TASKS)}")


def generate_training_prompts(
    per_task: int, seed: int = 0, tasks: Sequence[str] = TRAINING_TASKS, max_count: int = 4,
    allow_fewer: bool = False,
) -> list[dict]:
    """GenEval-style training specs, ``per_task`` of each task, none overlapping the evaluation set.

    Each record is GenEval metadata plus the prompt: ``{"tag", "include", ["exclude"], "prompt"}``, ready to
    be written as a JSONL prompt file whose fields reach the ``geneval`` reward as metadata. Within a task the
    records are distinct under :func:`prompt_key`. Sampling is uniform over each task's template choices
    (rejection of duplicates and evaluation overlaps), seeded by ``seed``; tasks are drawn in ``tasks`` order
    and the result lists them in that order.

    Args:
        per_task: prompts per task (>= 1).
        seed: seed of the numpy generator.
        tasks: a subset of :data:`TRAINING_TASKS`.
        max_count: counting prompts ask for 2..max_count objects (2 <= max_count <= 10; GenEval uses 4).
        allow_fewer: a task with fewer than ``per_task`` distinct prompts outside the evaluation set gives all
            it has (logged as a warning) instead of raising. With GenEval's counts 2..4 the counting task has
            160 (3 × 80 minus the 80 evaluated).

    Raises:
        ValueError: ``single_object`` or an unknown task in ``tasks``, a bad ``per_task``/``max_count``, or
            more prompts asked for a task than exist once evaluation prompts are excluded.
    """
    if per_task < 1:
        raise ValueError(f"per_task must be >= 1, got {per_task}")
    if not 2 <= max_count <= 10:
        raise ValueError(f"max_count must be in 2..10, got {max_count}")
    for task in tasks:
        if task == "single_object":
            raise ValueError(
                "no single_object training prompt exists: all 80 single-object prompts are GenEval "
                f"evaluation prompts; choose tasks from {list(TRAINING_TASKS)}"
            )
        if task not in TRAINING_TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: {list(TRAINING_TASKS)}")
    eval_keys, _ = _evaluation_index()
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    for task in tasks:
        taken = sum(1 for k in eval_keys if k[0] == task and _in_space(k, max_count))
        available = _space_size(task, max_count) - taken
        wanted = per_task
        if per_task > available:
            message = (f"asked for {per_task} {task} prompts, but only {available} distinct ones exist outside "
                       f"the evaluation set (max_count={max_count})")
            if not allow_fewer:
                raise ValueError(message + "; ask for fewer, or pass allow_fewer=True (--allow-fewer)")
            logger.warning("%s: using all %d", message, available)
            wanted = available
        seen: set[tuple] = set()
        while len(seen) < wanted:
            spec = _sample(task, rng, max_count)
            key = prompt_key(spec)
            if key in seen or key in eval_keys:
                continue
            seen.add(key)
            out.append(spec)
    return out


def _space_size(task: str, max_count: int) -> int:
    """Number of distinct :func:`prompt_key` values the templates can produce for ``task``."""
    n = len(object_names())
    c = len(COLORS)
    return {
        "two_object": n * (n - 1) // 2,
        "counting": n * (max_count - 1),
        "colors": (n - 1) * c,
        "position": n * (n - 1) // 2,
        "color_attr": (n - 1) * (n - 2) // 2 * c * (c - 1),
    }[task]


def _in_space(key: tuple, max_count: int) -> bool:
    """Whether an evaluation key is one the generator could produce (counts within 2..max_count)."""
    return all(count <= max_count for _, count, _ in key[1]) if key[0] == "counting" else True


def main(argv: Sequence[str] | None = None) -> None:
    """Write ``per_task`` GenEval-style training prompts of each task to a JSONL file."""
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output JSONL file (a GenEval spec with its prompt per line)")
    parser.add_argument("--per-task", type=int, default=1000, help="prompts per task (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", nargs="+", default=list(TRAINING_TASKS), help="subset of the five tasks")
    parser.add_argument("--max-count", type=int, default=4, help="counting asks for 2..max_count objects")
    parser.add_argument("--allow-fewer", action="store_true",
                        help="a task with fewer distinct prompts than --per-task gives all it has (counting: 160)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT when it exists")
    args = parser.parse_args(argv)
    try:  # flowgrpo's write rule (flowgrpo.writing.outputs): an existing OUT only with --overwrite
        check_file(args.out, "out", overwrite=args.overwrite)
    except OutputRefused as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    specs = generate_training_prompts(args.per_task, args.seed, args.tasks, args.max_count, args.allow_fewer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_file(args.out, "".join(json.dumps(spec) + "\n" for spec in specs))  # a hard link keeps the old
    logger.info("wrote %d prompts to %s", len(specs), args.out)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
