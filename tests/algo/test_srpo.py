"""Specification of SRPO (``objective: {name: srpo}``, flowgrpo/algo/objectives/srpo.py): Direct-Align and the
semantic relative reward as the release Tencent-Hunyuan/SRPO at 81e5898 computes them ("SRPO.py:N" is line N of
its ``fastvideo/SRPO.py``; the FLUX HPS script ``scripts/finetune/SRPO_training_hpsv2.sh``).

The expected values are written here from the release's lines, never from the objective's code:

* the training σ's: S(u) = 3u/(1 + 2u) on u = linspace(1, 0, 51) (SRPO.py:248–249, 524–525), ``sigmas_l`` 1000
  values linear from S[5] to S[25] (SRPO.py:534, the default ``--train_timestep 5 25``);
* k = int((1 − 0.9)·1000) + 1 = 100 (SRPO.py:520: 0.1 is 0.09999… in floating point), then min(1000 − mid, k, mid);
* the denoising branch (``inversion == 1``): the model at sigmas_l[1000 − mid − k], one Euler step down to
  sigmas_l[1000 − mid], x̂₀ = (x − σ·ε)/(1 − σ) with the rollout's initial noise ε (SRPO.py:521, 544–608), reward
  (1 + d)·R(pos) − R(neg) with d = linspace(0.1, 0.25, 1000)[mid];
* the inversion branch (``inversion == 0``): m = max(mid − k, 1), the model at sigmas_l[1000 − m], one step up to
  sigmas_l[1000 − m − k], reward (1 + d)·R(neg) − R(pos) with d = linspace(0.3, 0.01, 1000)[m] (SRPO.py:618–620);
* the phrases of step j: ("Natural-lighting", "Detail", "Detailed", "Real")[j mod 4] and ("Concept art",
  "Painting", "Anime", "Flat", "Oil")[j mod 5], written ``phrase + ". " + prompt`` (SRPO.py:65–89, 514–517);
* the loss relu(0.7 − r) (SRPO.py:623), averaged over the two branches (its 2 accumulation steps).

The update runs on the linear-velocity model of tests/algo/test_path_objectives.py through the real plan, draws and
update loop; the reward is linear in the decoded pixels with weights that depend on the whole prompt text.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from flowgrpo.algo.objectives import build_objective
from flowgrpo.algo.objectives.srpo import (
    branch_sigmas,
    control_phrases,
    gap,
    srpo_loss,
    srpo_reward_problems,
    train_sigmas,
)
from flowgrpo.config import ConfigError, RewardSpec, build_config
from flowgrpo.records import Advantages, FinalSamples, PromptEmbeds
from flowgrpo.training.update import run_update
from tests.algo.test_path_objectives import FakeAdapter, _f
from tests.training.test_forward_update import FakeOptim

B, D = 8, 3
TEXT = [{"name": "hpsv2"}]
POS = ("Natural-lighting", "Detail", "Detailed", "Real")
NEG = ("Concept art", "Painting", "Anime", "Flat", "Oil")


# ----------------------------------------------------------------------------------------------- by hand
def _s(u):
    return 3 * u / (1 + 2 * u)


def _sigma_l(i, a=5, b=25, n=1000):
    lo, hi = _s(1 - a / 50), _s(1 - b / 50)
    return lo + (hi - lo) * i / (n - 1)


def _branches(mid):
    """{branch: (σ_in, σ_out, d)} of the release for the drawn mid (module docstring)."""
    k = min(1000 - mid, 100, mid)
    m = max(mid - k, 1)
    return {"denoise": (_sigma_l(1000 - min(mid + k, 1000)), _sigma_l(1000 - mid), 0.1 + 0.15 * mid / 999),
            "inversion": (_sigma_l(1000 - m), _sigma_l(1000 - min(m + k, 1000)), 0.3 - 0.29 * m / 999)}


def _pix(prompt: str) -> torch.Tensor:
    """The text reward's pixel weights for ``prompt``: (3,) float64 seeded by the prompt's CRC-32."""
    return torch.randn(3, generator=torch.Generator().manual_seed(zlib.crc32(prompt.encode())),
                       dtype=torch.float64)


class TextReward:
    """R(image, prompt) = <pixels, u(prompt)>: linear, differentiable, and a function of the whole prompt."""

    name = "text"
    differentiable = True
    text_conditioned = True

    def score_differentiable(self, images, prompts, metadata):
        u = torch.stack([_pix(p) for p in prompts])
        return (images.reshape(-1, 3).double() * u).sum(-1).float()


class Composed:
    def __init__(self) -> None:
        self.rewards = {"text": TextReward()}
        self.weights = {"text": 1.0}


def _samples(gen) -> FinalSamples:
    return FinalSamples(x0=torch.randn(B, D, generator=gen), initial_noise=torch.randn(B, D, generator=gen),
                        sigmas=torch.tensor([1.0, 0.5, 0.0]), group_ids=torch.arange(4).repeat_interleave(2),
                        sample_index=torch.tensor([0, 1] * 4),
                        embeds=PromptEmbeds({"e": torch.randn(B, D, generator=gen)}), images=torch.zeros(B, 3, 1, 1),
                        prompts=[f"prompt {i // 2}" for i in range(B)], metadata=[{}] * B, guidance_scale=3.0)


def _run(objective: dict):
    cfg = build_config({"objective": {"name": "srpo", **objective}, "rewards": TEXT,
                        "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8,
                                  "train_batch_size": 2, "optimizer_steps_per_epoch": 2, "seed": 5}})
    obj = build_objective(cfg)
    adapter, optim = FakeAdapter(), None
    optim = FakeOptim(adapter.transformer)
    obj.prepare(optim)
    obj.attach(adapter, Composed())
    samples = _samples(torch.Generator().manual_seed(0))
    adv = Advantages(values=torch.zeros(B), train_mask=torch.zeros(B, dtype=torch.bool), zero_spread_frac=1.0,
                     nan_frac=0.0, learning_frac=0.0)  # zero advantages: the reward's gradient trains anyway
    work = obj.plan(samples, adv, torch.ones(B, dtype=torch.bool), epoch=2)
    draws, real = [], obj.draws

    def recording(w, rows, inner):
        out = real(w, rows, inner)
        draws.append((optim.steps, rows.clone(), out[0].mid))
        return out

    obj.draws = recording
    metrics = run_update(obj, adapter, optim, work, inner_epochs=1, progress=False)
    return optim, samples, draws, metrics


def _expected(optim, samples, draws, *, branches=("denoise", "inversion"), noise=None, relative=True):
    """Each optimizer step's float64 gradient of the mean release loss over its (sample, branch) rows, and the mean
    loss of all rows."""
    grads, losses = [], []
    for step in range(len(optim.grads)):
        theta = torch.tensor(optim.before[step], dtype=torch.float64, requires_grad=True)
        pos, neg = POS[(step + 1) % 4], NEG[(step + 1) % 5]  # the release's step counts from 1
        rows_loss = []
        for _, rows, mid in [d for d in draws if d[0] == step]:
            x0, e = samples.x0[rows].double(), samples.embeds["e"][rows].double()
            eps = samples.initial_noise[rows].double() if noise is None else noise[rows].double()
            for branch in branches:
                s_in, s_out, d = _branches(mid)[branch]
                x_in = (1 - s_in) * x0 + s_in * eps
                v = _f(theta, x_in, torch.full((len(rows),), s_in, dtype=torch.float64), e, g=1.0)
                x_hat = (x_in + (s_out - s_in) * v - s_out * eps) / (1 - s_out)
                img = torch.sigmoid(x_hat)
                prompts = [samples.prompts[r] for r in rows.tolist()]
                r_pos = torch.stack([(img[i] * _pix(f"{pos}. {p}")).sum() for i, p in enumerate(prompts)])
                r_neg = torch.stack([(img[i] * _pix(f"{neg}. {p}")).sum() for i, p in enumerate(prompts)])
                r = (1 + d) * r_pos - r_neg if branch == "denoise" else (1 + d) * r_neg - r_pos
                if not relative:  # Direct-Align alone: the plain prompt
                    r = torch.stack([(img[i] * _pix(p)).sum() for i, p in enumerate(prompts)])
                rows_loss.append(torch.relu(0.7 - r))
        loss = torch.cat(rows_loss).mean()
        losses.append(loss.detach())
        (g,) = torch.autograd.grad(loss, theta)
        grads.append(g)
    return grads, float(torch.stack(losses).mean())


def _close(got, want):
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert float(w.abs().max()) > 0  # the step had a gradient: the test has power
        assert torch.allclose(torch.tensor(g, dtype=torch.float64), w, rtol=2e-5, atol=1e-10), (g, w)


# ------------------------------------------------------------------------------------------------ the update
def test_each_steps_gradient_is_the_releases_two_branch_hinge_through_one_step():
    optim, samples, draws, metrics = _run({})
    grads, loss = _expected(optim, samples, draws)
    _close(optim.grads, grads)
    assert metrics["objective/rows"] == 2 * B  # one row per (sample, branch)
    assert metrics["objective/loss"] == pytest.approx(loss, rel=1e-5)
    assert all(5 <= mid <= 995 for *_, mid in draws)  # SRPO.py:864 random.randint(5, timestep_length - 5)
    assert len({mid for *_, mid in draws}) > 1  # one draw per micro-batch, not one for the run
    assert 0 < metrics["objective/active"] < 1  # rows on both sides of the hinge: relu's cut is tested


def test_the_denoising_branch_alone_and_direct_align_without_the_relative_reward():
    optim, samples, draws, metrics = _run({"branches": "denoise"})
    grads, _ = _expected(optim, samples, draws, branches=("denoise",))
    _close(optim.grads, grads)
    assert metrics["objective/rows"] == B
    optim, samples, draws, metrics = _run({"branches": "denoise", "relative": False})
    grads, loss = _expected(optim, samples, draws, branches=("denoise",), relative=False)
    _close(optim.grads, grads)
    assert metrics["objective/loss"] == pytest.approx(loss, rel=1e-5)


def test_a_fresh_noise_prior_is_seeded_by_the_sample_and_used_on_both_sides_of_the_step():
    """``noise: fresh``: the ε the test reads back from the draws is not the rollout's, and the gradient is the
    release's formula with that ε (the same ε noises x₀ and is removed from the step's result)."""
    from flowgrpo.algo.objectives.srpo import SRPO

    seen = {}
    real = SRPO.draws

    def keep(self, work, rows, inner):
        out = real(self, work, rows, inner)
        for i, r in enumerate(rows.tolist()):
            seen[r] = out[0].noise[i].clone()
        return out

    SRPO.draws = keep
    try:
        optim, samples, draws, _ = _run({"noise": "fresh"})
    finally:
        SRPO.draws = real
    noise = torch.stack([seen[r] for r in range(B)])
    assert not torch.allclose(noise, samples.initial_noise)
    grads, _ = _expected(optim, samples, draws, noise=noise)
    _close(optim.grads, grads)


def test_an_update_with_no_row_inside_the_hinge_is_warned_once(caplog):
    """Margin −100 under the linear text reward: every relu term is 0 and the gradient 0; one warning line."""
    import logging

    with caplog.at_level(logging.WARNING, logger="flowgrpo.algo.objectives.srpo"):
        optim, _, _, metrics = _run({"margin": -100.0})
    assert metrics["objective/active"] == 0.0 and all(g == 0 for grads in optim.grads for g in grads)
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "flowgrpo.algo.objectives.srpo"]
    assert msg.startswith("objective srpo: no row was inside the hinge in this update") and "\n" not in msg
    with caplog.at_level(logging.WARNING, logger="flowgrpo.algo.objectives.srpo"):
        _run({})  # rows inside the hinge: no warning
    assert len([r for r in caplog.records if r.name == "flowgrpo.algo.objectives.srpo"]) == 1


# ------------------------------------------------------------------------------------------------ the pieces
def test_training_sigmas_and_branches_by_hand():
    st = build_config({"objective": "srpo", "rewards": TEXT}).objective
    sig = train_sigmas(st)
    want = torch.tensor([_sigma_l(i) for i in range(1000)], dtype=torch.float64)
    assert sig.shape == (1000,) and torch.allclose(sig.double(), want, atol=1e-6)
    assert gap(500, st) == 100 and gap(5, st) == 5 and gap(950, st) == 50
    for mid in (5, 60, 100, 101, 500, 995):
        for branch, (s_in, s_out, d) in _branches(mid).items():
            got = branch_sigmas(mid, branch, st)
            assert got == pytest.approx((s_in, s_out, d), abs=1e-6), (mid, branch)
    s_in, s_out, _ = branch_sigmas(500, "denoise", st)
    assert s_in > s_out  # denoising steps down in noise
    s_in, s_out, _ = branch_sigmas(500, "inversion", st)
    assert s_in < s_out  # the inversion steps up
    with pytest.raises(ValueError, match="mid must be in"):
        branch_sigmas(0, "denoise", st)


def test_control_phrases_cycle_by_step_and_the_hinge():
    assert [control_phrases(j) for j in (1, 2, 4, 5)] == [("Detail", "Painting"), ("Detailed", "Anime"),
                                                          ("Natural-lighting", "Oil"), ("Detail", "Concept art")]
    r = torch.tensor([0.0, 0.5, 0.7, 1.2])
    assert torch.allclose(srpo_loss(r), torch.tensor([0.7, 0.2, 0.0, 0.0]))
    assert torch.allclose(srpo_loss(r, 1.0, 2.0), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_the_defaults_are_the_releases():
    """Written from the release's HPS script and argparse defaults (SRPO.py:1137–1170; the script's
    --groundtruth_ratio 0.9, --discount_inv 0.3 0.01, --discount_pos 0.1 0.25, --timestep_length 1000, --shift 3)."""
    o = build_config({"objective": "srpo", "rewards": TEXT}).objective
    assert (o.timestep_length, o.grid_steps, o.train_shift, o.train_timestep) == (1000, 50, 3.0, (5, 25))
    assert (o.groundtruth_ratio, o.discount_pos, o.discount_inv, o.margin) == (0.9, (0.1, 0.25), (0.3, 0.01), 0.7)
    assert (o.positive_phrases, o.negative_phrases) == (POS, NEG)
    assert (o.branches, o.relative, o.noise, o.solver) == ("both", True, "initial", "euler")


# ------------------------------------------------------------------------------------------------ refusals
def test_a_reward_that_does_not_read_the_prompt_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        build_config({"objective": "srpo", "rewards": [{"name": "digit_correctness"}]})
    (line,) = [ln for ln in str(err.value).splitlines() if "digit_correctness" in ln]
    assert "does not read the prompt" in line and "objective.relative=false" in line
    # Direct-Align alone takes it (denoising branch only); the inversion branch needs the phrases
    build_config({"objective": {"name": "srpo", "relative": False, "branches": "denoise"},
                  "rewards": [{"name": "digit_correctness"}]})
    with pytest.raises(ConfigError, match="objective.branches=denoise"):
        build_config({"objective": {"name": "srpo", "relative": False}, "rewards": [{"name": "digit_correctness"}]})
    assert srpo_reward_problems([RewardSpec(name="jpeg_compressibility")], False)[0].startswith(
        "objective.name=srpo backpropagates the reward's gradient, but reward 'jpeg_compressibility'")
    assert srpo_reward_problems([RewardSpec(name=n) for n in ("hpsv2", "pickscore", "clip_score")], True) == []


def test_a_train_timestep_outside_the_grid_is_refused():
    with pytest.raises(ConfigError, match=r"objective.train_timestep=\[5, 60\] must be 0 <= a < b <= "
                                          r"objective.grid_steps=50"):
        build_config({"objective": {"name": "srpo", "train_timestep": [5, 60]}, "rewards": TEXT})


# ------------------------------------------------------------------------------------------------ the configs
#: configs/flux_srpo.yaml's release values, written from scripts/finetune/SRPO_training_hpsv2.sh ("sh") and
#: fastvideo/SRPO.py ("py") at 81e5898, not from our config
FLUX_RELEASE = {
    "model.pretrained": "black-forest-labs/FLUX.1-dev", "model.height": 720, "model.width": 720,   # sh 18, 36, 37
    "model.finetune": "full", "model.dtype": "bfloat16",                      # py 772-780; sh 30
    "sampling.num_steps": 25, "sampling.guidance_scale": 1.0,                 # sh 39, 34
    "eval_sampling.num_steps": 50, "eval_sampling.guidance_scale": 3.5,       # py 1184-1188, 1171-1176
    "objective.name": "srpo", "objective.solver": "euler",                    # py 272-285
    "objective.train_guidance_scale": 3.5,                                    # py 569-573
    "objective.branches": "both", "objective.relative": True, "objective.noise": "initial",   # py 529-531, 521
    "objective.timestep_length": 1000, "objective.grid_steps": 50, "objective.train_shift": 3.0,  # sh 50; py 524; sh 46
    "objective.train_timestep": (5, 25), "objective.groundtruth_ratio": 0.9,  # py 1150-1154, sh 51
    "objective.discount_pos": (0.1, 0.25), "objective.discount_inv": (0.3, 0.01),   # sh 49, 48
    "objective.positive_phrases": POS, "objective.negative_phrases": NEG, "objective.margin": 0.7,   # py 65-89, 623
    "train.num_epochs": 19, "train.train_batch_size": 1, "train.lr": 5e-6, "train.warmup_steps": 0,   # py 861-866; sh
    "train.weight_decay": 1e-4, "train.adam_betas": (0.9, 0.999), "train.adam_eps": 1e-8,   # sh 45; py 777, 779
    "train.max_grad_norm": 0.1, "train.seed": 42,                             # sh 44, 17
    "parallel.sharding": "fsdp2",                                             # py 737-745: FSDP, full shard
}


def test_flux_srpo_reproduces_the_release():
    from pathlib import Path

    from flowgrpo.config import load_config
    from tests.config.test_release_configs import _get

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "flux_srpo.yaml")
    wrong = {k: (_get(cfg, k), v) for k, v in FLUX_RELEASE.items()
             if (tuple(_get(cfg, k)) if isinstance(v, tuple) else _get(cfg, k)) != v}
    assert not wrong, f"(ours, release) {wrong}"
    assert [(r.name, r.weight, r.kwargs.get("version")) for r in cfg.rewards] == [("hpsv2", 1.0, "v2.1")]
    assert cfg.batch_size == 32  # 32 samples an optimizer step: 32 of the release's GPUs x one image


def test_a_reward_that_does_not_read_the_prompt_is_refused_through_the_command(tmp_path, capsys):
    """``flowgrpo train configs/digits_srpo.yaml objective.relative=true objective.branches=both``: the digits reward
    reads the digit from the metadata, not the prompt: one line naming it, exit 2, nothing written."""
    from pathlib import Path

    from flowgrpo.cli import main as cli_main

    config = Path(__file__).resolve().parents[2] / "configs" / "digits_srpo.yaml"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["train", str(config), "objective.relative=true", "objective.branches=both",
                  f"output_dir={tmp_path / 'run'}", "logging.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "reward 'digit_correctness' does not read the prompt" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
