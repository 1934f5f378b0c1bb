"""Odd inputs a new user tried from the README alone, each through the real entry point (trainer, CLI, server).

Each case was a traceback or a silent wrong result before: a prompt file that is not UTF-8 text, a prompt set
record whose prompt is not a string, a reward that returns strings, out-of-range numbers on the command line
(``--port 99999``, ``--per-task -1``, ``--num-steps 0``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main
from flowgrpo.config import build_config

REPO = Path(__file__).resolve().parents[2]
NOT_UTF8 = b"\xff\xfe\x00a handwritten digit\n"
MOD = __name__  # the stub reward below is loaded by 'module:attr'


def scoring_function(images, prompts, metadata):
    """What a new user writes first: a scoring function, where a reward class (or factory) is expected."""
    return [0.0] * len(prompts)


NOT_A_REWARD = 3


class Verdicts:
    """A reward that answers in words (a plausible plugin mistake): not numbers."""

    name = "verdicts"

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        return ["good"] * len(prompts)


def test_a_reward_returning_words_is_one_line_naming_it_not_a_traceback(tmp_path, tiny_flux_dir, capsys):
    from flowgrpo.train import main

    (tmp_path / "p.txt").write_text("a red cube\na blue ball\n")
    with pytest.raises(SystemExit) as info:
        main([f"model.pretrained={tiny_flux_dir}", "model.height=32", "model.width=32", "sampling.num_steps=2",
              "eval_sampling.num_steps=2", "chunker={name: per_step}", "train.num_epochs=1",
              "train.prompts_per_epoch=2", "train.group_size=2", "train.rollout_batch_size=4",
              "train.train_batch_size=4", "train.optimizer_steps_per_epoch=1",
              f"rewards=[{{name: '{MOD}:Verdicts'}}]", "eval_rewards=[]", f"data.train_prompts={tmp_path / 'p.txt'}",
              f"data.eval_prompts={tmp_path / 'p.txt'}",
              "data.eval_num_prompts=2", "logging.progress=false", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "error: reward 'Verdicts' returned list ['good', 'good'], which is not numbers")


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


@pytest.mark.parametrize("attr, needle", [
    ("scoring_function", r"is a scoring function \(it takes \['images', 'prompts'\]\), not a factory: a reward is a "
                         r"class, or a factory"),
    ("NOT_A_REWARD", r"is a int \(3\), not a class or factory"),
])
def test_a_module_attr_that_cannot_build_a_reward_is_named_before_any_model_loads(tmp_path, monkeypatch, attr,
                                                                                  needle):
    """Before: 'missing a required argument: images (rewards[].kwargs)' and "'int' object is not callable"."""
    import flowgrpo.models as models
    from flowgrpo.runner import run

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the rewards were checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    cfg = build_config(None, [f"rewards=[{{name: '{MOD}:{attr}'}}]", f"output_dir={tmp_path / 'r'}"])
    with pytest.raises(Exception, match=rf"reward '{MOD}:{attr}' {needle}") as info:
        run(cfg)
    assert not isinstance(info.value, AssertionError)


@pytest.mark.parametrize("name, suffix", [("hpd", ".json"), ("pickapic", ".jsonl"), ("ocr", ".txt"),
                                          ("pickapic", ".csv")])
def test_flowgrpo_prompts_names_a_source_that_is_not_utf8(tmp_path, name, suffix):
    src = tmp_path / f"src{suffix}"
    src.write_bytes(NOT_UTF8)
    with pytest.raises(SystemExit, match=rf"{src}: not UTF-8 text"):
        cli_main(["prompts", name, str(src), "--out", str(tmp_path / "o.txt")])


def test_flowgrpo_prompts_refuses_a_prompt_that_is_not_a_string(tmp_path):
    """Before: ``{"prompt": 5}`` was dropped silently and the file written without it."""
    src = tmp_path / "train.json"
    src.write_text(json.dumps([{"prompt": "a cat"}, {"prompt": 5}]))
    out = tmp_path / "o.txt"
    with pytest.raises(SystemExit, match=r"record 1: field 'prompt' must be a string .*got int 5"):
        cli_main(["prompts", "hpd", str(src), "--out", str(out)])
    assert not out.exists()


def test_flowgrpo_prompts_counts_null_prompts_it_drops(tmp_path, caplog):
    src = tmp_path / "train.jsonl"
    src.write_text('{"caption": "a cat"}\n{"caption": null}\n')
    out = tmp_path / "o.txt"
    with caplog.at_level("WARNING"):
        cli_main(["prompts", "pickapic", str(src), "--out", str(out)])
    assert out.read_text() == "a cat\n"
    assert "dropped 1 records whose prompt field is null" in caplog.text


def test_flowgrpo_prompts_names_the_line_of_a_bad_jsonl_source(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text('{"caption": "a cat"}\n{oops\n')
    with pytest.raises(SystemExit, match=rf"{src}:2: not valid JSON"):
        cli_main(["prompts", "pickapic", str(src), "--out", str(tmp_path / "o.txt")])


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_reward_server_refuses_a_port_out_of_range_in_one_line(port):
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.rewards.server", "--reward", "jpeg_compressibility",
                           "--port", port], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --port" in proc.stderr
    assert "allowed: an integer from 0 to 65535 (0: pick a free one)" in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["prompts", "geneval", "--out", "o.jsonl", "--per-task", "-1"], "argument --per-task: -1 is out of range"),
    (["sample", "--model", "tiny", "--num-steps", "0", "--out", "s"], "argument --num-steps: 0 is out of range"),
    (["sample", "--model", "tiny", "--num-images", "-2", "--out", "s"], "argument --num-images: -2 is out of range"),
    (["sample", "--model", "tiny", "--batch-size", "0", "--out", "s"], "argument --batch-size: 0 is out of range"),
    (["sample", "--model", "tiny", "--height", "-64", "--out", "s"], "argument --height: -64 is out of range"),
])
def test_cli_numbers_out_of_range_are_usage_errors(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "allowed: an integer" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_override_without_a_value_says_how_overrides_are_written(tmp_path, monkeypatch, capsys):
    """``flowgrpo train train.num_epochs`` (no ``=``) was read as a config file that does not exist, no hint."""
    from flowgrpo.train import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train.num_epochs"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "error: config file 'train.num_epochs' does not exist; a config file ends in .yaml, and an override is "
        "dotted.key=value (e.g. train.num_epochs=20)")


@pytest.mark.parametrize("overrides, needle", [
    (["algo.group_filter.keep=4"], "algo.group_filter.keep=4 is read only by algo.group_filter.name=gfpo, but "
                                   "algo.group_filter.name is 'none'"),
    (["algo.group_filter.select=bottom"], "algo.group_filter.select='bottom' is read only by"),
    (["algo.policy_loss.tau_pos=5000"], "algo.policy_loss.tau_pos=5000 is read only by algo.policy_loss.name=sapo, "
                                        "but algo.policy_loss.name is 'clipped'"),
    (["algo.policy_loss={name: sapo, c: 5}"], "algo.policy_loss.c=5 is read only by algo.policy_loss.name=dual_clip, "
                                              "but algo.policy_loss.name is 'sapo'"),
    (["algo.sapo_tau_pos=5000"], "algo.sapo_tau_pos=5000 is read only by algo.policy_loss=sapo, but "
                                 "algo.policy_loss is 'clipped'"),  # the key of earlier versions
    (["algo.advantage=rloo", "algo.global_std=true"], "algo.global_std=True is read only by algo.advantage=grpo, "
                                                       "but algo.advantage is 'rloo'"),
])
def test_a_setting_the_chosen_strategy_does_not_read_is_refused(tmp_path, monkeypatch, capsys, overrides, needle):
    """Before: ``algo.group_filter.keep=4`` without a filter started an 80-epoch run that never filtered."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    with pytest.raises(SystemExit) as info:
        main([*overrides, f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and needle in err.strip().splitlines()[-1]


@pytest.mark.parametrize("overrides, why", [
    (["chunker={name: per_step, drop_last_step: true}"], "chunker.drop_last_step=true leaves it out"),
    (["chunker={name: per_step}", "sampling.sde_kind=cps"], "sde_kind 'cps' makes it deterministic"),
    (["chunker={name: chunk, drop_last_step: true}"], "chunker.drop_last_step=true leaves it out"),
    (["chunker={name: trajectory, drop_last_step: true}"], "chunker.drop_last_step=true leaves it out"),
])
def test_one_step_whose_only_transition_is_never_trained_is_refused_before_loading(tmp_path, monkeypatch, capsys,
                                                                                  overrides, why):
    """Before: ``sampling.num_steps=1 chunker.drop_last_step=true`` loaded the model, evaluated, sampled, then
    died in the plan with a traceback blaming sde_kind and noise_level."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    with pytest.raises(SystemExit) as info:
        main(["sampling.num_steps=1", *overrides, f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: sampling.num_steps=1 leaves no transition to train: the last "
                                            f"transition is never trained ({why}); use sampling.num_steps >= 2")


@pytest.mark.parametrize("level", ["1.5", "3"])
def test_a_cps_noise_level_above_one_is_refused_before_loading(tmp_path, monkeypatch, capsys, level):
    """Before: cps with a = 1.5 trained silently with the std of a = 0.5 (sin(a·π/2) folds back above 1)."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    with pytest.raises(SystemExit) as info:
        main(["chunker={name: per_step}", "sampling.sde_kind=cps", f"sampling.noise_level={level}",
              f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"error: sampling.noise_level={float(level)} is outside [0, 1], the range of sde_kind 'cps'")


def _tiny_overrides(tmp_path: Path, tiny_flux_dir: Path) -> list[str]:
    (tmp_path / "p.txt").write_text("a red cube\na blue ball\n")
    return [f"model.pretrained={tiny_flux_dir}", "model.height=32", "model.width=32", "sampling.num_steps=2",
            "eval_sampling.num_steps=2", "chunker={name: per_step}", "train.prompts_per_epoch=2", "train.group_size=2",
            "train.rollout_batch_size=4", "train.train_batch_size=4", "train.optimizer_steps_per_epoch=1",
            "rewards=[{name: jpeg_compressibility}]",
            "eval_rewards=[]", f"data.train_prompts={tmp_path / 'p.txt'}", f"data.eval_prompts={tmp_path / 'p.txt'}",
            "data.eval_num_prompts=2", "logging.progress=false"]


def test_an_output_dir_override_ending_in_yaml_is_an_override_not_a_config(tmp_path, tiny_flux_dir, capsys):
    """Before: ``output_dir=runs/x.yaml`` as the first argument was read as a config file named
    'output_dir=runs/x.yaml' that does not exist."""
    from flowgrpo.train import main

    with pytest.raises(SystemExit) as info:  # help shows the value this command would use, without a run
        main([f"output_dir={tmp_path / 'run.yaml'}", *_tiny_overrides(tmp_path, tiny_flux_dir), "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and f"[{tmp_path / 'run.yaml'}]" in out


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
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # see test_bad_input
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


class RefusesPrompts:
    """A reward that refuses the prompts it is given only when scoring (it has no ``check_prompts`` hook)."""

    name = "refuses"

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        raise ValueError("refuses needs metadata field 'colour'")


def test_a_rewards_value_error_on_bad_input_is_one_line(tmp_path, tiny_flux_dir, capsys):
    """Before: the default's ``digit_judge`` kept with plain-text prompts died in the first evaluation with a
    traceback, although its ValueError names the missing metadata field (the reward contract's bad input). Now
    the digits rewards check the prompt sets before the model loads (their ``check_prompts`` hook), and a reward
    without the hook that raises ValueError on a batch is still one line."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load before the prompt sets are checked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "load_model_from_config", no_model)
        with pytest.raises(SystemExit) as info:
            main([*_tiny_overrides(tmp_path, tiny_flux_dir), "eval_rewards=[{name: digit_judge}]",
                  "train.num_epochs=1", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"error: reward 'digit_judge' cannot score the evaluation prompts ({tmp_path / 'p.txt'}): digit_judge "
        "needs metadata['digit']")
    with pytest.raises(SystemExit) as info:
        main([*_tiny_overrides(tmp_path, tiny_flux_dir), f"eval_rewards=[{{name: '{MOD}:RefusesPrompts'}}]",
              "train.num_epochs=1", f"output_dir={tmp_path / 'run2'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: reward 'RefusesPrompts' failed on a batch of 2: ValueError: "
                                                   "refuses needs metadata field 'colour'")


def test_an_out_of_the_wrong_kind_is_one_line_before_any_work(tmp_path, capsys):
    """Before: ``flowgrpo sample --out FILE`` loaded the model, sampled, then FileExistsError; ``flowgrpo prompts
    --out FOLDER`` read the sources, then IsADirectoryError."""
    a_file = tmp_path / "taken.txt"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as info:
        cli_main(["sample", "--model", "/nonexistent/model", "--prompts", "digits_eval", "--out", str(a_file)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--out {str(a_file)!r} is a file; give a folder" in err
    src = tmp_path / "p.txt"
    src.write_text('draw "hi"\n')
    with pytest.raises(SystemExit, match=rf"--out {str(tmp_path)!r} is a folder; give the prompt file"):
        cli_main(["prompts", "ocr", str(src), "--out", str(tmp_path)])


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


def test_an_entropy_threshold_no_jump_reaches_is_one_line_before_any_evaluation(tmp_path, tiny_flux_dir, capsys,
                                                                                  monkeypatch):
    """Before: E-GRPO's entropy rule ran first in the first rollout, after the model load and the 'before'
    evaluation, and died there with a traceback (DanceGRPO's SDE at eta 0.7 never reaches tau 0.9 per dim)."""
    from flowgrpo.train import main
    from flowgrpo.training.loop import Trainer

    def no_training(self):
        raise AssertionError("the run started although its chunker cannot plan on the model's grid")

    monkeypatch.setattr(Trainer, "fit", no_training)
    overrides = [o for o in _tiny_overrides(tmp_path, tiny_flux_dir) if not o.startswith("chunker=")]
    with pytest.raises(SystemExit) as info:
        main([*overrides, "sampling.num_steps=8", "chunker={name: entropy_merge, entropy_threshold: 0.9}",
              "sampling.sde_kind=dance_sde", "sampling.noise_level=0.7", "train.num_epochs=1",
              f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: no jump within the first 4 steps reaches "
                                                   "entropy_threshold=0.9")
