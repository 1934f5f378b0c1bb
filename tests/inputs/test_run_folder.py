"""The run folder and resume, from a new user's trials: an output_dir that holds a run, is a file, or stopped
before its first checkpoint; a resume that keeps the history and names what changed, of a finished run, with
another shape or another prompt sampler; corrupt checkpoint files; overwrite; Ctrl-C that leaves the checkpoint and
prints the command that resumes. Nothing is silently fixed or lost."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from flowgrpo.checkpoints.save_load import CheckpointError, load_checkpoint, save_checkpoint
from flowgrpo.config import ConfigError, build_config
from flowgrpo.data.prompts import GroupSampler
from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _cfg, _tiny_overrides

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ the output folder


def test_an_occupied_output_dir_is_refused_before_any_model_loads(tmp_path, tiny_flux_dir, monkeypatch):
    import flowgrpo.models as models
    from flowgrpo.runner import run

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "run").mkdir()
    _saved_run_config(tmp_path / "run")
    with pytest.raises(FileExistsError, match="already holds a run"):
        run(_cfg(tmp_path, tiny_flux_dir))


def _saved_run_config(folder):
    """A run's config.yaml in ``folder``, as a run saves it (a folder holding it is a flowgrpo run's)."""
    from flowgrpo.config import save_config

    save_config(build_config({"output_dir": str(folder)}), folder / "config.yaml")


def _run_folder(tmp_path, **train):
    from flowgrpo.training.run_folder import RunFolder

    return RunFolder(build_config({"output_dir": str(tmp_path), "train": train}))


def test_an_output_dir_holding_a_run_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(FileExistsError, match="already holds a run"):
        _run_folder(tmp_path).claim(3)


def test_an_output_dir_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    """Before: ``error: [Errno 17] File exists: '…'``, naming no setting."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before output_dir was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    a_file = tmp_path / "run.yaml"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as info:
        main([f"output_dir={a_file}"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.strip().splitlines()[-1] == f"error: output_dir {str(a_file)!r} is a file, not a folder; choose a " \
                                           "folder for the run"


def test_an_output_dir_under_a_file_is_named_without_a_traceback(tmp_path, monkeypatch, capsys):
    """Before: a NotADirectoryError traceback from the run lock's mkdir."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as info:
        main([f"output_dir={a_file / 'sub' / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2
    assert err == (f"error: output_dir {str(a_file / 'sub' / 'run')!r} cannot be made: {str(a_file)!r} above it is "
                   "a file, not a folder; choose a folder for the run")
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("value", ["''", "'  '"])
def test_an_empty_output_dir_is_refused(value):
    """Before: '' was the current folder, and the run (checkpoints, weights, lock) was written into it."""
    with pytest.raises(ConfigError, match=r"output_dir must name a folder for the run, got '\s*'"):
        build_config({}, [f"output_dir={value}"])


def test_a_run_that_stopped_before_its_first_checkpoint_says_how_to_start_it_again(tmp_path):
    """Before: the refusal suggested train.resume_from=<run>/checkpoints, a folder that did not exist, and
    train.resume_from=auto said 'starting a new run' and then hit the same refusal."""
    from flowgrpo.preflight import check_output_dir, resolve_auto_resume

    _saved_run_config(tmp_path)
    cfg = build_config({"output_dir": str(tmp_path)})
    with pytest.raises(FileExistsError, match="stopped before its first checkpoint; start it again with "
                                              "logging.overwrite=true") as info:
        check_output_dir(cfg)
    assert "resume_from=" + str(tmp_path / "checkpoints") not in str(info.value)
    again = resolve_auto_resume(build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}}))
    assert again.train.resume_from is None and again.logging.overwrite  # README: such a folder starts afresh
    check_output_dir(again)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("epoch_0\n")
    with pytest.raises(FileExistsError, match=f"resume it with train.resume_from={tmp_path / 'checkpoints'}"):
        check_output_dir(cfg)


@pytest.mark.slow
def test_overwrite_removes_the_old_runs_checkpoints(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    run(_cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 4}, logging={"save_every": 1}))
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "epoch_3").is_dir()
    run(_cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 2}, logging={"overwrite": True, "save_every": 1}))
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["epoch_0", "epoch_1"]
    assert (ckpts / "latest").read_text() == "epoch_1"


# ----------------------------------------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resume_keeps_history_and_records_changed_settings(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    full = tmp_path / "run"
    first = _cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}, train={"num_epochs": 2})
    run(first)
    old = yaml.safe_load((full / "config.yaml").read_text())
    del old["logging"]["plot_every"]  # as a run of a version without that setting wrote it
    (full / "config.yaml").write_text(yaml.safe_dump(old))
    original = (full / "config.yaml").read_text()
    before = {k: v for k, v in json.loads((full / "summary.json").read_text()).items() if k.endswith("_before")}
    assert before
    # resume from the newest checkpoint (after epoch 2 of 2) into the same folder, extended to 3 epochs with another
    # learning rate (an older checkpoint is refused: flowgrpo.training.run_folder.refuse_older_resume)
    resumed = _cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1},
                   train={"num_epochs": 3, "lr": 5e-3, "resume_from": str(full / "checkpoints" / "epoch_1")})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        run(resumed)
    assert (full / "config.yaml").read_text() == original  # never overwritten
    assert any("train.lr: 0.01 -> 0.005" in r.getMessage() for r in caplog.records)
    assert any("logging.plot_every: (absent) -> 1" in r.getMessage() for r in caplog.records)
    beside = yaml.safe_load((full / "config_resumed_at_epoch_2.yaml").read_text())
    assert beside["train"]["lr"] == 5e-3
    summary = json.loads((full / "summary.json").read_text())
    assert {k: summary[k] for k in before} == before  # the base model's, not the checkpoint's
    assert [r["epoch"] for r in read_metrics(full / "metrics.jsonl")] == [0, 1, 2]


def test_resuming_into_the_folder_drops_records_after_the_checkpoint(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    lines = [json.dumps({"epoch": e}) for e in (0, 1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _run_folder(tmp_path, resume_from=str(tmp_path / "checkpoints")).claim(3)
    kept = [json.loads(x)["epoch"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]  # the stub resumes at epoch 3


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_rewrites_nothing(tmp_path, tiny_flux_dir, caplog, capsys):
    from flowgrpo.runner import main, run

    run(_cfg(tmp_path, tiny_flux_dir))
    out = tmp_path / "run"

    def stamps():  # the run's files; the lock file (flowgrpo.writing.run_lock) names whichever process holds the folder
        return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".flowgrpo.lock"}

    before = stamps()
    again = _cfg(tmp_path, tiny_flux_dir, train={"resume_from": str(out / "checkpoints")})
    with caplog.at_level(logging.INFO, logger="flowgrpo.training"):  # INFO: the resumed line's level
        summary = run(again)
    assert any("already finished all 2 epochs (its checkpoint epoch_1 is after epoch 2/2" in r.getMessage()
               for r in caplog.records)  # numbered as the epoch lines, not "after epoch 1" of 2
    assert not any("continuing with epoch" in r.getMessage() for r in caplog.records)  # only the finished line
    assert not any("were not used" in r.getMessage() for r in caplog.records)  # nothing given differs
    assert summary == json.loads((out / "summary.json").read_text())
    assert stamps() == before
    # settings given that nothing reads (trial 4: group_size=16 lr=5 on a finished run) are named, not dropped
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flowgrpo.training"):
        run(_cfg(tmp_path, tiny_flux_dir, train={"resume_from": str(out / "checkpoints"), "lr": 5.0}))
    (line,) = [r.getMessage() for r in caplog.records if "already finished" in r.getMessage()]
    assert line.endswith("The settings given that differ from the run's were not used: train.lr: 0.01 -> 5.0."), line
    assert stamps() == before
    # a copy of the finished folder resumed in place reports its own files, not the original's
    shutil.copytree(out, tmp_path / "copy")
    summary = run(_cfg(tmp_path, tiny_flux_dir, "copy", train={"resume_from": str(tmp_path / "copy" / "checkpoints")}))
    written = [v for v in summary["outputs"].values() if isinstance(v, str)]
    assert written and all(v.startswith(str(tmp_path / "copy")) for v in written)
    # through the command: its report heads the run's files as unchanged, not "written:" (fresh-user trial 7)
    capsys.readouterr()
    main([str(out / "config.yaml"), f"train.resume_from={out / 'checkpoints'}"])
    printed = capsys.readouterr().out
    assert "the run's files, unchanged (it had already finished):" in printed and "written:" not in printed, printed
    assert stamps() == before
    # into a new folder there is nothing to train and no output to finish: refused before any model loads (trial 8:
    # it said it was finishing an interrupted run's outputs and wrote a checkpoint and a summary there)
    from flowgrpo.strategies.settings import ConfigError

    elsewhere = _cfg(tmp_path, tiny_flux_dir, "elsewhere", train={"resume_from": str(out / "checkpoints")})
    with pytest.raises(ConfigError, match=r"is after epoch 2 of its run .*train.num_epochs=2: nothing is left to "
                                          r"train into output_dir=.*set train.num_epochs above 2"):
        run(elsewhere)
    assert not [p for p in (tmp_path / "elsewhere").rglob("*") if p.name != ".flowgrpo.lock"]
    assert stamps() == before


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_names_the_parameter_and_both_shapes(tmp_path, tiny_flux_dir):
    from flowgrpo.checkpoints.save_load import CheckpointError
    from flowgrpo.runner import run
    from flowgrpo.strategies.settings import ConfigError

    run(_cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 1}))
    other = _cfg(tmp_path, tiny_flux_dir, "rank2", model={"lora_rank": 2},
                 train={"resume_from": str(tmp_path / "run" / "checkpoints")})
    # the checkpoint's run's config says it first, before the model loads (refuse_changed_model)
    with pytest.raises(ConfigError, match=r"model.lora_rank: 4 -> 2: .*set model.lora_rank=4"):
        run(other)
    (tmp_path / "run" / "config.yaml").unlink()  # without it, the checkpoint's tensors say it once loaded
    with pytest.raises(CheckpointError, match=r"parameter '.*lora_A.*' has shape \(4, \d+\) in the checkpoint but "
                                              r"\(2, \d+\) in the model"):
        run(other)


def test_a_resume_with_other_prompts_per_epoch_is_explained_in_config_terms():
    state = {"position": 24, "seed": 0, "n": 30, "p": 8}
    with pytest.raises(ValueError, match=r"the checkpoint's prompt sampler drew 8 prompts an epoch from 30 prompts "
                                         r".*this run asks for train.prompts_per_epoch=16 from 30 prompts .*a resume "
                                         r"cannot change train.prompts_per_epoch.*changed here: "
                                         r"train.prompts_per_epoch$"):
        GroupSampler(30, 16, 0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"changed here: train.seed, the training prompt set$"):
        GroupSampler(31, 8, 1).load_state_dict(state)
    ok = GroupSampler(30, 8, 0)
    ok.load_state_dict(state)
    assert ok.position == 24


# ----------------------------------------------------------------------------------------- corrupt checkpoint files


def _parts(seed=0):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    from flowgrpo.training.ema import EMA

    return model, opt, sched, GroupSampler(30, 8, seed), EMA(list(model.parameters()), 0.9)


def _saved(tmp_path):
    model, opt, sched, sampler, ema = _parts()
    save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, ema=ema)
    return tmp_path / "epoch_0"


def _load(tmp_path, sampler=None):
    model, opt, sched, own, ema = _parts()
    return load_checkpoint(tmp_path, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler or own,
                           ema=ema)


def _without_sizes(folder):
    """``folder``'s ``state.json`` without its list of file sizes, as a version before the list wrote it."""
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "files"}))


@pytest.mark.parametrize("name", ["trainable.safetensors", "ema.safetensors", "optimizer.pt", "rng.pt",
                                  "state.json"])
def test_a_truncated_checkpoint_file_is_named_as_corrupt(tmp_path, name):
    """Found by the sizes ``state.json`` lists before anything is read; in a checkpoint without them (an older
    version's), when the file is read."""
    folder = _saved(tmp_path)
    f = folder / name
    size = f.stat().st_size
    if name != "state.json":
        f.write_bytes(f.read_bytes()[:min(1000, size // 2)])
        with pytest.raises(CheckpointError, match=rf"epoch_0' is not as it was written: {name} has "
                                                  rf"{min(1000, size // 2)} of its {size} bytes"):
            _load(tmp_path)
        _without_sizes(folder)
    else:
        f.write_bytes(f.read_bytes()[:min(1000, size // 2)])
        with pytest.raises(CheckpointError, match=r"epoch_0' is not as it was written: its state.json is unreadable"):
            _load(tmp_path)
        return
    with pytest.raises(CheckpointError, match=rf"{name}' is corrupt or unreadable"):
        _load(tmp_path)


def test_a_garbage_safetensors_file_is_named_as_corrupt(tmp_path):
    """Bytes of the right size but not a safetensors file: found when the file is read."""
    folder = _saved(tmp_path)
    f = folder / "trainable.safetensors"
    f.write_bytes(b"\x00" * f.stat().st_size)
    with pytest.raises(CheckpointError, match=r"trainable.safetensors' is corrupt or unreadable"):
        _load(tmp_path)


def test_a_state_json_without_its_entries_is_named_as_corrupt(tmp_path):
    folder = _saved(tmp_path)
    (folder / "state.json").write_text(json.dumps({"epoch": 0}))
    with pytest.raises(CheckpointError, match=r"state.json' is corrupt or unreadable .*'lr_scheduler'"):
        _load(tmp_path)


def test_a_missing_checkpoint_file_is_named(tmp_path):
    folder = _saved(tmp_path)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer.pt is missing"):
        _load(tmp_path)


def test_an_intact_checkpoint_still_loads(tmp_path):
    _saved(tmp_path)
    assert _load(tmp_path) == 0


def test_load_checkpoint_reports_the_sampler_mismatch(tmp_path):
    _saved(tmp_path)
    with pytest.raises(ValueError, match="train.prompts_per_epoch=16"):
        _load(tmp_path, sampler=GroupSampler(30, 16, 0))


# ------------------------------------------------------------------------------------------------- interrupted runs


def _default_sigint() -> None:
    """In the child: SIGINT back to its default. A suite started in the background (``nohup … &``, some CI runners)
    has SIGINT ignored, the child inherits that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_leaves_the_checkpoint(tmp_path, tiny_flux_dir):
    cfg = _cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 500}, logging={"save_every": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.Popen([sys.executable, "flowgrpo/train.py", str(path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=_default_sigint)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("interrupted in epoch ") and "is intact; resume: " in line
    assert re.match(r"interrupted in epoch [1-9]\d*/500; ", line), line  # 1-based, as the epoch lines
    assert f"train.resume_from={tmp_path / 'run' / 'checkpoints'}" in line
    ckpt = tmp_path / "run" / "checkpoints" / latest.read_text().strip()
    assert (ckpt / "state.json").is_file() and (ckpt / "trainable.safetensors").is_file()


@pytest.mark.slow
def test_ctrl_c_under_the_cli_prints_the_cli_command_that_resumes(tmp_path, tiny_flux_dir):
    """Before: the resume line was ``<python> flowgrpo/train.py …``, a path relative to the repository, whatever
    command was run and wherever."""
    import os
    import signal
    import time

    out = tmp_path / "run"
    argv = ["train", *_tiny_overrides(tmp_path, tiny_flux_dir), "train.num_epochs=500", "logging.save_every=1",
            f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "rewards"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "flowgrpo.cli", *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # see _default_sigint
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("interrupted in epoch ") and "; resume: flowgrpo train model.pretrained=" in line
    assert line.endswith(f"train.resume_from={out / 'checkpoints'}")


def _unmakeable(tmp_path, monkeypatch, kind):
    """A folder whose making fails as the OS would fail it: under ``/proc`` (no such file or directory: a real
    virtual file system, Linux) or, for "permission", a ``mkdir`` refused with EACCES (the tests run as root, who
    may write anywhere)."""
    if kind == "proc":
        if not Path("/proc/self").exists():
            pytest.skip("no /proc on this platform")
        return Path("/proc/flowgrpo-no-such-folder/run"), "No such file or directory"
    target = tmp_path / "locked" / "run"
    real_mkdir = Path.mkdir

    def refuse(self, *a, **k):
        if self in (target, target.parent):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", refuse)
    return target, "Permission denied"


@pytest.mark.parametrize("kind", ["proc", "permission"])
def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys, kind):
    """Before: a PermissionError (``/sys/…``) or FileNotFoundError (``/proc/…``) traceback from the run lock's
    mkdir."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    folder, reason = _unmakeable(tmp_path, monkeypatch, kind)
    with pytest.raises(SystemExit) as info:
        main([f"output_dir={folder}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"error: output_dir {str(folder)!r} cannot be used as a run folder: "
                                               f"{reason} (")
    assert err[0].endswith("); choose a folder you can write to")


def test_resuming_a_finished_run_prints_only_the_finished_line():
    # no "continuing with epoch 6/5" beside "already finished"; a checkpoint past train.num_epochs says so
    from flowgrpo.training.optim import resumed_line
    from flowgrpo.training.run_folder import finished_line

    assert resumed_line("runs/x/checkpoints/epoch_4", 5, 5) is None
    assert resumed_line("runs/x/checkpoints/epoch_4", 7, 5) is None
    assert resumed_line("c/epoch_1", 2, 10) == (
        "resumed from c/epoch_1 (saved after epoch 2/10); continuing with epoch 3/10")
    assert finished_line("runs/x/checkpoints", 5, 5).startswith(
        "the run of runs/x/checkpoints already finished all 5 epochs (its checkpoint epoch_4 is after epoch 5/5")
    line = finished_line("runs/x/checkpoints", 7, 5)
    assert "already trained 7 epochs (its checkpoint epoch_6 is after epoch 7" in line
    assert "more than train.num_epochs=5 asks" in line and "train.num_epochs above 7" in line


def test_a_resume_that_stretches_a_cosine_schedule_says_the_rate_jumps():
    """90 → 180 epochs resumed at epoch 45 (0-based): the old curve's rate there is 0.1 + 0.9·(1 + cos(π/2))/2 =
    0.55 of train.lr, the new one's 0.1 + 0.9·(1 + cos(π/4))/2 = 0.868; same length or a constant rate: no line."""
    from types import SimpleNamespace

    from flowgrpo.training.run_folder import schedule_shift_line

    saved = {"train": {"lr_schedule": "cosine", "num_epochs": 90, "lr_min_ratio": 0.1}}
    train = SimpleNamespace(lr_schedule="cosine", num_epochs=180, lr_min_ratio=0.1)
    line = schedule_shift_line(saved, train, 45)
    assert "epoch 46" in line and "train.num_epochs 90 -> 180" in line and "from 0.55 to 0.868" in line
    same = SimpleNamespace(lr_schedule="cosine", num_epochs=90, lr_min_ratio=0.1)
    assert schedule_shift_line(saved, same, 45) is None
    assert schedule_shift_line(saved, SimpleNamespace(lr_schedule="constant", num_epochs=180, lr_min_ratio=0.0),
                               45) is None


def test_a_resume_with_another_objective_reports_the_switch_first_in_one_line(tmp_path):
    """Resuming a dpo run with sde_ratio once buried ``objective.name: 'dpo' -> 'sde_ratio'`` among one
    ``-> (absent)`` line per setting of either objective (issue 54): the switch comes first, one entry counting the
    settings dropped and added; a setting outside the section is still listed by itself."""
    from flowgrpo.strategies.settings import flat_dict, save_config
    from flowgrpo.training.run_folder import changed_settings

    dpo = build_config({"objective": {"name": "dpo"}})
    save_config(dpo, tmp_path / "config.yaml")
    grpo = build_config({"train": {"lr": dpo.train.lr * 2}})
    old_keys = {k for k in flat_dict(dpo.objective.model_dump(mode="json")) if k != "name"}
    new_keys = {k for k in flat_dict(grpo.objective.model_dump(mode="json")) if k != "name"}  # its chunker's too
    changed = changed_settings(tmp_path / "config.yaml", grpo)
    first = next(iter(changed.values()))
    assert first.startswith("objective.name: 'dpo' -> 'sde_ratio'")
    assert f"{len(old_keys - new_keys)} of the old one's dropped, {len(new_keys - old_keys)} of the new one's" in first
    assert not any("(absent)" in line for line in changed.values())
    assert f"train.lr: {dpo.train.lr!r} -> {grpo.train.lr!r}" in changed.values()


def test_a_resume_into_a_new_folder_with_another_evaluation_size_is_refused(tmp_path, monkeypatch):
    """A resume into a new output_dir takes the "before" figures of the checkpoint's run (its eval_before.json), so
    another data.eval_num_prompts there once mixed evaluation sizes in the before/after table (issue 54): refused,
    naming the key and both values; the same evaluation passes."""
    from flowgrpo.strategies.settings import save_config
    from flowgrpo.training import run_folder

    origin = tmp_path / "origin"
    (origin / "checkpoints" / "epoch_1").mkdir(parents=True)
    save_config(build_config({"output_dir": str(origin), "data": {"eval_num_prompts": 2}}), origin / "config.yaml")
    monkeypatch.setattr(run_folder, "resolve_checkpoint", lambda path, **_: Path(path))
    resume = {"output_dir": str(tmp_path / "new"), "train": {"resume_from": str(origin / "checkpoints" / "epoch_1")}}
    with pytest.raises(ConfigError, match=r"another evaluation than its first leg \(data.eval_num_prompts: 2 -> 3\)"):
        run_folder.refuse_changed_evaluation(build_config({**resume, "data": {"eval_num_prompts": 3}}))
    run_folder.refuse_changed_evaluation(build_config({**resume, "data": {"eval_num_prompts": 2}}))


@pytest.mark.slow
def test_ctrl_c_under_accelerate_launch_prints_the_line_with_the_same_launch(tmp_path, tiny_flux_dir):
    """Ctrl-C under ``accelerate launch`` (the terminal's SIGINT to the launcher and its child, one process group)
    once lost the "interrupted …; resume: …" line: accelerate 1.16 answers it with SIGTERM to the child (then
    SIGKILL after 5 s), whose default ends Python at once. The child now stops on the first of the two signals and
    prints the line, and the resume command is the accelerate launch it was started with."""
    import shutil

    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate's launcher is not on PATH")
    cfg = _cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 500}, logging={"save_every": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    launch = [accelerate, "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "flowgrpo/train.py", str(path)]
    # the launch's own variables only (an earlier test of this process may have left ACCELERATE_USE_CPU in its
    # environment: the resume line would then rightly repeat it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True, preexec_fn=_default_sigint)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    while not latest.exists() and proc.poll() is None:  # no deadline: as long as the machine takes
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, err = proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    lines = [x for x in err.splitlines() if x.startswith("interrupted ")]
    assert len(lines) == 1, err[-2000:]
    assert re.match(r"interrupted in epoch [1-9]\d*/500; last checkpoint .* is intact; resume: accelerate launch "
                    r"--cpu --num_processes 1 .*flowgrpo/train.py ", lines[0]), lines[0]
    assert lines[0].endswith(f"train.resume_from={tmp_path / 'run' / 'checkpoints'}")


@pytest.mark.slow
def test_ctrl_c_under_torchrun_prints_one_line_with_the_torchrun_launch(tmp_path, tiny_flux_dir):
    """Under torchrun the resume command was a single-process ``<python> flowgrpo/train.py …`` (issue 54): it is the
    torchrun launch, printed once (rank 0), though torchrun's agent also sends its workers SIGTERM."""
    import shutil

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    cfg = _cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 500, "rollout_batch_size": 2},
               logging={"save_every": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.Popen([torchrun, "--nproc_per_node", "2", "flowgrpo/train.py", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"},
                            preexec_fn=_default_sigint)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    while not latest.exists() and proc.poll() is None:  # no deadline: as long as the machine takes
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate()
    lines = [x for x in err.splitlines() if x.startswith("interrupted ")]
    assert len(lines) == 1, err[-3000:]
    # the launch as it was started, its ACCELERATE_USE_CPU=true with it (without it a CPU machine fails)
    assert (f"; resume: ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 flowgrpo/train.py {path} "
            "train.resume_from=") in lines[0], lines[0]
    # the stop signal ends our ranks quietly: no frame of ours, no KeyboardInterrupt (torchrun's agent prints its own
    # SignalException traceback on Ctrl-C: torch's, not ours)
    assert not re.search(r'File ".*/flowgrpo/', err) and "KeyboardInterrupt" not in err, err[-3000:]


# ------------------------------------------------------------------------------- a resume writes into its own run


def _resume_cfg(out, resume_from, **logging_):
    return build_config({"output_dir": str(out), "train": {"resume_from": str(resume_from)}, "logging": logging_})


def test_a_resume_into_another_runs_folder_is_refused_naming_both(tmp_path):
    from flowgrpo.training.run_folder import refuse_foreign_resume

    a, b = tmp_path / "A", tmp_path / "B"
    for run_dir in (a, b):
        (run_dir / "checkpoints" / "epoch_1").mkdir(parents=True)
        _saved_run_config(run_dir)
    ckpt = a / "checkpoints" / "epoch_1"
    with pytest.raises(ConfigError, match=rf"run in '{re.escape(str(a))}'.*output_dir '{re.escape(str(b))}' holds "
                       rf"another run.*output_dir={re.escape(str(a))}\) or into a new folder"):
        refuse_foreign_resume(_resume_cfg(b, a / "checkpoints"), ckpt)
    refuse_foreign_resume(_resume_cfg(a, a / "checkpoints"), ckpt)  # its own run
    refuse_foreign_resume(_resume_cfg(tmp_path / "new", a / "checkpoints"), ckpt)  # a new folder
    (tmp_path / "link").symlink_to(a)  # the same run reached another way
    refuse_foreign_resume(_resume_cfg(tmp_path / "link", tmp_path / "link" / "checkpoints"), ckpt)


def test_overwrite_with_a_resume_is_refused_as_a_contradiction(tmp_path):
    from flowgrpo.training.run_folder import refuse_foreign_resume

    ckpt = tmp_path / "A" / "checkpoints" / "epoch_1"
    ckpt.mkdir(parents=True)
    with pytest.raises(ConfigError, match="logging.overwrite=true and train.resume_from=.* contradict"):
        refuse_foreign_resume(_resume_cfg(tmp_path / "A", ckpt, overwrite=True), ckpt)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_checkpoints_files_have_the_mode_a_plain_open_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        folder = _saved(tmp_path)
        (tmp_path / "plain").write_text("x")  # what a plain open gives, with this umask
    finally:
        os.umask(old)
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.rglob("*") if f.is_file()}
    assert {"trainable.safetensors", "ema.safetensors"} <= modes.keys()
    assert modes == dict.fromkeys(modes, want)


# --------------------------------------------------------------------- a run never writes or removes through a link


def _linked_run(tmp_path, link_name):
    """A run folder (config.yaml, metrics, a checkpoint, weights) whose ``link_name`` is a link to a user's file or
    folder of the same kind; returns (run folder, the link's target)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "epoch_0").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("epoch_0")
    _saved_run_config(run_dir)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 0}) + "\n")
    mine = tmp_path / "mine"
    if link_name == "transformer":
        mine.mkdir()
        (mine / "config.json").write_text("{}")
    else:
        (run_dir / link_name).unlink(missing_ok=True)
        mine.write_text(json.dumps({"epoch": 7}) + "\n")
    (run_dir / link_name).symlink_to(mine)
    return run_dir, mine


def _tree(folder):
    return sorted((str(p.relative_to(folder)), p.is_symlink()) for p in folder.rglob("*"))


def test_overwrite_of_a_run_with_a_linked_part_removes_nothing(tmp_path):
    from flowgrpo.preflight import check_output_dir

    run_dir, mine = _linked_run(tmp_path, "transformer")
    before = _tree(tmp_path)
    cfg = build_config({"output_dir": str(run_dir), "logging": {"overwrite": True}})
    for check in (lambda: check_output_dir(cfg), lambda: _run_folder_of(cfg).claim(0)):
        with pytest.raises(ValueError, match=rf"'{re.escape(str(run_dir / 'transformer'))}' is a symbolic link "
                           rf"\(to '{re.escape(str(mine))}'\).*nothing was changed"):
            check()
        assert _tree(tmp_path) == before  # every check before anything is removed


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json"])
def test_a_resume_never_writes_through_a_link(tmp_path, name):
    run_dir, mine = _linked_run(tmp_path, name)
    cfg = build_config({"output_dir": str(run_dir), "train": {"resume_from": str(run_dir / "checkpoints")}})
    with pytest.raises(ValueError, match=rf"'{re.escape(str(run_dir / name))}' is a symbolic link"):
        _run_folder_of(cfg).claim(0)
    assert mine.read_text() == json.dumps({"epoch": 7}) + "\n"


def _run_folder_of(cfg):
    from flowgrpo.training.run_folder import RunFolder

    return RunFolder(cfg)


# ------------------------------------------------------------- a hard-linked copy of a run file keeps its content


def test_a_hard_linked_metrics_file_is_never_changed_in_place(tmp_path):
    from flowgrpo.writing.metrics import MetricsSink

    (tmp_path / "config.yaml").write_text("{}\n")
    metrics = tmp_path / "metrics.jsonl"
    old = "".join(json.dumps({"epoch": e}) + "\n" for e in (0, 1, 2))
    metrics.write_text(old)
    os.link(metrics, tmp_path / "backup.jsonl")
    _run_folder(tmp_path, resume_from=str(tmp_path / "checkpoints")).claim(1)  # drops epochs 1 and 2
    assert (tmp_path / "backup.jsonl").read_text() == old
    assert [json.loads(x)["epoch"] for x in metrics.read_text().splitlines()] == [0]
    os.link(metrics, tmp_path / "backup2.jsonl")
    sink = MetricsSink(metrics)
    sink.log({"reward/x/mean": 0.5})
    sink.commit(1)
    assert (tmp_path / "backup2.jsonl").read_text() == json.dumps({"epoch": 0}) + "\n"
    assert [json.loads(x)["epoch"] for x in metrics.read_text().splitlines()] == [0, 1]
    assert metrics.stat().st_nlink == 1
    sink.commit(2)  # a file of one link is appended to in place
    assert metrics.stat().st_nlink == 1 and len(metrics.read_text().splitlines()) == 3


def test_run_files_are_replaced_not_rewritten(tmp_path):
    from flowgrpo.writing.outputs import replace_file, write_text_file

    path = tmp_path / "summary.json"
    path.write_text("old")
    os.link(path, tmp_path / "backup.json")
    write_text_file(path, "new")
    assert (path.read_text(), (tmp_path / "backup.json").read_text()) == ("new", "old")
    with pytest.raises(RuntimeError):
        replace_file(path, lambda tmp: (tmp.write_text("half"), (_ for _ in ()).throw(RuntimeError("disk full"))))
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["backup.json", "summary.json"]


@pytest.mark.parametrize("where", ["run", "."])
def test_the_runs_own_folder_is_refused_as_its_prompt_embeddings_dir(tmp_path, where):
    from flowgrpo.preflight import check_output_dir
    from flowgrpo.writing.outputs import OutputRefused

    out = tmp_path / "run"
    cache = (tmp_path / where).resolve()
    cfg = build_config({"output_dir": str(out), "model": {"prompt_embeddings_dir": str(cache),
                                                          "cache_prompt_embeddings": True}})
    with pytest.raises(OutputRefused, match=rf"prompt_embeddings_dir '{re.escape(str(cache))}' is or holds the run's "
                       rf"output_dir '{re.escape(str(out))}'.*prompt_embeddings_dir={re.escape(str(out))}/"):
        check_output_dir(cfg)
    assert not out.exists()
    other = build_config({"output_dir": str(out), "model": {"prompt_embeddings_dir": str(out / "embeds"),
                                                            "cache_prompt_embeddings": True}})
    check_output_dir(other)  # a folder of its own, even inside the run's


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_marker_written_by_hand_does_not_make_a_users_checkpoints_a_runs(tmp_path, monkeypatch, capsys,
                                                                               overwrite):
    """Fresh-user trial 6: a folder with ``.flowgrpo-output`` {"kind": "run"} written by hand and the user's own
    ``checkpoints/latest`` passed as a run folder, and ``logging.overwrite=true`` replaced that file. A run writes
    config.yaml before any checkpoint, so run parts without it are refused, before any model loads."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    (out / ".flowgrpo-output").write_text('{"kind": "run"}\n')
    (out / "checkpoints" / "latest").write_text("x\n")
    with pytest.raises(SystemExit) as info:
        main([f"output_dir={out}", *(["logging.overwrite=true"] if overwrite else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "holds" in err[0] and "but no config.yaml" in err[0] and "nothing was written or removed" in err[0]
    assert (out / "checkpoints" / "latest").read_text() == "x\n"
    assert sorted(os.listdir(out)) == [".flowgrpo-output", "checkpoints"]
