"""Odd and bad input tried as a new user would, each through the real entry point (``flowgrpo.runner.run``, the
``flowgrpo/train.py`` script or the ``flowgrpo`` CLI): reward semantics, duplicate prompts, config checked before
any model loads, resume that loses nothing, clean exits."""

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
from safetensors.torch import load_file

from flowgrpo.config import ConfigError, build_config
from flowgrpo.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
MOD = __name__  # the stub rewards below are loaded by 'module:attr'


class Scripted:
    """A reward whose scores come from ``fn(prompt, index_in_batch)``; returns a list (None allowed)."""

    name = "scripted"

    def __init__(self, kind: str = "const") -> None:
        self.kind = kind

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        mean = images.mean(dim=(1, 2, 3)).tolist()
        if self.kind == "const":  # every sample equal: every group has zero spread
            return [1.0] * len(prompts)
        if self.kind == "none_for_cube":  # not applicable to cube prompts
            return [None if "cube" in p else m for p, m in zip(prompts, mean, strict=True)]
        if self.kind == "inf_for_ball":
            return [float("inf") if "ball" in p else m for p, m in zip(prompts, mean, strict=True)]
        return mean


def _cfg(tmp_path: Path, tiny_flux_dir: Path, name: str = "run", *, prompts=("a red cube", "a blue ball",
         "a green tree"), overrides=(), **sections) -> object:
    path = tmp_path / f"{name}_prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    data = {
        "output_dir": str(tmp_path / name),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "lora_rank": 4},
        "sampling": {"num_steps": 2},
        "eval_sampling": {"num_steps": 2},
        "train": {"num_epochs": 2, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4, "lr": 1e-2},
        "algo": {"clip_range": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(path), "eval_prompts": str(path), "eval_num_prompts": 2},
        "logging": {"progress": False, "save_rollout_stats": True},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return build_config(data, list(overrides))


def _rollouts(run: Path, epoch: int) -> dict:
    return load_file(run / "rollouts" / f"epoch_{epoch}.safetensors")


def _assert_groups_distinct(stats: dict, group_size: int) -> None:
    ids = stats["group_ids"]
    assert set(torch.unique(ids, return_counts=True)[1].tolist()) == {group_size}, ids.tolist()
    init = stats["initial_latents"].flatten(1)
    assert len({tuple(r.tolist()) for r in init}) == init.shape[0]  # every sample its own noise


# ----------------------------------------------------------------------------------------------- rewards


@pytest.mark.slow
def test_none_is_nan_counted_and_a_negative_weight_is_a_penalty(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    cfg = _cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 1, "prompts_per_epoch": 3, "rollout_batch_size": 2},
               rewards=[{"name": f"{MOD}:Scripted", "kwargs": {"kind": "none_for_cube"}},
                        {"name": "jpeg_incompressibility", "weight": -0.5}])
    run(cfg)
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    stats = _rollouts(tmp_path / "run", 0)
    cube = torch.isnan(stats["reward/Scripted"])
    assert int(cube.sum()) == 2 and rec["reward/Scripted/nan_frac"] == pytest.approx(2 / 6)
    # weighted sum over the components present: the cube samples are −0.5·kB alone
    expected = torch.where(cube, 0.0, stats["reward/Scripted"].nan_to_num()) - 0.5 * stats[
        "reward/jpeg_incompressibility"]
    torch.testing.assert_close(stats["reward_total"], expected)


@pytest.mark.slow
def test_an_infinite_score_stops_the_run_naming_the_reward_before_advantages(tmp_path, tiny_flux_dir, monkeypatch):
    import flowgrpo.algo.objectives.base as trainer_mod
    from flowgrpo.rewards.compose import RewardError
    from flowgrpo.runner import run

    called = []
    monkeypatch.setattr(trainer_mod, "compute_advantages", lambda *a, **k: called.append(1))
    cfg = _cfg(tmp_path, tiny_flux_dir, rewards=[{"name": f"{MOD}:Scripted", "kwargs": {"kind": "inf_for_ball"}}])
    with pytest.raises(RewardError, match=r"reward 'Scripted' returned an infinite score.*'a blue ball'"):
        run(cfg)
    assert not called


@pytest.mark.slow
def test_zero_spread_warns_and_no_unmeasured_policy_statistic(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    cfg = _cfg(tmp_path, tiny_flux_dir, rewards=[{"name": f"{MOD}:Scripted", "kwargs": {"kind": "const"}}],
               algo={"drop_zero_spread_groups": True})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        run(cfg)
    warned = [r.getMessage() for r in caplog.records if "carry a learning signal" in r.getMessage()]
    assert len(warned) == 1 and "train.group_size" in warned[0]  # once, with what to change
    for rec in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        assert rec["adv/low_signal"] == 1.0 and rec["adv/learning_frac"] == 0.0
        assert not [k for k in rec if k.startswith("policy/")], rec  # nothing trained, nothing measured


def test_gdpo_takes_the_compositions_weights_a_negative_one_a_penalty():
    from flowgrpo.algo.advantages import compute_advantages
    from flowgrpo.rewards.compose import compose_rewards

    # one group of 2: quality (1, 0), penalty (1, 0), weights 1 and −2. Each component normalised in the group:
    # ±k with k = 0.5/(0.5 + 1e-4) for both; weighted sum [k − 2k, −k + 2k] = [−k, k]; over the batch mean 0,
    # population std k: A = [−k, k]/(k + 1e-4). The sample better on quality but penalised twice as much loses.
    rewards = compose_rewards({"quality": torch.tensor([1.0, 0.0]), "penalty": torch.tensor([1.0, 0.0])},
                              {"quality": 1.0, "penalty": -2.0})
    assert rewards.total.tolist() == [-1.0, 0.0]  # the weighted sum, 1·1 − 2·1
    adv = compute_advantages(rewards, torch.tensor([0, 0]), multi_reward="gdpo").values
    k = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-k / (k + 1e-4), k / (k + 1e-4)]))


# ----------------------------------------------------------------------------------------------- sampling


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


# ----------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, needle", [
    (["model.max_sequence_length=0"], "'model.max_sequence_length': Input should be greater than or equal to 1"),
    (["model.max_sequence_length=-5"], "greater than or equal to 1"),
    (["model.height=0"], "'model.height': Input should be greater than or equal to 1"),
    (["train.learning_rate=1e-4"], "unknown config key 'train.learning_rate'; did you mean 'train.lr'?"),
    (["train.epochs=3"], "did you mean 'train.num_epochs'?"),
    (["train.kl_beta=0.1"], "did you mean 'algo.kl_beta'?"),
    (["sampling.eta=0.3"], "did you mean 'sampling.noise_level'?"),
    (["sampling.guidance_scale=.nan"], "finite number"),
    (["rewards=[{name: jpeg_compressibility, weight: 0}]"], "every reward in rewards has weight 0"),
])
def test_bad_values_are_refused_by_the_schema(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        build_config({}, overrides)


@pytest.mark.parametrize("overrides, needle", [
    (["rewards=[{name: jpeg_compressibility, kwargs: {qualty: 80}}]"],
     "reward 'jpeg_compressibility' has no keyword argument 'qualty'.*did you mean 'quality'"),
    (["rewards=[{name: jpeg_compresibility}]"], "unknown reward 'jpeg_compresibility'.*did you mean"),
    (["data.train_prompts=/nonexistent/prompts.txt"], "data.train_prompts: prompt file '/nonexistent/prompts.txt'"),
    (["data.eval_prompts=/nonexistent/eval.txt"], "data.eval_prompts: prompt file"),
    (["sampling.noise_level=0"], "noise_level=0.0 leaves no stochastic transition"),
    (["sampling.sde_kind=ode"], "sde_kind='ode' with sampling.noise_level=0.7 leaves no stochastic"),
    (["sampling.sde_kind=cps", "sampling.noise_level=0"], "leaves no stochastic transition"),
    (["train.resume_from=/nonexistent/checkpoints"], "checkpoint '/nonexistent/checkpoints' does not exist"),
    (["logging.trackers=[wandb]"], r"logging.trackers=\['wandb'\]: \['wandb'\] not installed"),
])
def test_everything_is_checked_before_any_model_loads(tmp_path, tiny_flux_dir, monkeypatch, overrides, needle):
    import flowgrpo.models as models
    from flowgrpo.runner import run

    if "wandb" in " ".join(overrides) and __import__("importlib").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    cfg = _cfg(tmp_path, tiny_flux_dir, overrides=overrides)
    with pytest.raises(Exception, match=needle) as info:
        run(cfg)
    assert not isinstance(info.value, AssertionError)


def test_an_occupied_output_dir_is_refused_before_any_model_loads(tmp_path, tiny_flux_dir, monkeypatch):
    import flowgrpo.models as models
    from flowgrpo.runner import run

    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    with pytest.raises(FileExistsError, match="already holds a run"):
        run(_cfg(tmp_path, tiny_flux_dir))


def test_batch_layout_is_checked_per_process(tmp_path, tiny_flux_dir, monkeypatch):
    from flowgrpo.runner import run

    monkeypatch.setenv("WORLD_SIZE", "2")
    # B = 4: 2 trajectories a process, one micro-batch of 2, but 2 optimizer steps asked for
    cfg = _cfg(tmp_path, tiny_flux_dir, overrides=["train.optimizer_steps_per_epoch=2", "train.rollout_batch_size=2",
                                                   "train.prompts_per_epoch=2"])
    with pytest.raises(ValueError, match="optimizer_steps_per_epoch=2 exceeds the 1 training micro-batches of the "
                                         "2 trajectories each of the 2 processes"):
        run(cfg)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("digits*.yaml")) + [REPO / "configs/tiny_jpeg.yaml"])
def test_shipped_cpu_configs_split_over_two_processes(path):
    from flowgrpo.config import load_config
    from flowgrpo.preflight import check_batch

    check_batch(load_config(path), 2)  # the README's `torchrun --nproc_per_node 2` command


def test_the_script_reports_a_config_error_in_one_line_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "flowgrpo/train.py", "train.learning_rate=1e-4",
                           f"output_dir={tmp_path / 'r'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: unknown config key 'train.learning_rate'; did you mean "
                                                   "'train.lr'?")


# ----------------------------------------------------------------------------------------------- runs and checkpoints


@pytest.mark.slow
def test_resume_keeps_history_and_records_changed_settings(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    full = tmp_path / "run"
    first = _cfg(tmp_path, tiny_flux_dir, logging={"save_every": 1}, train={"num_epochs": 3})
    run(first)
    old = yaml.safe_load((full / "config.yaml").read_text())
    del old["logging"]["plot_every"]  # as a run of a version without that setting wrote it
    (full / "config.yaml").write_text(yaml.safe_dump(old))
    original = (full / "config.yaml").read_text()
    before = {k: v for k, v in json.loads((full / "summary.json").read_text()).items() if k.endswith("_before")}
    assert before
    # resume from the checkpoint after epoch 1 into the same folder, with another learning rate
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


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_rewrites_nothing(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    run(_cfg(tmp_path, tiny_flux_dir))
    out = tmp_path / "run"

    def stamps():  # the run's files; the lock file (flowgrpo.run_lock) names whichever process holds the folder
        return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".flowgrpo.lock"}

    before = stamps()
    again = _cfg(tmp_path, tiny_flux_dir, train={"resume_from": str(out / "checkpoints")})
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        summary = run(again)
    assert any("already finished all 2 epochs" in r.getMessage() for r in caplog.records)
    assert summary == json.loads((out / "summary.json").read_text())
    assert stamps() == before
    # a copy of the finished folder resumed in place reports its own files, not the original's
    shutil.copytree(out, tmp_path / "copy")
    summary = run(_cfg(tmp_path, tiny_flux_dir, "copy", train={"resume_from": str(tmp_path / "copy" / "checkpoints")}))
    written = [v for v in summary["outputs"].values() if isinstance(v, str)]
    assert written and all(v.startswith(str(tmp_path / "copy")) for v in written)


@pytest.mark.slow
def test_overwrite_removes_the_old_runs_checkpoints(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    run(_cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 4}, logging={"save_every": 1}))
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "epoch_3").is_dir()
    run(_cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 2}, logging={"overwrite": True, "save_every": 1}))
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["epoch_0", "epoch_1"]
    assert (ckpts / "latest").read_text() == "epoch_1"


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_names_the_parameter_and_both_shapes(tmp_path, tiny_flux_dir):
    from flowgrpo.checkpoint import CheckpointError
    from flowgrpo.runner import run

    run(_cfg(tmp_path, tiny_flux_dir, train={"num_epochs": 1}))
    other = _cfg(tmp_path, tiny_flux_dir, "rank2", model={"lora_rank": 2},
                 train={"resume_from": str(tmp_path / "run" / "checkpoints")})
    with pytest.raises(CheckpointError, match=r"parameter '.*lora_A.*' has shape \(4, \d+\) in the checkpoint but "
                                              r"\(2, \d+\) in the model"):
        run(other)


@pytest.mark.slow
def test_sample_run_rebuilds_the_model_as_training_did(tmp_path, tiny_flux_dir):
    from flowgrpo.runner import run

    run(_cfg(tmp_path, tiny_flux_dir, model={"scheduler_shift": 3.0}, train={"num_epochs": 1}))
    out = tmp_path / "sampled"
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "sample", "--run", str(tmp_path / "run"), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(out / "images.pt"), torch.load(tmp_path / "run" / "eval_images_after.pt"),
                               rtol=0, atol=1e-5)
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "sample", "--run", str(tmp_path), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"flowgrpo sample: {str(tmp_path)!r} is not a run folder (no "
                                                "config.yaml in it)"]


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
