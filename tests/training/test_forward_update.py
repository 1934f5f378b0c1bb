"""Specification of the forward-process objectives' update in the loop (flowgrpo.algo.objectives: nft, awm, dgpo).

The objectives run their real plan and update on a model whose velocity is linear in three scalar weights,
v = w·x + b·σ + c·e + 0.05·g (e the prompt embedding, g the guidance), through a stand-in for the optimizer that
records each step's gradient and steps plain SGD. The expected gradient of every optimizer step is derived here,
in float64, from the releases' formulas written out below (DiffusionNFT train_nft_sd3.py 910–970, AWM
train_sd3_awm.py 1293–1354, DGPO train_sd3_dgpo.py 1127–1156 and 162–193): the mean over the step's trained rows of
the per-row loss at the recorded (σ, ε) draws, with the old copy's and the reference's velocities from weights
tracked here by hand (old ← d·old + (1 − d)·θ on each release's schedule). The draws' scopes (per sample, per
micro-batch, per epoch and group) are checked on the recorded draws.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from flowgrpo.algo.objectives import build_objective
from flowgrpo.config import build_config
from flowgrpo.records import Advantages, FinalSamples, PromptEmbeds
from flowgrpo.training.update import run_update

LR = 0.05
TRAIN_G, ROLLOUT_G = 2.0, 3.0
B, D, T = 8, 3, 4
ADV = [1.2, -1.2, 0.5, -0.5, 7.0, -7.0, 0.0, 0.0]  # ±7 is clipped to ±5
MASKED = 7  # a sample the advantages leave out (value 0, train_mask False)
OLD_OFFSET = [0.05, -0.04, 0.03]  # the old copy's distance from the weights when the update starts


class Lin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.7))
        self.b = torch.nn.Parameter(torch.tensor(-0.3))
        self.c = torch.nn.Parameter(torch.tensor(0.2))

    def forward(self, x, sigma, e, g):
        return self.w * x + self.b * sigma.reshape(-1, 1) + self.c * e + 0.05 * g


class FakeAdapter:
    """The adapter interface the update uses: velocity, reference (the initial weights, frozen), attention."""

    def __init__(self) -> None:
        self.transformer = Lin()
        self.forward_module = self.transformer
        self.base = copy.deepcopy(self.transformer).requires_grad_(False)
        self.device = torch.device("cpu")
        self.guidances: list[float] = []

    def velocity(self, x, sigma, embeds, guidance):
        self.guidances.append(guidance)
        return self.forward_module(x.float(), sigma, embeds["e"], guidance)

    @contextlib.contextmanager
    def reference(self):
        current, self.forward_module = self.forward_module, self.base
        try:
            yield
        finally:
            self.forward_module = current

    def attention(self):
        return contextlib.nullcontext()


class FakeOptim:
    """What the update uses of :class:`~flowgrpo.training.optim.Optimization`: plain SGD, gradients recorded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.steps = 0
        self.lr = LR
        self.grads: list[list[float]] = []
        self.before: list[list[float]] = []
        self.sync_every_micro_batch = False  # parallel.gradient_sync=step: one process, nothing deferred

    def accumulating(self, *, sync):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self, epoch):
        self.before.append([float(p.detach()) for p in self.params])
        self.grads.append([float(p.grad) for p in self.params])
        with torch.no_grad():
            for p in self.params:
                p -= LR * p.grad
        self.steps += 1
        return math.sqrt(sum(g * g for g in self.grads[-1]))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def train_mode(self):
        pass


def _setup(objective: dict):
    cfg = build_config({"objective": {"train_guidance_scale": TRAIN_G, **objective},
                        "sampling": {"num_steps": T, "guidance_scale": ROLLOUT_G},
                        "algo": {"clip_range": 1e-4},
                        "train": {"prompts_per_epoch": 4, "group_size": 2, "rollout_batch_size": 8,
                                  "train_batch_size": 2, "optimizer_steps_per_epoch": 2, "seed": 5}})
    obj = build_objective(cfg)
    adapter = FakeAdapter()
    optim = FakeOptim(adapter.transformer)
    obj.prepare(optim)
    gen = torch.Generator().manual_seed(0)
    samples = FinalSamples(
        x0=torch.randn(B, D, generator=gen), initial_noise=torch.zeros(B, D), sigmas=torch.linspace(1, 0, T + 1),
        group_ids=torch.tensor([10, 10, 11, 11, 12, 12, 13, 13]), sample_index=torch.tensor([0, 1] * 4),
        embeds=PromptEmbeds({"e": torch.randn(B, D, generator=gen)}), images=torch.zeros(B, 3, 1, 1),
        prompts=["p"] * B, metadata=[{}] * B, guidance_scale=ROLLOUT_G)
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


def _f(theta, x, sigma, e, g):
    w, b, c = theta
    return w * x + b * sigma.reshape(-1, 1) + c * e + 0.05 * g


def _mean(t):
    return t.mean(dim=1)


def _nft_rows(theta, old, ref, x0, eps, sigma, e, a, o):
    """DiffusionNFT, train_nft_sd3.py 910–970 (β = o.beta, c = 5, w_min = 1e-5)."""
    s = sigma.reshape(-1, 1)
    xt = (1 - s) * x0 + s * eps
    v, v_old, v_ref = _f(theta, xt, sigma, e, TRAIN_G), _f(old, xt, sigma, e, TRAIN_G), _f(ref, xt, sigma, e, TRAIN_G)
    c = 5.0
    r = torch.clamp(torch.clamp(a, -c, c) / c / 2 + 0.5, 0, 1)
    vp = o.beta * v + (1 - o.beta) * v_old
    vn = (1 + o.beta) * v_old - o.beta * v
    loss = []
    for vv in (vp, vn):
        x0h = xt - s * vv
        w = torch.clamp(_mean((x0h - x0).abs()), min=1e-5).detach()
        loss.append(_mean((x0h - x0) ** 2 / w.reshape(-1, 1)))
    policy = c * (r * loss[0] + (1 - r) * loss[1]) / o.beta
    return policy + o.kl_beta * _mean((v - v_ref) ** 2)


def _awm_rows(theta, old, ref, x0, eps, sigma, e, a, o):
    """AWM, train_sd3_awm.py 234–251 (ghuber, p = 0.25) and 1293–1354, on-policy."""
    s = sigma.reshape(-1, 1)
    xt = (1 - s) * x0 + s * eps
    v, v_old, v_ref = _f(theta, xt, sigma, e, TRAIN_G), _f(old, xt, sigma, e, TRAIN_G), _f(ref, xt, sigma, e, TRAIN_G)
    m = _mean((v - (eps - x0)) ** 2)
    p = 0.25
    lp = -((m + 1e-10) ** p - 1e-10 ** p) * sigma / p
    ratio = torch.exp(lp - lp.detach())
    adv = torch.clamp(a, -5, 5) / 5
    policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.0, 2.0))
    return policy + o.kl_beta * _mean((v - v_ref) ** 2) + o.ema_beta * _mean((v - v_old) ** 2)


def _dgpo_rows(theta, old, ref, x0, eps, sigma, e, a, o, groups):
    """DGPO, train_sd3_dgpo.py 1127–1156 and compute_group_dgpo_loss_allreduce 162–193 (G = 2)."""
    s = sigma.reshape(-1, 1)
    xt = (1 - s) * x0 + s * eps
    v, v_old, v_ref = _f(theta, xt, sigma, e, TRAIN_G), _f(old, xt, sigma, e, TRAIN_G), _f(ref, xt, sigma, e, TRAIN_G)
    adv = torch.clamp(a, -5, 5)
    target = eps - x0
    err = _mean((target - v) ** 2)
    ratio = torch.exp(_mean((target - v_old) ** 2) - err).detach()
    clipped = torch.where(adv > 0, ratio > 1 + o.clip_range, ratio < 1 - o.clip_range)
    err = torch.where(clipped, err.detach(), err)
    ref_err = _mean((target - v_ref) ** 2)
    weight = torch.zeros_like(err)
    for g in groups.unique():
        rows = groups == g
        weight[rows] = torch.sigmoid((adv[rows] * o.beta_dpo * (err.detach()[rows] - ref_err[rows]) / 2).sum())
    return weight * adv * err + o.kl_beta * _mean((v - v_ref) ** 2)


ROWS = {"nft": _nft_rows, "awm": _awm_rows, "dgpo": _dgpo_rows}


def _expected_grads(name, cfg, samples, draws, optim, old_by_step, ref):
    """Per optimizer step, the float64 gradient of the mean over its trained rows of the release's per-row loss."""
    o, a = cfg.objective, torch.tensor(ADV, dtype=torch.float64)
    trained = torch.ones(B, dtype=torch.bool)
    trained[MASKED] = False
    out = []
    for step, theta0 in enumerate(optim.before):
        theta = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in theta0]
        old = torch.tensor(old_by_step[step], dtype=torch.float64)
        total, n = 0.0, 0
        for _, rows, ds in (d for d in draws if d[0] == step):
            for d in ds:
                args = (theta, old, ref, samples.x0[rows].double(), d.noise.double(), d.sigma.double(),
                        samples.embeds["e"][rows].double(), a[rows], o)
                loss = ROWS[name](*args, samples.group_ids[rows]) if name == "dgpo" else ROWS[name](*args)
                total = total + (loss * trained[rows]).sum()
                n += int(trained[rows].sum())
        grads = torch.autograd.grad(total / n, theta)
        out.append([float(g) for g in grads])
    return out


def _lerp(old, new, d):
    return [d * o + (1 - d) * n for o, n in zip(old, new, strict=True)]


@pytest.mark.parametrize("name", ["nft", "awm", "dgpo"])
def test_each_step_minimises_the_mean_release_loss_over_its_rows(name):
    objective = {"name": name, **({"trunc_steps": 3, "num_train_timesteps": 2} if name == "dgpo" else {})}
    cfg, obj, adapter, optim, samples, adv, draws = _setup(objective)
    theta_start = _values(optim.params)
    ref = torch.tensor(theta_start, dtype=torch.float64)
    old_start = [v + dv for v, dv in zip(theta_start, OLD_OFFSET, strict=True)]
    with torch.no_grad():  # an old copy apart from both the weights and the reference (as after some epochs)
        for s, v in zip(obj.old.shadow, old_start, strict=True):
            s.fill_(v)
    work = obj.plan(samples, adv, adv.train_mask, epoch=0)
    k = obj.sigmas_per_sample(samples.sigmas)
    held = [any(MASKED in mb.tolist() for mb in share) for share in work.steps]
    assert held == [False, True] or name == "awm"  # consecutive micro-batches: the masked sample in the second step
    assert work.step_rows == [k * (4 - h) for h in held]  # 2 micro-batches of 2 a step, less the masked sample
    metrics = run_update(obj, adapter, optim, work, inner_epochs=1, progress=False)
    assert set(adapter.guidances) == {TRAIN_G}  # every training forward at the training guidance
    assert len(optim.grads) == 2
    # the old copy by hand: NFT and AWM keep theirs for the whole epoch and move it once after it (k = the 2
    # steps taken); DGPO moves it after each step with k = the steps before it (d(0) = 0: a copy of the weights)
    if name == "dgpo":
        old_by_step = [old_start, optim.before[1]]
        after = _lerp(optim.before[1], _values(optim.params), 0.001)
    else:
        old_by_step = [old_start, old_start]
        after = _lerp(old_start, _values(optim.params), 0.002)
    expected = _expected_grads(name, cfg, samples, draws, optim, old_by_step, ref)
    for got, want in zip(optim.grads, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (got, want)
    assert _values(obj.old.shadow) == pytest.approx(after, rel=1e-6)
    assert metrics["objective/rows"] == sum(work.step_rows)
    assert metrics["objective/old_decay"] == pytest.approx(0.001 if name == "dgpo" else 0.002)


def test_draw_scopes():
    """NFT: per sample K distinct grid σ's; AWM: one σ per forward, shared by a micro-batch; DGPO: the same σ's for
    every micro-batch of the epoch, ε shared by a group's rows."""
    grid = torch.linspace(1, 0, T + 1)
    found = {}
    for name in ("nft", "awm", "dgpo"):
        objective = {"name": name, **({"trunc_steps": 3, "num_train_timesteps": 2} if name == "dgpo" else {})}
        _, obj, adapter, optim, samples, adv, draws = _setup(objective)
        run_update(obj, adapter, optim, obj.plan(samples, adv, adv.train_mask, epoch=0), inner_epochs=1, progress=False)
        found[name] = draws
    for _, rows, ds in found["nft"]:
        sig = torch.stack([d.sigma for d in ds], dim=1)  # (n, K)
        assert sig.shape == (len(rows), 3)
        for row in sig:
            assert len(set(row.tolist())) == 3 and set(row.tolist()) <= set(grid[:T].tolist())
        assert not all(torch.equal(d.noise[0], d.noise[1]) for d in ds)  # each sample its own ε
    assert len({tuple(torch.stack([d.sigma for d in ds], 1)[0].tolist()) for _, _, ds in found["nft"]}) > 1
    awm_sets = []
    for _, _, ds in found["awm"]:
        assert len(ds) == 6 and all(len(set(d.sigma.tolist())) == 1 for d in ds)  # K = 6, shared by the rows
        awm_sets.append(tuple(float(d.sigma[0]) for d in ds))
    assert all(set(s) <= set(grid[1:T].tolist()) for s in awm_sets)  # discrete_wo_init: grid steps 1..
    dgpo_sets = {tuple(float(d.sigma[0]) for d in ds) for _, _, ds in found["dgpo"]}
    assert len(dgpo_sets) == 1  # one draw an epoch, every micro-batch
    for _, _, ds in found["dgpo"]:
        for d in ds:  # rows (2j, 2j + 1) are one group: one ε
            assert torch.equal(d.noise[0], d.noise[1])


def test_awm_cuts_its_micro_batches_from_a_seeded_permutation_as_the_release():
    """AWM's release shuffles the samples before cutting the micro-batches that share their σ's
    (train_sd3_awm.py 1085–1087): by default a permutation of each rollout batch from the run's generator scheme
    (seed 5, the epoch, ``awm_shuffle``, the batch's index; here one rollout batch of all 8 samples, the release's
    layout); ``shuffle_micro_batches: false`` keeps consecutive samples (one
    prompt's group together). Each micro-batch's σ's are drawn for its place in the plan."""
    from flowgrpo.algo.objectives.awm import awm_train_sigma_indices
    from flowgrpo.rng import derive_seed

    plans = {}
    for epoch in (0, 1):
        _, obj, adapter, optim, samples, adv, draws = _setup({"name": "awm"})
        work = obj.plan(samples, adv, adv.train_mask, epoch=epoch)
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(derive_seed(5, epoch, "awm_shuffle", 0)))
        layout = [mb.tolist() for share in work.steps for mb in share]
        assert layout == perm.reshape(4, 2).tolist()  # micro-batches of 2, steps of 2 of them, in that order
        plans[epoch] = layout
        # which samples share a micro-batch: not one group's two samples each (the consecutive layout)
        assert any(len({int(samples.group_ids[i]) for i in mb}) == 2 for mb in layout)
        run_update(obj, adapter, optim, work, inner_epochs=1, progress=False)
        grid = torch.linspace(1, 0, T + 1)
        for place, (_, rows, ds) in enumerate(draws):
            assert rows.tolist() == layout[place]
            idx = awm_train_sigma_indices(T, obj.o, torch.Generator().manual_seed(
                derive_seed(5, epoch, 0, "awm_t", place)))
            assert [float(d.sigma[0]) for d in ds] == grid[idx].tolist()  # the micro-batch's σ's: its place
    assert plans[0] != plans[1]  # a new permutation every epoch
    _, obj, _, _, samples, adv, _ = _setup({"name": "awm", "shuffle_micro_batches": False})
    work = obj.plan(samples, adv, adv.train_mask, epoch=0)
    assert [mb.tolist() for share in work.steps for mb in share] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def _fresh(name: str, **objective):
    _, obj, adapter, optim, *_ = _setup({"name": name, **objective})
    with torch.no_grad():
        for p in optim.params:
            p += 1.0  # the trained weights move away from the old copy
    return obj, optim


def _values(params):
    return [float(p.detach()) for p in params]


def test_which_weights_roll_out():
    obj, optim = _fresh("nft")
    trained = _values(optim.params)
    with obj.rollout_weights():  # DiffusionNFT: the old copy
        assert _values(optim.params) == _values(obj.old.shadow) != trained
    assert _values(optim.params) == trained
    obj, optim = _fresh("awm")
    with obj.rollout_weights():  # AWM: the trained weights
        assert _values(optim.params) == _values(optim.params) != _values(obj.old.shadow)
    obj, optim = _fresh("dgpo", switch_ema_ref=3, trunc_steps=3)
    for steps, old in ((3, False), (4, True)):  # DGPO: the old copy once past switch_ema_ref optimizer steps
        optim.steps = steps
        with obj.rollout_weights():
            assert (_values(optim.params) == _values(obj.old.shadow)) is old
    assert _values(optim.params) == trained


def test_old_copy_state_round_trip_and_refusal():
    obj, optim = _fresh("nft")
    obj.old.update(100)  # d = 0.1: the copy is neither the start nor the weights
    state = obj.state_dict()
    assert sorted(state) == ["old_copy.0", "old_copy.1", "old_copy.2"]
    other, _ = _fresh("nft")
    other.load_state_dict(state)
    assert _values(other.old.shadow) == _values(obj.old.shadow)
    with pytest.raises(ValueError, match="old-copy state holds 2 tensors"):
        other.load_state_dict({k: v for k, v in state.items() if k != "old_copy.2"})
