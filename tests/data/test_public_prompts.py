"""``flowgrpo prompts`` (flowgrpo.data.public_prompts) on small fixtures in the public datasets' own file formats:
HPDv2, Pick-a-Pic (parquet and JSONL), OCR, GenEval. Its refusals of bad sources and options are in
tests/inputs/test_prompts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main


def test_geneval_seed_is_honoured(tmp_path):
    pytest.importorskip("flowgrpo_rewards.geneval.prompts")
    for seed in (0, 1):
        cli_main(["prompts", "geneval", "--out", str(tmp_path / f"s{seed}.jsonl"), "--per-task", "4", "--seed",
                  str(seed)])
    assert _lines(tmp_path / "s0.jsonl") != _lines(tmp_path / "s1.jsonl")


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_hpd_prompts_from_train_test_and_benchmark_files(tmp_path):
    train = [  # HPDv2 train.json: human_preference, prompt, file_path
        {"human_preference": [1, 0], "prompt": "A cat on a sofa ", "file_path": ["train/0.jpg", "train/1.jpg"]},
        {"human_preference": [0, 1], "prompt": "A cat on a sofa", "file_path": ["train/2.jpg", "train/3.jpg"]},
        {"human_preference": [1, 0], "prompt": "An  old lighthouse\nat dusk", "file_path": ["a.jpg", "b.jpg"]},
    ]
    test = [  # HPDv2 test.json: prompt, image_path, rank, raw_annotations
        {"prompt": "A red fox", "image_path": ["test/0.jpg", "test/1.jpg"], "rank": [1, 2],
         "raw_annotations": [{"rank": [1, 2], "user_hash": "x"}]},
    ]
    (tmp_path / "train.json").write_text(json.dumps(train))
    (tmp_path / "test.json").write_text(json.dumps(test))
    (tmp_path / "anime.json").write_text(json.dumps(["A girl with a sword", "A red fox"]))  # benchmark: strings
    out = tmp_path / "data" / "hpd_train.txt"
    cli_main(["prompts", "hpd", str(tmp_path / "train.json"), "--out", str(out)])
    assert _lines(out) == ["A cat on a sofa", "An old lighthouse at dusk"]
    cli_main(["prompts", "hpd", str(tmp_path / "test.json"), str(tmp_path / "anime.json"), "--out", str(out),
              "--overwrite"])  # its own file of the call above: replaced only when asked
    assert _lines(out) == ["A red fox", "A girl with a sword"]


def test_pickapic_captions_from_parquet_once_each(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({  # a Pick-a-Pic shard: one row per image pair; the caption repeats
        "are_different": [True, True, True], "best_image_uid": ["u0", "u2", "u4"],
        "caption": ["a corgi astronaut", "a corgi astronaut", "a castle made of cheese"],
        "has_label": [True, True, True], "image_0_uid": ["u0", "u2", "u4"], "image_1_uid": ["u1", "u3", "u5"],
        "jpg_0": [b"\xff\xd8", b"\xff\xd8", b"\xff\xd8"], "jpg_1": [b"\xff\xd8", b"\xff\xd8", b"\xff\xd8"],
        "label_0": [1.0, 0.5, 0.0], "label_1": [0.0, 0.5, 1.0], "model_0": ["sdxl"] * 3, "model_1": ["sd2"] * 3,
    })
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    out = tmp_path / "pickscore_train.txt"
    cli_main(["prompts", "pickapic", str(tmp_path / "train-00000-of-00001.parquet"), "--out", str(out)])
    assert _lines(out) == ["a corgi astronaut", "a castle made of cheese"]


def test_pickapic_captions_from_jsonl_export(tmp_path):
    src = tmp_path / "validation_unique.jsonl"
    src.write_text("".join(json.dumps({"caption": c, "ranking_id": i}) + "\n" for i, c in enumerate(["b", "a", "b"])))
    out = tmp_path / "pickscore_test.txt"
    cli_main(["prompts", "pickapic", str(src), "--out", str(out)])
    assert _lines(out) == ["b", "a"]


def test_ocr_prompts_keep_only_quoted_targets(tmp_path, caplog):
    src = tmp_path / "ocr.txt"
    src.write_text('A neon sign that says "OPEN"\nA beach at sunset\nA mug printed with ""\n'
                   'A poster reading "Hello World"\n')
    out = tmp_path / "ocr_train.txt"
    with caplog.at_level("WARNING"):
        cli_main(["prompts", "ocr", str(src), "--out", str(out)])
    assert _lines(out) == ['A neon sign that says "OPEN"', 'A poster reading "Hello World"']
    assert "dropped 2 of 4" in caplog.text


def test_geneval_prompts_are_generated_specs(tmp_path):
    pytest.importorskip("flowgrpo_rewards.geneval.prompts")
    out = tmp_path / "geneval_train.jsonl"
    cli_main(["prompts", "geneval", "--out", str(out), "--per-task", "3"])
    specs = [json.loads(line) for line in _lines(out)]
    assert len(specs) == 15  # five training tasks × 3
    assert all("prompt" in s and "tag" in s and "include" in s for s in specs)
