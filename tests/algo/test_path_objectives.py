"""Specification of the path objectives: ReFL / DRaFT (``refl``, flowgrpo/algo/objectives/reward_backprop.py) and
on-policy distillation (``opd``, flowgrpo/algo/objectives/opd.py).

Each runs its real plan, draws and update on a model whose velocity is linear in three scalar weights,
v = w·x + b·σ + c·e + 0.05·g, through a stand-in optimizer that records each step's gradient and steps plain SGD.
The expected gradient of every optimizer step is derived here in float64 from the papers' formulas written out
below (autograd differentiates the hand-written formula, never the objective's code):

* DRaFT-K: K Euler steps x ← x + (σ_{i+1} − σ_i)·v from the rollout's x_{T−K}, the decode, loss −s·R;
* DRaFT-LV: x = (1 − σ_{T−1})·x₀ + σ_{T−1}·ε, x̂₀ = x − σ_{T−1}·v, loss −s·R for each of n copies;
* ReFL: x̂₀ = x_j − σ_j·v at the step drawn, loss s·max(0, m − R);
* OPD: ½·mean_dims((μ^S − μ^T)²) (ODE) or mean_dims((μ^S − μ^T)²)/(2·(a·√(σ/(1 − σ)))²) (flow_sde), μ the
  transition means of the student's and a fixed teacher's velocities at the student's states.

The decode is sigmoid(x) as a (n, 3, 1, 1) image behind ``torch.no_grad`` (as the adapters'), the reward a linear
function of the pixels with ``differentiable = True``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from flowgrpo.algo.objectives import build_objective
from flowgrpo.algo.objectives.opd import opd_step_loss, opd_train_steps, teacher_source
from flowgrpo.algo.objectives.paths import PathSamples
from flowgrpo.algo.objectives.reward_backprop import (
    check_differentiable_rewards,
    draft_loss,
    euler_replay,
    refl_loss,
    refl_step,
)
from flowgrpo.config import build_config
from flowgrpo.records import Advantages, PromptEmbeds
from flowgrpo.rng import make_generator
from flowgrpo.training.update import run_update
from tests.training.test_forward_update import FakeOptim

LR = 0.05
G = 3.0
B, D, T = 8, 3, 4
PIX = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)  # the reward's weights of the three pixels
SIGMAS = torch.tensor([1.0, 0.7, 0.45, 0.2, 0.0])


class Lin(torch.nn.Module):
    def __init__(self, w=0.7, b=-0.3, c=0.2) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))
        self.b = torch.nn.Parameter(torch.tensor(b))
        self.c = torch.nn.Parameter(torch.tensor(c))

    def forward(self, x, sigma, e, g):
        return self.w * x + self.b * sigma.reshape(-1, 1) + self.c * e + 0.05 * g


class FakeAdapter:
    """What the update uses of an adapter: velocity, decode (behind ``torch.no_grad``), attention, device."""

    def __init__(self) -> None:
        self.transformer = Lin()
        self.forward_module = self.transformer
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.guidances: list[float] = []

    def velocity(self, x, sigma, embeds, guidance):
        self.guidances.append(guidance)
        return self.forward_module(x.float(), sigma, embeds["e"], guidance)

    @torch.no_grad()
    def decode(self, latents):
        return torch.sigmoid(latents.float()).reshape(-1, 3, 1, 1)

    def attention(self):
        return contextlib.nullcontext()


class LinearReward:
    name = "linear"
    differentiable = True

    def score_differentiable(self, images, prompts, metadata):
        return (images.reshape(-1, 3).double() * PIX).sum(-1).float()


class Composed:
    def __init__(self, weight: float = 1.0) -> None:
        self.rewards = {"linear": LinearReward()}
        self.weights = {"linear": weight}


def _f(theta, x, sigma, e, g=G):
    w, b, c = theta
    return w * x + b * sigma.reshape(-1, 1) + c * e + 0.05 * g


def _samples(gen) -> PathSamples:
    lat = torch.randn(B, T + 1, D, generator=gen)
    return PathSamples(x0=lat[:, -1], initial_noise=lat[:, 0], sigmas=SIGMAS.clone(),
                       group_ids=torch.tensor([10, 10, 11, 11, 12, 12, 13, 13]), sample_index=torch.tensor([0, 1] * 4),
                       embeds=PromptEmbeds({"e": torch.randn(B, D, generator=gen)}),
                       images=torch.zeros(B, 3, 1, 1), prompts=["p"] * B, metadata=[{}] * B, guidance_scale=G,
                       latents=lat)


def _run(objective: dict, teacher: Lin | None = None):
    cfg = build_config({"objective": objective, "sampling": {"num_steps": T, "guidance_scale": G},
                        "algo": {"clip_range": 1e-4, "kl_beta": 0.0},
                        "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8,
                                  "train_batch_size": 2, "optimizer_steps_per_epoch": 2, "seed": 5}})
    obj = build_objective(cfg)
    adapter = FakeAdapter()
    optim = FakeOptim(adapter.transformer)
    obj.prepare(optim)
    if teacher is None:
        obj.attach(adapter, Composed())
    else:
        obj.teacher = teacher
    gen = torch.Generator().manual_seed(0)
    samples = _samples(gen)
    adv = Advantages(values=torch.zeros(B), train_mask=torch.zeros(B, dtype=torch.bool), zero_spread_frac=1.0,
                     nan_frac=0.0, learning_frac=0.0)  # zero advantages: the reward objectives train anyway
    work = obj.plan(samples, adv, torch.ones(B, dtype=torch.bool), epoch=3)
    draws = []
    real = obj.draws

    def recording(w, rows, inner):
        out = real(w, rows, inner)
        draws.append((optim.steps, rows.clone(), out))
        return out

    obj.draws = recording
    metrics = run_update(obj, adapter, optim, work, inner_epochs=obj.cfg.train.inner_epochs, progress=False)
    return obj, adapter, optim, samples, work, draws, metrics


def _reward(x0_hat):
    return (torch.sigmoid(x0_hat) * PIX).sum(-1)


def _expected_refl(variant, optim, samples, draws, *, k=1, scale=1.0, margin=2.0):
    """Each optimizer step's float64 gradient of the mean of the papers' losses over the step's rows."""
    out = []
    for step in range(len(optim.grads)):
        theta = torch.tensor(optim.before[step], dtype=torch.float64, requires_grad=True)
        losses = []
        for _, rows, ds in [d for d in draws if d[0] == step]:
            e = samples.embeds["e"][rows].double()
            for d in ds:
                s = SIGMAS.double()
                if variant == "draft_k":
                    x = samples.latents[rows, T - k].double()
                    for i in range(T - k, T):
                        x = x + (s[i + 1] - s[i]) * _f(theta, x, s[i].expand(len(rows)), e)
                    losses.append(-scale * _reward(x))
                elif variant == "draft_lv":
                    sig = s[T - 1]
                    x = (1 - sig) * samples.x0[rows].double() + sig * d.noise.double()
                    x_hat = x - sig * _f(theta, x, sig.expand(len(rows)), e)
                    losses.append(-scale * _reward(x_hat))
                else:
                    sig = s[d.step]
                    x = samples.latents[rows, d.step].double()
                    x_hat = x - sig * _f(theta, x, sig.expand(len(rows)), e)
                    losses.append(scale * torch.relu(margin - _reward(x_hat)))
        loss = torch.cat(losses).mean()
        (grad,) = torch.autograd.grad(loss, theta)
        out.append(grad)
    return out


def _check(optim, expected):
    assert len(optim.grads) == len(expected) == 2
    for got, want in zip(optim.grads, expected, strict=True):
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=1e-8), (got, want)
        assert float(want.abs().max()) > 1e-4  # the gradient is not trivially 0: the test has power


@pytest.mark.parametrize("k", [1, 3])
def test_draft_k_gradient_is_the_reward_gradient_through_the_last_k_steps(k):
    obj, adapter, optim, samples, work, draws, metrics = _run({"name": "refl", "variant": "draft_k", "k": k,
                                                                "reward_scale": 0.5})
    _check(optim, _expected_refl("draft_k", optim, samples, draws, k=k, scale=0.5))
    assert all(d.step == T - k for _, _, ds in draws for d in ds)
    assert set(adapter.guidances) == {G}  # the rollout's guidance: the replay is the same sampler
    assert metrics["objective/rows"] == B and metrics["objective/loss"] == pytest.approx(
        -0.5 * metrics["objective/reward"])


def test_draft_k_replay_without_update_reproduces_the_rollout():
    """Euler steps from the rollout's x_{T−K} with the weights that rolled out give the rollout's x_T."""
    gen = torch.Generator().manual_seed(1)
    lin, e = Lin(), torch.randn(B, D, generator=gen)
    path = [torch.randn(B, D, generator=gen)]
    for i in range(T):
        path.append(path[-1] + (SIGMAS[i + 1] - SIGMAS[i]) * lin(path[-1], SIGMAS[i].expand(B), e, G))
    with torch.no_grad():
        got = euler_replay(lambda z, s: lin(z, torch.full((B,), s), e, G), path[T - 2], SIGMAS, T - 2,
                           checkpointing=True)
    assert torch.allclose(got, path[T], atol=1e-6)


def test_draft_lv_gradient_averages_the_renoised_copies():
    obj, adapter, optim, samples, work, draws, metrics = _run({"name": "refl", "variant": "draft_lv",
                                                                "lv_samples": 3})
    _check(optim, _expected_refl("draft_lv", optim, samples, draws))
    first = draws[0]
    assert len(first[2]) == 3 and all(d.step == T - 1 for d in first[2])
    # each sample's copies are drawn from a generator of (seed, epoch, pass, "draft_lv", its group, its index)
    r = int(first[1][0])
    g = make_generator(5, 3, 0, "draft_lv", int(samples.group_ids[r]), int(samples.sample_index[r]))
    eps = torch.randn((3, D), generator=g)
    assert all(torch.equal(first[2][c].noise[0], eps[c]) for c in range(3))
    assert metrics["objective/rows"] == 3 * B


def test_refl_gradient_is_the_hinge_at_a_late_step():
    obj, adapter, optim, samples, work, draws, metrics = _run({"name": "refl", "variant": "refl",
                                                                "refl_last_steps": 2, "reward_scale": 0.5,
                                                                "refl_margin": 0.0})
    _check(optim, _expected_refl("refl", optim, samples, draws, scale=0.5, margin=0.0))
    # margin 0: the hinge is off for the rows scoring above 0, on for the others (both kinds occur)
    r = metrics["objective/reward"]
    assert -1.5 < r < 1.0
    steps = [d.step for _, _, ds in draws for d in ds]
    assert all(T - 2 <= j <= T - 1 for j in steps)
    # per global micro-batch: make_generator(seed, epoch, pass, "refl", micro-batch index)
    want = [T - 2 + int(torch.randint(2, (1,), generator=make_generator(5, 3, 0, "refl", i))) for i in range(4)]
    assert steps == want


def test_refl_step_window_is_the_releases_randint():
    """THUDM/ImageReward ``ImageReward/ReFL.py`` lines 714, 717: ``random.randint(30, 39)`` of 40 steps: every step
    of [30, 39], none outside."""
    g = torch.Generator().manual_seed(0)
    seen = {refl_step(40, 10, g) for _ in range(400)}
    assert seen == set(range(30, 40))
    with pytest.raises(ValueError, match="refl_last_steps"):
        refl_step(4, 5, g)


def test_loss_functions_by_hand():
    r = torch.tensor([0.5, 2.5, -1.0])
    assert torch.equal(draft_loss(r, 2.0), torch.tensor([-1.0, -5.0, 2.0]))
    assert torch.allclose(refl_loss(r, 1e-3, 2.0), torch.tensor([1.5e-3, 0.0, 3e-3]))


def _expected_opd(optim, samples, draws, teacher: Lin, *, a=0.0):
    out = []
    th_t = torch.tensor([float(teacher.w), float(teacher.b), float(teacher.c)], dtype=torch.float64)
    for step in range(len(optim.grads)):
        theta = torch.tensor(optim.before[step], dtype=torch.float64, requires_grad=True)
        losses = []
        for _, rows, ds in [d for d in draws if d[0] == step]:
            e = samples.embeds["e"][rows].double()
            for d in ds:
                j, s = d.step, SIGMAS.double()
                x = samples.latents[rows, j].double()
                sig, dt = s[j], s[j + 1] - s[j]
                vs, vt = _f(theta, x, sig.expand(len(rows)), e), _f(th_t, x, sig.expand(len(rows)), e)
                if a == 0:
                    losses.append(0.5 * ((dt * (vs - vt)) ** 2).mean(-1))
                else:
                    # Flow-GRPO's mean: x(1 + std²dt/(2σ)) + v(1 + std²(1−σ)/(2σ))dt, std = a√(σ/(1−σ)), σ=1 → σ₁
                    den = 1 - (s[1] if float(sig) == 1.0 else sig)
                    std = a * torch.sqrt(sig / den)
                    coef = (1 + std**2 * (1 - sig) / (2 * sig)) * dt
                    losses.append(((coef * (vs - vt)) ** 2).mean(-1) / (2 * std**2))
        loss = torch.cat(losses).mean()
        (grad,) = torch.autograd.grad(loss, theta)
        out.append(grad)
    return out


@pytest.mark.parametrize("a", [0.0, 0.7])
def test_opd_gradient_is_the_transition_kl_to_the_teacher(a):
    teacher = Lin(0.4, 0.1, -0.5).requires_grad_(False)
    obj, adapter, optim, samples, work, draws, metrics = _run({"name": "opd", "noise_level": a,
                                                                "timestep_fraction": 0.75}, teacher=teacher)
    _check(optim, _expected_opd(optim, samples, draws, teacher, a=a))
    assert [d.step for d in draws[0][2]] == [0, 1, 2]  # int(4 * 0.75) = 3: the first three steps
    assert metrics["objective/rows"] == 3 * B
    assert not any(p.grad is not None for p in teacher.parameters())  # the teacher stays frozen


def test_opd_step_loss_by_hand():
    ms, mt = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])
    assert float(opd_step_loss(ms, mt, None, 0.5, 0.25, noise_level=0.0)) == pytest.approx(0.5 * (1 + 4) / 2)
    # flow_sde: d = std/√(σ − σ_next) = a√(σ/(1−σ)); std of a = 0.7 at σ = 0.5 → d = 0.7, std = 0.7·√0.25
    std = torch.tensor([0.7 * 0.5])
    got = float(opd_step_loss(ms, mt, std, torch.tensor([0.5]), torch.tensor([0.25]), noise_level=0.7))
    assert got == pytest.approx(((1 + 4) / 2) / (2 * 0.49), rel=1e-6)
    assert opd_train_steps(10, 0.99) == 9 and opd_train_steps(4, 1.0) == 4
    with pytest.raises(ValueError, match="trains no step"):
        opd_train_steps(1, 0.5)


def test_teacher_folder_layouts(tmp_path):
    with pytest.raises(ValueError, match="objective.teacher='.*nothing' is not a folder"):
        teacher_source(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no transformer"):
        teacher_source(str(tmp_path / "empty"))
    (tmp_path / "run" / "transformer").mkdir(parents=True)
    (tmp_path / "run" / "transformer" / "config.json").write_text("{}")
    assert teacher_source(str(tmp_path / "run")) == ("transformer", tmp_path / "run" / "transformer")
    (tmp_path / "lrun" / "lora").mkdir(parents=True)
    (tmp_path / "lrun" / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    assert teacher_source(str(tmp_path / "lrun")) == ("lora", tmp_path / "lrun" / "lora")


@pytest.mark.parametrize("reward", ["jpeg_compressibility", "ocr", "geneval", "digit_correctness_strict"])
def test_a_non_differentiable_reward_is_refused_by_name(reward):
    with pytest.raises(ValueError, match=f"reward '{reward}' declares no differentiable score"):
        build_config({"objective": {"name": "refl"}, "algo": {"clip_range": 1e-4, "kl_beta": 0.0},
                      "rewards": [{"name": reward}]})


def test_differentiable_and_zero_weight_rewards_pass():
    from flowgrpo.config.schema import RewardSpec

    check_differentiable_rewards([RewardSpec(name=n) for n in ("digit_correctness", "hpsv2", "pickscore",
                                                                 "clip_score", "aesthetic")])
    check_differentiable_rewards([RewardSpec(name="jpeg_compressibility", weight=0.0)])  # a metric: no gradient


def test_a_strict_instance_is_refused_when_attached():
    from flowgrpo_rewards.digits import DigitCorrectness

    cfg = build_config({"objective": {"name": "refl"}, "algo": {"clip_range": 1e-4, "kl_beta": 0.0}})
    obj = build_objective(cfg)
    composed = Composed()
    composed.rewards = {"digit_correctness": DigitCorrectness(strict=True)}
    composed.weights = {"digit_correctness": 1.0}
    with pytest.raises(ValueError, match="reward 'digit_correctness' as configured has no differentiable score"):
        obj.attach(FakeAdapter(), composed)


def test_settings_out_of_range_are_refused():
    for bad in ({"variant": "draft"}, {"k": 0}, {"reward_scale": 0.0}):
        with pytest.raises(ValueError):
            build_config({"objective": {"name": "refl", **bad}, "algo": {"clip_range": 1e-4, "kl_beta": 0.0}})
    with pytest.raises(ValueError, match="objective.k=5 exceeds sampling.num_steps=4"):  # before any model loads
        build_config({"objective": {"name": "refl", "variant": "draft_k", "k": 5}, "sampling": {"num_steps": 4},
                      "algo": {"clip_range": 1e-4, "kl_beta": 0.0}})
    cfg = build_config({"objective": {"name": "refl", "variant": "draft_k", "k": 5}, "sampling": {"num_steps": 5},
                        "algo": {"clip_range": 1e-4, "kl_beta": 0.0}})
    with pytest.raises(ValueError, match="objective.k=5 exceeds sampling.num_steps=4"):  # and on the model's grid
        build_objective(cfg).trajectories_per_sample(SIGMAS, None)
    with pytest.raises(ValueError, match="objective.name=opd needs objective.teacher"):
        build_objective(build_config({"objective": {"name": "opd"}, "algo": {"clip_range": 1e-4,
                                                                              "kl_beta": 0.0}})).validate()


def test_the_teacher_is_a_frozen_copy_of_the_weights_it_was_given():
    """OPD's teacher velocity is the teacher module's, through the adapter's forward; the student's is unchanged."""
    from flowgrpo.algo.objectives.opd import OPD

    cfg = build_config({"objective": {"name": "opd"}, "algo": {"clip_range": 1e-4, "kl_beta": 0.0}})
    obj: OPD = build_objective(cfg)
    adapter = FakeAdapter()
    obj.teacher = copy.deepcopy(adapter.transformer).requires_grad_(False)
    with torch.no_grad():
        obj.teacher.w += 1.0
    x, s, e = torch.ones(2, D), torch.tensor([0.5, 0.5]), {"e": torch.zeros(2, D)}
    vt = obj.teacher_velocity(adapter, x, s, e, 1.0)
    assert torch.allclose(vt, 1.7 * x + -0.3 * 0.5 + 0.05)
    assert adapter.forward_module is adapter.transformer and not vt.requires_grad


def _tiny_flux_teacher(folder):
    from diffusers import FluxTransformer2DModel

    FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                           num_attention_heads=1, joint_attention_dim=8, pooled_projection_dim=8,
                           axes_dims_rope=(2, 2, 4)).save_pretrained(folder)


def test_a_teacher_of_another_family_is_refused_naming_both_families(tmp_path):
    """A FLUX teacher for an SD3 student once reached diffusers' "Cannot load ... pass ignore_mismatched_sizes=True"
    (issue 54, the wrong fix): the teacher's class is compared with the student's before its weights are read."""
    from types import SimpleNamespace

    from diffusers import SD3Transformer2DModel

    from flowgrpo.algo.objectives.opd import load_teacher

    _tiny_flux_teacher(tmp_path / "teacher" / "transformer")
    student = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                    num_attention_heads=1, joint_attention_dim=8, caption_projection_dim=8,
                                    pooled_projection_dim=8, out_channels=4)
    adapter = SimpleNamespace(transformer=student, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="teacher family FluxTransformer2DModel vs student family "
                                         "SD3Transformer2DModel"):
        load_teacher(str(tmp_path / "teacher"), adapter, None)


def test_the_teacher_family_is_checked_before_any_model_loads_when_the_student_folder_names_it(tmp_path):
    """The student's transformer class is read from its folder's model_index.json, so ``validate`` (before any
    model loads) refuses the FLUX teacher of an SD3 pipeline folder; a teacher of the same class passes."""
    import json

    _tiny_flux_teacher(tmp_path / "teacher")
    (tmp_path / "sd3").mkdir()
    (tmp_path / "sd3" / "model_index.json").write_text(json.dumps(
        {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"]}))
    cfg = build_config({"model": {"pretrained": str(tmp_path / "sd3")}, "algo": {"clip_range": 1e-4, "kl_beta": 0.0},
                        "objective": {"name": "opd", "teacher": str(tmp_path / "teacher")}})
    with pytest.raises(ValueError, match="teacher family FluxTransformer2DModel vs student family "
                                         "SD3Transformer2DModel"):
        build_objective(cfg).validate()
    index = json.loads((tmp_path / "sd3" / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    (tmp_path / "sd3" / "model_index.json").write_text(json.dumps(index))
    build_objective(cfg).validate()


@pytest.mark.parametrize("name", ["opd", "dmd2", "tdm_r1"])
def test_a_lora_teacher_of_another_base_model_is_refused_before_any_model_loads(tmp_path, name):
    """A LoRA teacher inside a run folder whose config.yaml names another ``model.pretrained`` than the student's is
    refused by ``validate`` (fresh-user trial 8: a digits LoRA as the teacher of the tiny FLUX loaded the base model,
    then diffusers' size mismatch surfaced as a traceback); one of the student's base passes."""
    import yaml
    from safetensors.torch import save_file

    run = tmp_path / "teacher_run"
    (run / "lora").mkdir(parents=True)
    save_file({"transformer.x_embedder.lora_A.weight": torch.zeros(4, 64)},  # a readable file; its fit is not
              run / "lora" / "pytorch_lora_weights.safetensors")  # read before the load
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"pretrained": "digits"}}))
    objective = {"name": name, "teacher": str(run / "lora")}
    extra = {"algo": {"clip_range": 1e-4, "kl_beta": 0.0}} if name == "opd" else {}
    cfg = build_config({"model": {"pretrained": "tiny"}, "objective": objective, **extra})
    with pytest.raises(ValueError, match=r"is a LoRA of model.pretrained='digits' \(its run's config.yaml\), the "
                                         r"student is 'tiny'"):
        build_objective(cfg).validate()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"pretrained": "tiny"}}))
    build_objective(cfg).validate()
