"""Odd and bad prompts and prompt sources: files that are not UTF-8 text, records whose prompt is not a string or
is missing, JSONL that does not parse, ``flowgrpo prompts`` options that cannot apply, a prompt set smaller than an
epoch's prompts (no prompt twice an epoch; forced copies are groups of their own, on one process or two), prompts
longer than the text encoders take."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flowgrpo.cli import main as cli_main
from flowgrpo.config import build_config
from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _cfg, _rollouts

REPO = Path(__file__).resolve().parents[2]
NOT_UTF8 = b"\xff\xfe\x00a handwritten digit\n"


def _refused(capsys, argv: list[str], match: str) -> None:
    """``flowgrpo prompts`` refuses ``argv`` with exit code 2 and one ``flowgrpo prompts: error:`` line matching
    ``match``."""
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith("flowgrpo prompts: error: ")
    assert re.search(match, err[-1]), err[-1]


def _assert_groups_distinct(stats: dict, group_size: int) -> None:
    ids = stats["group_ids"]
    assert set(torch.unique(ids, return_counts=True)[1].tolist()) == {group_size}, ids.tolist()
    init = stats["initial_latents"].flatten(1)
    assert len({tuple(r.tolist()) for r in init}) == init.shape[0]  # every sample its own noise


# ----------------------------------------------------------------------------------------------------- prompt files


def test_a_prompt_file_that_is_not_utf8_is_named_before_any_model_loads(tmp_path, monkeypatch):
    import flowgrpo.models as models
    from flowgrpo.runner import run

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the prompt file was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(NOT_UTF8)
    for key in ("train_prompts", "eval_prompts"):
        cfg = build_config(None, [f"data.{key}={bad}", f"output_dir={tmp_path / key}"])
        with pytest.raises(ValueError, match=rf"data.{key}: {bad}: not UTF-8 text \(byte 0"):
            run(cfg)
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"prompt": "caf\xe9"}\n')
    cfg = build_config(None, [f"data.train_prompts={jsonl}", f"output_dir={tmp_path / 'j'}"])
    with pytest.raises(ValueError, match=rf"{jsonl}: not UTF-8 text"):
        run(cfg)


def test_a_directory_given_as_a_prompt_file_is_named_as_a_directory(tmp_path):
    """Before: 'prompt file … does not exist' for a folder that exists."""
    from flowgrpo.data.prompts import load_prompts

    with pytest.raises(ValueError, match=rf"prompt file '{tmp_path}' is a directory; give a .txt or .jsonl file in it"):
        load_prompts(str(tmp_path))


# ------------------------------------------------------------------------------------------------- flowgrpo prompts


@pytest.mark.parametrize("name, suffix", [("hpd", ".json"), ("pickapic", ".jsonl"), ("ocr", ".txt"),
                                          ("pickapic", ".csv")])
def test_flowgrpo_prompts_names_a_source_that_is_not_utf8(tmp_path, capsys, name, suffix):
    src = tmp_path / f"src{suffix}"
    src.write_bytes(NOT_UTF8)
    _refused(capsys, ["prompts", name, str(src), "--out", str(tmp_path / "o.txt")], rf"{src}: not UTF-8 text")


def test_flowgrpo_prompts_refuses_a_prompt_that_is_not_a_string(tmp_path, capsys):
    """Before: ``{"prompt": 5}`` was dropped silently and the file written without it."""
    src = tmp_path / "train.json"
    src.write_text(json.dumps([{"prompt": "a cat"}, {"prompt": 5}]))
    out = tmp_path / "o.txt"
    _refused(capsys, ["prompts", "hpd", str(src), "--out", str(out)],
             r"record 1: field 'prompt' must be a string .*got int 5")
    assert not out.exists()


def test_flowgrpo_prompts_counts_null_prompts_it_drops(tmp_path, caplog):
    src = tmp_path / "train.jsonl"
    src.write_text('{"caption": "a cat"}\n{"caption": null}\n')
    out = tmp_path / "o.txt"
    with caplog.at_level("WARNING"):
        cli_main(["prompts", "pickapic", str(src), "--out", str(out)])
    assert out.read_text() == "a cat\n"
    assert "dropped 1 records whose prompt field is null" in caplog.text


def test_flowgrpo_prompts_names_the_line_of_a_bad_jsonl_source(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_text('{"caption": "a cat"}\n{oops\n')
    _refused(capsys, ["prompts", "pickapic", str(src), "--out", str(tmp_path / "o.txt")], rf"{src}:2: not valid JSON")


@pytest.mark.parametrize("argv, match", [
    (["prompts", "hpd", "SRC", "--out", "o.txt", "--per-task", "5"], "--per-task applies only to the geneval"),
    (["prompts", "ocr", "SRC", "--out", "o.txt", "--seed", "3"], "--seed applies only to the geneval generator"),
    (["prompts", "hpd", "SRC", "--out", "o.jsonl"], "would be read as JSONL, but the file holds one prompt a line"),
    (["prompts", "geneval", "--out", "o.txt"], "must end in .jsonl"),
])
def test_prompts_options_that_cannot_apply_are_refused(tmp_path, capsys, argv, match):
    src = tmp_path / "train.json"
    src.write_text(json.dumps([{"prompt": "a cat"}]))
    argv = [str(src) if a == "SRC" else str(tmp_path / a) if a.startswith("o.") else a for a in argv]
    _refused(capsys, argv, match)
    assert not any(tmp_path.glob("o.*"))


def test_hpd_record_without_prompt_is_an_error(tmp_path, capsys):
    (tmp_path / "train.json").write_text(json.dumps([{"caption": "x"}]))
    _refused(capsys, ["prompts", "hpd", str(tmp_path / "train.json"), "--out", str(tmp_path / "o.txt")],
             "record 0 has no field prompt")


def test_unknown_set_and_missing_source(tmp_path, capsys):
    _refused(capsys, ["prompts", "laion", "x.json", "--out", str(tmp_path / "o.txt")], "unknown prompt set|laion")
    _refused(capsys, ["prompts", "hpd", str(tmp_path / "absent.json"), "--out", str(tmp_path / "o.txt")],
             "no such file")


# ------------------------------------------------------------------------------------------ sampling the prompt set


@pytest.mark.slow
def test_no_prompt_twice_an_epoch_and_forced_copies_are_own_groups(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    # 3 prompts, 2 an epoch: epoch 1 straddles two passes over the set; with seed 3 the last prompt of the
    # first pass's permutation is the first of the second's (the old sampler drew it twice in epoch 1)
    run(_cfg(tmp_path, tiny_flux_dir, "fit", train={"num_epochs": 3, "seed": 3}))
    for epoch in range(3):
        stats = _rollouts(tmp_path / "fit", epoch)
        _assert_groups_distinct(stats, 2)
        assert len(set(stats["group_ids"].tolist())) == 2
    # 2 prompts, 3 an epoch: one prompt must repeat; each copy is its own group with its own noise
    run(_cfg(tmp_path, tiny_flux_dir, "repeat", prompts=("a red cube", "a blue ball"),
             train={"num_epochs": 1, "prompts_per_epoch": 3, "rollout_batch_size": 2}))
    stats = _rollouts(tmp_path / "repeat", 0)
    _assert_groups_distinct(stats, 2)
    assert len(set(stats["group_ids"].tolist())) == 3


@pytest.mark.slow
def test_repeated_prompt_copies_are_own_groups_across_two_processes(tmp_path, tiny_flux_dir):
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    paths = {}
    for name in ("one", "two"):
        cfg = _cfg(tmp_path, tiny_flux_dir, name, prompts=("a red cube", "a blue ball"),
                   train={"num_epochs": 1, "prompts_per_epoch": 3, "rollout_batch_size": 3})
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    for cmd in ([sys.executable, "flowgrpo/train.py", str(paths["one"])],
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
                 "flowgrpo/train.py", str(paths["two"])]):
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _rollouts(tmp_path / "one", 0), _rollouts(tmp_path / "two", 0)
    _assert_groups_distinct(two, 2)
    for key in ("group_ids", "initial_latents", "reward_total"):
        assert torch.equal(one[key], two[key]), key


@pytest.mark.slow
def test_prompt_truncation_is_warned_once_per_encoder_and_counted(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    long = "a red cube " + " ".join(["very"] * 100) + " on a table"
    cfg = _cfg(tmp_path, tiny_flux_dir, prompts=(long, "a blue ball"), train={"num_epochs": 2})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.models.base"):
        run(cfg)
    msgs = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    # once per encoder (CLIP: 77 tokens, T5: model.max_sequence_length = 16), with the count and the limit
    assert len(msgs) == 2, msgs
    assert any("CLIP text encoder's limit of 77 tokens" in m for m in msgs)
    assert any("T5 text encoder's limit of 16 tokens" in m for m in msgs)
    counts = [r["rollout/truncated_prompts"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert counts == [2.0, 2.0]  # the long prompt, cut by both encoders, each epoch
