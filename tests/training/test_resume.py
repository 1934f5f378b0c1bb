"""Resume that loses nothing, from a fresh user's trials: ``train.resume_from=auto`` continues with the settings
the run last ran with (an extension is not forgotten), a run stopped during its final evaluation and save is
finished by its resume, another evaluation size on resume is refused and another evaluation reward named, and the
resume line and the interruption report count epochs as the epoch lines do."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from flowgrpo.config import ConfigError, build_config
from flowgrpo.preflight import latest_run_config, resolve_auto_resume
from tests.tiny_runs import _cfg


def _fake_run(folder, epochs_by_file: dict[str, int]):
    """A run folder with a checkpoint marker and config files whose ``train.num_epochs`` are given by name."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "latest").write_text("epoch_4\n")
    for name, epochs in epochs_by_file.items():
        (folder / name).write_text(yaml.safe_dump({"train": {"num_epochs": epochs}}))


def test_auto_resume_continues_with_the_newest_resumed_config(tmp_path):
    # resumed at epochs 2 and 10: the newest is epoch 10's (numerically, not "2" > "10" as text)
    _fake_run(tmp_path, {"config.yaml": 2, "config_resumed_at_epoch_2.yaml": 6, "config_resumed_at_epoch_10.yaml": 12})
    assert latest_run_config(tmp_path) == tmp_path / "config_resumed_at_epoch_10.yaml"
    auto = build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}})
    assert resolve_auto_resume(auto).train.num_epochs == 12
    assert resolve_auto_resume(auto, ["train.num_epochs=20"]).train.num_epochs == 20  # the command line wins


def test_auto_resume_without_resumed_configs_uses_config_yaml(tmp_path):
    _fake_run(tmp_path, {"config.yaml": 3})
    assert latest_run_config(tmp_path) == tmp_path / "config.yaml"
    auto = build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}})
    assert resolve_auto_resume(auto).train.num_epochs == 3


def test_auto_resume_says_a_named_config_file_is_not_used(tmp_path, caplog):
    _fake_run(tmp_path, {"config.yaml": 3})
    auto = build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.preflight"):
        resolve_auto_resume(auto, config_file="configs/tiny_jpeg.yaml")
    assert any("configs/tiny_jpeg.yaml is not used" in r.getMessage() for r in caplog.records)


def test_auto_resume_never_removes_a_finished_run_whose_checkpoints_are_gone(tmp_path):
    """A finished run with checkpoints/ emptied (to free disk) was taken for one that stopped before its first
    checkpoint: its weights, metrics and config were removed and the embedded default trained in their place."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"train": {"num_epochs": 3}}))
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "checkpoints").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    auto = build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}})
    with pytest.raises(ConfigError, match=r"holds a finished run's results \(summary.json, transformer\) but no "
                                          r"checkpoint to continue from .*nothing was removed"):
        resolve_auto_resume(auto)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_auto_resume_starts_a_stopped_run_again_with_its_own_settings(tmp_path):
    """The run's saved config, not the command's (the embedded default when it names no file), in its folder."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"output_dir": "/elsewhere", "train": {"num_epochs": 7}}))
    auto = build_config({"output_dir": str(tmp_path), "train": {"resume_from": "auto"}})
    again = resolve_auto_resume(auto, ["train.lr=0.002"])
    assert (again.train.num_epochs, again.train.lr, again.output_dir) == (7, 0.002, str(tmp_path))
    assert again.train.resume_from is None and again.logging.overwrite


def test_a_command_without_a_config_file_resumes_on_the_runs_own_settings(tmp_path, capsys):
    """No config file and train.resume_from=auto: the overrides are checked against the run's settings; an error
    once named the embedded default's train.rollout_batch_size=64, in neither the run nor the command."""
    from flowgrpo.preflight import auto_resume_config_file
    from flowgrpo.runner import DEFAULT_CONFIG, main

    run = {"output_dir": str(tmp_path), "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8,
                                                  "train_batch_size": 8}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run))
    overrides = [f"output_dir={tmp_path}", "train.resume_from=auto", "train.prompts_per_epoch=3"]
    assert auto_resume_config_file(DEFAULT_CONFIG, overrides) == tmp_path / "config.yaml"
    assert auto_resume_config_file(DEFAULT_CONFIG, overrides[:1]) is None  # not resuming
    assert auto_resume_config_file(DEFAULT_CONFIG, [f"output_dir={tmp_path / 'none'}", overrides[1]]) is None
    with pytest.raises(SystemExit) as info:
        main(overrides)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and "train.rollout_batch_size=8 must divide" in err and "= 6" in err, err


@pytest.mark.slow
def test_extended_run_resumed_by_auto_trains_to_the_extension(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    out = tmp_path / "run"
    run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}))  # 2 epochs
    run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1},  # extended to 4
             train={"num_epochs": 4, "resume_from": str(out / "checkpoints")}))
    # a crash after the third epoch: the latest checkpoint is epoch_2, the run's summary is gone
    (out / "checkpoints" / "latest").write_text("epoch_2\n")
    (out / "summary.json").unlink()
    auto = resolve_auto_resume(build_config({"output_dir": str(out), "train": {"resume_from": "auto"}}))
    assert auto.train.num_epochs == 4
    summary = run(auto)
    assert summary["epochs"] == 4 and json.loads((out / "summary.json").read_text())["epochs"] == 4


@pytest.mark.slow
def test_a_run_stopped_during_its_final_save_is_finished_by_its_resume(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    out = tmp_path / "run"
    run(_cfg(tmp_path, tiny_flux_dir))
    card = out / "lora" / "README.md"
    assert card.is_file()
    summary_before = json.loads((out / "summary.json").read_text())
    for path in (out / "summary.json", out / "before_after.png", card):  # as a Ctrl-C after the last checkpoint
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        summary = run(_cfg(tmp_path, tiny_flux_dir, train={"resume_from": str(out / "checkpoints")}))
    assert any("final outputs are incomplete (no summary.json and no model card)" in r.getMessage()
               for r in caplog.records)
    assert card.is_file() and (out / "before_after.png").is_file() and (out / "summary.json").is_file()
    # the same weights evaluated the same way: the figures of the uninterrupted run
    figures = {k: v for k, v in summary_before.items() if k.endswith(("_before", "_after"))}
    assert figures and {k: summary[k] for k in figures} == figures


@pytest.mark.slow
def test_resume_refuses_another_evaluation_names_a_changed_reward_and_counts_epochs_as_the_files(
        tmp_path, tiny_flux_dir, caplog):
    """Another evaluation size on resume is refused before anything is written (metrics.jsonl would mix
    evaluations of 2 and 3 images); another evaluation reward is named; the resume line counts epochs as the epoch
    lines (1-based) and names the checkpoint whose 0-based number metrics.jsonl and the checkpoint folders use."""
    from flowgrpo.runner import run

    out = tmp_path / "run"
    run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}))
    metrics = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"another evaluation than its first leg \(data.eval_num_prompts: 2 -> 3\)"):
        run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}, data={"eval_num_prompts": 3},
                 train={"num_epochs": 3, "resume_from": str(out / "checkpoints")}))
    assert (out / "metrics.jsonl").read_text() == metrics and not list(out.glob("config_resumed_at_epoch_*"))
    # other records: refused (the same records under another file name pass: tests/inputs/test_run_folder.py)
    (tmp_path / "other.txt").write_text("a yellow star\na blue ball\n")
    with pytest.raises(ConfigError, match=r"another evaluation than its first leg \(data.eval_prompts: "):
        run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}, data={"eval_prompts": str(tmp_path / "other.txt")},
                 train={"num_epochs": 3, "resume_from": str(out / "checkpoints")}))
    judge = {"eval_rewards": [{"name": "jpeg_compressibility"}]}
    with caplog.at_level(logging.INFO, logger="flowgrpo.training"):
        run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}, **judge,
                 train={"num_epochs": 3, "resume_from": str(out / "checkpoints")}))
    messages = [r.getMessage() for r in caplog.records]
    assert any("compare different evaluations" in m and "eval_rewards" in m for m in messages)
    # epoch_1 holds the state after the epoch line "epoch 2/3"; the next line is "epoch 3/3", record epoch 2
    assert f"resumed from {out / 'checkpoints' / 'epoch_1'} (saved after epoch 2/3); continuing with epoch 3/3" \
        in messages
    assert [r["epoch"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2]
    assert (out / "checkpoints" / "epoch_2").is_dir() and (out / "config_resumed_at_epoch_2.yaml").is_file()
    # extending alone changes no evaluation setting against the last leg, but still against the first
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        run(_cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}, **judge,
                 train={"num_epochs": 4, "resume_from": str(out / "checkpoints")}))
    messages = [r.getMessage() for r in caplog.records]
    assert any("differ from" in m and "config_resumed_at_epoch_2.yaml" in m and "train.num_epochs: 3 -> 4" in m
               for m in messages)
    assert any("compare different evaluations" in m for m in messages)  # eval_rewards against the original


def test_interruption_report_counts_epochs_from_one_and_names_the_final_save(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import flowgrpo.runner as runner

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("epoch_1\n")
    cfg = build_config({"output_dir": str(tmp_path), "train": {"num_epochs": 2}})
    args = SimpleNamespace(config=None, overrides=[f"output_dir={tmp_path}"])
    monkeypatch.setattr(runner, "_TRAINER", SimpleNamespace(out=tmp_path, cfg=cfg, epoch=0, stage="epochs"))
    assert runner._interrupted_line(args, "flowgrpo train").startswith("\ninterrupted in epoch 1/2; last checkpoint")
    monkeypatch.setattr(runner, "_TRAINER", SimpleNamespace(out=tmp_path, cfg=cfg, epoch=1, stage="final"))
    line = runner._interrupted_line(args, "flowgrpo train")
    assert line.startswith("\ninterrupted during the final evaluation and save; last checkpoint")
    assert line.rstrip().endswith(f"train.resume_from={tmp_path / 'checkpoints'}")
    # Ctrl-C during the evaluation before training: no epoch started (a fresh run, then a resumed one at epoch 2)
    monkeypatch.setattr(runner, "_TRAINER", SimpleNamespace(out=tmp_path, cfg=cfg, epoch=0, stage="before"))
    assert runner._interrupted_line(args, "flowgrpo train").startswith("\ninterrupted before the first epoch (")
    monkeypatch.setattr(runner, "_TRAINER", SimpleNamespace(out=tmp_path, cfg=cfg, epoch=1, stage="before"))
    assert runner._interrupted_line(args, "flowgrpo train").startswith("\ninterrupted before epoch 2/2 (")


def test_the_trainer_is_before_its_first_epoch_until_the_epochs_start():
    # the loop's stage: "before" from construction to the first epoch (read from the source order of fit)
    import inspect

    from flowgrpo.training.loop import Trainer

    init, fit = inspect.getsource(Trainer.__init__), inspect.getsource(Trainer.fit)
    assert 'self.stage = "before"' in init
    assert fit.index("self.run.before(") < fit.index('self.stage = "epochs"') < fit.index("for epoch in range(")


def test_the_embedded_default_saves_checkpoints_during_its_epochs():
    # a 90-epoch default with save_every 0 loses the whole run to Ctrl-C at epoch 89: it saves every 10 epochs,
    # so the last save before the end is after epoch 80 (epoch_79), as docs/checkpoints.md says
    from flowgrpo.config import load_config
    from flowgrpo.runner import DEFAULT_CONFIG

    cfg = load_config(DEFAULT_CONFIG, [])
    every, n = cfg.logging.save_every, cfg.train.num_epochs
    assert (every, n) == (10, 90)
    assert [e for e in range(n - 1) if (e + 1) % every == 0][-1] == 79
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    assert "saves every 10 epochs" in " ".join(text.split())
