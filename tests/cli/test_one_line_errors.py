"""Specification (issue #54): a refusal of our command-line parsers is ONE line, ``PROG: error: MESSAGE`` on stderr
with exit status 2 (no usage block before it; ``--help`` still shows the usage); config errors of ``flowgrpo
train`` are one line too, each override's fault named (an override without a key, a fixed-length tuple given too
few values)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main
from flowgrpo.config import ConfigError, load_config
from flowgrpo.rewards.server import _parse_args as server_args

REPO = Path(__file__).resolve().parents[2]


def _refusal(capsys, call, argv) -> str:
    """stderr of ``call(argv)``, which must exit 2."""
    with pytest.raises(SystemExit) as ended:
        call(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "prog", "value"), [
    (["sample", "--num-images", "-1", "--out", "o"], "flowgrpo sample", "-1"),
    (["sample", "--num-steps", "0", "--out", "o"], "flowgrpo sample", "0"),
    (["sample", "--batch-size", "0", "--out", "o"], "flowgrpo sample", "0"),
    (["plan", "c.yaml", "--gpus", "0"], "flowgrpo plan", "0"),
    (["plan", "c.yaml", "--gpus", "1", "--gpu-memory-gib", "-3"], "flowgrpo plan", "-3"),
    (["prompts", "geneval", "--per-task", "0", "--out", "x.jsonl"], "flowgrpo prompts", "0"),
    (["nosuch"], "flowgrpo", "nosuch"),
])
def test_cli_range_refusal_is_one_line(capsys, argv, prog, value):
    err = _refusal(capsys, cli_main, argv)
    assert err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: ") and value in err
    assert "usage:" not in err


def test_reward_server_port_refusal_is_one_line(capsys):
    err = _refusal(capsys, server_args, ["--reward", "jpeg_compressibility", "--port", "-1"])
    assert err.count("\n") == 1 and err.startswith("flowgrpo-reward-server: error: argument --port: -1"), err


def test_geneval_exclusive_options_one_line():
    out = subprocess.run([sys.executable, str(REPO / "eval" / "geneval.py"), "--images", "X", "--model", "tiny"],
                         capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("geneval.py: error: "), out.stderr


def test_help_still_shows_usage(capsys):
    with pytest.raises(SystemExit) as ended:
        cli_main(["sample", "--help"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.startswith("usage: flowgrpo sample")


def _parser_calls(path: Path) -> list[str]:
    """Names of the callables that make parsers in ``path`` (``argparse.ArgumentParser``: ``ArgumentParser``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name.endswith("Parser"):
                names.append(name)
    return names


def test_every_parser_of_ours_is_one_line():
    files = [*(REPO / "flowgrpo").rglob("*.py"), *(REPO / "rewards" / "flowgrpo_rewards").rglob("*.py"),
             *(REPO / "eval").glob("*.py")]
    plain = [str(f.relative_to(REPO)) for f in files if "ArgumentParser" in _parser_calls(f)]
    assert plain == []


def test_two_config_errors_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny_jpeg.yaml", ["output_dir=null", "train.lr=abc"])
    text = str(err.value)
    assert "\n" not in text and "output_dir" in text and "train.lr" in text


def test_override_without_key():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny_jpeg.yaml", ["=5"])
    assert "'=5'" in str(err.value) and "no key" in str(err.value)
    assert "unknown config key" not in str(err.value)


@pytest.mark.parametrize("value", ["[0.9]", "[0.9, 0.99, 0.5]"])
def test_fixed_length_tuple_names_its_count(value):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny_jpeg.yaml", [f"train.adam_betas={value}"])
    text = str(err.value)
    assert "'train.adam_betas'" in text and "exactly 2 values" in text, text
    assert "adam_betas.1" not in text
