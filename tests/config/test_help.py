"""Specification of ``train.py --help`` (flowgrpo.config.help): every field of the schema listed with its
description."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from flowgrpo.config import Config

REPO = Path(__file__).resolve().parents[2]


def _schema_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, description) of every leaf field, walked from the pydantic schema here in the test."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _schema_keys(ann, f"{prefix}{name}.")
        else:
            rows.append((prefix + name, field.description or ""))
    return rows


def test_train_help_lists_every_field():
    out = subprocess.run([sys.executable, str(REPO / "flowgrpo" / "train.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    keys = _schema_keys(Config)
    assert len(keys) > 50
    lines = out.stdout.splitlines()
    for key, description in keys:
        line = next((ln for ln in lines if ln.split() and ln.split()[0] == key), None)
        assert line is not None, f"--help does not list {key}"
        assert description[:30] in line, f"--help does not describe {key}"
