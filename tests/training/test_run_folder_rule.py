"""A run writes only into a folder that is absent, empty or a flowgrpo run's (flowgrpo.writing.outputs), whatever
``logging.overwrite`` or ``train.resume_from=auto`` say, and is refused in one line before any model loads.

Before: a first run into a folder holding a user's ``transformer/``, ``lora/``, ``metrics.jsonl`` and
``samples_latest.png`` (but no ``config.yaml``) replaced them, exit 0; a folder with a ``config.yaml`` of another
tool counted as a run, and ``logging.overwrite=true`` removed the user's ``transformer/`` with it.
"""

from __future__ import annotations

import pytest
import yaml

from tests.tiny_runs import _tiny_overrides

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]

USERS_FILES = {"transformer/diffusion_pytorch_model.safetensors": b"user weights", "transformer/config.json": b"{}",
               "lora/pytorch_lora_weights.safetensors": b"user lora", "metrics.jsonl": b'{"user": 1}\n',
               "samples_latest.png": b"user png"}


def _users_folder(folder, files=USERS_FILES):
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _contents(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _train(overrides, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``flowgrpo train`` with ``overrides``, the model's loading forbidden: (exit status, stderr's error lines)."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as info:
        main(overrides)
    err = capsys.readouterr().err
    return info.value.code, [line for line in err.splitlines() if "error" in line.lower()]


@pytest.mark.parametrize("extra", [[], ["logging.overwrite=true"], ["train.resume_from=auto"]])
def test_a_first_run_into_a_folder_of_a_users_files_is_refused_and_changes_nothing(tmp_path, tiny_flux_dir,
                                                                                   monkeypatch, capsys, extra):
    folder = _users_folder(tmp_path / "mine")
    code, errors = _train([*_tiny_overrides(tmp_path, tiny_flux_dir), f"output_dir={folder}", *extra],
                          monkeypatch, capsys)
    assert code == 2
    assert errors == [f"error: output_dir {str(folder)!r} is not empty and was not made by flowgrpo (it holds 'lora' "
                      "and 3 more): nothing was written; choose another folder, or empty this one"]
    assert _contents(folder) == USERS_FILES  # not even the run's lock or marker


def test_another_tools_config_yaml_does_not_make_a_folder_a_run(tmp_path, tiny_flux_dir, monkeypatch, capsys):
    """With it, ``logging.overwrite=true`` once removed the folder's transformer/ and metrics.jsonl as an old
    run's."""
    files = {**USERS_FILES, "config.yaml": yaml.safe_dump({"defaults": ["trainer"], "lr": 1e-4}).encode()}
    folder = _users_folder(tmp_path / "mine", files)
    code, errors = _train([*_tiny_overrides(tmp_path, tiny_flux_dir), f"output_dir={folder}",
                           "logging.overwrite=true"], monkeypatch, capsys)
    assert code == 2 and len(errors) == 1 and "is not empty and was not made by flowgrpo" in errors[0]
    assert _contents(folder) == files


@pytest.mark.parametrize("inside", ["transformer/run2", "checkpoints", "checkpoints/run2"])
def test_a_run_inside_another_runs_weights_or_checkpoints_is_refused(tmp_path, tiny_flux_dir, monkeypatch, capsys,
                                                                     inside):
    """``flowgrpo push`` uploads the weights folder; a resume reads the checkpoints."""
    from flowgrpo.config import build_config, save_config

    run = tmp_path / "run"
    (run / "transformer").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    save_config(build_config({"output_dir": str(run)}), run / "config.yaml")
    before = _contents(run)
    code, errors = _train([*_tiny_overrides(tmp_path, tiny_flux_dir), f"output_dir={run / inside}"], monkeypatch,
                          capsys)
    part = run / inside.split("/")[0]
    assert code == 2 and errors == [f"error: output_dir {str(run / inside)!r} would write into {str(part)!r}, part "
                                    f"of the flowgrpo run in {str(run)!r}: choose a folder outside it"]
    assert _contents(run) == before and sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml",
                                                                                "transformer"]


def test_a_run_inside_its_own_model_folder_is_refused(tmp_path, tiny_flux_dir, monkeypatch, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    overrides = [o for o in _tiny_overrides(tmp_path, tiny_flux_dir) if not o.startswith("model.pretrained=")]
    code, errors = _train([*overrides, f"model.pretrained={model}", f"output_dir={model / 'run'}"], monkeypatch,
                          capsys)
    assert code == 2 and errors == [f"error: output_dir {str(model / 'run')!r} lies inside {str(model)!r}, an input "
                                    "of this command; choose a path outside it"]
    assert sorted(p.name for p in model.iterdir()) == ["model_index.json"]


def test_a_refused_output_dir_is_said_by_rank_0_first(tmp_path, tiny_flux_dir, monkeypatch, capsys):
    """Rank 1 of a two-process launch finds the same refusal in its preflight and waits before it says it, naming
    its rank (rank 0 holds the folder's lock and says it at once; the launcher then ends rank 1 during its wait:
    ``test_a_setup_refusal_is_one_line_on_two_processes``). Its wait is 0 here (no launcher to end it)."""
    import flowgrpo.runner as runner

    monkeypatch.setattr(runner, "OTHER_RANK_WAIT_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(runner, "Accelerator", lambda *a, **k: pytest.fail("rank 1 went on to set up the run"))
    # its log filter would stay on pytest's session-wide capture handlers (and hide later tests' warnings); what
    # is checked here is the refusal's own line
    monkeypatch.setattr(runner, "one_rank_speaks", lambda: None)
    folder = _users_folder(tmp_path / "mine")
    code, errors = _train([*_tiny_overrides(tmp_path, tiny_flux_dir), f"output_dir={folder}",
                           "train.rollout_batch_size=2", "train.train_batch_size=2"], monkeypatch, capsys)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("(rank 1) error: output_dir"), errors
    assert _contents(folder) == USERS_FILES


def test_an_empty_folder_and_a_runs_own_folder_are_taken(tmp_path):
    """The rule refuses nothing a run may use: an empty folder, and its own folder on overwrite (whose files it
    did not write it keeps: RunFolder.claim removes only the run's own names)."""
    from flowgrpo.config import build_config
    from flowgrpo.preflight import check_output_dir
    from flowgrpo.training.run_folder import RunFolder

    (tmp_path / "empty").mkdir()
    check_output_dir(build_config({"output_dir": str(tmp_path / "empty")}))
    cfg = build_config({"output_dir": str(tmp_path / "run"), "logging": {"overwrite": True}})
    RunFolder(cfg).claim(0)
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    check_output_dir(cfg)
    RunFolder(cfg).claim(0)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".flowgrpo-output", "notes.txt"]


def test_a_prompt_embeddings_dir_of_a_users_files_is_refused(tmp_path, tiny_flux_dir, monkeypatch, capsys):
    """The run's other output folder: the prompt embeddings' cache (before: rows written among the user's files)."""
    folder = _users_folder(tmp_path / "mine")
    code, errors = _train([*_tiny_overrides(tmp_path, tiny_flux_dir), f"output_dir={tmp_path / 'run'}",
                           "model.cache_prompt_embeddings=true", f"model.prompt_embeddings_dir={folder}"],
                          monkeypatch, capsys)
    assert code == 2 and errors == [f"error: model.prompt_embeddings_dir {str(folder)!r} is not empty and was not "
                                    "made by flowgrpo (it holds 'lora' and 3 more): nothing was written; choose "
                                    "another folder, or empty this one"]
    assert _contents(folder) == USERS_FILES and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_setup_refusal_is_one_line_on_two_processes(tmp_path, tiny_flux_dir):
    """The real launch (torchrun, 2 processes): a reward whose weights are missing is found by both processes'
    set-up; the main process says it and the launcher ends the other during its wait, so the run prints it once
    (a fresh user's trial saw it twice, as every refusal of the set-up)."""
    import os
    import subprocess
    import sys

    from tests.training.test_distributed import _free_port

    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HPS_V2_CHECKPOINT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           "flowgrpo/train.py", *_tiny_overrides(tmp_path, tiny_flux_dir), f"output_dir={tmp_path / 'run'}",
           "train.rollout_batch_size=2", "train.train_batch_size=2", "rewards=[{name: hpsv2}]"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "error:" in ln and "hpsv2" in ln.lower()]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-3000:]
