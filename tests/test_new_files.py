"""Every file flowgrpo writes for a user is a new file renamed over the old name
(:func:`flowgrpo.writing.outputs.replace_file`), never an old one rewritten in place: a hard link to an earlier
output (a user's backup) keeps its content and a crash leaves the old file whole. Fresh-user trial 4 found
``flowgrpo sample`` rewriting its PNGs and images.pt in place; this test reads the source of the package, the
evaluation script and the reward plugins for every call that writes a path in place (``write_text``,
``write_bytes``, ``torch.save``, an image's ``save``, ``safetensors``' ``save_file``, ``open`` for writing) whose
target is not a temporary (a name holding ``tmp``) or an in-memory buffer. The few places that must write in
place are listed with the reason; a listed place that no longer writes fails too (the list stays true)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("flowgrpo", "eval", "rewards/flowgrpo_rewards")

#: (file, function): why it writes in place
ALLOWED = {
    ("flowgrpo/writing/outputs.py", "append_text"): "an append to a file with one link (metrics.jsonl); a shared "
                                                    "one is replaced whole",
    ("flowgrpo/builds/cache_folder.py", "_locked"): "a build folder's lock file, opened for its lock",
    ("flowgrpo/testing/adapters.py", "sources"): "test fixtures in a test's own folder",
    ("flowgrpo/testing/adapters.py", "run_one_epoch"): "test fixtures in a test's own folder",
    ("rewards/flowgrpo_rewards/tiny_models.py", "save_tiny_hps_checkpoint"): "tiny random reward models for tests",
    ("rewards/flowgrpo_rewards/tiny_models.py", "save_tiny_open_clip_dir"): "tiny random reward models for tests",
    ("rewards/flowgrpo_rewards/tiny_models.py", "save_tiny_aesthetic_mlp"): "tiny random reward models for tests",
    ("rewards/flowgrpo_rewards/geneval/colors.py", "build_tiny_clip"): "a tiny random model for tests",
}


def _writes_in_place(call: ast.Call) -> ast.expr | None:
    """The path ``call`` writes in place, or None when it writes nothing."""
    fn, args = call.func, call.args
    if isinstance(fn, ast.Attribute) and fn.attr in ("write_text", "write_bytes"):
        return fn.value
    if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "torch":
        return args[1] if fn.attr == "save" and len(args) > 1 else None
    if isinstance(fn, ast.Attribute) and fn.attr == "save" and args:  # an image's save(path, …)
        owner = ast.unparse(fn.value)
        return None if owner == "dcp" or owner.startswith("self.") else args[0]  # a checkpoint's own writer
    if isinstance(fn, ast.Name) and fn.id == "save_file" and len(args) > 1:
        return args[1]
    mode = args[1] if isinstance(fn, ast.Name) and fn.id == "open" and len(args) > 1 else (
        args[0] if isinstance(fn, ast.Attribute) and fn.attr == "open" and args else None)
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax"):
        return args[0] if isinstance(fn, ast.Name) else fn.value
    return None


class _Writes(ast.NodeVisitor):
    """The in-place writes of one file by the innermost function holding them."""

    def __init__(self, name: str, source: str) -> None:
        self.name, self.source, self.stack = name, source, ["<module>"]
        self.found: dict[tuple[str, str], list[str]] = {}

    def visit_FunctionDef(self, node) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        target = _writes_in_place(node)
        text = (ast.get_source_segment(self.source, target) or "").lower() if target is not None else ""
        if target is not None and not any(w in text for w in ("tmp", "buf", "temp")):
            key = (self.name, self.stack[-1])
            self.found.setdefault(key, []).append(f"{self.name}:{node.lineno}: {ast.unparse(node)[:100]}")
        self.generic_visit(node)


def _in_place_writes() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            writes = _Writes(path.relative_to(REPO).as_posix(), source)
            writes.visit(ast.parse(source))
            found.update(writes.found)
    return found


def test_every_file_is_written_anew():
    found = _in_place_writes()
    loose = [line for key, lines in found.items() if key not in ALLOWED for line in lines]
    assert not loose, "writes in place (use flowgrpo.writing.outputs.replace_file):\n" + "\n".join(loose)


def test_the_list_of_places_that_write_in_place_is_true():
    found = _in_place_writes()
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, stale
