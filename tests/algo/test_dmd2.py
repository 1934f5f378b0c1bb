"""Specification of DMD2 (``objective.name=dmd2``, flowgrpo/algo/objectives/dmd2.py; arXiv 2405.14867, release
tianweiy/DMD2 ``main/sd_guidance.py`` and ``main/train_sd.py``).

The pure losses against the release's formulas written out here (``compute_distribution_matching_loss`` lines
235–241: p_real = latents − pred_real_image, p_fake = latents − pred_fake_image, grad = (p_real − p_fake) /
|p_real|.mean, loss = ½·mse(latents, sg(latents − grad)); ``compute_loss_fake`` line 295 in velocity form); the
iteration schedule (``train_one_step`` lines 330–408: the generator first when the iteration is a multiple of
``dfake_gen_update_ratio``, then the fake score); and the update in the loop on a model whose velocity is linear in
three weights, each optimizer step's gradient (the student's and the fake score's, in the order they are taken)
against the float64 gradient derived here with both weights tracked by hand. The end-to-end runs (tiny FLUX and
SD3.5, the command line, save–kill–resume, two processes) are marked slow.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowgrpo.algo.objectives import build_objective
from flowgrpo.algo.objectives.dmd2 import dm_gradient, dm_loss, draw_sigmas, fake_score_loss, iteration_schedule
from flowgrpo.algo.objectives.dmd2_gan import classifier_loss, generator_gan_loss
from flowgrpo.algo.objectives.paths import PathSamples
from flowgrpo.config import build_config
from flowgrpo.models.base import AdapterBase
from flowgrpo.records import Advantages, PromptEmbeds
from flowgrpo.training.optim import SecondOptimizer
from flowgrpo.training.update import run_update
from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here
from tests.training.objective_runs import assert_resume_equals_whole, assert_two_processes_equal_one, tiny_run
from tests.training.test_forward_update import LR, FakeAdapter, FakeOptim, Lin
from tests.training.test_path_runs import _teacher
from tests.training.test_sharding import SHARDED, _free_port, _in_process, _ok, _torchrun
from tests.training.test_sharding import _config as sharding_base

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- the pure losses
def _release_grad(latents, pred_real, pred_fake):
    """``sd_guidance.py`` lines 235–239, float64."""
    p_real = latents - pred_real
    p_fake = latents - pred_fake
    grad = (p_real - p_fake) / torch.abs(p_real).mean(dim=[1, 2], keepdim=True)
    return torch.nan_to_num(grad)


def test_the_dm_loss_pulls_the_output_along_the_releases_normalised_gradient():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    real = g + 0.3 * torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    fake = g + 0.5 * torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    real[2] = fake[2] = g[2]  # a row whose predictions are the output itself: 0/0, set to 0 as the release
    want = _release_grad(g, real, fake)
    got = dm_gradient(g, real, fake)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert float(want[:2].abs().min()) > 0 and torch.equal(got[2], torch.zeros_like(got[2]))
    # the loss: ½·mse(latents, sg(latents − grad)) over all elements = the mean over rows of ours; its gradient
    # with respect to the output is grad / (rows · 20)
    leaf = g.clone().float().requires_grad_(True)
    loss = dm_loss(leaf, got).mean()
    release = 0.5 * torch.nn.functional.mse_loss(g, (g - want).detach())
    assert float(loss.detach()) == pytest.approx(float(release), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(leaf.grad.double(), want / (3 * 20), rtol=1e-5, atol=1e-9)


def test_the_fake_score_loss_is_the_flow_matching_error_on_the_detached_output():
    gen = torch.Generator().manual_seed(1)
    v, g, eps = (torch.randn(2, 3, 4, generator=gen) for _ in range(3))
    g.requires_grad_(True)
    v.requires_grad_(True)
    got = fake_score_loss(v, g, eps)
    want = torch.stack([((v[i] - (eps[i] - g[i])) ** 2).mean() for i in range(2)])
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert g.grad is None  # no gradient reaches the student through the fake score's loss


def test_the_sigmas_are_the_releases_integer_timesteps_as_flow_sigmas():
    s = draw_sigmas(torch.Generator().manual_seed(0), 4000, 20, 981, 1000)
    t = (s.double() * 1000).round() - 1
    assert float(t.min()) == 20 and float(t.max()) == 980  # randint(20, 981): 20 … 980, (t + 1)/1000
    assert torch.allclose(s.double(), (t + 1) / 1000, atol=1e-7)


def test_the_generator_steps_first_on_every_ratio_th_iteration_then_the_fake_score():
    assert iteration_schedule(0, 4, 2) == [("generator", 0), ("fake", 0), ("fake", 1), ("generator", 2), ("fake", 2),
                                           ("fake", 3)]
    # iterations counted across epochs: after 3, iteration 5 (the third of this epoch) is the next generator one
    assert iteration_schedule(3, 3, 5) == [("fake", 0), ("fake", 1), ("generator", 2), ("fake", 2)]
    assert iteration_schedule(0, 2, 1) == [("generator", 0), ("fake", 0), ("generator", 1), ("fake", 1)]


def test_settings_are_refused_before_any_model_loads():
    with pytest.raises(ValueError, match="leave no timestep"):
        build_config({"objective": {"name": "dmd2", "min_step_percent": 0.5, "max_step_percent": 0.4}})
    cfg = build_config({"objective": {"name": "dmd2"}, "train": {"inner_epochs": 2}})
    with pytest.raises(ValueError, match=r"train.inner_epochs=2: set it to 1"):
        build_objective(cfg).validate()
    with pytest.raises(ValueError, match="is not a folder"):
        build_objective(build_config({"objective": {"name": "dmd2", "teacher": "/no/such/folder"}})).validate()


# ---------------------------------------------------------------------------------------------- the update loop
B, D, T = 8, 3, 4
ROLLOUT_G, REAL_G = 3.0, 4.0
HELD = 7  # a sample the group filter leaves out (keep False)


class Recording(FakeOptim):
    """:class:`FakeOptim` (plain SGD, gradients recorded) that also logs which optimizer stepped, in order."""

    def __init__(self, model, name, log) -> None:
        super().__init__(model)
        self.name, self.log, self.norms = name, log, []
        self.sync_every_micro_batch = True

    def step(self, epoch):
        norm = super().step(epoch)
        self.log.append(self.name)
        return norm


def _f(theta, x, sigma, e, g):
    w, b, c = theta
    return w * x + b * sigma.reshape(-1, 1) + c * e + 0.05 * g


def _values(module):
    return [float(p.detach()) for p in module.parameters()]


def _setup():
    cfg = build_config({"objective": {"name": "dmd2", "dfake_gen_update_ratio": 2, "real_guidance_scale": REAL_G},
                        "sampling": {"num_steps": T, "guidance_scale": ROLLOUT_G},
                        "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8,
                                  "train_batch_size": 2, "optimizer_steps_per_epoch": 4, "seed": 5}})
    obj = build_objective(cfg)
    adapter, log = FakeAdapter(), []
    optim = Recording(adapter.transformer, "generator", log)
    obj.prepare(optim)
    obj.teacher = Lin().requires_grad_(False)
    with torch.no_grad():
        for p, v in zip(obj.teacher.parameters(), (0.9, -0.1, 0.5), strict=True):
            p.fill_(v)
    obj.fake = obj.fake_forward = copy.deepcopy(obj.teacher).requires_grad_(True)
    obj.fake_optim = Recording(obj.fake, "fake", log)
    samples = path_samples(torch.linspace(1, 0, T + 1), ROLLOUT_G)
    adv = Advantages(values=torch.zeros(B), train_mask=torch.zeros(B, dtype=torch.bool), zero_spread_frac=0.0,
                     nan_frac=0.0, learning_frac=0.0)
    return obj, adapter, optim, samples, adv, recorded(obj, "draw")


def path_samples(sigmas: torch.Tensor, guidance_scale: float) -> PathSamples:
    """B = 8 paths of T + 1 states (len(sigmas)) in D = 3 dimensions, four groups of two, seeded 0: the update-loop
    tests' rollout (TDM-R1's too)."""
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(B, len(sigmas), D, generator=gen)
    return PathSamples(
        x0=latents[:, -1], initial_noise=latents[:, 0], sigmas=sigmas,
        group_ids=torch.tensor([10, 10, 11, 11, 12, 12, 13, 13]), sample_index=torch.tensor([0, 1] * 4),
        embeds=PromptEmbeds({"e": torch.randn(B, D, generator=gen)}), images=torch.zeros(B, 3, 1, 1),
        prompts=["p"] * B, metadata=[{}] * B, guidance_scale=guidance_scale, latents=latents)


def recorded(obj, method: str) -> list:
    """``obj.<method>`` (a draw method) wrapped so that what it returns is kept, in order, in the list returned here
    (a list it returns, element by element)."""
    kept, real = [], getattr(obj, method)

    def recording(*args):
        out = real(*args)
        if isinstance(out, list):
            kept.extend(out)
        else:
            kept.append(out)
        return out

    setattr(obj, method, recording)
    return kept


def _generator_rows(theta, phi, teacher, s, d):
    """The release's L_DM of draw ``d``'s rows (float64) with the student's weights ``theta``."""
    x = s.latents[d.rows, d.step].double()
    sj = float(s.sigmas[d.step])
    e = s.embeds["e"][d.rows].double()
    g = x - sj * _f(theta, x, torch.full((len(d.rows),), sj, dtype=torch.float64), e, ROLLOUT_G)
    sig = d.sigma.double()
    xt = (1 - sig.reshape(-1, 1)) * g.detach() + sig.reshape(-1, 1) * d.noise.double()
    pred_real = xt - sig.reshape(-1, 1) * _f(teacher, xt, sig, e, REAL_G)
    pred_fake = xt - sig.reshape(-1, 1) * _f(phi, xt, sig, e, 1.0)
    p_real, p_fake = g.detach() - pred_real, g.detach() - pred_fake
    grad = torch.nan_to_num((p_real - p_fake) / p_real.abs().mean(dim=1, keepdim=True))
    return 0.5 * ((g - (g - grad).detach()) ** 2).mean(dim=1)


def _fake_rows(theta, phi, s, d):
    """The fake score's flow-matching loss of draw ``d``'s rows on the output under ``theta`` (detached)."""
    x = s.latents[d.rows, d.step].double()
    sj = float(s.sigmas[d.step])
    e = s.embeds["e"][d.rows].double()
    g = (x - sj * _f(theta, x, torch.full((len(d.rows),), sj, dtype=torch.float64), e, ROLLOUT_G)).detach()
    sig = d.sigma.double()
    xt = (1 - sig.reshape(-1, 1)) * g + sig.reshape(-1, 1) * d.noise.double()
    return ((_f(phi, xt, sig, e, 1.0) - (d.noise.double() - g)) ** 2).mean(dim=1)


def test_each_step_of_the_generator_and_the_fake_score_follows_the_release_in_order():
    """4 iterations of one micro-batch of 2, ratio 2: generator, fake, fake, generator, fake, fake. Each generator
    step uses the fake score as the fake steps before it left it; each fake step trains on the student's output
    from the start of its iteration (before that iteration's generator step); sample 7 (left out) trains nothing."""
    obj, adapter, optim, s, adv, draws = _setup()
    keep = torch.ones(B, dtype=torch.bool)
    keep[HELD] = False
    work = obj.plan(s, adv, keep, epoch=0)
    assert work.step_rows == [2.0, 2.0, 2.0, 1.0]
    theta = torch.tensor(_values(adapter.transformer), dtype=torch.float64)
    phi = torch.tensor(_values(obj.fake), dtype=torch.float64)
    teacher = torch.tensor(_values(obj.teacher), dtype=torch.float64)
    metrics = run_update(obj, adapter, optim, work, inner_epochs=1, progress=False)
    assert optim.log == ["generator", "fake", "fake", "generator", "fake", "fake"]
    gen_grads, fake_grads = iter(optim.grads), iter(obj.fake_optim.grads)
    by_kind = {k: [d for d in draws if d.kind == k] for k in ("generator", "fake")}
    trained = keep.double()
    for i in range(4):
        start = theta.clone()
        for kind in ("generator", "fake") if i % 2 == 0 else ("fake",):
            d = by_kind[kind].pop(0)
            assert d.rows.tolist() == [2 * i, 2 * i + 1]
            w = trained[d.rows]
            if kind == "generator":
                th = theta.clone().requires_grad_(True)
                loss = (_generator_rows(th, phi, teacher, s, d) * w).sum() / w.sum()
                (want,) = torch.autograd.grad(loss, th)
                got = next(gen_grads)
                theta = theta - LR * torch.tensor(got, dtype=torch.float64)
            else:
                ph = phi.clone().requires_grad_(True)
                loss = (_fake_rows(start, ph, s, d) * w).sum() / w.sum()
                (want,) = torch.autograd.grad(loss, ph)
                got = next(fake_grads)
                phi = phi - LR * torch.tensor(got, dtype=torch.float64)
            assert got == pytest.approx(want.tolist(), rel=1e-5, abs=1e-8), (i, kind, got, want)
            assert max(abs(v) for v in got) > 1e-4  # the step moved its weights: the comparison has power
    assert _values(adapter.transformer) == pytest.approx(theta.tolist(), rel=1e-6)
    assert _values(obj.fake) == pytest.approx(phi.tolist(), rel=1e-6)
    assert metrics["objective/rows"] == 4 and metrics["objective/fake_rows"] == 7
    # the student's forwards at the rollout's guidance, the teacher's at its own, the fake score's at 1
    assert set(adapter.guidances) == {ROLLOUT_G, REAL_G, 1.0}


# ---------------------------------------------------------------------------------------------- the GAN term
def test_the_gan_losses_are_the_releases_softplus_forms():
    """``sd_guidance.py`` line 323 (the generator: softplus(−D(G)), large when the classifier calls G generated) and
    line 391 (the classifier: softplus(D(fake)) + softplus(−D(real)), real labelled 1), float64 by hand."""
    real = torch.tensor([2.0, -1.0, 0.3], dtype=torch.float64)
    fake = torch.tensor([-3.0, 0.5, 1.2], dtype=torch.float64)
    torch.testing.assert_close(generator_gan_loss(fake).double(), torch.log1p(torch.exp(-fake)), rtol=1e-6, atol=0)
    want = torch.log1p(torch.exp(fake)) + torch.log1p(torch.exp(-real))
    torch.testing.assert_close(classifier_loss(real, fake).double(), want, rtol=1e-6, atol=0)
    # a classifier that is right (real high, fake low) has the smaller loss; the generator's is then large
    assert float(classifier_loss(real[:1], fake[:1])) < float(classifier_loss(fake[:1], real[:1]))
    assert float(generator_gan_loss(fake[:1])) > float(generator_gan_loss(real[:1]))


C, BLOCKS, GEN_W, CLS_W = 4, 3, 0.3, 0.7


class _Block(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(C, C)
        with torch.no_grad():
            self.lin.weight.copy_(0.5 * torch.randn(C, C, generator=g))
            self.lin.bias.copy_(0.1 * torch.randn(C, generator=g))

    def forward(self, h):
        return None, h + torch.tanh(self.lin(h))  # (encoder_hidden_states, hidden_states), as FLUX's blocks


class Blocks(torch.nn.Module):
    """A velocity model of D image tokens of width C through three blocks: token i enters as x_i·a + σ·b + e_i·c,
    leaves as h_i·o (+ 0.05·guidance)."""

    config = SimpleNamespace(num_attention_heads=2, attention_head_dim=C // 2)

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a, self.b, self.c, self.o = (torch.nn.Parameter(torch.randn(C, generator=g)) for _ in range(4))
        self.transformer_blocks = torch.nn.ModuleList(_Block(i) for i in range(BLOCKS))

    def forward(self, x, sigma, e, g):
        h = x[..., None] * self.a + sigma.reshape(-1, 1, 1) * self.b + e[..., None] * self.c
        for block in self.transformer_blocks:
            _, h = block(h)
        return h @ self.o + 0.05 * g


def _features(model, x, sigma, e, k):
    """Block k's output of ``model`` (float64 copy) at (x, σ), by hand (no hook)."""
    h = x[..., None] * model.a + sigma.reshape(-1, 1, 1) * model.b + e[..., None] * model.c
    for block in model.transformer_blocks[:k + 1]:
        h = h + torch.tanh(block.lin(h))
    return h


class BlockAdapter(FakeAdapter):
    """:class:`FakeAdapter` whose fake score has blocks (the adapters' lookup of them)."""

    block_lists = ("transformer_blocks",)
    feature_blocks = AdapterBase.feature_blocks
    block_image_tokens = staticmethod(AdapterBase.block_image_tokens)
    feature_width = staticmethod(AdapterBase.feature_width)


class _Real:
    """Stands for :class:`~flowgrpo.algo.objectives.dmd2_gan.RealImages`: 5 real latents with their prompts' e."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(9)
        self.latents, self.e = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)

    def __len__(self):
        return 5

    def batch(self, adapter, index):
        return self.latents[index], PromptEmbeds({"e": self.e[index]})


def _gan_setup(**gan):
    """:func:`_setup` with the GAN term on, the DM loss weighted 0 (the generator's loss is the GAN loss alone) and a
    fake score with blocks; returns (objective, adapter, work)."""
    cfg = build_config({"objective": {"name": "dmd2", "dm_loss_weight": 0.0, "gan": {
        "gen_weight": GEN_W, "guidance_weight": CLS_W, "real_images": "unused", **gan}},
        "sampling": {"num_steps": T, "guidance_scale": ROLLOUT_G},
        "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8, "train_batch_size": 2,
                  "optimizer_steps_per_epoch": 4, "seed": 5}})
    obj, adapter = build_objective(cfg), BlockAdapter()
    obj.teacher = Blocks().requires_grad_(False)
    obj.fake = obj.fake_forward = copy.deepcopy(obj.teacher).requires_grad_(True)
    obj.attach_gan(adapter)
    obj.real = _Real()
    _, _, _, s, adv, _ = _setup()
    work = obj.plan(s, adv, torch.ones(B, dtype=torch.bool), epoch=0)
    return obj, adapter, work


def _grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def _gan_case():
    """:func:`_gan_setup`'s first micro-batch with float64 copies of the fake score and the head, and the student's
    output G (float64, with gradient to its weights ``theta``) at the micro-batch's step."""
    obj, adapter, work = _gan_setup()
    s, rows = work.samples, work.steps[0][0]
    c = SimpleNamespace(obj=obj, adapter=adapter, work=work, s=s, rows=rows, embeds=s.embeds.index(rows),
                        state=obj.update_state(work), e=s.embeds["e"][rows].double(), k=BLOCKS // 2,
                        fake64=copy.deepcopy(obj.fake).double(), head64=copy.deepcopy(obj.gan_head).double(),
                        theta=torch.tensor(_values(adapter.transformer), dtype=torch.float64, requires_grad=True))
    c.draw = obj.draw(work, rows, 0, "generator")
    x, sj = s.latents[rows, c.draw.step].double(), float(s.sigmas[c.draw.step])
    c.g = x - sj * _f(c.theta, x, torch.full((2,), sj, dtype=torch.float64), c.e, ROLLOUT_G)
    return c


def _hand_logits(c, x, eps, sig, cond):
    """The head on block k of the fake score at x noised with ε at σ, float64 by hand."""
    x_t = (1 - sig.double().reshape(-1, 1)) * x + sig.double().reshape(-1, 1) * eps.double()
    return c.head64(_features(c.fake64, x_t, sig.double(), cond, c.k))


def test_the_generators_gan_loss_moves_the_student_through_a_frozen_classifier():
    """One generator step's GEN_W·softplus(−D(G)) against float64 by hand (the fake score's block-1 features, the
    head, at the drawn σ and ε): the student gets its gradient, the fake score and the head none (the release's
    requires_grad_(False)), and they train again after."""
    c = _gan_case()
    d, student = c.draw, list(c.adapter.transformer.parameters())
    others = list(c.obj.fake.parameters()) + list(c.obj.gan_head.parameters())
    assert d.gan is not None and d.gan.sigma.min() > 0  # noise_steps 1000: σ in (0, 1]
    want = GEN_W * torch.log1p(torch.exp(-_hand_logits(c, c.g, d.gan.noise, d.gan.sigma, c.e)))
    terms = c.obj.generator_terms(c.adapter, c.work, d, c.embeds, c.state)
    torch.testing.assert_close(terms.loss.double(), want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(terms.stats["gan_gen_loss"].double(), want.detach() / GEN_W, rtol=1e-5, atol=1e-7)
    terms.loss.sum().backward()
    (want_grad,) = torch.autograd.grad(want.sum(), c.theta)
    got = torch.stack([p.grad for p in student]).double()
    torch.testing.assert_close(got, want_grad, rtol=1e-4, atol=1e-9)
    assert float(want_grad.abs().min()) > 1e-5  # the GAN loss moves the student: the comparison has power
    assert _grads(others) == [None] * len(others)  # the classifier took no gradient
    assert all(p.requires_grad for p in others)  # and trains again after


def test_the_classifiers_loss_trains_the_head_and_the_fake_score_on_detached_images():
    """One fake step's flow-matching loss + CLS_W·(softplus(D(sg G)) + softplus(−D(real))) against float64 by hand:
    the head and the fake score up to the feature block get their gradients, the student none."""
    c = _gan_case()
    obj, student = c.obj, list(c.adapter.transformer.parameters())
    fake, head = list(obj.fake.parameters()), list(obj.gan_head.parameters())
    df = obj.draw(c.work, c.rows, 0, "fake")
    params64 = list(c.fake64.parameters()) + list(c.head64.parameters())
    for p in params64:
        p.requires_grad_(True)
    g0, index = c.g.detach(), df.gan.real_index
    cls = (torch.log1p(torch.exp(_hand_logits(c, g0, df.gan.noise, df.gan.sigma, c.e)))
           + torch.log1p(torch.exp(-_hand_logits(c, obj.real.latents[index].double(), df.gan.real_noise,
                                                 df.gan.real_sigma, obj.real.e[index].double()))))
    sig = df.sigma.double().reshape(-1, 1)
    x_t = (1 - sig) * g0 + sig * df.noise.double()
    fm = ((c.fake64(x_t, df.sigma.double(), c.e, 1.0) - (df.noise.double() - g0)) ** 2).mean(dim=1)
    want = fm + CLS_W * cls
    terms = obj.fake_terms(c.adapter, c.work, df, c.embeds, c.state)  # no generator step: G computed without grad
    torch.testing.assert_close(terms.loss.double(), want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(terms.stats["gan_cls_loss"].double(), cls.detach(), rtol=1e-5, atol=1e-7)
    terms.loss.sum().backward()
    want_grads = torch.autograd.grad(want.sum(), params64, retain_graph=True)
    for p, w in zip(fake + head, want_grads, strict=True):
        torch.testing.assert_close(p.grad.double(), w, rtol=1e-4, atol=1e-9)
    # the classification loss trains the head and the fake score up to the feature block (a, b, c, blocks 0 … k),
    # not after it (block k + 1, the output o): the comparison above has power on both
    cls_grads = torch.autograd.grad(cls.sum(), params64, allow_unused=True)
    k, named = c.k, [n for n, _ in c.fake64.named_parameters()]
    assert named[:4] == ["a", "b", "c", "o"] and named[4 + 2 * (k + 1)] == f"transformer_blocks.{k + 1}.lin.weight"
    assert all(float(gr.abs().min()) > 1e-6 for gr in cls_grads[:3] + (cls_grads[4 + 2 * k],) + cls_grads[-10:])
    assert cls_grads[3] is None and cls_grads[4 + 2 * (k + 1)] is None
    assert _grads(student) == [None] * len(student)  # no gradient reaches the student


def test_the_gan_term_is_off_by_default_and_on_leaves_the_dmd2_draws_as_they_were():
    """Default: no head, no GAN draws, no head in the checkpoint state; on: the DM draws (step, σ, ε) are the same
    numbers (the GAN's come from their own generators) and building the head leaves the global random state."""
    off, _, _, s, adv, _ = _setup()
    assert not off.o.gan.on and off.gan_head is None
    work_off = off.plan(s, adv, torch.ones(B, dtype=torch.bool), epoch=0)
    on, adapter, work = _gan_setup()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    on.attach_gan(adapter)  # the head built again
    assert torch.equal(torch.get_rng_state(), before)
    for kind in ("generator", "fake"):
        a, b = off.draw(work_off, work_off.steps[1][0], 0, kind), on.draw(work, work.steps[1][0], 0, kind)
        assert a.gan is None and b.gan is not None
        assert a.step == b.step and torch.equal(a.sigma, b.sigma) and torch.equal(a.noise, b.noise)
    off.fake, off.fake_optim = on.fake, SecondOptimizer(list(on.fake.parameters()), off.cfg.train, lr=LR,
                                                        checkpoints=None)
    assert not any(k.startswith("gan_head.") for k in off.state_dict())


def test_the_head_is_in_the_checkpoint_state_and_a_state_without_it_is_refused():
    obj, _, _ = _gan_setup()
    obj.fake_optim = SecondOptimizer(list(obj.fake.parameters()) + list(obj.gan_head.parameters()), obj.cfg.train,
                                     lr=LR, checkpoints=None)
    with torch.no_grad():
        for p in obj.gan_head.parameters():
            p.add_(1.0)
    state = obj.state_dict()
    assert {k for k in state if k.startswith("gan_head.")} == {f"gan_head.{k}" for k in obj.gan_head.state_dict()}
    fresh, _, _ = _gan_setup()
    fresh.fake_optim = SecondOptimizer(list(fresh.fake.parameters()) + list(fresh.gan_head.parameters()),
                                       fresh.cfg.train, lr=LR, checkpoints=None)
    assert not torch.equal(fresh.gan_head.tokens.weight, obj.gan_head.tokens.weight)
    fresh.load_state_dict(state)
    for a, b in zip(fresh.gan_head.parameters(), obj.gan_head.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="has no GAN head"):
        fresh.load_state_dict({k: v for k, v in state.items() if not k.startswith("gan_head.")})
    assert int(state["gan_block"]) == 1  # the middle of three blocks
    other, _, _ = _gan_setup(feature_block=0)  # the head on another block: its features are not the saved head's
    other.fake_optim = SecondOptimizer(list(other.fake.parameters()) + list(other.gan_head.parameters()),
                                       other.cfg.train, lr=LR, checkpoints=None)
    with pytest.raises(ValueError, match=r"GAN head reads block 1 of the fake score, and objective.gan.feature_block "
                                         r"gives block 0: resume with feature_block=1"):
        other.load_state_dict(state)


def test_help_lists_each_gan_setting_with_its_default():
    from flowgrpo.config.help import describe_fields

    rows = {key: (default, text) for key, default, text in describe_fields()}
    assert rows["objective.gan.gen_weight"][0] == "0.0" and rows["objective.gan.noise_steps"][0] == "1000"
    assert rows["objective.gan.real_images"][1].startswith("[dmd2] DMD2 GAN: the real images")
    assert "objective.gan" not in rows and "objective.chunker.name" in rows  # a strategy section is still its own


def test_gan_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"gan.gen_weight=0.01 turns the GAN term on, which needs "
                                         r"objective.gan.real_images"):
        build_config({"objective": {"name": "dmd2", "gan": {"gen_weight": 0.01}}})
    with pytest.raises(ValueError, match=r"noise_steps=2000 is above num_train_timesteps=1000"):
        build_config({"objective": {"name": "dmd2", "gan": {"noise_steps": 2000, "gen_weight": 0.01,
                                                            "real_images": "digits_real"}}})
    for key, value in (("real_images", "digits_real"), ("feature_block", 99), ("noise_steps", 10),
                       ("guidance_weight", 0.5)):  # nothing read is ignored: with the GAN off, a setting is refused
        with pytest.raises(ValueError, match=rf"objective.gan.{key}={value!r} is read only with the GAN term on, "
                                             r"and objective.gan.gen_weight is 0 \(off\)"):
            build_config({"objective": {"name": "dmd2", "gan": {key: value}}})
    build_config({"objective": {"name": "dmd2", "gan": {"gen_weight": 0.0, "noise_steps": 1000}}})  # defaults
    on = {"name": "dmd2", "gan": {"gen_weight": 0.01, "real_images": "/no/such/set.jsonl"}}
    with pytest.raises(ValueError, match=r"objective.gan.real_images: .*no/such/set.jsonl"):
        build_objective(build_config({"objective": on})).validate()
    with pytest.raises(ValueError, match=r"feature_block=3 is past the model's blocks: its transformer has 3"):
        _gan_setup(feature_block=3)
    from flowgrpo.models.wan import WanAdapter

    with pytest.raises(ValueError, match=r"objective.gan needs the transformer blocks .* WanAdapter names none"):
        object.__new__(WanAdapter).feature_blocks(Blocks())  # a family whose blocks are not named
    obj, adapter, _ = _gan_setup(feature_block=0)
    assert obj.gan_block is obj.fake.transformer_blocks[0]


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_sd3_dir(tmp_path_factory):
    """tests/training/conftest.py's tiny SD3.5 pipeline (its tokenizers know the test prompts' words)."""
    from flowgrpo.models.sd3 import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"), seed=0, words="a red cube blue ball".split())


def _run_config(tmp_path, model_dir, teacher, out: str = "run", **sections) -> dict:
    """tests/training/objective_runs.py's one-epoch tiny run (4 samples, 2 iterations of one micro-batch of 2)
    of DMD2 with ratio 2 (iteration 0: generator and fake score; iteration 1: fake score) and ``teacher``."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red cube", "digit": 3}\n{"prompt": "a blue ball", "digit": 7}\n')
    return tiny_run(tmp_path / out, model_dir, {"name": "dmd2", "dfake_gen_update_ratio": 2, "teacher": str(teacher)},
                    prompts, {"rewards": [{"name": "digit_correctness"}]}, sections)


def _check_epoch(rec: dict) -> None:
    """An epoch of two iterations: one generator step of 2 rows, two fake steps of 2 rows each."""
    assert rec["objective/rows"] == 2 and rec["objective/fake_rows"] == 4
    assert rec["policy/grad_norm"] > 0 and rec["objective/fake_grad_norm"] > 0
    assert rec["objective/loss"] > 0 and rec["objective/fake_loss"] > 0


def test_without_a_teacher_folder_the_teacher_is_the_base_model_and_the_fake_score_a_trainable_copy(tiny_flux_dir):
    """``objective.teacher`` unset: the real score is a fresh load of ``model.pretrained``'s transformer (frozen, in
    eval mode), the fake score another module with the same weights, trained; neither is the student."""
    from flowgrpo.models import load_model_from_config

    cfg = build_config({"model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32,
                                  "width": 32}, "objective": {"name": "dmd2"}})
    obj = build_objective(cfg)
    adapter = load_model_from_config(cfg.model, progress=False)
    obj.prepare(SimpleNamespace(second_optimizer=lambda params, lr: SecondOptimizer(params, cfg.train, lr=lr,
                                                                                    checkpoints=None)))
    obj.attach(adapter, None)
    student = dict(adapter.transformer.named_parameters())
    for module, trained in ((obj.teacher, False), (obj.fake, True)):
        assert module is not adapter.transformer
        named = dict(module.named_parameters())
        assert named.keys() == student.keys() and all(torch.equal(named[k], student[k]) for k in named)
        assert all(p.requires_grad == trained for p in named.values())
    assert obj.fake is not obj.teacher and obj.fake_optim.params == list(obj.fake.parameters())
    assert not obj.teacher.training


@pytest.mark.slow
def test_an_epoch_on_the_tiny_sd35_moves_the_student_and_the_fake_score(tmp_path, tiny_sd3_dir):
    from flowgrpo.runner import run

    run(build_config(_run_config(tmp_path, tiny_sd3_dir, _teacher(tmp_path, tiny_sd3_dir))))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    _check_epoch(rec)
    assert rec["objective/fake_steps"] == 2
    # the rollout: T = 3 Euler calls for each of 2 micro-batches; the update: the generator step's forward with
    # gradient and iteration 1's student output without (iteration 0's fake step reuses the generator's); the
    # real and fake scores are other modules
    assert rec["rollout/transformer_calls"] == 6 and rec["update/transformer_calls"] == 2
    ckpt = tmp_path / "run" / "checkpoints" / "epoch_0"
    weights = load_file(ckpt / "trainable.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())
    state = load_file(ckpt / "objective.safetensors")
    teacher = load_file(next((tmp_path / "teacher").glob("*.safetensors")))
    moved = [k for k in teacher if not torch.equal(state[f"fake.{k}"], teacher[k])]
    assert moved and float(state["fake_optim.steps"]) == 2  # the fake score trained, from the teacher


@pytest.mark.slow
def test_two_epochs_on_the_tiny_flux_through_the_command(tmp_path):
    """``python -m flowgrpo.cli train CONFIG`` with ``model.pretrained=tiny`` (the embedded tiny FLUX) and a teacher
    made from it; the second epoch's first iteration (2) is a generator one again."""
    from flowgrpo.models import resolve_pretrained

    tiny = Path(resolve_pretrained("tiny"))
    cfg = _run_config(tmp_path, "tiny", _teacher(tmp_path, tiny))
    path = tmp_path / "dmd2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "train", str(path), "train.num_epochs=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["objective/fake_steps"] for r in recs] == [2, 4]
    for rec in recs:
        _check_epoch(rec)


@pytest.mark.slow
def test_save_kill_resume_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir):
    """The fake score's weights, its optimizer's state and its step count (the iteration count) are in the
    checkpoint: the resumed run's epoch 1 equals the uninterrupted one's to the bit."""
    teacher = _teacher(tmp_path, tiny_flux_dir)
    assert_resume_equals_whole(
        tmp_path, lambda out, **s: build_config(_run_config(tmp_path, tiny_flux_dir, teacher, out, **s)),
        files=("trainable.safetensors", "objective.safetensors"), figures=("objective/loss", "objective/fake_loss"))


def _real_set(tmp_path: Path) -> Path:
    """An image set of two 32×32 images with the test prompts (the tiny runs' size)."""
    from PIL import Image

    folder = tmp_path / "real"
    folder.mkdir()
    for i, color in enumerate(((200, 30, 30), (30, 30, 200))):
        Image.new("RGB", (32, 32), color).save(folder / f"{i}.png")
    (folder / "set.jsonl").write_text('{"prompt": "a red cube", "target": "0.png"}\n'
                                      '{"prompt": "a blue ball", "target": "1.png"}\n')
    return folder / "set.jsonl"


def test_real_images_of_another_size_than_the_model_are_refused_before_training(tmp_path, tiny_flux_dir):
    """The real set's 32×32 images against a 64×64 model: one line when the objective attaches (the image sizes are
    read by validate, before any model loads; the model's size is known once it loads)."""
    from flowgrpo.models import load_model_from_config

    gan = {"gen_weight": 0.01, "real_images": str(_real_set(tmp_path))}
    cfg = build_config({"model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 64,
                                  "width": 64}, "objective": {"name": "dmd2", "gan": gan}})
    obj = build_objective(cfg)
    obj.validate()
    obj.prepare(SimpleNamespace(second_optimizer=lambda params, lr: None))
    with pytest.raises(ValueError, match=r"objective.gan.real_images: .*set.jsonl:1: target '0.png' is 32x32 .*"
                                         r"the model makes 64x64"):
        obj.attach(load_model_from_config(cfg.model, progress=False), None)


@pytest.mark.slow
def test_save_kill_resume_with_the_gan_term_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir):
    """The GAN head's weights are in the checkpoint with the fake score's and their optimizer's state (the head's
    moments among them): with the GAN on, the resumed run's epoch 1 equals the uninterrupted one's to the bit."""
    teacher, real = _teacher(tmp_path, tiny_flux_dir), _real_set(tmp_path)
    gan = {"gan": {"gen_weight": 0.5, "real_images": str(real), "noise_steps": 500}}
    assert_resume_equals_whole(
        tmp_path, lambda out, **s: build_config(_run_config(tmp_path, tiny_flux_dir, teacher, out,
                                                            **{**s, "objective": gan})),
        files=("trainable.safetensors", "objective.safetensors"),
        figures=("objective/loss", "objective/gan_gen_loss", "objective/fake_gan_cls_loss"))


@pytest.mark.slow
def test_an_epoch_of_the_digits_config_with_the_gan_term_through_the_command(tmp_path):
    """``configs/digits_dmd2.yaml`` with the GAN term on (the real digits of ``digits_real``) for one small epoch
    through the command line: both GAN losses logged, the head in the checkpoint, trained by the fake score's
    optimizer (2 steps)."""
    proc = subprocess.run([sys.executable, "-m", "flowgrpo.cli", "train", str(REPO / "configs" / "digits_dmd2.yaml"),
                           f"output_dir={tmp_path / 'run'}", "train.num_epochs=1", "train.prompts_per_epoch=2",
                           "train.rollout_batch_size=8", "train.optimizer_steps_per_epoch=2",
                           "data.eval_num_prompts=10", "logging.progress=false", "objective.gan.gen_weight=0.005",
                           "objective.gan.real_images=digits_real"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["objective/rows"] == 4 and rec["objective/fake_rows"] == 8 and rec["objective/fake_steps"] == 2
    assert rec["objective/gan_gen_loss"] > 0 and rec["objective/fake_gan_cls_loss"] > 0
    assert 0 < rec["objective/fake_gan_real_prob"] < 1 and 0 < rec["objective/fake_gan_fake_prob"] < 1
    state = load_file(tmp_path / "run" / "checkpoints" / "epoch_0" / "objective.safetensors")
    assert any(k.startswith("gan_head.") for k in state) and float(state["fake_optim.steps"]) == 2


@pytest.mark.slow
def test_in_bfloat16_the_fake_score_trains_float32_weights(tmp_path, tiny_flux_dir):
    """``model.dtype=bfloat16``: the teacher in bfloat16, the fake score float32 master weights computing in bfloat16
    (the release's float32 fake UNet under autocast): a step of lr 1e-6 still moves it (bfloat16 weights would round
    most such steps away)."""
    from flowgrpo.runner import run

    teacher = _teacher(tmp_path, tiny_flux_dir)
    run(build_config(_run_config(tmp_path, tiny_flux_dir, teacher, model={"dtype": "bfloat16"},
                                 objective={"fake_lr": 1e-6})))
    _check_epoch(read_metrics(tmp_path / "run" / "metrics.jsonl")[0])
    state = load_file(tmp_path / "run" / "checkpoints" / "epoch_0" / "objective.safetensors")
    weights = load_file(next((tmp_path / "teacher").glob("*.safetensors")))
    assert all(state[f"fake.{k}"].dtype == torch.float32 for k in weights)
    moved = sum(not torch.equal(state[f"fake.{k}"], weights[k].to(torch.bfloat16).float()) for k in weights)
    assert moved > len(weights) // 2, (moved, len(weights))


def sharding_config(root: Path, tiny: Path, name: str, objective: dict, **sections) -> Path:
    """tests/training/test_path_sharding.py's run (4 prompts of a digit × G = 2, micro-batches of one group, the
    digits reward) with ``sections`` (``parallel``) merged."""
    prompts = root / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}", "digit": {d}}}\n' for p, d in
                               (("a red cube", 1), ("a blue ball", 4), ("a green tree", 7), ("a red ball", 9))))
    return sharding_base(root, tiny, name, objective=objective, algo={"clip_range": 1e-4},
                         train={"prompts_per_epoch": 4, "rollout_batch_size": 2, "train_batch_size": 2},
                         rewards=[{"name": "digit_correctness"}], data={"train_prompts": str(prompts)}, **sections)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, tiny_flux_dir) -> Path:
    root = tmp_path_factory.mktemp("dmd2_sharding")
    gan = {"gen_weight": 0.5, "real_images": str(_real_set(root)), "noise_steps": 500}
    o = {"name": "dmd2", "teacher": str(_teacher(root, tiny_flux_dir)), "gan": gan}
    _in_process(sharding_config(root, tiny_flux_dir, "dmd2_one", o))
    two = [sharding_config(root, tiny_flux_dir, "dmd2_two", o),
           sharding_config(root, tiny_flux_dir, "dmd2_fsdp2", o, parallel=SHARDED)]
    _ok(_torchrun(["--nproc_per_node", "2", "--master_port", _free_port()], two))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("two", ["dmd2_two", "dmd2_fsdp2"])
def test_a_two_process_epoch_equals_one_process(two_process_runs, two):
    """8 samples, one iteration (generator step, then fake step) over all of them, on two processes (DDP, or the
    student sharded by FSDP2 with the teacher and the fake score whole on each), with the GAN term on (its real
    images drawn per micro-batch, its head trained by the fake score's optimizer): the student's, the fake score's
    and the head's weights (the fake score's and the head's gradients averaged over the processes by their own
    optimizer) as one process's. The GAN term off is the same run without its terms (bit for bit the run before
    it existed: ``test_the_gan_term_is_off_by_default_and_on_leaves_the_dmd2_draws_as_they_were``)."""
    assert_two_processes_equal_one(two_process_runs / "dmd2_one", two_process_runs / two,
                                   rollout_keys=("reward_total", "group_ids", "initial_latents"),
                                   parts=("trainable", "objective"), rows=8,
                                   figures=("objective/loss", "objective/fake_loss", "objective/fake_grad_norm",
                                            "objective/gan_gen_loss", "objective/fake_gan_cls_loss"))
