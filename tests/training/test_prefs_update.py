"""Specification of the preference and supervised objectives' update in the loop (dpo, dpo_offline, sft).

As tests/training/test_forward_update.py: the objectives run their real plan and update on a model whose velocity
is linear in three weights, through a recording SGD stand-in for the optimizer; each optimizer step's gradient
must equal the float64 gradient, derived here, of the mean over the step's pairs (rows) of the release's loss at
the recorded (σ, ε) draws: Diffusion-DPO's softplus(β/2·((e_θʷ − e_refʷ) − (e_θˡ − e_refˡ))) with the
reference's velocity from the initial weights (SalesforceAIResearch/DiffusionDPO train.py 1125–1145), the pairs
chosen by hand from the advantages (best against worst, Flow-Factory trainers/dpo.py 355–356), and SFT's
mean((v − (ε − x₀))²).
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.algo.objectives import build_objective
from flowgrpo.config import build_config
from flowgrpo.records import Advantages, FinalSamples, PromptEmbeds
from flowgrpo.training.update import run_update
from tests.training.test_forward_update import TRAIN_G, FakeAdapter, FakeOptim, _f

B, D = 8, 3
#  group 20: best sample 2, worst 1; group 21: sample 5 masked, best 7, worst 6
ADV = [0.3, -1.0, 2.0, 0.1, 0.4, 9.0, -0.7, 1.1]
MASKED = 5
PAIRS_BY_HAND = [(2, 1), (7, 6)]


def _setup(objective: dict, group_size: int, steps: int, train_batch_size: int = 1):
    cfg = build_config({"objective": {"train_guidance_scale": TRAIN_G, **objective},
                        "sampling": {"num_steps": 4, "guidance_scale": 3.0},
                        "algo": {"clip_range": 1e-4},
                        "train": {"prompts_per_epoch": B // group_size, "group_size": group_size,
                                  "rollout_batch_size": B, "train_batch_size": train_batch_size,
                                  "optimizer_steps_per_epoch": steps, "seed": 5}})
    obj = build_objective(cfg)
    adapter = FakeAdapter()
    optim = FakeOptim(adapter.transformer)
    obj.prepare(optim)
    gen = torch.Generator().manual_seed(0)
    groups = torch.arange(B // group_size).repeat_interleave(group_size) + 20
    samples = FinalSamples(
        x0=torch.randn(B, D, generator=gen), initial_noise=torch.zeros(B, D), sigmas=torch.linspace(1, 0, 5),
        group_ids=groups, sample_index=torch.arange(group_size).repeat(B // group_size),
        embeds=PromptEmbeds({"e": torch.randn(B, D, generator=gen)}), images=torch.zeros(B, 3, 1, 1),
        prompts=["p"] * B, metadata=[{}] * B, guidance_scale=3.0)
    mask = torch.ones(B, dtype=torch.bool)
    mask[MASKED] = False
    adv = Advantages(values=torch.tensor(ADV), train_mask=mask, zero_spread_frac=0.0, nan_frac=0.0,
                     learning_frac=0.75)
    draws = []
    real = obj.draws

    def recording(work, rows, inner):
        out = real(work, rows, inner)
        draws.append((obj.optim.steps, rows.clone(), out))
        return out

    obj.draws = recording
    return cfg, obj, adapter, optim, samples, adv, draws


def _err(theta, x0, eps, sigma, e):
    s = sigma.reshape(-1, 1)
    v = _f(theta, (1 - s) * x0 + s * eps, sigma, e, TRAIN_G)
    return ((v - (eps - x0)) ** 2).mean(dim=1)


def _dpo_grads(optim, draws, samples, pairs, beta, ref):
    """Per step: the float64 gradient of the mean over its rows of softplus(β/2·Δ) (the DPO loss by hand); both
    images of a pair are conditioned on the prompt (here: the embedding) of the chosen one: a pair is one prompt."""
    x0, e = samples.x0.double(), samples.embeds["e"].double()
    out = []
    for step, before in enumerate(optim.before):
        theta = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in before]
        total, n = 0.0, 0
        for _, rows, ds in (d for d in draws if d[0] == step):
            for d in ds:
                w = torch.tensor([pairs[r][0] for r in rows.tolist()])
                lo = torch.tensor([pairs[r][1] for r in rows.tolist()])
                eps, sig = d.noise.double(), d.sigma.double()
                delta = ((_err(theta, x0[w], eps, sig, e[w]) - _err(ref, x0[w], eps, sig, e[w]))
                         - (_err(theta, x0[lo], eps, sig, e[w]) - _err(ref, x0[lo], eps, sig, e[w])))
                total = total + torch.nn.functional.softplus(beta / 2 * delta).sum()
                n += len(rows)
        out.append([float(g) for g in torch.autograd.grad(total / n, theta)])
    return out


@pytest.mark.parametrize("beta", [3.0, 40.0])
def test_online_dpo_steps_minimise_the_mean_pair_loss(beta):
    cfg, obj, adapter, optim, samples, adv, draws = _setup(
        {"name": "dpo", "beta_dpo": beta, "num_train_timesteps": 2}, group_size=4, steps=2)
    ref = torch.tensor([float(p.detach()) for p in optim.params], dtype=torch.float64)
    work = obj.plan(samples, adv, adv.train_mask, epoch=0)
    assert work.extra["chosen"].tolist() == [p[0] for p in PAIRS_BY_HAND]
    assert work.extra["rejected"].tolist() == [p[1] for p in PAIRS_BY_HAND]
    assert work.step_rows == [2.0, 2.0]  # one pair a step, K = 2 sigmas each
    metrics = run_update(obj, adapter, optim, work, inner_epochs=obj.cfg.train.inner_epochs, progress=False)
    assert set(adapter.guidances) == {TRAIN_G}
    # the shared noise of a pair: one ε per (pair, σ), the same for its two images (one draw, one noise)
    assert all(d.noise.shape == (len(rows), D) for _, rows, ds in draws for d in ds)
    expected = _dpo_grads(optim, draws, samples, PAIRS_BY_HAND, beta, ref)
    for got, want in zip(optim.grads, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (got, want)
    assert metrics["objective/rows"] == 4
    # the first step starts at the reference: the loss is log 2 there
    assert 0.0 <= metrics["objective/implicit_acc"] <= 1.0


def test_all_pairs_and_masked_slots():
    """``pairs: all``: 6 slots a group of 4, those with the masked sample or equal advantages masked; the step's
    mean runs over the real pairs only."""
    cfg, obj, adapter, optim, samples, adv, draws = _setup(
        {"name": "dpo", "beta_dpo": 5.0, "pairs": "all"}, group_size=4, steps=1, train_batch_size=4)
    work = obj.plan(samples, adv, adv.train_mask, epoch=0)
    pairs = [(int(a), int(b)) for a, b, k in zip(work.extra["chosen"], work.extra["rejected"], work.trained,
                                                  strict=True) if k]
    by_hand = [(0, 1), (2, 0), (0, 3), (2, 1), (3, 1), (2, 3), (4, 6), (7, 4), (7, 6)]
    assert pairs == by_hand
    assert work.step_rows == [9.0]
    run_update(obj, adapter, optim, work, inner_epochs=obj.cfg.train.inner_epochs, progress=False)
    ref = torch.tensor(optim.before[0], dtype=torch.float64)
    slots = list(zip(work.extra["chosen"].tolist(), work.extra["rejected"].tolist(), strict=True))
    kept = [(s, rows, [type(d)(d.rows[work.trained[d.rows]], d.sigma[work.trained[d.rows]],
                               d.noise[work.trained[d.rows]]) for d in ds]) for s, rows, ds in draws]
    kept = [(s, ds[0].rows, ds) for s, _, ds in kept]
    expected = _dpo_grads(optim, kept, samples, slots, 5.0, ref)
    assert optim.grads[0] == pytest.approx(expected[0], rel=1e-5, abs=1e-7)


def test_offline_dpo_pairs_are_the_dataset_order():
    """Offline: sample 0 of each group of 2 is chosen, whatever the advantages (here the opposite way)."""
    cfg, obj, adapter, optim, samples, adv, draws = _setup(
        {"name": "dpo_offline", "beta_dpo": 6.0}, group_size=2, steps=1, train_batch_size=4)
    adv = Advantages(values=torch.tensor([-1.0, 1.0] * 4), train_mask=torch.ones(B, dtype=torch.bool),
                     zero_spread_frac=0.0, nan_frac=0.0, learning_frac=1.0)
    work = obj.plan(samples, adv, adv.train_mask, epoch=0)
    assert work.extra["chosen"].tolist() == [0, 2, 4, 6] and work.extra["rejected"].tolist() == [1, 3, 5, 7]
    run_update(obj, adapter, optim, work, inner_epochs=obj.cfg.train.inner_epochs, progress=False)
    ref = torch.tensor(optim.before[0], dtype=torch.float64)
    expected = _dpo_grads(optim, draws, samples, [(0, 1), (2, 3), (4, 5), (6, 7)], 6.0, ref)
    assert optim.grads[0] == pytest.approx(expected[0], rel=1e-5, abs=1e-7)


def test_sft_steps_minimise_the_mean_flow_matching_loss():
    cfg, obj, adapter, optim, samples, adv, draws = _setup(
        {"name": "sft", "num_train_timesteps": 2}, group_size=2, steps=2, train_batch_size=2)
    adv = Advantages(values=torch.zeros(B), train_mask=torch.ones(B, dtype=torch.bool), zero_spread_frac=1.0,
                     nan_frac=0.0, learning_frac=0.0)
    work = obj.plan(samples, adv, adv.train_mask, epoch=0)
    assert work.step_rows == [8.0, 8.0]  # 4 samples a step, K = 2
    run_update(obj, adapter, optim, work, inner_epochs=obj.cfg.train.inner_epochs, progress=False)
    x0, e = samples.x0.double(), samples.embeds["e"].double()
    for step, before in enumerate(optim.before):
        theta = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in before]
        total = sum(_err(theta, x0[rows], d.noise.double(), d.sigma.double(), e[rows]).sum()
                    for s, rows, ds in draws if s == step for d in ds)
        want = [float(g) for g in torch.autograd.grad(total / 8, theta)]
        assert optim.grads[step] == pytest.approx(want, rel=1e-5, abs=1e-7)
    # per-sample draws: the two samples of a record have their own σ's
    sig = torch.cat([d.sigma for _, _, ds in draws for d in ds])
    assert len(set(sig.tolist())) == len(sig)
