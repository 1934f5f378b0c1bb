"""Specification of TDM-R1 (``objective.name=tdm_r1``, flowgrpo/algo/objectives/tdm_r1.py; arXiv 2603.07700, release
Luo-Yihong/TDM-R1 ``scripts/train_tdmr1_pub.py`` and ``config/tdmr1_clean.py``).

Expected values are the release's expressions written out here in float64 (its ``convert``/``inv_convert``, the
"TDM-Style Fake Score Training", "DGPO-style Training of Surrogate Reward" and "TDM-R1 Training of few-step
generator" blocks), never the module's functions: the pure pieces by hand, then the update in the loop on a model
whose velocity is linear in three weights, each optimizer step's gradient (the generator's, the fake score's, the
surrogate's, in the order they are taken) against the gradient derived here with the four models tracked by hand,
and the slow surrogate following the surrogate. The end-to-end runs (tiny FLUX and SD3.5 through the command line,
save–kill–resume, two processes) are marked slow.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowgrpo.algo.objectives import build_objective
from flowgrpo.algo.objectives.tdm_r1 import draw_time, renoise, shift, surrogate_target, unshift
from flowgrpo.config import build_config, load_config
from flowgrpo.records import Advantages, PromptEmbeds
from flowgrpo.training.update import run_update
from flowgrpo.writing.metrics import read_metrics
from tests.algo.test_dmd2 import Recording as DMD2Recording
from tests.algo.test_dmd2 import path_samples, recorded
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here
from tests.training.objective_runs import assert_resume_equals_whole, assert_two_processes_equal_one, tiny_run
from tests.training.test_forward_update import LR, FakeAdapter, Lin
from tests.training.test_path_runs import _teacher
from tests.training.test_sharding import _config as sharding_base
from tests.training.test_sharding import _free_port, _in_process, _ok, _torchrun

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- the pure pieces
def _convert(x, s=3):  # the release's, on the 0-1000 scale
    return s * x / 1000 / (1 + (s - 1) * x / 1000) * 1000


def _inv_convert(y, s=3):
    return 1000 * y / (1000 * s - (s - 1) * y)


def test_times_are_the_releases_shifted_draws_above_the_next_state():
    for y in (0.0, 0.1, 0.5, 0.93):
        assert float(shift(torch.tensor(y, dtype=torch.float64))) == pytest.approx(_convert(1000 * y) / 1000)
        assert float(unshift(torch.tensor(y, dtype=torch.float64))) == pytest.approx(_inv_convert(1000 * y) / 1000)
    # tau_tmp_inv = u * (1000 - (inv(t_next) + 20)) + (inv(t_next) + 20); tau = convert(tau_tmp_inv)
    for u, t_next, t_min in ((0.0, 400.0, 0.0), (0.37, 400.0, 0.0), (0.99, 120.0, 300.0), (0.5, 0.0, 550.0)):
        lower = max(t_next, t_min)
        inv = _inv_convert(lower)
        want = max(_convert(u * (1000 - (inv + 20)) + inv + 20), lower) / 1000
        assert draw_time(u, t_next / 1000, t_min / 1000) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="leaves none below 1"):
        draw_time(0.5, 0.995)


def test_the_forward_noising_and_the_surrogates_target():
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g, dtype=torch.float64)
    sn, tau = 0.4, 0.7
    alpha = (1 - tau) / (1 - sn)
    beta = math.sqrt(tau ** 2 - (sn * alpha) ** 2)
    assert torch.allclose(renoise(x, sn, tau, eps).double(), x * alpha + beta * eps, atol=1e-6)
    # a clean state re-noised has the variance of x_tau = (1 - tau) x0 + tau eps: beta = tau, alpha = 1 - tau
    assert torch.allclose(renoise(x, 0.0, tau, eps).double(), (1 - tau) * x + tau * eps, atol=1e-6)
    want = -x / (1 - sn) + eps / beta * (tau + sn ** 2 * alpha / (1 - sn))
    assert torch.allclose(surrogate_target(x, sn, tau, eps).double(), want, atol=1e-5)
    # at sigma_n = 0 it is flow matching's target eps - x0
    assert torch.allclose(surrogate_target(x, 0.0, tau, eps).double(), eps - x, atol=1e-6)


def test_settings_are_refused_before_any_model_loads(tmp_path):
    for g in (1.0, 1.2, 0.5):  # no guidance, or so near 1 that the division amplifies rounding (trial 8)
        with pytest.raises(ValueError, match=rf"cfg_reward_scale=3.5 needs .*real_guidance_scale >= 1.5 \(got {g}\)"):
            build_config({"objective": {"name": "tdm_r1", "real_guidance_scale": g}})
    for name in ("reward_time_floor", "surrogate_time_floor"):  # named, with the largest allowed (trial 8)
        with pytest.raises(ValueError, match=rf"objective.{name}=0.999 leaves no time to draw above it: it must be "
                                             r"below 0.9932"):
            build_config({"objective": {"name": "tdm_r1", name: 0.999}})
    with pytest.raises(ValueError, match="slow_decay_min=0.5 exceeds"):
        build_config({"objective": {"name": "tdm_r1", "slow_decay_min": 0.5}})
    cfg = build_config({"objective": {"name": "tdm_r1"}, "train": {"inner_epochs": 2}})
    with pytest.raises(ValueError, match=r"train.inner_epochs=2: set it to 1"):
        build_objective(cfg).validate()
    cfg = build_config({"objective": {"name": "tdm_r1"}, "train": {"group_size": 4, "train_batch_size": 2}})
    with pytest.raises(ValueError, match="train_batch_size=2 must be a multiple of train.group_size=4"):
        build_objective(cfg).validate()
    obj = build_objective(build_config({"objective": {"name": "tdm_r1", "num_train_timesteps": 3}}))
    with pytest.raises(ValueError, match="num_train_timesteps=3 distinct boundaries of a 2-step student"):
        obj.trajectories_per_sample(torch.tensor([1.0, 0.5, 0.0]), None)
    with pytest.raises(ValueError, match="is not a folder"):
        build_objective(build_config({"objective": {"name": "tdm_r1", "teacher": str(tmp_path / "no")}})).validate()


def test_the_digits_config_trains_on_the_strict_verdict_against_the_base_model():
    cfg = load_config(REPO / "configs" / "digits_tdm_r1.yaml")
    assert cfg.objective.name == "tdm_r1" and cfg.objective.teacher == "digits"
    assert [r.name for r in cfg.rewards] == ["digit_correctness_strict"]
    assert cfg.sampling.num_steps == 2 and cfg.objective.cfg_reward_scale == 0
    assert cfg.train.train_batch_size % cfg.train.group_size == 0


# ---------------------------------------------------------------------------------------------- the update loop
B, D, T = 8, 3, 4
ROLLOUT_G, REAL_G, SURR_G, CFG_C, TDM_W = 1.0, 4.0, 2.5, 3.5, 0.3
ADV = [1.2, -1.2, 0.5, -0.5, 2.0, -2.0, 0.3, -0.3]
SETTINGS = {"name": "tdm_r1", "real_guidance_scale": REAL_G, "surrogate_guidance_scale": SURR_G, "trunc_steps": 2,
            "num_train_timesteps": 2, "clip_range": 0.02, "reference_threshold": 1e-4, "beta_dpo": 10.0,
            "reference_beta": 0.1, "reward_time_floor": 0.3, "surrogate_time_floor": 0.2}


class Recording(DMD2Recording):
    """tests/algo/test_dmd2.py's recording SGD that also calls ``on_step`` as
    :class:`~flowgrpo.training.optim.SecondOptimizer` does."""

    def __init__(self, model, name, log) -> None:
        super().__init__(model, name, log)
        self.on_step = None

    def step(self, epoch):
        norm = super().step(epoch)
        if self.on_step is not None:
            self.on_step(self.steps - 1)
        return norm


def _f(p, x, sigma, e, g):
    """Lin's velocity in float64: w·x + b·σ + c·e + 0.05·g (linear in g: the unconditional prediction is g = 0)."""
    w, b, c = p
    return w * x + b * sigma.reshape(-1, 1) + c * e + 0.05 * g


def _values(module):
    return torch.tensor([float(p.detach()) for p in module.parameters()], dtype=torch.float64)


def _module(values, trained):
    m = Lin()
    with torch.no_grad():
        for p, v in zip(m.parameters(), values, strict=True):
            p.fill_(v)
    return m.requires_grad_(trained)


def _setup():
    cfg = build_config({"objective": SETTINGS, "sampling": {"num_steps": T, "guidance_scale": ROLLOUT_G},
                        "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8,
                                  "train_batch_size": 2, "optimizer_steps_per_epoch": 2, "seed": 5}})
    obj = build_objective(cfg)
    adapter, log = FakeAdapter(), []
    optim = Recording(adapter.transformer, "generator", log)
    obj.prepare(optim)
    obj.teacher = _module((0.9, -0.1, 0.5), False)
    obj.fake = obj.fake_forward = _module((0.85, -0.05, 0.45), True)  # already apart from the teacher
    obj.surrogate = obj.surrogate_forward = _module((0.95, -0.2, 0.55), True)
    obj.slow = obj.slow_forward = _module((0.93, -0.15, 0.52), False)
    obj.fake_optim, obj.surrogate_optim = Recording(obj.fake, "fake", log), Recording(obj.surrogate, "surrogate", log)
    obj.surrogate_optim.on_step = obj._follow
    samples = path_samples(torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0]), ROLLOUT_G)
    adv = Advantages(values=torch.tensor(ADV), train_mask=torch.ones(B, dtype=torch.bool), zero_spread_frac=0.0,
                     nan_frac=0.0, learning_frac=1.0)
    return obj, adapter, optim, samples, adv, recorded(obj, "draws")


def _ab(sn, tau):
    alpha = (1 - tau) / (1 - sn)
    return alpha, math.sqrt(tau ** 2 - (sn * alpha) ** 2)


def _gen_out(theta, s, d):
    """The generator's x0 and Euler step from x_j (the release's model_x0, model_xnext)."""
    x = s.latents[d.rows, d.step].double()
    e = s.embeds["e"][d.rows].double()
    sj, sn = float(s.sigmas[d.step]), float(s.sigmas[d.step + 1])
    v = _f(theta, x, torch.full((len(d.rows),), sj, dtype=torch.float64), e, ROLLOUT_G)
    return x - sj * v, x - (sj - sn) * v, e, sn


def _generator_loss(theta, phi, psi, teacher, s, d):
    """The release's generator loss of draw d (mean over its rows) with the generator's weights theta."""
    x0, xn, e, sn = _gen_out(theta, s, d)
    n, tau, tau_d = len(d.rows), d.tau, d.tau_reward
    a, b = _ab(sn, tau)
    xt = a * xn.detach() + b * d.noise.double()
    st = torch.full((n,), tau, dtype=torch.float64)
    fake_x0 = xt - tau * _f(phi, xt, st, e, 1.0)
    real_x0 = xt - tau * _f(teacher, xt, st, e, REAL_G)
    cond_x0, uncond_x0 = xt - tau * _f(teacher, xt, st, e, 1.0), xt - tau * _f(teacher, xt, st, e, 0.0)
    cfg_rev = (x0 + CFG_C * (cond_x0 - uncond_x0)).detach()
    kl_rev = (x0 + (cond_x0 - fake_x0)).detach()
    wf = (x0 - real_x0).abs().mean(dim=1, keepdim=True).detach()
    err_kl, err_cfg = (kl_rev - x0) ** 2, (cfg_rev - x0) ** 2
    if d.step < 2:
        ad, bd = _ab(sn, tau_d)
        xd = ad * xn.detach() + bd * d.reward_noise.double()
        sd = torch.full((n,), tau_d, dtype=torch.float64)
        dgpo_x0 = xd - tau_d * _f(psi, xd, sd, e, SURR_G)
        ref_x0 = xd - tau_d * _f(teacher, xd, sd, e, 1.0)
        rev = (x0 + dgpo_x0 - ref_x0).detach()
        wd = (x0 - dgpo_x0).abs().mean(dim=1, keepdim=True).detach()
        return TDM_W * (err_cfg / wf).mean() + (1 - TDM_W) * (((rev - x0) ** 2) / wd).mean() + (err_kl / wf).mean()
    return TDM_W * ((err_cfg + err_kl) / wf).mean()


def _fake_loss(theta, phi, teacher, s, d):
    x0, xn, e, sn = _gen_out(theta, s, d)
    a, b = _ab(sn, d.tau)
    xt = a * xn.detach() + b * d.noise.double()
    st = torch.full((len(d.rows),), d.tau, dtype=torch.float64)
    target = (xt - x0.detach()) / d.tau
    fake_v, real_v = _f(phi, xt, st, e, 1.0), _f(teacher, xt, st, e, 1.0)
    return ((target - fake_v) ** 2).mean() + 0.02 * ((real_v - fake_v) ** 2).mean()


def _surrogate_loss(psi, slow, teacher, s, d, stats):
    """The release's DGPO-style surrogate loss of draw d (its rows are whole groups of 2)."""
    xn = s.latents[d.rows, d.step + 1].double()
    e = s.embeds["e"][d.rows].double()
    sn, tau, n = float(s.sigmas[d.step + 1]), d.tau, len(d.rows)
    a, b = _ab(sn, tau)
    eps = d.noise.double()
    xt = xn * a + b * eps
    target = -xn / (1 - sn) + eps / b * (tau + sn ** 2 * a / (1 - sn))
    st = torch.full((n,), tau, dtype=torch.float64)
    real_v, old_v, v = _f(teacher, xt, st, e, 1.0), _f(slow, xt, st, e, 1.0), _f(psi, xt, st, e, 1.0)
    adv = torch.tensor(ADV, dtype=torch.float64)[d.rows]
    dsm = ((target - v) ** 2).mean(dim=1)
    old = ((target - old_v) ** 2).mean(dim=1)
    ratio = torch.exp(-dsm + old)
    clip = torch.where(adv > 0, ratio > 1 + 0.02, ratio < 1 - 0.02)
    dsm = torch.where(clip, dsm.detach(), dsm)
    reg = ((v - real_v) ** 2).mean(dim=1).mean()
    ref = ((target - real_v) ** 2).mean(dim=1)
    ref_ratio = torch.exp(-dsm + ref)
    clip_ref = (reg > 1e-4) & torch.where(adv > 0, ref_ratio > 1.0, ref_ratio < 1.0)
    dsm = torch.where(clip_ref, dsm.detach(), dsm)
    term = adv * 10.0 * (dsm.detach() - ref) / 2
    groups = s.group_ids[d.rows]
    sums = torch.stack([term[groups == g].sum() for g in groups])
    stats.append((float(clip.double().mean()), float(clip_ref.double().mean())))
    return (d.step + 1) / T * ((torch.sigmoid(sums) * adv * dsm).mean() + 0.1 * reg)


def test_each_step_follows_the_release_in_order_and_the_slow_surrogate_trails_the_surrogate():
    """2 iterations of two micro-batches (whole groups of 2), 2 boundaries each: per iteration the generator's step
    (at the fake score and surrogate the iteration began with), the fake score's (on the generator's outputs from
    before its step), the surrogate's; then slow <- d*slow + (1 - d)*surrogate, d = 0.001 + 0.001 k."""
    obj, adapter, optim, s, adv, draws = _setup()
    work = obj.plan(s, adv, torch.ones(B, dtype=torch.bool), epoch=0)
    assert work.step_rows == [8.0, 8.0]  # 4 rows x 2 boundaries a step
    theta, phi, psi = _values(adapter.transformer), _values(obj.fake), _values(obj.surrogate)
    slow, teacher = _values(obj.slow), _values(obj.teacher)
    metrics = run_update(obj, adapter, optim, work, inner_epochs=1, progress=False)
    assert optim.log == ["generator", "fake", "surrogate"] * 2
    grads = {"generator": iter(optim.grads), "fake": iter(obj.fake_optim.grads),
             "surrogate": iter(obj.surrogate_optim.grads)}
    by_kind = {k: [d for d in draws if d.kind == k] for k in grads}
    stats: list = []
    for i in range(2):
        start = theta.clone()
        for kind in ("generator", "fake", "surrogate"):
            ds = [by_kind[kind].pop(0) for _ in range(4)]  # 2 micro-batches x 2 boundaries
            assert sorted({int(r) for d in ds for r in d.rows}) == list(range(4 * i, 4 * i + 4))
            if kind == "generator":
                p = theta.clone().requires_grad_(True)
                loss = sum(_generator_loss(p, phi, psi, teacher, s, d) for d in ds) / 4
            elif kind == "fake":
                p = phi.clone().requires_grad_(True)
                loss = sum(_fake_loss(start, p, teacher, s, d) for d in ds) / 4
            else:
                p = psi.clone().requires_grad_(True)
                loss = sum(_surrogate_loss(p, slow, teacher, s, d, stats) for d in ds) / 4
            (want,) = torch.autograd.grad(loss, p)
            got = torch.tensor(next(grads[kind]), dtype=torch.float64)
            assert got.tolist() == pytest.approx(want.tolist(), rel=1e-4, abs=1e-7), (i, kind, got, want)
            assert got.abs().max() > 1e-4  # the step moved its weights: the comparison has power
            if kind == "generator":
                theta = theta - LR * got
            elif kind == "fake":
                phi = phi - LR * got
            else:
                psi = psi - LR * got
                decay = 0.001 + 0.001 * i
                slow = decay * slow + (1 - decay) * psi
    assert _values(adapter.transformer).tolist() == pytest.approx(theta.tolist(), rel=1e-6)
    assert _values(obj.fake).tolist() == pytest.approx(phi.tolist(), rel=1e-6)
    assert _values(obj.surrogate).tolist() == pytest.approx(psi.tolist(), rel=1e-6)
    assert _values(obj.slow).tolist() == pytest.approx(slow.tolist(), rel=1e-6)
    # both clips and no clip occur among the rows: the masks are tested, not constant
    assert 0 < sum(c for c, _ in stats) < len(stats) and 0 < sum(c for _, c in stats) < len(stats)
    steps = {d.step for d in draws if d.kind == "generator"}
    assert min(steps) < 2 <= max(steps)  # boundaries with and without the surrogate's reward (trunc_steps 2)
    assert metrics["objective/rows"] == 16 and metrics["objective/surrogate_rows"] == 16
    assert metrics["objective/slow_decay"] == pytest.approx(0.002)


def test_the_surrogates_boundary_is_drawn_in_proportion_to_its_index_plus_one():
    """The release's ``probs = (arange(N) + 1) / sum``: over 2000 draws of a 4-step path, boundary j' is drawn with
    frequency (j' + 1)/10 (the standard error of each frequency is below 0.011); the generator's boundaries are M
    distinct ones, drawn uniformly."""
    import dataclasses

    obj, _, _, s, adv, _ = _setup()
    work = obj.plan(s, adv, torch.ones(B, dtype=torch.bool), epoch=0)
    rows = work.steps[0][0]
    counts, pairs = torch.zeros(T), []
    for epoch in range(1000):
        w = dataclasses.replace(work, epoch=epoch)
        for d in obj.draws(w, rows, 0, "surrogate"):
            counts[d.step] += 1
        pairs.append(tuple(d.step for d in obj.draws(w, rows, 0, "generator")))
    assert (counts / counts.sum()).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.035)
    assert all(a != b for a, b in pairs)
    firsts = torch.bincount(torch.tensor([a for a, _ in pairs]), minlength=T).double() / len(pairs)
    assert firsts.tolist() == pytest.approx([0.25] * T, abs=0.045)


# ---------------------------------------------------------------------------------------------- end to end
TINY = {"name": "tdm_r1", "real_guidance_scale": 3.0, "surrogate_guidance_scale": 2.0, "trunc_steps": 2,
        "num_train_timesteps": 2, "reward_time_floor": 0.3, "surrogate_time_floor": 0.3}


@pytest.fixture(scope="module")
def tiny_sd3_dir(tmp_path_factory):
    """tests/training/conftest.py's tiny SD3.5 pipeline (its tokenizers know the test prompts' words)."""
    from flowgrpo.models.sd3 import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"), seed=0, words="a red cube blue ball".split())


def _run_config(tmp_path, model_dir, teacher, out: str = "run", **sections) -> dict:
    """tests/training/objective_runs.py's one-epoch tiny run (4 samples, 2 iterations of one micro-batch of one
    group, 3 steps, 2 boundaries each) of TDM-R1 against ``teacher`` (the strict verdict is all alike on the tiny
    models' images: the classifier's probability gives the surrogate a signal)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red cube", "digit": 3}\n{"prompt": "a blue ball", "digit": 7}\n')
    return tiny_run(tmp_path / out, model_dir, {**TINY, "teacher": str(teacher)}, prompts,
                    {"rewards": [{"name": "digit_correctness"}], "train": {"train_batch_size": 2}}, sections)


def _check_epoch(rec: dict) -> None:
    """Two iterations of 2 rows x 2 boundaries: each role's steps and gradients."""
    assert rec["objective/rows"] == rec["objective/fake_rows"] == rec["objective/surrogate_rows"] == 8
    assert rec["policy/grad_norm"] > 0 and rec["objective/fake_grad_norm"] > 0
    assert rec["objective/surrogate_grad_norm"] > 0 and rec["objective/cfg_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_an_epoch_trains_through_the_command(tmp_path, tiny_flux_dir, tiny_sd3_dir, model):
    """``python -m flowgrpo.cli train CONFIG`` on the tiny FLUX and SD3.5 pipelines (LoRA) against a teacher made
    from the pipeline: the generator, the fake score and the surrogate each step twice, the slow surrogate trails
    the surrogate; the three LoRA adapters and the two optimizers' states are the objective's checkpoint state."""
    model_dir = tiny_flux_dir if model == "flux" else tiny_sd3_dir
    teacher = _teacher(tmp_path, model_dir)
    path = tmp_path / "tdm_r1.yaml"
    path.write_text(yaml.safe_dump(_run_config(tmp_path, model_dir, teacher)))
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "train", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    _check_epoch(rec)
    assert rec["objective/fake_steps"] == rec["objective/surrogate_steps"] == 2
    assert rec["objective/slow_decay"] == pytest.approx(0.002)
    ckpt = tmp_path / "run" / "checkpoints" / "epoch_0"
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in load_file(ckpt / "trainable.safetensors").items())
    state = load_file(ckpt / "objective.safetensors")
    for name in ("fake", "surrogate", "slow"):  # LoRA adapters on the teacher: only their own weights are state
        mine = {k: v for k, v in state.items() if k.startswith(f"{name}.")}
        assert mine and all("lora_" in k for k in mine), name
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in mine.items()), name  # trained from B = 0
    assert float(state["fake_optim.steps"]) == float(state["surrogate_optim.steps"]) == 2


@pytest.mark.slow
def test_an_epoch_of_the_digits_config_through_the_command(tmp_path):
    """``configs/digits_tdm_r1.yaml`` (the digits model, its strict verdict, the base model as the teacher) for one
    small epoch through the command line."""
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "train", str(REPO / "configs" / "digits_tdm_r1.yaml"),
                           f"output_dir={tmp_path / 'run'}", "train.num_epochs=1", "train.prompts_per_epoch=2",
                           "train.rollout_batch_size=16", "data.eval_num_prompts=10", "logging.progress=false"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["objective/surrogate_rows"] == 32 and rec["objective/fake_steps"] == 1
    assert "reward/digit_correctness_strict/mean" in rec


@pytest.mark.slow
def test_save_kill_resume_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir):
    """The fake score, the surrogate, the slow surrogate and the two optimizers' states are in the checkpoint: the
    resumed run's epoch 1 equals the uninterrupted one's to the bit."""
    teacher = _teacher(tmp_path, tiny_flux_dir)
    assert_resume_equals_whole(
        tmp_path, lambda out, **s: build_config(_run_config(tmp_path, tiny_flux_dir, teacher, out, **s)),
        files=("trainable.safetensors", "objective.safetensors"),
        figures=("objective/loss", "objective/fake_loss", "objective/surrogate_loss"))


@pytest.mark.slow
def test_a_two_process_epoch_equals_one_process(tmp_path, tiny_flux_dir):
    """4 prompts x G = 2, micro-batches of one group, one iteration: two processes (each half of the micro-batches,
    the surrogate's group sums all-reduced, the second optimizers' gradients averaged) train the generator, the
    fake score and the surrogate as one process does."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}", "digit": {d}}}\n' for p, d in
                               (("a red cube", 1), ("a blue ball", 4), ("a green tree", 7), ("a red ball", 9))))
    o = {**TINY, "teacher": str(_teacher(tmp_path, tiny_flux_dir))}

    def config(name):
        return sharding_base(tmp_path, tiny_flux_dir, name, objective=o, algo={"clip_range": 1e-4},
                             train={"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 2},
                             rewards=[{"name": "digit_correctness"}], data={"train_prompts": str(prompts)})

    _in_process(config("one"))
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], [config("two")]))
    assert_two_processes_equal_one(tmp_path / "one", tmp_path / "two",
                                   rollout_keys=("reward_total", "group_ids", "initial_latents"),
                                   parts=("trainable", "objective"), rows=16,
                                   figures=("objective/loss", "objective/fake_loss", "objective/surrogate_loss"))


def test_under_lora_the_three_copies_are_adapters_on_the_teachers_own_weights(tiny_flux_dir):
    """``model.finetune: lora``: the fake score, the surrogate and the slow surrogate share every weight of the
    teacher (the same tensors: no memory) and add their own LoRA (B = 0: each starts as the teacher); only the LoRA
    weights of the fake score and the surrogate are trained; the slow surrogate starts as the surrogate."""
    from types import SimpleNamespace

    from flowgrpo.models import load_model_from_config
    from flowgrpo.training.optim import SecondOptimizer

    cfg = build_config({"model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32,
                                  "width": 32, "finetune": "lora"}, "objective": TINY})
    obj = build_objective(cfg)
    adapter = load_model_from_config(cfg.model, progress=False)
    obj.prepare(SimpleNamespace(second_optimizer=lambda params, lr, betas=None: SecondOptimizer(
        params, cfg.train, lr=lr, checkpoints=None, betas=betas)))
    obj.attach(adapter, None)
    base = {id(p) for p in obj.teacher.parameters()}
    for name, trained in (("fake", True), ("surrogate", True), ("slow", False)):
        module = getattr(obj, name)
        named = dict(module.named_parameters())
        lora = {k: p for k, p in named.items() if "lora_" in k}
        assert lora and all(id(p) in base for k, p in named.items() if "lora_" not in k), name
        assert all(p.requires_grad == trained for p in lora.values()), name
        assert not any(p.requires_grad for k, p in named.items() if "lora_" not in k), name
    assert obj.fake_optim.params == [p for p in obj.fake.parameters() if p.requires_grad]
    slow, surrogate = dict(obj.slow.named_parameters()), dict(obj.surrogate.named_parameters())
    assert all(torch.equal(slow[k], surrogate[k]) for k in slow if "lora_" in k)
    assert obj.surrogate_optim.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert not any(p.requires_grad for p in obj.teacher.parameters())


def test_a_teacher_whose_velocity_ignores_guidance_is_refused_with_the_guidance_reward():
    """The guidance reward c·(cond − uncond) on a model sampled without guidance (the digits model: its velocity is
    the same at every guidance scale) would be 0 at the cost of the guided forwards: refused in one line naming the
    fix at the first forward (trial 8: ``objective=tdm_r1`` on digits took the SD3.5 preset's 3.5 / 4.5 silently)."""

    class Unguided(Lin):
        def forward(self, x, sigma, e, g):
            return super().forward(x, sigma, e, 1.0)

    obj, adapter, *_ = _setup()
    x, tau, embeds = torch.randn(2, D), torch.full((2,), 0.5), PromptEmbeds({"e": torch.randn(2, D)})
    cond, guided, uncond = obj._real(adapter, x, tau, embeds)  # Lin: guidance moves the velocity
    assert not torch.equal(guided, cond) and torch.allclose(uncond, cond - 0.05, atol=1e-6)
    obj.teacher, obj.guidance_checked = Unguided().requires_grad_(False), False
    with pytest.raises(ValueError, match=r"cfg_reward_scale=3.5: the teacher's velocity does not change with "
                                         r"guidance .*set objective.cfg_reward_scale=0"):
        obj._real(adapter, x, tau, embeds)
