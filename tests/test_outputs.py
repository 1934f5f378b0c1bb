"""The write rule (flowgrpo.writing.outputs): a writer writes only into a folder that is absent, empty or flowgrpo's
own of the same kind, never over a file unasked, never onto its input, never into a part of another run. Each case here
is the rule's promise, stated on folders built by hand; the writers' own tests (tests/cli/test_write_rule.py,
tests/training/test_run_folder_rule.py, …) check that every writer asks it."""

from __future__ import annotations

import json

import pytest
import yaml

from flowgrpo.writing.outputs import (
    MARKER_FILE,
    OutputRefused,
    check_file,
    check_folder,
    claim_folder,
    owner,
    unclaim_folder,
)

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _users_folder(folder):
    """A folder of a user's own files (named as a run's would be)."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text("{}")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    return folder


def test_an_absent_or_empty_folder_may_be_written(tmp_path):
    check_folder(tmp_path / "new" / "deeper", "--out", "sample")
    (tmp_path / "empty").mkdir()
    check_folder(tmp_path / "empty", "--out", "sample")
    (tmp_path / "empty" / ".flowgrpo.lock").write_text("")  # a lock a run left in a folder it never wrote
    check_folder(tmp_path / "empty", "--out", "sample")


def test_a_folder_of_a_users_files_is_refused_naming_a_file_and_the_remedy(tmp_path):
    folder = _users_folder(tmp_path / "mine")
    with pytest.raises(OutputRefused) as info:
        check_folder(folder, "--out", "sample")
    assert str(info.value) == (f"--out {str(folder)!r} is not empty and was not made by flowgrpo (it holds "
                               "'metrics.jsonl' and 1 more): nothing was written; choose another folder, or empty "
                               "this one")


def test_a_claimed_folder_is_its_kinds_and_no_other_kinds(tmp_path):
    folder = tmp_path / "s"
    assert claim_folder(folder, "sample") is True
    assert json.loads((folder / MARKER_FILE).read_text()) == {"kind": "sample"} and owner(folder) == "sample"
    (folder / "00000.png").write_bytes(b"x")
    check_folder(folder, "--out", "sample")  # a second sample into its own folder
    with pytest.raises(OutputRefused, match=r"holds flowgrpo's sample output, not run output"):
        check_folder(folder, "output_dir", "run")
    assert claim_folder(folder, "sample") is False


def test_a_run_folder_of_an_older_version_is_a_run_and_a_foreign_config_yaml_is_not(tmp_path):
    from flowgrpo.config import build_config

    old = tmp_path / "old"
    old.mkdir()  # a run of a version without the marker: its config.yaml is the resolved config, every section
    (old / "config.yaml").write_text(yaml.safe_dump(build_config({"output_dir": str(old)}).model_dump(mode="json")))
    assert owner(old) == "run"
    check_folder(old, "output_dir", "run")
    # another trainer's config with an output_dir and a train section (a fresh user's trial: a run into it called
    # it a stopped run, and logging.overwrite=true then removed its checkpoints, config, metrics and summary)
    trainer = _users_folder(tmp_path / "trainer")
    (trainer / "config.yaml").write_text(yaml.safe_dump({"output_dir": "./out", "train": {"batch_size": 32}}))
    assert owner(trainer) is None
    # the user's own flowgrpo config file kept in the folder it names (the command's input: removed by overwrite)
    own = _users_folder(tmp_path / "own")
    (own / "config.yaml").write_text((REPO / "configs" / "tiny_jpeg.yaml").read_text()
                                     + f"\noutput_dir: {own}\n")
    assert owner(own) is None
    other = _users_folder(tmp_path / "other")
    (other / "config.yaml").write_text(yaml.safe_dump({"defaults": ["trainer"], "lr": 1e-4}))  # e.g. Hydra's
    assert owner(other) is None
    with pytest.raises(OutputRefused, match="not made by flowgrpo"):
        check_folder(other, "output_dir", "run")


@pytest.mark.parametrize("part", ["transformer", "lora", "checkpoints", "checkpoints/epoch_3/new"])
def test_nothing_is_written_into_a_runs_weights_or_checkpoints(tmp_path, part):
    run = tmp_path / "run"
    claim_folder(run, "run")
    with pytest.raises(OutputRefused, match=f"would write into {str(run / part.split('/')[0])!r}, part of the "
                                            f"flowgrpo run in {str(run)!r}"):
        check_folder(run / part, "--out", "sample")
    check_folder(run / "samples", "--out", "sample")  # a new folder of its own beside them is fine


def test_an_output_is_never_an_input_nor_inside_one(tmp_path):
    src = tmp_path / "prompts.json"
    src.write_text("[]")
    with pytest.raises(OutputRefused, match="is also an input of this command"):
        check_file(src, "--out", inputs=[src], overwrite=True)  # even with the overwrite option
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(OutputRefused, match=f"lies inside {str(model)!r}, an input of this command"):
        check_folder(model / "samples", "--out", "sample", inputs=[None, "digits", model])


def test_an_existing_file_is_replaced_only_when_asked(tmp_path):
    out = tmp_path / "train.txt"
    check_file(out, "--out")
    out.write_text("mine\n")
    with pytest.raises(OutputRefused) as info:
        check_file(out, "--out")
    assert str(info.value) == (f"--out {str(out)!r} exists and flowgrpo does not replace a file unasked: nothing was "
                               "written; choose another path, or give --overwrite to replace it")
    check_file(out, "--out", overwrite=True)


def test_a_cache_folder_of_its_own_names_counts_as_owned(tmp_path):
    cache = tmp_path / "embeds"
    (cache / "0123456789abcdef").mkdir(parents=True)
    check_folder(cache, "model.prompt_embeddings_dir", "prompt embeddings", own_names=r"[0-9a-f]{16}")
    (cache / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match="not made by flowgrpo"):
        check_folder(cache, "model.prompt_embeddings_dir", "prompt embeddings", own_names=r"[0-9a-f]{16}")


def test_a_failed_writer_removes_only_a_folder_it_left_empty(tmp_path):
    made = tmp_path / "made"
    claim_folder(made, "sample")
    unclaim_folder(made)
    assert not made.exists()
    kept = tmp_path / "kept"
    claim_folder(kept, "sample")
    (kept / "00000.png").write_bytes(b"x")
    unclaim_folder(kept)
    assert sorted(p.name for p in kept.iterdir()) == [MARKER_FILE, "00000.png"]


def test_a_hard_link_to_an_input_is_that_input(tmp_path):
    """``prompts ocr p2.txt --out hl.txt --overwrite`` with hl.txt a hard link of p2.txt truncated the source to
    the kept prompts (a fresh user's trial): the same file under another name is refused as the input itself."""
    import os

    source = tmp_path / "p2.txt"
    source.write_text("a\nb\n")
    os.link(source, tmp_path / "hl.txt")
    with pytest.raises(OutputRefused, match="is also an input of this command"):
        check_file(tmp_path / "hl.txt", "--out", inputs=[source], overwrite=True)
    assert source.read_text() == "a\nb\n"
