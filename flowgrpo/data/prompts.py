"""Prompt datasets and the P×G group sampler.

A prompt file is plain text (one prompt a line, stripped; blank lines are separators and skipped) or JSONL
(``.jsonl``: each line an object with a ``prompt`` string; every other field is metadata handed to the rewards;
blank lines skipped). One rule decides what is blank: nothing left once folded (:func:`flowgrpo.text.is_blank`:
only whitespace of any form and invisible characters). A blank line of a text file is no prompt; a JSONL record is
a prompt by construction, so a blank ``prompt`` in it is an error naming the file and line. An editing record names its
conditioning image(s) with ``image`` (a path) or ``images`` (a list), relative to the prompt file; the loader
checks they exist and hands them on as ``images``, a list of absolute paths. Embedded sets: ``digits`` (the
digits task), ``digits_eval`` (the canonical phrasing of each digit, a subset of the training phrasings: the
frozen random text encoders cannot generalise to unseen ones) and ``t2i_compbench`` (T2I-CompBench validation
prompts, MIT, see ``flowgrpo/assets/prompts/t2i_compbench/LICENSE``), and the digits task's datasets for the
dataset objectives, built into the cache on first use (:mod:`flowgrpo.tasks.digits.datasets`): ``digits_real`` (the
real training digits, an image set) and ``digits_pairs`` (the base model's scored samples, a preference set).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module, resources
from pathlib import Path

import torch

from flowgrpo.data.public_prompts import prompt_set_names
from flowgrpo.data.text_files import iter_jsonl, read_text_lines
from flowgrpo.rng import make_generator
from flowgrpo.text import is_blank


@dataclass(frozen=True)
class PromptSet:
    """Prompts with their metadata dicts (``{}`` for plain text)."""

    prompts: list[str]
    metadata: list[dict]
    source: str

    def __len__(self) -> int:
        return len(self.prompts)


def _assets() -> Path:
    return Path(str(resources.files("flowgrpo") / "assets"))


def _built(target: str):
    """An embedded set built into the cache on first use by ``target`` (``"module:function"`` returning the set's
    file), imported only when the set is named: a task's builders load the task, which stands above this module
    (as the model zoo's builders are named in :mod:`flowgrpo.models`)."""

    def build() -> list[Path]:
        module, attr = target.split(":")
        return [Path(getattr(import_module(module), attr)())]

    return build


EMBEDDED = {
    "digits": lambda: [_assets() / "digits" / "prompts.jsonl"],
    "digits_eval": lambda: [_assets() / "digits" / "eval.jsonl"],
    "t2i_compbench": lambda: sorted((_assets() / "prompts" / "t2i_compbench").glob("*_val.txt")),
    "digits_real": _built("flowgrpo.tasks.digits.datasets:ensure_real_set"),
    "digits_pairs": _built("flowgrpo.tasks.digits.datasets:ensure_preference_set"),
}


def _resolve_images(obj: dict, path: Path, lineno: int) -> None:
    """Conditioning images of an editing record: ``image`` (a path) or ``images`` (a list of paths), relative to
    the prompt file's folder; replaced in place by ``images``, the list of absolute paths of existing files."""
    if "image" in obj and "images" in obj:
        raise ValueError(f"{path}:{lineno}: give 'image' or 'images', not both")
    if "image" not in obj and "images" not in obj:
        return
    raw = [obj.pop("image")] if "image" in obj else obj.pop("images")
    if not isinstance(raw, list) or not raw or not all(isinstance(p, str) and p for p in raw):
        raise ValueError(f"{path}:{lineno}: 'image' must be a path and 'images' a non-empty list of paths, "
                         f"got {raw!r}")
    files = [(path.parent / p).resolve() for p in raw]
    for given, f in zip(raw, files, strict=True):
        if not f.is_file():
            raise ValueError(f"{path}:{lineno}: conditioning image {given!r} not found (looked for {f})")
    obj["images"] = [str(f) for f in files]


def _read_jsonl(path: Path) -> tuple[list[str], list[dict]]:
    prompts, meta = [], []
    for lineno, obj in iter_jsonl(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: each JSONL line needs a string field 'prompt'")
        if is_blank(obj["prompt"]):
            raise ValueError(f"{path}:{lineno}: the prompt {obj['prompt']!r} is empty (only whitespace or invisible "
                             "characters); give each record a prompt, or remove the line")
        prompts.append(obj.pop("prompt"))
        _resolve_images(obj, path, lineno)
        meta.append(obj)
    return prompts, meta


def how_to_make(path: Path) -> str:
    """How to make a missing prompt file ``path``: the ``flowgrpo prompts`` command and its sets (read from
    :func:`flowgrpo.data.public_prompts.prompt_set_names`), or a file written by hand."""
    return (f"build it from a local copy of a public prompt set with 'flowgrpo prompts SET SOURCE... --out "
            f"{path}' (SET: {', '.join(prompt_set_names())}; see flowgrpo prompts --help; a shipped config's header "
            "names its set), or write it: one prompt a line (.txt), or JSONL with a 'prompt' field")


def load_prompts(name_or_path: str) -> PromptSet:
    """Read a prompt file or an embedded set. Raises ``ValueError`` for a missing/empty/malformed file."""
    paths = EMBEDDED[name_or_path]() if name_or_path in EMBEDDED else [Path(name_or_path)]
    prompts: list[str] = []
    meta: list[dict] = []
    for path in paths:
        if path.is_dir():
            raise ValueError(f"prompt file {str(path)!r} is a directory; give a .txt or .jsonl file in it")
        if not path.is_file():
            raise ValueError(f"prompt file {str(path)!r} does not exist (embedded sets: {sorted(EMBEDDED)}); "
                             f"{how_to_make(path)}")
        if path.suffix == ".jsonl":
            p, m = _read_jsonl(path)
        else:
            p = [ln.strip() for ln in read_text_lines(path) if not is_blank(ln)]
            m = [{} for _ in p]
        prompts += p
        meta += m
    if not prompts:
        raise ValueError(f"prompt set {name_or_path!r} holds no prompts")
    return PromptSet(prompts, meta, name_or_path)


class GroupSampler:
    """Draws P prompts per epoch, without replacement within a pass over the set (a fresh seeded permutation
    each pass), so every prompt is seen equally often. Each prompt becomes one group of G samples.

    No prompt appears twice in one epoch while P ≤ N (the set's size): when an epoch straddles two passes, the
    next pass's permutation is reordered (stably) so that the prompts the epoch already drew from the old pass
    come after the epoch's share of the new one. Every pass still holds each prompt exactly once. With P > N an
    epoch must repeat prompts; :func:`group_keys` then gives each copy its own group (and noise).

    The state is the number of prompts drawn so far (``position``), saved in checkpoints; the draws are a pure
    function of (seed, N, P, position).
    """

    def __init__(self, num_prompts: int, prompts_per_epoch: int, seed: int) -> None:
        if num_prompts < 1:
            raise ValueError("the prompt set is empty")
        if prompts_per_epoch < 1:
            raise ValueError(f"prompts_per_epoch must be >= 1, got {prompts_per_epoch}")
        self.n = num_prompts
        self.p = prompts_per_epoch
        self.seed = seed
        self.position = 0
        self._perms: dict[int, list[int]] = {}

    def _raw_perm(self, pass_index: int) -> list[int]:
        return torch.randperm(self.n, generator=make_generator(self.seed, "prompts", pass_index)).tolist()

    def _straddle(self, pass_index: int) -> tuple[int, int]:
        """(draws of the epoch straddling the start of pass ``pass_index`` from the previous pass, from this one);
        (0, 0) when no epoch straddles it or when P > N (repeats are then unavoidable)."""
        start = pass_index * self.n
        epoch_start = start // self.p * self.p
        if pass_index == 0 or epoch_start == start or self.p > self.n:
            return 0, 0
        return start - epoch_start, epoch_start + self.p - start

    def _perm(self, pass_index: int) -> list[int]:
        """Pass ``pass_index``'s order, reordered against the epoch that straddles its start (if any)."""
        if pass_index in self._perms:
            return self._perms[pass_index]
        first = pass_index  # the earliest pass whose order this one depends on, through a chain of straddles
        while first - 1 not in self._perms and self._straddle(first)[0]:
            first -= 1
        for k in range(first, pass_index + 1):
            perm = self._raw_perm(k)
            old, new = self._straddle(k)
            if old:
                before = set(self._perms[k - 1][self.n - old:])  # what the straddling epoch drew from pass k−1
                head = [i for i in perm if i not in before][:new]
                taken = set(head)
                perm = head + [i for i in perm if i not in taken]
            self._perms[k] = perm
        for k in [k for k in self._perms if k < pass_index - 1]:  # keep the cache small
            del self._perms[k]
        return self._perms[pass_index]

    def next_prompt_ids(self) -> torch.Tensor:
        """(P,) long global prompt indices of the next epoch."""
        ids = [self._perm(pos // self.n)[pos % self.n] for pos in range(self.position, self.position + self.p)]
        self.position += self.p
        return torch.tensor(ids, dtype=torch.long)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "n": self.n, "p": self.p}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's :meth:`state_dict`.

        Raises ``ValueError``, in the run's settings (``train.prompts_per_epoch``, ``train.seed``, the training
        prompt set), when the checkpoint's sampler drew from another set, another P or another seed."""
        n, p, seed = state["n"], state["p"], state["seed"]
        if n != self.n or p != self.p or seed != self.seed:
            pairs = (("train.prompts_per_epoch", p, self.p), ("train.seed", seed, self.seed),
                     ("the training prompt set", n, self.n))
            changed = [name for name, old, new in pairs if old != new]
            raise ValueError(
                f"the checkpoint's prompt sampler drew {p} prompts an epoch from {n} prompts (train.seed={seed}); "
                f"this run asks for train.prompts_per_epoch={self.p} from {self.n} prompts (train.seed={self.seed}): "
                "a resume cannot change train.prompts_per_epoch, train.seed or the training prompt set "
                f"(data.train_prompts); changed here: {', '.join(changed)}")
        self.position = int(state["position"])


def group_keys(prompt_ids: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """(P,) long key of each drawn group: ``prompt_id + copy·N``, where ``copy`` counts the earlier draws of the
    same prompt in this epoch (0 for the first). Keys are unique within an epoch, equal the prompt id for a prompt
    drawn once, and are the same on every process; they seed the group's noise and are its group id."""
    seen: dict[int, int] = {}
    keys = []
    for pid in prompt_ids.tolist():
        copy = seen.get(pid, 0)
        seen[pid] = copy + 1
        keys.append(pid + copy * num_prompts)
    return torch.tensor(keys, dtype=torch.long)
