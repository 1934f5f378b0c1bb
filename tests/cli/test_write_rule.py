"""Every ``flowgrpo`` subcommand that writes, and the module commands that build datasets and models, keep the
write rule (flowgrpo.writing.outputs): an ``--out`` file is replaced only with ``--overwrite`` and never when it is a
source; an output folder is absent, empty or the command's own, never a part of a run (its weights, which
``flowgrpo push`` uploads, its checkpoints) nor inside an input. Each refusal is one line (``error: …``, exit status
2) before any model is built or any source read, and leaves every file as it was.

Before: ``flowgrpo prompts hpd hpd_test.json --out hpd_test.json`` replaced the HPDv2 JSON by prompt lines;
``--out`` onto an existing file was written without asking; ``flowgrpo sample --run RUN --out RUN/transformer``
(or ``RUN``, ``RUN/checkpoints``) wrote its images into the run; ``python -m flowgrpo.tasks.digits.model DIR
--force`` removed DIR whatever it held.
"""

from __future__ import annotations

import json
import os

import pytest

from flowgrpo.cli import main as cli_main

HPD = json.dumps([{"prompt": "a cat on a mat", "image_path": ["0.png", "1.png"], "rank": [1, 2]}])


def _contents(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(argv, capsys, prog: str = "flowgrpo") -> str:
    """Run ``argv``; assert exit status 2 and one error line, and return it."""
    with pytest.raises(SystemExit) as info:
        cli_main(argv) if prog == "flowgrpo" else prog(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert info.value.code == 2 and len(errors) == 1, errors
    return errors[0]


# ------------------------------------------------------------------------------------------------ flowgrpo prompts
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_prompts_never_replace_their_own_source(tmp_path, capsys, overwrite):
    src = tmp_path / "hpd_test.json"
    src.write_text(HPD)
    line = _refused(["prompts", "hpd", str(src), "--out", str(src), *overwrite], capsys)
    assert line == (f"flowgrpo prompts: error: --out {str(src)!r} is also an input of this command ({str(src)!r}): "
                    "writing would replace it; choose another path")
    assert src.read_text() == HPD


@pytest.mark.parametrize("prompt_set", ["hpd", "geneval"])
def test_prompts_replace_an_existing_file_only_with_overwrite(tmp_path, capsys, prompt_set):
    if prompt_set == "geneval":
        pytest.importorskip("flowgrpo_rewards")
    src = tmp_path / "hpd_test.json"
    src.write_text(HPD)
    out = tmp_path / ("train.jsonl" if prompt_set == "geneval" else "train.txt")
    out.write_text("my own prompts\n")
    sources = [str(src)] if prompt_set == "hpd" else []
    line = _refused(["prompts", prompt_set, *sources, "--out", str(out), "--per-task", "1"][: None if prompt_set ==
                    "geneval" else -2], capsys)
    assert line == (f"flowgrpo prompts: error: --out {str(out)!r} exists and flowgrpo does not replace a file unasked: "
                    "nothing was written; choose another path, or give --overwrite to replace it")
    assert out.read_text() == "my own prompts\n"
    cli_main(["prompts", prompt_set, *sources, "--out", str(out), "--overwrite",
              *(["--per-task", "1"] if prompt_set == "geneval" else [])])
    assert out.read_text() != "my own prompts\n"
    if prompt_set == "hpd":
        assert out.read_text() == "a cat on a mat\n"


# ------------------------------------------------------------------------------------------------- flowgrpo sample
@pytest.fixture
def run_folder(tmp_path, tiny_flux_dir):
    """A finished run's folder as a run leaves it (config, weights, a checkpoint); no model is built from it."""
    from flowgrpo.config import build_config, save_config

    run = tmp_path / "run"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\n")
    cfg = build_config({"output_dir": str(run), "model": {"pretrained": str(tiny_flux_dir), "finetune": "full",
                                                          "height": 32, "width": 32},
                        "data": {"train_prompts": str(prompts), "eval_num_prompts": 1}})
    (run / "transformer").mkdir(parents=True)
    (run / "transformer" / "config.json").write_text("{}")
    (run / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    (run / "checkpoints" / "epoch_0").mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    return run


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: every refusal comes first."""
    import flowgrpo.models as models

    for name in ("load_model", "load_model_from_config"):
        monkeypatch.setattr(models, name, lambda *a, **k: pytest.fail("the model was built"))


@pytest.mark.parametrize("inside", ["transformer", ".", "checkpoints", "checkpoints/epoch_0"])
def test_sample_never_writes_into_the_run_it_samples(run_folder, capsys, no_model, inside):
    before = _contents(run_folder)
    out = run_folder / inside if inside != "." else run_folder
    line = _refused(["sample", "--run", str(run_folder), "--out", str(out)], capsys)
    assert line.startswith(f"flowgrpo sample: error: --out {str(out)!r} ")
    assert any(why in line for why in ("is also an input of this command", "part of the flowgrpo run",
                                       "holds flowgrpo's run output, not sample output"))
    assert _contents(run_folder) == before


def test_sample_may_write_a_new_folder_beside_the_runs_own(run_folder, monkeypatch):
    import flowgrpo.cli as cli

    monkeypatch.setattr(cli, "_sample_into", lambda out, *a: (out / "images.pt").write_bytes(b"images"))
    cli_main(["sample", "--run", str(run_folder), "--out", str(run_folder / "samples")])
    assert (run_folder / "samples" / "images.pt").read_bytes() == b"images"


def test_sample_refuses_a_folder_of_a_users_files_and_inside_its_weights(tmp_path, capsys, no_model):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "00000.png").write_bytes(b"my picture")
    line = _refused(["sample", "--model", "tiny", "--prompts", "digits_eval", "--out", str(mine)], capsys)
    assert line == (f"flowgrpo sample: error: --out {str(mine)!r} is not empty and was not made by flowgrpo (it "
                    "holds '00000.png'): nothing was written; choose another folder, or empty this one")
    assert _contents(mine) == {"00000.png": b"my picture"}
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"lora")
    line = _refused(["sample", "--model", "tiny", "--lora", str(lora), "--prompts", "digits_eval", "--out",
                     str(lora / "samples")], capsys)
    assert f"lies inside {str(lora)!r}, an input of this command" in line and not (lora / "samples").exists()


def test_sample_writes_into_an_empty_folder_and_again_into_its_own(tmp_path, monkeypatch):
    """The rule takes what sampling may use: an empty folder, a folder beside the run's own, its own output."""
    import flowgrpo.cli as cli
    from flowgrpo.writing.outputs import record_written

    def fake_sample(out, args, s, weights):  # as the writer does: what it writes is recorded in the marker
        (out / "images.pt").write_bytes(b"images")
        record_written(out, "sample", ["images.pt"])

    monkeypatch.setattr(cli, "_sample_into", fake_sample)
    (tmp_path / "empty").mkdir()
    for _ in range(2):
        cli_main(["sample", "--model", "tiny", "--prompts", "digits_eval", "--out", str(tmp_path / "empty")])
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [".flowgrpo-output", "images.pt"]


def test_sample_keeps_and_refuses_a_recorded_file_edited_since(tmp_path, monkeypatch, capsys):
    """A file an earlier call wrote and recorded, then edited by the user (same size, other bytes), is the user's:
    the next call refuses before building the model and removes nothing. A call that stopped half-way (its names
    recorded before writing) leaves its files its own."""
    import flowgrpo.cli as cli
    from flowgrpo.writing.outputs import record_written

    calls = []

    def fake_sample(out, args, s, weights):  # the writer's order: record the names, write, record the contents
        calls.append(out)
        names = ["00000.png", "00001.png"]
        cli._replace_written(out, names)
        for n in names:
            (out / n).write_bytes(f"image{len(calls)} {n}".encode())
        if len(calls) == 2:
            raise KeyboardInterrupt  # stopped before recording the contents
        record_written(out, "sample", names)

    monkeypatch.setattr(cli, "_sample_into", fake_sample)
    out = tmp_path / "out"
    argv = ["sample", "--model", "tiny", "--prompts", "digits_eval", "--out", str(out)]
    cli_main(argv)
    with pytest.raises(KeyboardInterrupt):
        cli_main(argv)
    cli_main(argv)  # after a call that stopped half-way
    assert len(calls) == 3
    (out / "00001.png").write_bytes(b"mine 1 00001.png")  # the same size: the digest tells
    line = _refused(argv, capsys)
    assert line == (f"flowgrpo sample: error: --out {str(out)!r} holds '00001.png', which an earlier flowgrpo call "
                    "wrote but which was changed since, so it is yours now: nothing was written; move it out of this "
                    "folder, or choose another folder")
    assert len(calls) == 3 and (out / "00001.png").read_bytes() == b"mine 1 00001.png"
    assert (out / "00000.png").read_bytes() == b"image3 00000.png"


# ------------------------------------------------------------------------------- dataset and model builders
def test_dataset_builders_refuse_a_users_folder_and_their_source(tmp_path, capsys):
    from flowgrpo.data.image_sets import ImageItem, write_image_set
    from flowgrpo.data.image_sets import main as image_sets_main
    from flowgrpo.tasks.digits.datasets import main as digits_sets_main
    from flowgrpo.writing.outputs import OutputRefused

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.jsonl").write_text("my data\n")
    with pytest.raises(OutputRefused, match="is not empty and was not made by flowgrpo"):
        write_image_set([ImageItem("a digit", b"png", {})], mine)
    for argv, main in ((["real", str(mine)], digits_sets_main), (["pairs", str(mine)], digits_sets_main),
                       (["imagefolder", str(tmp_path / "src"), str(mine)], image_sets_main)):
        assert "is not empty and was not made by flowgrpo" in _refused(argv, capsys, main)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "a cat"}\n')
    line = _refused(["imagefolder", str(tmp_path / "src"), str(tmp_path / "src")], capsys, image_sets_main)
    assert "is also an input of this command" in line
    assert _contents(mine) == {"data.jsonl": b"my data\n"}
    assert _contents(tmp_path / "src") == {"metadata.jsonl": b'{"file_name": "0.png", "text": "a cat"}\n'}


def test_model_builders_refuse_a_users_folder_whatever_the_overwrite_option(tmp_path, capsys):
    """``--force`` (now also ``--overwrite``) once removed the folder with shutil.rmtree before building."""
    from flowgrpo.models.random_pipelines import main as zoo_main
    from flowgrpo.models.tiny import main as tiny_main
    from flowgrpo.tasks.digits.model import main as digits_main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model_index.json").write_text("my model")
    for argv, main in ((["flux", str(mine)], zoo_main), ([str(mine)], tiny_main),
                       ([str(mine), "--steps", "1", "--force"], digits_main),
                       ([str(mine), "--overwrite"], digits_main), ([str(mine)], digits_main)):
        line = _refused(argv, capsys, main)
        assert line.endswith(f"error: {'OUT_DIR' if main is digits_main else 'out_dir'} {str(mine)!r} is not empty "
                             "and was not made by flowgrpo (it holds 'model_index.json'): nothing was written; choose "
                             "another folder, or empty this one")
    assert _contents(mine) == {"model_index.json": b"my model"}


def test_prompts_overwrite_never_writes_through_a_hard_link_or_a_symbolic_link(tmp_path):
    """``flowgrpo prompts … --out F --overwrite`` wrote F in place, so a hard-linked backup of F took the new prompts,
    and through a symbolic link F it replaced the link's target elsewhere (fresh-user trial 2): the file is now
    replaced whole (a hard link keeps the old text) and a link is refused, nothing written."""
    from flowgrpo.cli import main

    src = tmp_path / "src.txt"
    src.write_text('a sign that says "cat"\n')
    out, backup = tmp_path / "p.txt", tmp_path / "p-backup.txt"
    out.write_text("keepme\n")
    os.link(out, backup)
    main(["prompts", "ocr", str(src), "--out", str(out), "--overwrite"])
    assert backup.read_text() == "keepme\n" and out.read_text() != "keepme\n"
    precious, link = tmp_path / "precious.txt", tmp_path / "plink.txt"
    precious.write_text("precious\n")
    link.symlink_to(precious)
    with pytest.raises(SystemExit) as stop:
        main(["prompts", "ocr", str(src), "--out", str(link), "--overwrite"])
    assert stop.value.code == 2 and precious.read_text() == "precious\n" and link.is_symlink()


def test_sample_writes_each_file_anew_so_a_hard_link_keeps_the_earlier_images(tmp_path):
    """A second ``flowgrpo sample`` into its own folder once rewrote the PNGs and images.pt in place: a user's hard
    link to an earlier image (a favourite kept elsewhere) took the new image's bytes (fresh-user trial 4). Each file
    is now a new one, renamed over the old name."""
    out = tmp_path / "out"
    argv = ["sample", "--model", "tiny", "--prompts", "digits_eval", "--out", str(out), "--num-images", "2",
            "--num-steps", "2"]
    cli_main(argv)
    kept = {}
    for name in ("00000.png", "images.pt", "grid.png"):
        os.link(out / name, tmp_path / f"kept_{name}")
        kept[name] = (out / name).read_bytes()
    cli_main([*argv, "--seed", "5"])
    for name, before in kept.items():
        assert (tmp_path / f"kept_{name}").read_bytes() == before, name
        assert (out / name).read_bytes() != before and (out / name).stat().st_nlink == 1, name
