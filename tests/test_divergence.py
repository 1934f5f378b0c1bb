"""A diverging run keeps its healthy checkpoints and stops in one line naming the divergence
(flowgrpo.watch.divergence).

The rule: an epoch is unhealthy when an update figure is NaN or infinite, or a KL figure exceeds both its floor
(approx_kl 1e-2, kl_ref 1.0) and 1000 times its largest earlier value (without one: 1000 times the floor); a
checkpoint is written only from finite weights. The limits below are
computed here from that statement, not read from the module.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.watch.divergence import DivergenceWatch, TrainingDiverged, check_weights


def test_the_rule_by_hand(tmp_path):
    history = [{"epoch": 0, "policy_later/approx_kl": 2e-7}, {"epoch": 1, "policy_later/approx_kl": 3e-6}]
    watch = DivergenceWatch(history)
    # a healthy run's KL grows, even 3000-fold in an epoch: below the floor of 1e-2, never flagged
    assert watch.flag({"policy_later/approx_kl": 9e-3, "policy/grad_norm": 12.0}) is None
    # beyond both the floor and 1000 times the history
    assert watch.flag({"policy_later/approx_kl": 0.0486}).startswith("policy_later/approx_kl = 0.0486")
    assert DivergenceWatch([{"policy_later/approx_kl": 5e-5}]).flag({"policy_later/approx_kl": 0.0486}) is None
    # the issue's epoch: kl 1.3e+26 against at most 3e-6 before
    what = watch.flag({"policy_later/approx_kl": 1.3e26})
    assert what.startswith("policy_later/approx_kl = 1.3e+26 (at most 3e-06 in the earlier epochs")
    # above the floor but within 1000x of the history: not flagged; beyond both: flagged
    high = DivergenceWatch([{"policy/kl_ref": 0.01}, {"policy/kl_ref": 0.004}])
    assert high.flag({"policy/kl_ref": 9.0}) is None  # 9 <= 1000 * 0.01
    assert high.flag({"policy/kl_ref": 10.5}).startswith("policy/kl_ref = 10.5")
    # no history: the limit is 1000 times the floor
    assert DivergenceWatch().flag({"policy/kl_ref": 999.0, "policy/approx_kl": 9.0}) is None
    assert DivergenceWatch().flag({"policy/kl_ref": 1001.0}) is not None
    assert DivergenceWatch().flag({"policy/approx_kl": 11.0}) is not None
    # any non-finite update figure
    assert watch.flag({"policy/ratio_mean": math.nan}) == "policy/ratio_mean = nan"
    assert watch.flag({"policy/grad_norm": math.inf}) == "policy/grad_norm = inf"
    assert watch.flag({"reward/total/mean": math.nan}) is None  # NaN rewards are handled, not a divergence
    with pytest.raises(TrainingDiverged, match=r"^epoch 3/8: the run diverged: policy_later/approx_kl = 1\.3e\+26 .*"
                                               r"no checkpoint was written yet"):
        watch.check({"policy_later/approx_kl": 1.3e26}, 2, 8, tmp_path / "checkpoints")


def test_non_finite_weights_are_never_written(tmp_path):
    w = torch.ones(4, 3)
    check_weights([("a", w)], 0, 2, tmp_path)
    w[1, 2] = math.nan
    w[0, 0] = math.inf
    with pytest.raises(TrainingDiverged, match=r"epoch 1/2: .* 2 of the 12 values of the trained weight b are NaN or "
                                               r"infinite.*no checkpoint was written from these weights"):
        check_weights([("a", torch.ones(2)), ("b", w)], 0, 2, tmp_path)


def test_nan_images_name_the_divergence_not_the_decoder_range():
    from flowgrpo.rewards.base import check_reward_inputs

    images = torch.full((2, 3, 4, 4), 0.5)
    images[1, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="1 of the 96 image values are NaN or infinite.*diverged") as err:
        check_reward_inputs(images, ["a", "b"], [{}, {}], "jpeg")
    assert "[-1, 1]" not in str(err.value)
    with pytest.raises(ValueError, match=r"map \[-1, 1\] decoder output"):  # a finite range error keeps its hint
        check_reward_inputs(images.nan_to_num(0.5) + 0.7, ["a", "b"], [{}, {}], "jpeg")


def _cfg(tmp_path, tiny_flux_dir, overrides=()):
    from flowgrpo.config import build_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\n")
    return build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "lora_rank": 4},
        "sampling": {"num_steps": 2}, "eval_sampling": {"num_steps": 2},
        "train": {"num_epochs": 2, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4,
                  "optimizer_steps_per_epoch": 2, "train_batch_size": 2, "lr": 1e-3},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts), "eval_num_prompts": 2},
        "logging": {"progress": False, "save_every": 1, "checkpoints_total_limit": 2},
    }, list(overrides))


def _bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_diverging_resume_stops_in_one_line_and_keeps_the_healthy_checkpoints(tmp_path, tiny_flux_dir,
                                                                                monkeypatch, capsys):
    """The issue's case: a healthy run resumed with a learning rate that blows the policy up. Its KL jumps by
    many orders of magnitude in the first resumed epoch; no checkpoint of that epoch is written (it would rotate
    a good one out), and the command stops with one line naming the figure and the epoch, 1-based."""
    from flowgrpo.runner import main, run

    run(_cfg(tmp_path, tiny_flux_dir))
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("epoch_*")) == ["epoch_0", "epoch_1"]
    before = _bytes(ckpts)
    # the issue's resume: a learning rate 10**4 times too high moves the LoRA far off the policy (measured: the
    # off-policy approx_kl jumps from ~1e-10 to ~5e-2, the later ratios' mean to ~0.78 against a clip of 1e-4)
    cfg = _cfg(tmp_path, tiny_flux_dir, ["train.num_epochs=4", f"train.resume_from={ckpts}", "train.lr=10.0"])
    from flowgrpo.config import save_config

    save_config(cfg, tmp_path / "resume.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "resume.yaml")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: epoch 3/4: the run diverged: policy_later/approx_kl = ")
    assert f"the last checkpoint, {ckpts / 'epoch_1'}, is intact" in err[-1]
    assert _bytes(ckpts) == before  # nothing rotated out, nothing written from the diverged weights


@pytest.mark.slow
@pytest.mark.parametrize("bad_step, expected", [
    (0, "epoch 1/2: the run diverged: the gradient norm is nan (the weights were not updated); no checkpoint was "
        "written yet"),
    (2, "epoch 2/2: the run diverged: the gradient norm is nan (the weights were not updated); the last "
        "checkpoint, {ckpts}/epoch_0, is intact"),
])
def test_a_non_finite_gradient_stop_counts_from_one_and_names_the_checkpoint(tmp_path, tiny_flux_dir, monkeypatch,
                                                                           bad_step, expected):
    """Two optimizer steps an epoch: step ``bad_step`` (0-based over the run) has a NaN gradient norm."""
    from accelerate import Accelerator

    from flowgrpo.runner import run

    real = Accelerator.clip_grad_norm_
    calls = []

    def clip(self, *args, **kwargs):
        calls.append(1)
        norm = real(self, *args, **kwargs)
        return torch.full_like(torch.as_tensor(norm), math.nan) if len(calls) - 1 == bad_step else norm

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", clip)
    with pytest.raises(TrainingDiverged) as err:
        run(_cfg(tmp_path, tiny_flux_dir))
    assert str(err.value).startswith(expected.format(ckpts=tmp_path / "run" / "checkpoints"))
