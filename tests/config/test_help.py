"""Specification of ``--help`` (flowgrpo.config.help): ``train.py --help`` lists every field of the schema with its
description and the value this command would use (``flowgrpo train`` too); ``eval/geneval.py --help`` shows its
defaults."""

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


# ------------------------------------------------------------------------------------- the values this command uses
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def _help_value(text: str, key: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.split() and ln.split()[0] == key)
    return line.rsplit("[", 1)[1].rstrip("]")


def test_train_help_shows_the_values_this_command_uses():
    import yaml

    digits = yaml.safe_load((REPO / "flowgrpo" / "configs" / "digits.yaml").read_text())
    out = _run("flowgrpo/train.py", "--help")
    assert out.returncode == 0, out.stderr
    assert _help_value(out.stdout, "train.num_epochs") == str(digits["train"]["num_epochs"])
    assert _help_value(out.stdout, "output_dir") == digits["output_dir"]
    assert _help_value(out.stdout, "model.finetune") == digits["model"]["finetune"]
    assert "base: OTHER.yaml" in out.stdout and "train.resume_from=auto" in out.stdout
    assert "digit_correctness" in out.stdout.split("registered rewards")[1]
    jpeg = yaml.safe_load((REPO / "configs" / "tiny_jpeg.yaml").read_text())
    out = _run("-m", "flowgrpo.cli", "train", "configs/tiny_jpeg.yaml", "train.seed=7", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: flowgrpo train ")
    assert _help_value(out.stdout, "train.num_epochs") == str(jpeg["train"]["num_epochs"])
    assert _help_value(out.stdout, "train.seed") == "7"


def test_geneval_help_shows_defaults():
    out = _run("eval/geneval.py", "--help")
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert "(default: 28)" in flat and "(default: 4)" in flat and "(default: float32)" in flat
