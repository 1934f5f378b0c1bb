"""Reading text and JSONL files as every prompt and dataset reader does: UTF-8 with a clear error naming the file,
JSONL lines numbered (:mod:`flowgrpo.data.prompts` for config prompt files, :mod:`flowgrpo.data.public_prompts`
for the public sets' converters, :mod:`flowgrpo.data.image_sets` for image datasets)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; a line that is not JSON raises
    ``ValueError`` naming ``path:line``."""
    for lineno, line in enumerate(read_text(path).split("\n"), 1):  # only \n ends a JSONL line (U+2028 may not)
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents; a file that is not UTF-8 text raises ``ValueError`` naming the file and the
    byte offset (prompt files must be UTF-8)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}: {err.object[err.start:err.start + 4]!r}); "
                         "prompt files must be UTF-8 encoded text") from None


def read_text_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (:func:`read_text`)."""
    return read_text(path).splitlines()
