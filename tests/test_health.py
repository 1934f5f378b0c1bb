"""Health before a checkpoint, as a kind (flowgrpo.watch.divergence rule 4, flowgrpo.checkpoints.health's health
records).

The statement tested: a checkpoint is written only from weights shown healthy by figures of the weights
themselves (the norm of the trained weights at most doubled by the epoch's update; a probe forward of the new
weights finite and within 100 times the start's), so the rule holds with one optimizer step an epoch, where no
later step measures the update; images with NaN or infinite values stop the run in one line and mark the checkpoint
that made them unhealthy; ``train.resume_from=auto`` never picks a checkpoint marked unhealthy; a checkpoint not
healthy never pushes a healthy one out of the rotation; the checkpoint with the best evaluation figure is kept.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowgrpo.checkpoints.health import (
    CheckpointError,
    best_checkpoint,
    mark_unhealthy,
    newest_healthy,
    resolve_checkpoint,
    rotation_victims,
)
from flowgrpo.cli import main as cli_main
from flowgrpo.watch.divergence import DivergenceWatch, WeightHealth
from tests.tiny_runs import _tiny_overrides


def _train(capsys, *args) -> tuple[int, list[str]]:
    """``flowgrpo train ARGS`` as a user runs it: (exit code, stderr lines)."""
    capsys.readouterr()
    try:
        cli_main(["train", *args])
        code = 0
    except SystemExit as stop:
        code = stop.code or 0
    return code, capsys.readouterr().err.strip().splitlines()


def _bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _good_run(tmp_path, tiny_flux_dir, capsys, extra=()) -> tuple[list[str], object]:
    """Two healthy epochs with one optimizer step each and a checkpoint after each (``epoch_0``, ``epoch_1``)."""
    out = tmp_path / "run"
    args = [*_tiny_overrides(tmp_path, tiny_flux_dir), "model.finetune=full", "train.lr=1e-4", "train.num_epochs=2",
            "logging.save_every=1", "logging.checkpoints_total_limit=2", f"output_dir={out}", *extra]
    code, err = _train(capsys, *args)
    assert code == 0, err[-3:]
    assert sorted(p.name for p in (out / "checkpoints").glob("epoch_*")) == ["epoch_0", "epoch_1"]
    return args, out / "checkpoints"


@pytest.mark.parametrize("objective", [[], ["objective=nft", "advantage.name=grpo"]],
                         ids=["sde_ratio", "nft"])
def test_a_diverged_update_that_no_later_step_measures_is_never_checkpointed(tmp_path, tiny_flux_dir, capsys,
                                                                              objective):
    """The issue's case 1: ``optimizer_steps_per_epoch=1`` and a resume at ``train.lr=1000``. Adam moves every
    weight by ~lr, so the norm of the (~0.02-sized) trained weights grows by orders of magnitude; no update figure
    measures it (no later step), yet no ``epoch_2`` may be written and ``epoch_0`` must stay."""
    args, ckpts = _good_run(tmp_path, tiny_flux_dir, capsys, objective)
    before = _bytes(ckpts)
    code, err = _train(capsys, *args, "train.resume_from=auto", "train.num_epochs=4", "train.lr=1000")
    assert code == 1 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: epoch 3/4: the run diverged: health/")
    assert f"the last checkpoint, {ckpts / 'epoch_1'}, is intact. Resume from it (train.resume_from=auto)" in err[-1]
    assert _bytes(ckpts) == before  # nothing written from the diverged weights, nothing rotated out
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["epoch"] == 2 and record["health/weight_growth"] > 2


@pytest.mark.parametrize("factor", [1e4, 30.0])
def test_non_finite_images_stop_in_one_line_and_auto_resume_skips_the_checkpoint_that_made_them(
        tmp_path, tiny_flux_dir, capsys, factor):
    """A checkpoint holding diverged weights (here: epoch_1's weights times 1e4, or times 30, whose images are
    finite, written as ``epoch_2`` as an older version would have written it): the resumed weights fail the probe
    before their first update (times 1e4 would make the rollout's images NaN; times 30 made every resume diverge in
    its first epoch and name the checkpoint intact). The run stops in one line, the checkpoint is marked
    unhealthy, ``latest`` goes back to ``epoch_1``, and ``resume_from=auto`` with a sane lr continues from there
    (main: a ValueError traceback from the reward scorer, then the same crash on every auto resume)."""
    args, ckpts = _good_run(tmp_path, tiny_flux_dir, capsys)
    bad = ckpts / "epoch_2"
    bad.mkdir()
    for f in (ckpts / "epoch_1").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    save_file({k: v * factor for k, v in load_file(bad / "trainable.safetensors").items()},
              bad / "trainable.safetensors")
    (bad / "health.json").unlink(missing_ok=True)  # an older version wrote no health record
    state = json.loads((bad / "state.json").read_text())
    (bad / "state.json").write_text(json.dumps({**state, "epoch": 2}))
    (ckpts / "latest").write_text("epoch_2")

    code, err = _train(capsys, *args, "train.resume_from=auto", "train.num_epochs=4")
    assert code == 1 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: epoch 4/4: the run diverged: ")
    assert "the run diverged: before its update, health/probe_rms = " in err[-1]
    assert f"checkpoint {bad} holds these weights and is now marked unhealthy" in err[-1]
    assert f"the last checkpoint, {ckpts / 'epoch_1'}, is intact" in err[-1]
    assert (ckpts / "latest").read_text() == "epoch_1"
    assert json.loads((bad / "health.json").read_text())["healthy"] is False

    code, err = _train(capsys, *args, "train.resume_from=auto", "train.num_epochs=3")
    assert code == 0, err[-3:]
    assert (tmp_path / "run" / "config_resumed_at_epoch_2.yaml").is_file()  # continued from epoch_1
    assert (ckpts / "latest").read_text() == "epoch_2"
    assert json.loads((ckpts / "epoch_2" / "health.json").read_text())["healthy"] is True  # re-saved, healthy


def _ckpt(root, epoch, health=None):
    p = root / f"epoch_{epoch}"
    p.mkdir(parents=True)
    (p / "state.json").write_text(json.dumps({"epoch": epoch, "lr_scheduler": {}, "sampler": {}}))
    if health is not None:
        (p / "health.json").write_text(json.dumps(health))
    return p


def test_rotation_and_the_resume_choice_never_favour_an_unhealthy_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    e0, e1 = _ckpt(root, 0, {"healthy": True}), _ckpt(root, 1)  # epoch_1: written before health records
    e2 = _ckpt(root, 2, {"healthy": False, "why": "x"})
    e3 = _ckpt(root, 3, {"healthy": False, "why": "x"})
    (root / "latest").write_text("epoch_3")
    assert newest_healthy(root) == e1 and resolve_checkpoint(root) == e1
    with pytest.raises(CheckpointError, match=r"epoch_2' is marked unhealthy \(x\); resume from a healthy one, "):
        resolve_checkpoint(e2)
    # keep 2: the two unhealthy ones do not count, so neither healthy one goes
    assert rotation_victims([e0, e1, e2, e3], 2, e1) == [e2, e3]
    e4 = _ckpt(root, 4, {"healthy": True})
    assert rotation_victims([e0, e1, e2, e3, e4], 2, e4) == [e0, e2, e3]
    # marking: latest goes back to the newest healthy; with none left it is removed
    (root / "latest").write_text("epoch_4")
    assert mark_unhealthy(root, e4, "NaN images") == e1 and (root / "latest").read_text() == "epoch_1"
    mark_unhealthy(root, e1, "y")
    assert mark_unhealthy(root, e0, "z") is None and not (root / "latest").exists()
    assert newest_healthy(root) is None


def test_the_best_evaluated_checkpoint_stays_out_of_the_rotation(tmp_path):
    root = tmp_path / "checkpoints"

    def ev(v):
        return {"healthy": True, "eval": {"metric": "eval/r/mean", "value": v}}

    e = [_ckpt(root, 0, ev(0.5)), _ckpt(root, 1, ev(0.58)), _ckpt(root, 2, ev(0.3)), _ckpt(root, 3, ev(0.2))]
    assert best_checkpoint(e) == e[1]
    assert rotation_victims(e, 2, e[3]) == [e[0]]  # epoch_1 (0.58) kept beside the newest two
    e.append(_ckpt(root, 4, {"healthy": True}))  # not evaluated
    assert rotation_victims(e, 2, e[4]) == [e[0], e[2]]
    mark_unhealthy(root, e[1], "x")  # an unhealthy checkpoint is never the best
    assert best_checkpoint(e) == e[0]


def test_weight_health_rule_by_hand():
    """Growth: norm after / norm before > 2 is flagged; probe: RMS > 100 x the start's, or not finite (rule 1)."""
    assert WeightHealth.flag({"health/weight_growth": 1.9, "health/probe_rms": 99.0, "health/probe_rms_start": 1.0}) \
        is None
    assert WeightHealth.flag({"health/weight_growth": 2.1}).startswith("health/weight_growth = 2.1 ")
    assert WeightHealth.flag({"health/probe_rms": 101.0, "health/probe_rms_start": 1.0}).startswith(
        "health/probe_rms = 101 ")
    watch = DivergenceWatch()
    assert watch.flag({"health/probe_rms": math.nan, "health/probe_rms_start": 1.0}) == "health/probe_rms = nan"
    # the forward objectives' own figures are watched too
    assert watch.flag({"objective/loss": math.inf}) == "objective/loss = inf"
    assert watch.flag({"objective/kl_ref": 1001.0}).startswith("objective/kl_ref = 1e+03")
    assert watch.flag({"objective/kl_ref": 999.0}) is None


def test_the_evaluation_hands_its_non_finite_count_to_the_check_before_any_reward_scores(monkeypatch):
    """The evaluation's images (3 of them, 2 NaN values and 1 infinite, counted by hand) reach ``check`` as 3.0
    before any reward is asked for a score (the rewards here are an object with no attribute: scoring first would
    raise AttributeError, not the check's own exception)."""
    import contextlib
    from types import SimpleNamespace

    from flowgrpo.data.prompts import PromptSet
    from flowgrpo.training import evaluation

    images = torch.zeros(3, 3, 4, 4)
    images[0, 0, 0, :2] = math.nan
    images[2, 1, 1, 1] = math.inf
    monkeypatch.setattr(evaluation, "generate_images", lambda *args, **kwargs: images)
    cfg = SimpleNamespace(train=SimpleNamespace(seed=0, rollout_batch_size=2), data=SimpleNamespace(eval_num_prompts=3),
                          eval_sampling=SimpleNamespace(num_steps=2, guidance_scale=1.0, cache=None),
                          logging=SimpleNamespace(progress=False), batch_size=4)
    optim = SimpleNamespace(eval_mode=lambda: None, eval_weights=contextlib.nullcontext)
    prompts = PromptSet(["a", "b"], [{}, {}], "test")
    seen = []

    class Stop(Exception):
        pass

    def check(bad: float) -> None:
        seen.append(bad)
        raise Stop

    ev = evaluation.Evaluation(cfg, adapter=None, optim=optim, rewards=object(), eval_rewards=None, prompts=prompts,
                               eval_prompts=None, main=True)
    assert ev.eval_set() == (["a", "b", "a"], [{}, {}, {}])  # min(3, B=4) training prompts, cycled
    with pytest.raises(Stop):
        ev.evaluate("before", check)
    assert seen == [3.0]


def test_the_probe_measures_the_weights_growth_and_velocity(tiny_flux_dir):
    """On the tiny model: weights scaled by 3 give a growth of 3 (one norm each side, by hand: ||3w|| / ||w||)."""
    from flowgrpo.models import load_model

    adapter = load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)
    params = [p for p in adapter.transformer.parameters()]
    health = WeightHealth(adapter, params, prompt="a red cube", metadata={}, guidance_scale=1.0, seed=0)
    health.begin()
    assert math.isfinite(health.start) and health.start > 0
    with torch.no_grad():
        for p in params:
            p.mul_(3.0)
    figures = health.measure()
    assert figures["health/weight_growth"] == pytest.approx(3.0, rel=1e-6)
    assert figures["health/probe_rms_start"] == health.start


class ScriptedEvalReward:
    """An evaluation reward whose figure follows a script, one value per evaluation (the before-training one
    first): the collapse guard's input as a user's reward would give it."""

    name = "scripted"
    modalities = ("image",)
    script = (0.5, 0.9, 0.4, 0.3)

    def __init__(self) -> None:
        self.calls = 0

    def setup(self, device) -> None:
        pass

    def __call__(self, images, prompts, metadata):
        value = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return torch.full((len(images),), value)


class WholeSetEvalReward(ScriptedEvalReward):
    """An evaluation reward that reports whole-set figures (``batch_metrics``, as the digits judge): their names
    are known only once evaluated."""

    def batch_metrics(self, images, prompts, metadata):
        return {"coverage": 0.5}


# --- the collapse guard (issue 42, case 2) -------------------------------------------------------------------------
def test_the_collapse_warning_on_a_hand_made_metric_stream():
    """The issue's digits collapse, as figures: correctness 0.58 at epoch 2, then 0.14. A fall of more than the
    fraction (0.2) below the best is warned, naming the epoch, the figure, its value and the best; smaller falls
    and rises are not."""
    from flowgrpo.watch.divergence import CollapseWatch

    history = [{"epoch": 0, "eval/c/mean": 0.40}, {"epoch": 1, "eval/c/mean": 0.58}, {"epoch": 2}]
    watch = CollapseWatch("eval/c/mean", 0.2, history)
    assert watch.observe({"eval/c/mean": 0.47}, "epoch 4") is None  # (0.58 - 0.47) / 0.58 = 0.19
    warning = watch.observe({"eval/c/mean": 0.14}, "epoch 5")  # 0.76 below
    assert warning.startswith("epoch 5: eval/c/mean = 0.14, 76% below its best, 0.58 at epoch 2 "
                              "(logging.collapse_fraction=0.2)")
    assert watch.observe({"eval/c/mean": 0.6}, "epoch 6") is None and watch.best == (0.6, "epoch 6")
    # a negative figure (jpeg compressibility, in -kB): the fall is relative to its size
    neg = CollapseWatch("eval/j/mean", 0.2, [{"epoch": 0, "eval/j/mean": -3.0}])
    assert neg.observe({"eval/j/mean": -3.5}, "epoch 2") is None  # 0.5 / 3 = 0.17
    assert neg.observe({"eval/j/mean": -3.7}, "epoch 3").startswith("epoch 3: eval/j/mean = -3.7, 23% below")
    assert CollapseWatch("eval/c/mean", 0.0, history).observe({"eval/c/mean": 0.0}, "e") is None  # 0: never
    assert CollapseWatch(None, 0.2, history).observe({"eval/c/mean": 0.0}, "e") is None


def test_the_collapse_warning_says_what_is_kept_only_when_it_is():
    """The warning claimed "the best evaluated checkpoint is kept out of the rotation" also with
    ``logging.keep_best=false``, and when the best was the base model's "before" evaluation, which no checkpoint
    holds (the digits default at train.lr=3e-3 falls below it in its first epochs)."""
    from flowgrpo.watch.divergence import CollapseWatch

    off = CollapseWatch("eval/c/mean", 0.2, [{"epoch": 0, "eval/c/mean": 0.58}], keep_best=False)
    warning = off.observe({"eval/c/mean": 0.14}, "epoch 5")
    assert warning.endswith("the policy may be collapsing; logging.keep_best is off: the rotation may remove the "
                            "best evaluated checkpoint")
    base = CollapseWatch("eval/c/mean", 0.2)
    assert base.observe({"eval/c/mean": 0.46}, "before training") is None
    warning = base.observe({"eval/c/mean": 0.13}, "epoch 2")
    assert warning.startswith("epoch 2: eval/c/mean = 0.13, 72% below its best, 0.46 at before training ")
    assert warning.endswith("kept out of the rotation (logging.keep_best); its best is the base model's, which no "
                            "checkpoint holds: start again from the base model with a lower train.lr")
    kept = CollapseWatch("eval/c/mean", 0.2, [{"epoch": 1, "eval/c/mean": 0.58}])
    assert kept.observe({"eval/c/mean": 0.14}, "epoch 5").endswith("kept out of the rotation (logging.keep_best)")


def test_a_collapse_through_the_cli_is_warned_and_its_best_checkpoint_kept(tmp_path, tiny_flux_dir, capsys, caplog):
    """Evaluations before training and after each epoch give 0.5, 0.9, 0.4, then 0.3 at the final one; one
    checkpoint is kept by the rotation (``checkpoints_total_limit=1``), yet the best evaluated one (``epoch_0``,
    0.9) stays, and the two falls are warned."""
    out = tmp_path / "run"
    args = [*_tiny_overrides(tmp_path, tiny_flux_dir), "model.finetune=full", "train.lr=1e-4", "train.num_epochs=3",
            "logging.save_every=1", "logging.eval_every=1", "logging.checkpoints_total_limit=1", f"output_dir={out}",
            "logging.plot_every=0",
            "eval_rewards=[{name: 'tests.test_health:ScriptedEvalReward'}]",
            "logging.best_metric=eval/ScriptedEvalReward/mean"]
    with caplog.at_level("WARNING", logger="flowgrpo"):
        code, err = _train(capsys, *args)
    assert code == 0, err[-3:]
    warned = [r.getMessage() for r in caplog.records if "below its best" in r.getMessage()]
    assert warned == [
        "epoch 2: eval/ScriptedEvalReward/mean = 0.4, 56% below its best, 0.9 at epoch 1 "
        "(logging.collapse_fraction=0.2): the policy may be collapsing; the best evaluated checkpoint is kept out "
        "of the rotation (logging.keep_best)",
        "the final evaluation: eval/ScriptedEvalReward/mean = 0.3, 67% below its best, 0.9 at epoch 1 "
        "(logging.collapse_fraction=0.2): the policy may be collapsing; the best evaluated checkpoint is kept out "
        "of the rotation (logging.keep_best)"]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("epoch_*")) == ["epoch_0", "epoch_2"]
    assert json.loads((ckpts / "epoch_0" / "health.json").read_text())["eval"] == {
        "metric": "eval/ScriptedEvalReward/mean", "value": pytest.approx(0.9)}
    # a figure the run never evaluates is refused before training, in one line
    code, err = _train(capsys, *args[:-1], "logging.best_metric=eval/nope/mean", f"output_dir={tmp_path / 'r2'}")
    assert code == 2 and err[-1].startswith("error: logging.best_metric='eval/nope/mean' is no evaluation figure")


def test_a_best_metric_the_evaluation_never_reports_is_refused_also_beside_a_whole_set_reward(tmp_path, tiny_flux_dir,
                                                                                               capsys):
    """With a whole-set evaluation reward (figures named only once evaluated), a mistyped ``logging.best_metric``
    passed the check before training and the collapse guard and keep_best then watched nothing, silently; it is
    refused in one line after the "before" evaluation, before any epoch, naming the figures it could be."""
    out = tmp_path / "run"
    args = [*_tiny_overrides(tmp_path, tiny_flux_dir), "train.num_epochs=1", "logging.eval_every=1",
            f"output_dir={out}", "logging.plot_every=0", "logging.best_metric=eval/covrage",
            "eval_rewards=[{name: 'tests.test_health:WholeSetEvalReward'}]"]
    code, err = _train(capsys, *args)
    assert code == 2 and err[-1].startswith(
        "error: logging.best_metric='eval/covrage' is no evaluation figure of this run: its evaluation reports [")
    assert "'eval/coverage'" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    # the figure it reports is accepted, and the run starts again with the resume the message names
    code, err = _train(capsys, *args, "train.resume_from=auto", "logging.best_metric=eval/coverage")
    assert code == 0, err[-3:]


@pytest.mark.parametrize("name", ["trainable.safetensors", "optimizer.pt"])
def test_auto_resume_passes_over_a_checkpoint_truncated_after_it_was_written(tmp_path, tiny_flux_dir, capsys, caplog,
                                                                             name):
    """A file of the newest checkpoint cut short after the save (a full disk on a copy, a cut transfer): before,
    ``train.resume_from=auto`` picked it on every restart and stopped on the corrupt file, so no restart could go
    on. Now the sizes ``state.json`` lists show it; the resume continues from the intact ``epoch_0`` and says
    which file it passed over; naming the truncated folder itself is refused in one line naming the file."""
    args, ckpts = _good_run(tmp_path, tiny_flux_dir, capsys)
    f = ckpts / "epoch_1" / name
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])
    with pytest.raises(CheckpointError, match=rf"epoch_1' is not as it was written: {name} has {size // 2} of its "
                                              rf"{size} bytes \(truncated\?\); resume from an intact one, .*epoch_0"):
        resolve_checkpoint(ckpts / "epoch_1")
    assert resolve_checkpoint(ckpts) == ckpts / "epoch_0"
    assert rotation_victims([ckpts / "epoch_0", ckpts / "epoch_1"], 1, ckpts / "epoch_2") == [ckpts / "epoch_1"]

    with caplog.at_level("WARNING", logger="flowgrpo"):
        code, err = _train(capsys, *args, "train.resume_from=auto", "train.num_epochs=3")
    assert code == 0, err[-3:]
    warned = [r.getMessage() for r in caplog.records if "a resume passes it over" in r.getMessage()]
    assert len(warned) == 1 and f"{name} has {size // 2} of its {size} bytes (truncated?)" in warned[0], warned
    assert (tmp_path / "run" / "config_resumed_at_epoch_1.yaml").is_file()  # continued after epoch_0
    assert resolve_checkpoint(ckpts) == ckpts / "epoch_2"
    assert sorted(p.name for p in ckpts.glob("epoch_*")) == ["epoch_1", "epoch_2"]  # epoch_1 written again, whole
    assert (ckpts / "epoch_1" / name).stat().st_size == size
