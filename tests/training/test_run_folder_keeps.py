"""Nothing lost in a run folder (issue #54, part three), from a fresh user's trial on a finished tiny run:

- ``logging.overwrite=true`` removed a user's own file placed in the run's ``checkpoints/`` or ``lora/`` with the
  old run's folders; it is now refused in one line naming the file, before any model loads, and nothing is removed;
- a resume from an older checkpoint into a run that has a newer one (here: a finished run, its final weights
  written) replaced the final weights and the newer checkpoint silently; it is now refused in one line naming the
  newer checkpoint and the final weights, before any model loads.

A resume from the newest checkpoint, and an overwrite of a run folder holding only the run's own files, go on.
"""

from __future__ import annotations

import shutil

import pytest

from flowgrpo.config import ConfigError
from flowgrpo.preflight import check_output_dir
from flowgrpo.training.run_folder import RunFolder
from flowgrpo.writing.outputs import LOCK_FILE, OutputRefused
from tests.tiny_runs import _cfg, _tiny_overrides


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_flux_dir):
    """A finished 2-epoch LoRA run with a checkpoint after each epoch (epoch_0, epoch_1) and its rollouts."""
    from flowgrpo.runner import run

    tmp = tmp_path_factory.mktemp("finished")
    run(_cfg(tmp, tiny_flux_dir, logging={"save_every": 1, "save_rollout_stats": True}))
    return tmp


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """A copy of the finished run's folder (with its prompt file) for one test to change."""
    for p in finished_run.iterdir():
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp_path / p.name)
    return tmp_path


def _contents(folder) -> dict:
    """Every file's bytes by path, but the run lock's (rewritten by each run that takes the lock)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def _train(overrides, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``flowgrpo train`` with ``overrides``, the model's loading forbidden: (exit status, stderr's error lines)."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as info:
        main(overrides)
    return info.value.code, [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]


def test_a_runs_own_files_are_all_known_as_its_own(run_copy, tiny_flux_dir):
    """Every file a real run wrote into its folders (checkpoints, lora with its card, rollouts) is one the rule
    knows (else an overwrite of a plain finished run would be refused)."""
    from flowgrpo.training.run_folder import foreign_run_file

    out = run_copy / "run"
    assert {p.name for p in out.iterdir()} >= {"checkpoints", "lora", "rollouts"}
    assert foreign_run_file(out) is None
    check_output_dir(_cfg(run_copy, tiny_flux_dir, logging={"overwrite": True}))  # taken: no refusal


@pytest.mark.parametrize("place", ["checkpoints/notes.txt", "checkpoints/epoch_0/my_eval.json", "lora/mine.safetensors",
                                   "rollouts/analysis.csv", "transformer/diffusion_pytorch_model.safetensors.bak"])
def test_overwrite_refuses_a_users_file_inside_the_runs_folders_and_removes_nothing(run_copy, tiny_flux_dir, place):
    out = run_copy / "run"
    (out / place).parent.mkdir(parents=True, exist_ok=True)
    (out / place).write_bytes(b"the user's own")
    before = _contents(out)
    cfg = _cfg(run_copy, tiny_flux_dir, logging={"overwrite": True})
    expected = (f"logging.overwrite=true would remove {str(out / place)!r} with the old run's {place.split('/')[0]}/, "
                "but flowgrpo did not write it: nothing was removed; move it out of the run folder, or choose "
                "another output_dir")
    with pytest.raises(OutputRefused) as info:
        check_output_dir(cfg)
    assert str(info.value) == expected
    with pytest.raises(OutputRefused):  # the run's own removal checks it again (the lock is held since)
        RunFolder(cfg).claim(0)
    assert _contents(out) == before


def test_overwrite_refusal_is_one_line_before_the_model_loads(run_copy, tiny_flux_dir, monkeypatch, capsys):
    out = run_copy / "run"
    (out / "checkpoints" / "notes.txt").write_text("mine")
    before = _contents(out)
    code, errors = _train([*_tiny_overrides(run_copy, tiny_flux_dir), f"output_dir={out}", "logging.overwrite=true"],
                          monkeypatch, capsys)
    assert code == 2 and len(errors) == 1 and str(out / "checkpoints" / "notes.txt") in errors[0], errors
    assert _contents(out) == before


def test_overwrite_keeps_a_users_file_beside_the_runs_folders(run_copy, tiny_flux_dir):
    """At the top of the run folder a user's file is kept, as before; the run's own names are removed."""
    out = run_copy / "run"
    (out / "notes.txt").write_text("mine")
    cfg = _cfg(run_copy, tiny_flux_dir, logging={"overwrite": True})
    check_output_dir(cfg)
    RunFolder(cfg).claim(0)
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) == [".flowgrpo-output", "notes.txt"]


def test_a_resume_from_an_older_checkpoint_into_a_finished_run_is_refused_before_loading(run_copy, tiny_flux_dir,
                                                                                         monkeypatch, capsys):
    out = run_copy / "run"
    before = _contents(out)
    older = out / "checkpoints" / "epoch_0"
    cfg = _cfg(run_copy, tiny_flux_dir, train={"resume_from": str(older)})
    expected = (f"train.resume_from={older} (epoch_0) is older than what output_dir holds: "
                f"{str(out / 'checkpoints' / 'epoch_1')!r}, the final lora, the final summary.json; the resume would "
                f"replace them, nothing was changed. Resume from the newest (train.resume_from={out / 'checkpoints'}), "
                "or from this one into another output_dir")
    with pytest.raises(ConfigError) as info:
        check_output_dir(cfg)
    assert str(info.value) == expected
    code, errors = _train([*_tiny_overrides(run_copy, tiny_flux_dir), f"output_dir={out}",
                           f"train.resume_from={older}"], monkeypatch, capsys)
    assert code == 2 and errors == [f"error: {expected}"], errors
    assert _contents(out) == before


def test_final_weights_of_more_epochs_than_the_resumed_checkpoint_refuse_it_too(run_copy, tiny_flux_dir):
    """The newer checkpoint deleted (to free disk), the final weights of epoch 2 are still newer than epoch_0 named
    as the checkpoint to resume. (A resume from the root takes its newest healthy checkpoint, as before: the
    designed way on past a damaged newest one.)"""
    out = run_copy / "run"
    shutil.rmtree(out / "checkpoints" / "epoch_1")
    (out / "checkpoints" / "latest").write_text("epoch_0")
    check_output_dir(_cfg(run_copy, tiny_flux_dir, train={"resume_from": str(out / "checkpoints")}))
    cfg = _cfg(run_copy, tiny_flux_dir, train={"resume_from": str(out / "checkpoints" / "epoch_0")})
    with pytest.raises(ConfigError, match=r"\(epoch_0\) is older than what output_dir holds: the final lora, the "
                                          r"final summary.json; the resume would replace them"):
        check_output_dir(cfg)


def test_a_resume_from_the_newest_checkpoint_or_into_another_folder_goes_on(run_copy, tiny_flux_dir):
    out = run_copy / "run"
    for given in (out / "checkpoints", out / "checkpoints" / "epoch_1"):
        check_output_dir(_cfg(run_copy, tiny_flux_dir, train={"resume_from": str(given)}))
    older = str(out / "checkpoints" / "epoch_0")
    check_output_dir(_cfg(run_copy, tiny_flux_dir, "other", train={"resume_from": older}))


def test_a_newer_checkpoint_marked_unhealthy_does_not_block_the_resume_that_passes_it_over(run_copy,
                                                                                              tiny_flux_dir):
    """A run stopped at a diverged epoch (no final weights, no summary) resumes from its newest healthy checkpoint,
    as before."""
    from flowgrpo.checkpoints.health import mark_unhealthy

    root = run_copy / "run" / "checkpoints"
    shutil.rmtree(root.parent / "lora")
    (root.parent / "summary.json").unlink()
    mark_unhealthy(root, root / "epoch_1", "diverged")
    check_output_dir(_cfg(run_copy, tiny_flux_dir, train={"resume_from": str(root)}))
    check_output_dir(_cfg(run_copy, tiny_flux_dir, train={"resume_from": str(root / "epoch_0")}))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_resume_into_another_runs_folder_is_refused_before_loading(run_copy, tiny_flux_dir, monkeypatch, capsys,
                                                                     overwrite):
    """Run B (a copy of A: a run of its own) keeps its results when A's checkpoint is resumed into B's folder."""
    a, b = run_copy / "run", run_copy / "B"
    shutil.copytree(a, b, symlinks=True)
    before = _contents(b)
    code, errors = _train([*_tiny_overrides(run_copy, tiny_flux_dir), f"output_dir={b}",
                           f"train.resume_from={a / 'checkpoints'}", "train.num_epochs=7",
                           *(["logging.overwrite=true"] if overwrite else [])], monkeypatch, capsys)
    assert code == 2 and len(errors) == 1, errors
    if overwrite:
        assert "logging.overwrite=true and train.resume_from=" in errors[0] and "contradict" in errors[0]
    else:
        assert f"run in {str(a)!r}, but output_dir {str(b)!r} holds another run" in errors[0]
        assert f"output_dir={a}) or into a new folder" in errors[0]
    assert _contents(b) == before
