"""Specification of the registered policy losses (flowgrpo.algo.policy_losses) beside the clipped surrogate.

Each expected value is computed here from the paper's equation with ``math`` (or ``torch.distributions``), never
from the module under test:

* SAPO (arXiv 2511.20347): loss = −A·(4/τ)·sigmoid(τ(r − 1)), τ = τ_pos if A > 0 else τ_neg;
  d loss / d r = −A·4·s·(1 − s), s = sigmoid(τ(r − 1)).
* dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): for A < 0, objective max(min(rA, clip(r)A), cA), i.e. loss
  min(max(−rA, −clip(r)A), −cA).
* GRPO-Guard (arXiv 2510.22319): ℓ = (Δ + b)·std with b = mean_d(μθ − μold)²/(2 std²), which for a Gaussian
  transition x' = μold + std·ε equals mean_d(ε·(μθ − μold)); loss = (1/−dt)·max(−A e^ℓ, −A clip(e^ℓ)).
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algo.policy_losses import (
    POLICY_LOSSES,
    DualClipConfig,
    GrpoGuardConfig,
    PolicyLossInput,
    SapoConfig,
    clipped_surrogate,
    needs_moments,
)


def _settings(clip_low: float = 1e-4, clip_high: float = 1e-4, kl_beta: float = 0.0, loss=None,
              name: str = "clipped"):
    """What a policy loss reads: the SDE-ratio objective's section (objective.clip_range_low / high, kl_beta and
    the loss's own section ``loss``, default: loss ``name`` with its defaults)."""
    from flowgrpo.algo.objectives import SdeRatioConfig

    return SdeRatioConfig(clip_range_low=clip_low, clip_range_high=clip_high, kl_beta=kl_beta,
                          policy_loss=loss if loss is not None else name)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _inp(adv, delta, **kw):
    delta = torch.tensor(delta, dtype=torch.float32).reshape(len(adv), -1)
    old = torch.full_like(delta, -2.0)
    return PolicyLossInput(old + delta, old, torch.tensor(adv, dtype=torch.float32), **kw)


def test_registry_lists_the_losses_and_rejects_typos():
    assert {"clipped", "dual_clip", "sapo", "grpo_guard"} <= set(POLICY_LOSSES.names())
    with pytest.raises(KeyError, match="did you mean 'sapo'"):
        POLICY_LOSSES.get("sap")
    assert needs_moments(POLICY_LOSSES.get("grpo_guard")) and not needs_moments(POLICY_LOSSES.get("clipped"))


def test_registered_clipped_equals_the_plain_function():
    inp = _inp([1.0, -2.0, 0.5], [0.3, -0.2, 0.01])
    s = _settings(clip_low=0.1, clip_high=0.2)
    a = POLICY_LOSSES.get("clipped")(inp, s)
    b = clipped_surrogate(inp.new_log_probs, inp.old_log_probs, inp.advantages, clip_low=0.1, clip_high=0.2)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.clipped, b.clipped)


SAPO_CASES = [  # (A, Δ (one step: r = e^Δ))
    (1.0, 0.0), (1.0, 0.5), (1.0, -0.7), (-1.5, 0.0), (-1.5, 0.4), (-1.5, -0.3), (2.0, 3.0),
]


def test_sapo_by_the_equation():
    tau_pos, tau_neg = 1.0, 2.0
    s = _settings(loss=SapoConfig(tau_pos=tau_pos, tau_neg=tau_neg))
    inp = _inp([c[0] for c in SAPO_CASES], [c[1] for c in SAPO_CASES])
    new = inp.new_log_probs.clone().requires_grad_(True)
    terms = POLICY_LOSSES.get("sapo")(PolicyLossInput(new, inp.old_log_probs, inp.advantages), s)
    terms.loss.sum().backward()
    for i, (a, d) in enumerate(SAPO_CASES):
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(d)
        g = _sig(tau * (r - 1))
        assert float(terms.loss.detach()[i]) == pytest.approx(-a * 4 / tau * g, rel=1e-5, abs=1e-6)
        # chain rule through r = e^Δ: d loss/dΔ = −A·4·g(1−g)·r
        assert float(new.grad[i, 0]) == pytest.approx(-a * 4 * g * (1 - g) * r, rel=1e-4, abs=1e-6)
        assert bool(terms.clipped[i]) == (4 * g * (1 - g) < 0.5)
    # on-policy the gate's gradient equals the unclipped surrogate's, −A (the 4/τ normalisation)
    assert float(new.grad[0, 0]) == pytest.approx(-1.0, rel=1e-6)
    assert float(new.grad[3, 0]) == pytest.approx(1.5, rel=1e-6)


def test_sapo_rejects_non_positive_temperatures():
    with pytest.raises(ValueError, match="tau_pos=0"):
        POLICY_LOSSES.get("sapo")(_inp([1.0], [0.0]), _settings(loss=SapoConfig.model_construct(tau_pos=0.0)))


DUAL_CASES = [  # (A, Δ): r = e^Δ, ε = 0.2, c = 3
    (-1.0, 1.5),   # r = 4.48: PPO loss −A·r = 4.48 > −c·A = 3 → held at 3, no gradient
    (-1.0, 0.9),   # r = 2.46: PPO loss 2.46 < 3 → PPO's unclipped branch
    (-1.0, -0.5),  # r = 0.61 < 0.8: PPO's clipped branch −A·0.8 = 0.8
    (2.0, 1.5),    # A > 0: plain PPO, clipped at 1.2 → −2.4
    (2.0, -0.5),   # A > 0, r = 0.61: −A·r
]


def test_dual_clip_by_the_equation():
    eps, c = 0.2, 3.0
    s = _settings(clip_low=eps, clip_high=eps, loss=DualClipConfig(c=c))
    inp = _inp([x[0] for x in DUAL_CASES], [x[1] for x in DUAL_CASES])
    new = inp.new_log_probs.clone().requires_grad_(True)
    terms = POLICY_LOSSES.get("dual_clip")(PolicyLossInput(new, inp.old_log_probs, inp.advantages), s)
    terms.loss.sum().backward()
    for i, (a, d) in enumerate(DUAL_CASES):
        r = math.exp(d)
        objective = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
        if a < 0:
            objective = max(objective, c * a)
        assert float(terms.loss.detach()[i]) == pytest.approx(-objective, rel=1e-5)
    assert float(new.grad[0, 0]) == 0.0  # held at the bound
    assert float(new.grad[1, 0]) == pytest.approx(math.exp(0.9), rel=1e-5)  # −A·r
    assert terms.clipped.tolist() == [True, False, True, True, False]
    # the default clipped loss does not bound case 0
    plain = POLICY_LOSSES.get("clipped")(inp, s)
    assert float(plain.loss[0]) == pytest.approx(math.exp(1.5), rel=1e-5)
    with pytest.raises(ValueError, match="greater than 1"):  # the settings refuse it where it enters
        DualClipConfig(c=1.0)
    with pytest.raises(ValueError, match="policy_loss.c must be > 1"):  # and the loss, called without them
        POLICY_LOSSES.get("dual_clip")(inp, _settings(loss=DualClipConfig.model_construct(c=1.0)))


def _gaussian_pair(n: int, d: int, std: torch.Tensor, drift_scale: float, seed: int):
    """Rollout means, policy means and a sampled x' = μold + std·ε; log-probs by torch.distributions (mean over
    the D latent dims, the project's convention)."""
    g = torch.Generator().manual_seed(seed)
    mu_old = torch.randn(n, d, generator=g, dtype=torch.float64)
    mu_new = mu_old + drift_scale * torch.randn(n, d, generator=g, dtype=torch.float64)
    eps = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = mu_old + std[:, None] * eps
    lp_old = torch.distributions.Normal(mu_old, std[:, None]).log_prob(x).mean(1)
    lp_new = torch.distributions.Normal(mu_new, std[:, None]).log_prob(x).mean(1)
    return mu_old, mu_new, eps, lp_old, lp_new


def test_grpo_guard_ratio_is_the_drift_projected_on_the_noise():
    n, d = 6, 64
    std = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.5, 0.8], dtype=torch.float64)
    dt = -torch.tensor([0.02, 0.05, 0.1, 0.1, 0.2, 0.25], dtype=torch.float64)
    mu_old, mu_new, eps, lp_old, lp_new = _gaussian_pair(n, d, std, 1e-3, 0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    inp = PolicyLossInput(lp_new.float()[:, None], lp_old.float()[:, None], adv, std=std.float()[:, None],
                          dt=dt.float()[:, None], mean_drift_sq=((mu_new - mu_old) ** 2).mean(1).float()[:, None])
    s = _settings(clip_low=1e-4, clip_high=1e-4, loss=GrpoGuardConfig(stats="per_sample"))
    terms = POLICY_LOSSES.get("grpo_guard")(inp, s)
    ell = (eps * (mu_new - mu_old)).mean(1)  # the normalised log-ratio, independent of std
    torch.testing.assert_close(terms.ratio.double(), torch.exp(ell), rtol=0, atol=2e-6)
    for i in range(n):
        r, a = math.exp(float(ell[i])), float(adv[i])
        expected = max(-a * r, -a * min(max(r, 1 - 1e-4), 1 + 1e-4)) / float(-dt[i])
        assert float(terms.loss[i]) == pytest.approx(expected, rel=1e-4)
    # the plain ratio e^Δ is left-shifted by b = mean(drift²)/(2 std²): visible at the small-std steps
    plain = torch.exp(lp_new - lp_old)
    torch.testing.assert_close(plain, torch.exp(ell / std - ((mu_new - mu_old) ** 2).mean(1) / (2 * std**2)))


def _release_grpo_guard(lp_new, lp_old, mu_new, mu_old, s_t, sqrt_dt, adv, eps):
    """The release's RatioNorm branch (train_sd3_GRPO_Guard.py), written out for one micro-batch at one step:
    sigma_t = mean(std_dev_t); bias = ((μθ − μold)²).mean(dim=()) — every dim, log_prob being (B,) — divided by
    2·(mean(√−dt)·sigma_t)²; ratio = exp((Δ + bias)·mean(√−dt)·sigma_t); loss = mean(max(−A r, −A clip r)) /
    mean(√−dt)². Plain Python floats, element by element."""
    b, d = mu_new.shape
    sigma_t = sum(s_t) / b
    sq = sum(sqrt_dt) / b
    scale = sq * sigma_t
    bias = sum(float(mu_new[i, j] - mu_old[i, j]) ** 2 for i in range(b) for j in range(d)) / (b * d)
    bias /= 2 * scale**2
    ratios = [math.exp((float(lp_new[i]) - float(lp_old[i]) + bias) * scale) for i in range(b)]
    terms = [max(-adv[i] * r, -adv[i] * min(max(r, 1 - eps), 1 + eps)) for i, r in enumerate(ratios)]
    return ratios, sum(terms) / b / sq**2


def _guard_case(n, d, s_t, dts, drifts, seed):
    """A micro-batch of n pairs at one step with the release's s_t and dt per pair and unequal drifts."""
    g = torch.Generator().manual_seed(seed)
    sqrt_dt = [math.sqrt(-x) for x in dts]
    std = torch.tensor([a * q for a, q in zip(s_t, sqrt_dt, strict=True)], dtype=torch.float64)
    mu_old = torch.randn(n, d, generator=g, dtype=torch.float64)
    mu_new = mu_old + torch.tensor(drifts, dtype=torch.float64)[:, None] * torch.randn(n, d, generator=g,
                                                                                      dtype=torch.float64)
    x = mu_old + std[:, None] * torch.randn(n, d, generator=g, dtype=torch.float64)
    lp_old = torch.distributions.Normal(mu_old, std[:, None]).log_prob(x).mean(1)
    lp_new = torch.distributions.Normal(mu_new, std[:, None]).log_prob(x).mean(1)
    inp = dict(std=std.float()[:, None], dt=torch.tensor(dts, dtype=torch.float32)[:, None],
               mean_drift_sq=((mu_new - mu_old) ** 2).mean(1).float()[:, None])
    return mu_old, mu_new, lp_old, lp_new, sqrt_dt, inp


def test_grpo_guard_default_is_the_release_formula_with_one_bias_per_micro_batch():
    n, d, eps = 6, 48, 2e-5
    s_t, dts = [0.7] * n, [-0.1] * n  # the release: every pair of the micro-batch at the same step
    drifts = [1e-3, 3e-3, 1e-2, 2e-3, 5e-4, 8e-3]  # unequal: one shared bias differs from each pair's own
    mu_old, mu_new, lp_old, lp_new, sqrt_dt, kw = _guard_case(n, d, s_t, dts, drifts, 1)
    adv = [1.0, -1.0, 0.3, -0.7, 1.2, -0.4]
    ratios, release = _release_grpo_guard(lp_new, lp_old, mu_new, mu_old, s_t, sqrt_dt, adv, eps)
    inp = PolicyLossInput(lp_new.float()[:, None], lp_old.float()[:, None], torch.tensor(adv), **kw)
    ours = POLICY_LOSSES.get("grpo_guard")(inp, _settings(clip_low=eps, clip_high=eps, name="grpo_guard"))
    torch.testing.assert_close(ours.ratio.double(), torch.tensor(ratios, dtype=torch.float64), rtol=0, atol=1e-6)
    assert float(ours.loss.mean()) == pytest.approx(release, rel=1e-5)
    # the per-sample form is another computation: its log-ratios differ by several clip ranges
    own = POLICY_LOSSES.get("grpo_guard")(inp, _settings(clip_low=eps, clip_high=eps,
                                                            loss=GrpoGuardConfig(stats="per_sample")))
    assert float((own.ratio.double().log() - ours.ratio.double().log()).abs().max()) > 5 * eps


def test_grpo_guard_shares_its_statistics_within_each_group_over_the_trained_pairs():
    # two micro-batch steps in one call (groups 0 and 1, at different sigmas); pair 2 is not trained
    n, d, eps = 6, 32, 1e-3
    s_t, dts = [0.5, 0.5, 0.5, 0.9, 0.9, 0.9], [-0.05, -0.05, -0.05, -0.2, -0.2, -0.2]
    drifts = [1e-3, 4e-3, 5e-2, 2e-3, 6e-3, 1e-3]
    mu_old, mu_new, lp_old, lp_new, sqrt_dt, kw = _guard_case(n, d, s_t, dts, drifts, 2)
    adv = [1.0, -1.0, 0.5, -0.5, 0.8, -1.2]
    trained = torch.tensor([True, True, False, True, True, True])
    inp = PolicyLossInput(lp_new.float()[:, None], lp_old.float()[:, None], torch.tensor(adv), **kw,
                          trained=trained, groups=torch.tensor([0, 0, 0, 1, 1, 1]))
    ours = POLICY_LOSSES.get("grpo_guard")(inp, _settings(clip_low=eps, clip_high=eps, name="grpo_guard"))
    for rows in ([0, 1], [3, 4, 5]):  # each group is the release's micro-batch of its trained pairs
        pick = torch.tensor(rows)
        ratios, release = _release_grpo_guard(lp_new[pick], lp_old[pick], mu_new[pick], mu_old[pick],
                                              [s_t[i] for i in rows], [sqrt_dt[i] for i in rows],
                                              [adv[i] for i in rows], eps)
        torch.testing.assert_close(ours.ratio[pick].double(), torch.tensor(ratios, dtype=torch.float64), rtol=0,
                                   atol=1e-6)
        assert float(ours.loss[pick].mean()) == pytest.approx(release, rel=1e-5)
    # a group none of whose pairs is trained still gets finite values (the trainer masks them out)
    none = PolicyLossInput(inp.new_log_probs, inp.old_log_probs, inp.advantages, **kw,
                           trained=torch.zeros(n, dtype=torch.bool), groups=inp.groups)
    assert bool(torch.isfinite(POLICY_LOSSES.get("grpo_guard")(none, _settings(name="grpo_guard")).loss).all())


def test_grpo_guard_on_policy_ratio_is_one_and_needs_moments():
    lp = torch.randn(3, 2)
    inp = PolicyLossInput(lp, lp.clone(), torch.tensor([1.0, -1.0, 0.0]), std=torch.full((3, 2), 0.2),
                          dt=torch.full((3, 2), -0.1), mean_drift_sq=torch.zeros(3, 2))
    terms = POLICY_LOSSES.get("grpo_guard")(inp, _settings(name="grpo_guard"))
    assert torch.equal(terms.ratio, torch.ones(3))
    torch.testing.assert_close(terms.loss, torch.tensor([-10.0, 10.0, 0.0]))  # −A / (−dt)
    with pytest.raises(ValueError, match="needs std, dt and mean_drift_sq"):
        POLICY_LOSSES.get("grpo_guard")(PolicyLossInput(lp, lp, torch.zeros(3)),
                                        _settings(name="grpo_guard"))
    with pytest.raises(ValueError, match="stochastic"):
        POLICY_LOSSES.get("grpo_guard")(PolicyLossInput(lp, lp, torch.zeros(3), std=torch.zeros(3, 2),
                                                        dt=torch.full((3, 2), -0.1),
                                                        mean_drift_sq=torch.zeros(3, 2)),
                                        _settings(name="grpo_guard"))


def test_kl_is_added_by_every_loss():
    inp = _inp([1.0, -1.0], [0.0, 0.0], kl_ref=torch.tensor([[0.2], [0.4]]))
    for name in ("clipped", "dual_clip", "sapo"):
        base = POLICY_LOSSES.get(name)(inp, _settings(name=name))
        with_kl = POLICY_LOSSES.get(name)(inp, _settings(kl_beta=0.5, name=name))
        torch.testing.assert_close(with_kl.loss - base.loss, torch.tensor([0.1, 0.2])), name


def test_the_trainer_tells_grpo_guard_which_pairs_are_trained_and_share_a_micro_batch_step():
    from types import SimpleNamespace

    from flowgrpo.algo.objectives.sde_ratio import SdeRatio
    from flowgrpo.records import ChunkPlan
    from flowgrpo.sampling.packed_forward import ChunkForward

    b, t, d = 4, 3, 5
    plan = ChunkPlan(chunks=[(0,), (1,), (2,)], selected=torch.ones(b, 3, dtype=torch.bool))
    pair_mask = torch.ones(b, 3, dtype=torch.bool)
    pair_mask[1, 2] = False  # sample 1 is not trained at step 2
    batch = {"old_log_probs": torch.zeros(b, t), "advantages": torch.ones(b), "pair_mask": pair_mask}
    fake = SimpleNamespace(policy_loss=POLICY_LOSSES.get("grpo_guard"))
    work = SimpleNamespace(plan=plan, old_means=torch.zeros(b, t, d))
    items = [(torch.tensor([0, 1]), 2), (torch.tensor([2, 3]), 0)]  # two (rows, chunk) items in one call
    fwd = ChunkForward(log_probs=torch.zeros(2, 1), kl=None, means=torch.ones(2, 1, d), stds=torch.ones(2, 1),
                       dts=-torch.ones(2, 1))
    inp = SdeRatio._loss_input(fake, [fwd, fwd], items, work, batch)
    assert inp.trained.tolist() == [True, False, True, True]
    assert inp.groups.tolist() == [0, 0, 1, 1]
