"""Faithful to the public releases: every expected value here is computed in the test from the release's own
formula, re-derived from its code (yifan123/flow_grpo, XueZeyue/DanceGRPO, NVlabs/GDPO, ...), and compared with
our function. Where our default deliberately differs, the option that reproduces the release is tested.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.config import SamplingConfig, load_config
from flowgrpo.records import PromptEmbeds, Rewards
from flowgrpo.sampling.rollout import RolloutRequest, rollout
from flowgrpo.sampling.sde import kl_to_reference, transition_moments

REPO = Path(__file__).resolve().parents[2]


def _sd35_sigmas(num_steps: int = 10) -> torch.Tensor:
    """SD3.5's σ grid: diffusers' FlowMatchEulerDiscreteScheduler with the model's static shift 3."""
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(num_steps)
    return sched.sigmas.float()


# ------------------------------------------------------------------------------------------------ 1. KL form
def _release_flow_grpo_kl(mean, ref_mean, sigma: float, sigmas: torch.Tensor, a: float) -> torch.Tensor:
    """Flow-GRPO's train_sd3.py / train_flux.py: ``((μ − μ_ref)²).mean(dims) / (2·std_dev_t²)`` with
    ``std_dev_t = a·√(σ / (1 − σ'))``, σ' = ``scheduler.sigmas[1]`` where σ == 1, else σ (sd3_sde_with_logprob.py)."""
    denom = 1 - (float(sigmas[1]) if sigma == 1 else sigma)
    std_dev_t = a * math.sqrt(sigma / denom)
    return ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)


def _means(seed: int, sigma: float, sigma_next: float, kind: str, a: float):
    g = torch.Generator().manual_seed(seed)
    x, v, v_ref = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    mean, std = transition_moments(x, v, sigma, sigma_next, kind=kind, noise_level=a)
    ref_mean, _ = transition_moments(x, v_ref, sigma, sigma_next, kind=kind, noise_level=a)
    return mean, ref_mean, std


def test_flow_grpo_kl_form_equals_the_release_on_the_sd35_grid():
    sigmas = _sd35_sigmas(10)
    a = 0.7
    ratios = []
    for t in range(10):
        s, sn = float(sigmas[t]), float(sigmas[t + 1])
        mean, ref_mean, std = _means(t, s, sn, "flow_sde", a)
        ours = kl_to_reference(mean, ref_mean, std, s, sn, kind="flow_sde", form="flow_grpo")
        torch.testing.assert_close(ours.double(), _release_flow_grpo_kl(mean, ref_mean, s, sigmas, a), rtol=1e-5,
                                   atol=0)
        exact = kl_to_reference(mean, ref_mean, std, s, sn, kind="flow_sde", form="gaussian")
        # the exact Gaussian KL with the transition std s·√(σ − σ_next) is 1/(σ − σ_next) times the release's
        torch.testing.assert_close(exact, ours / (s - sn), rtol=1e-5, atol=0)
        ratios.append(1 / (s - sn))
    # on this grid the exact form is 3.7–25× the release's on the nine trained steps (the last, to σ = 0, is not
    # trained with timestep_fraction 0.99)
    assert 3.7 < min(ratios[:9]) < 3.8 and 25 < max(ratios[:9]) < 25.2


def test_gaussian_kl_form_is_the_exact_gaussian_kl_per_dim():
    s, sn, a = 0.8, 0.6, 0.7
    mean, ref_mean, std = _means(1, s, sn, "flow_sde", a)
    p = torch.distributions.Normal(mean.double(), std.double().view(-1, 1, 1, 1))
    q = torch.distributions.Normal(ref_mean.double(), std.double().view(-1, 1, 1, 1))
    expected = torch.distributions.kl_divergence(p, q).mean(dim=(1, 2, 3))
    ours = kl_to_reference(mean, ref_mean, std, s, sn, kind="flow_sde", form="gaussian")
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=0)


def test_flow_grpo_kl_form_for_cps_and_dance_sde():
    s, sn, a = 0.8, 0.6, 0.8
    # cps: Flow-GRPO's sde_type='cps' returns std_dev_t = σ_next·sin(aπ/2), the transition std itself
    mean, ref_mean, std = _means(2, s, sn, "cps", a)
    expected = ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * (sn * math.sin(a * math.pi / 2))
                                                                                   ** 2)
    ours = kl_to_reference(mean, ref_mean, std, s, sn, kind="cps", form="flow_grpo")
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=0)
    # dance_sde (no release KL): the same scale as flow_sde, its diffusion coefficient η, no Δσ
    eta = 0.3
    mean, ref_mean, std = _means(3, s, sn, "dance_sde", eta)
    expected = ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * eta**2)
    ours = kl_to_reference(mean, ref_mean, std, s, sn, kind="dance_sde", form="flow_grpo")
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=0)


def test_kl_form_errors_name_the_choices():
    mean, ref_mean, std = _means(0, 0.8, 0.6, "flow_sde", 0.7)
    with pytest.raises(KeyError, match="gaussian"):
        kl_to_reference(mean, ref_mean, std, 0.8, 0.6, kind="flow_sde", form="gausian")


def test_the_trainer_uses_the_configured_kl_form(tiny_flux):
    """chunk_forward's KL equals the release's formula under the default form."""
    from types import SimpleNamespace

    from flowgrpo.sampling.packed_forward import chunk_forward

    steps = 3
    settings = SamplingConfig(num_steps=steps, guidance_scale=3.5, sde_kind="flow_sde", noise_level=0.7)
    request = RolloutRequest(["a red cube"] * 2, [{}] * 2, torch.tensor([0, 0]), torch.tensor([0, 1]),
                             settings=settings, batch_size=2, seed=0, epoch=0)
    traj = rollout(tiny_flux, request, torch.ones(steps, dtype=torch.bool))
    ref_shift = torch.zeros(())

    class Ref:  # the "reference" adds a constant to the velocity, so the KL is known in closed form
        def __enter__(self):
            ref_shift.fill_(0.1)

        def __exit__(self, *exc):
            ref_shift.fill_(0.0)

    velocity = tiny_flux.velocity
    adapter = SimpleNamespace(device=tiny_flux.device, reference=Ref,
                              velocity=lambda *args: velocity(*args) + ref_shift)
    for form in ("flow_grpo", "gaussian"):
        with torch.no_grad():
            kl = chunk_forward(adapter, traj, torch.arange(2), (1,), settings, with_ref=True, kl_form=form).kl
        s, sn = float(traj.sigmas[1]), float(traj.sigmas[2])
        std_dev_t = 0.7 * math.sqrt(s / (1 - s))
        # μ depends on v through v·(1 + std_dev_t²·(1 − σ)/(2σ))·dt, so Δμ = 0.1·that coefficient everywhere
        dmu = 0.1 * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * (sn - s)
        d2 = std_dev_t**2 * (1 if form == "flow_grpo" else (s - sn))
        torch.testing.assert_close(kl[:, 0].double(), torch.full((2,), dmu**2 / (2 * d2), dtype=torch.float64),
                                   rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------------------ 2. final decode
class LinearAdapter:
    """v = 0.5·x + σ: a velocity whose x̂₀ the test can compute; ``decode`` returns the latents as the image."""

    device = torch.device("cpu")

    def encode_prompts(self, prompts):
        return PromptEmbeds({"e": torch.zeros(len(prompts), 1)})

    def initial_latents(self, batch_size, generator):
        return torch.stack([torch.randn(3, 2, 2, generator=g) for g in generator])

    def velocity(self, latents, sigma, embeds, guidance_scale):
        return 0.5 * latents + sigma.view(-1, 1, 1, 1)

    def decode(self, latents):
        return latents.clone()

    def sigmas(self, num_steps):
        return torch.cat([torch.linspace(1.0, 1.0 / num_steps, num_steps), torch.zeros(1)])


def _decode_rollout(final_decode: str, sde_steps: torch.Tensor, kind: str = "dance_sde"):
    settings = SamplingConfig(num_steps=len(sde_steps), guidance_scale=1.0, sde_kind=kind, noise_level=0.7,
                               final_decode=final_decode)
    request = RolloutRequest(["p"] * 2, [{}] * 2, torch.tensor([0, 0]), torch.tensor([0, 1]), settings=settings,
                             batch_size=2, seed=3, epoch=0)
    return rollout(LinearAdapter(), request, sde_steps)


@pytest.mark.parametrize("kind", ["dance_sde", "flow_sde"])
def test_x0_pred_decodes_the_last_steps_clean_prediction(kind):
    t = 4
    sde = torch.ones(t, dtype=torch.bool)
    pred = _decode_rollout("x0_pred", sde, kind)
    # DanceGRPO's run_sample_step decodes pred_original_sample = x − σ·v of its last step
    x, s = pred.latents[:, t - 1], float(pred.sigmas[t - 1])
    expected = x - s * (0.5 * x + s)
    torch.testing.assert_close(pred.images, expected, rtol=1e-6, atol=1e-6)
    # Flow-GRPO's pipeline decodes the last SDE sample
    sample = _decode_rollout("sample", sde, kind)
    assert torch.equal(sample.images, sample.latents[:, -1])
    assert torch.equal(sample.latents, pred.latents)  # the trajectory itself is the same
    assert (sample.images - pred.images).abs().max() > 0.05  # the last step's noise


def test_x0_pred_equals_the_sample_when_the_last_step_is_ode():
    sde = torch.tensor([True, True, False, False])
    a, b = _decode_rollout("x0_pred", sde), _decode_rollout("sample", sde)
    torch.testing.assert_close(a.images, b.images, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ 4. GDPO
def _release_gdpo(comps: dict[str, list[float]], weights: dict[str, float], g: int) -> list[float]:
    """NVlabs/GDPO (trl grpo_trainer.py): per reward, (r − group mean) / (group torch.std() + 1e-4); weighted sum;
    then (A − batch mean) / (batch torch.std() + 1e-4). torch.std is the unbiased std."""
    n = len(next(iter(comps.values())))
    total = [0.0] * n
    for name, r in comps.items():
        for start in range(0, n, g):
            grp = r[start : start + g]
            m, sd = statistics.fmean(grp), statistics.stdev(grp)
            for i in range(start, start + g):
                total[i] += weights[name] * (r[i] - m) / (sd + 1e-4)
    m, sd = statistics.fmean(total), statistics.stdev(total)
    return [(x - m) / (sd + 1e-4) for x in total]


def test_gdpo_trains_a_group_whose_total_is_flat_but_components_vary():
    # group 0: three rewards whose weighted total is flat (1/3 each) but which rank the samples differently;
    # group 1: ordinary spread
    comps = {"a": [1.0, 0.0, 0.0, 0.2, 0.9, 0.4], "b": [0.0, 1.0, 0.5, 0.1, 0.3, 0.8],
             "c": [0.0, 0.0, 0.5, 0.6, 0.1, 0.3]}
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    total = [sum(comps[k][i] for k in comps) / 3 for i in range(6)]
    assert max(total[:3]) == min(total[:3])
    rewards = Rewards({k: torch.tensor(v, dtype=torch.float64) for k, v in comps.items()}, weights,
                      torch.tensor(total, dtype=torch.float64))
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = compute_advantages(rewards, ids, multi_reward="gdpo", std_ddof=1, std_eps=1e-4)
    expected = _release_gdpo(comps, weights, 3)
    torch.testing.assert_close(adv.values.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6,
                               atol=1e-6)
    assert adv.values[:3].abs().min() > 0.1 and adv.zero_spread_frac == 0
    # summing first sees nothing to learn in group 0
    assert compute_advantages(rewards, ids).values[:3].tolist() == [0.0, 0.0, 0.0]


def test_gdpo_zero_spread_means_every_component_flat():
    comps = {"a": [1.0, 1.0, 0.0, 1.0], "b": [0.5, 0.5, 0.2, 0.9]}
    rewards = Rewards({k: torch.tensor(v) for k, v in comps.items()}, {"a": 1.0, "b": 1.0},
                      torch.tensor([0.75, 0.75, 0.1, 0.95]))
    adv = compute_advantages(rewards, torch.tensor([0, 0, 1, 1]), multi_reward="gdpo", drop_zero_spread=True)
    assert adv.values[:2].tolist() == [0.0, 0.0] and adv.zero_spread_frac == 0.5
    assert adv.train_mask.tolist() == [False, False, True, True]


def test_normalize_then_sum_is_mixgrpos_advantage_aggr():
    """MixGRPO train_grpo_flux.py (advantage_aggr): per reward, (r − group mean) / (group torch.std() + 1e-8),
    summed with the reward weights; no batch renormalisation."""
    comps = {"hps": [0.30, 0.31, 0.29, 0.25, 0.27, 0.26], "ir": [1.2, -0.3, 0.4, 0.9, 0.8, 1.5],
             "pick": [21.0, 22.5, 21.7, 20.1, 20.9, 20.0]}
    weights = {"hps": 1.0, "ir": 1.0, "pick": 0.5}
    expected = [0.0] * 6
    for name, r in comps.items():
        for start in (0, 3):
            grp = r[start : start + 3]
            m, sd = statistics.fmean(grp), statistics.stdev(grp)
            for i in range(start, start + 3):
                expected[i] += weights[name] * (r[i] - m) / (sd + 1e-8)
    total = torch.tensor([sum(weights[k] * comps[k][i] for k in comps) / 2.5 for i in range(6)], dtype=torch.float64)
    rewards = Rewards({k: torch.tensor(v, dtype=torch.float64) for k, v in comps.items()}, weights, total)
    adv = compute_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), multi_reward="normalize_then_sum",
                             std_ddof=1, std_eps=1e-8)
    torch.testing.assert_close(adv.values.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ 5. std ddof
def test_std_ddof_1_matches_dancegrpo_and_ddof_0_matches_flow_grpo():
    r = [0.3, 0.9, 0.4, 0.8, 0.1, 0.5, 0.7, 0.2, 0.6, 1.0, 0.0, 0.55]  # G = 12, one group
    ids = torch.zeros(12, dtype=torch.long)
    rewards = Rewards({"r": torch.tensor(r, dtype=torch.float64)}, {"r": 1.0}, torch.tensor(r, dtype=torch.float64))
    m = statistics.fmean(r)
    # DanceGRPO train_grpo_flux.py: (r − mean) / (group_rewards.std() + 1e-8), torch's unbiased std
    dance = compute_advantages(rewards, ids, std_ddof=1, std_eps=1e-8).values.double()
    torch.testing.assert_close(dance, torch.tensor([(x - m) / (statistics.stdev(r) + 1e-8) for x in r],
                                                   dtype=torch.float64), rtol=1e-6, atol=1e-7)
    # Flow-GRPO stat_tracking.py: (r − mean) / (np.std(r) + 1e-4), the population std (our default)
    flow = compute_advantages(rewards, ids).values.double()
    torch.testing.assert_close(flow, torch.tensor([(x - m) / (statistics.pstdev(r) + 1e-4) for x in r],
                                                  dtype=torch.float64), rtol=1e-6, atol=1e-7)
    ratio = float(dance.abs().sum() / flow.abs().sum())
    assert ratio == pytest.approx(math.sqrt(11 / 12), rel=1e-3)  # the issue's 1.044× the other way round


def test_std_ddof_is_checked():
    rewards = Rewards({"r": torch.tensor([0.0, 1.0])}, {"r": 1.0}, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="std_ddof"):
        compute_advantages(rewards, torch.tensor([0, 0]), std_ddof=2)


def test_default_config_is_flow_grpo():
    """The schema's defaults are Flow-GRPO's; the embedded digits task sets its std floor apart (its config's
    comment)."""
    from flowgrpo.runner import DEFAULT_CONFIG

    cfg = load_config()
    assert (cfg.objective.kl_form, cfg.advantage.std_ddof, cfg.advantage.std_eps) == ("flow_grpo", 0, 1e-4)
    assert cfg.sampling.final_decode == "sample"
    digits = load_config(DEFAULT_CONFIG)
    assert (digits.objective.kl_form, digits.advantage.std_ddof, digits.advantage.std_eps) == ("flow_grpo", 0, 0.05)


# ------------------------------------------------------------------------------------------------ 6. E-GRPO jump std
def _shift3_grid(num_steps: int = 16) -> torch.Tensor:
    """DanceGRPO-family σ grid: sd3_time_shift(3, linspace(1, 0, T + 1))."""
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    return 3 * t / (1 + 2 * t)


@pytest.mark.parametrize(("m", "issue_value"), [(1, 0.700), (2, 1.012), (3, 1.269)])
def test_merged_jump_from_sigma_one_has_the_releases_std_with_the_grid_guard(m, issue_value):
    """VisualGRPO flux_sampler.py _flow_grpo_step: std_dev_t = eta·√(σ/(1 − σ')), σ' = sigmas[1] where σ == 1, times
    √(σ − sigmas[index + merge_step])."""
    sig = _shift3_grid()
    a = 0.7
    release = a * math.sqrt(1 / (1 - float(sig[1]))) * math.sqrt(1 - float(sig[m]))
    assert release == pytest.approx(issue_value, abs=5e-4)
    x = torch.zeros(1, 4)
    _, std = transition_moments(x, x, 1.0, float(sig[m]), kind="flow_sde", noise_level=a,
                                sigma_one_next=float(sig[1]))
    assert float(std) == pytest.approx(release, rel=1e-5)
    _, ours = transition_moments(x, x, 1.0, float(sig[m]), kind="flow_sde", noise_level=a)  # guard: the jump's σ_next
    assert float(ours) == pytest.approx(a, rel=1e-6)


# ------------------------------------------------------------------------------------------------ chunkers
def _traj(latents: torch.Tensor, sigmas: torch.Tensor | None = None, stochastic: torch.Tensor | None = None):
    from flowgrpo.records import Trajectory

    b, t = latents.shape[0], latents.shape[1] - 1
    stochastic = torch.ones(b, t, dtype=torch.bool) if stochastic is None else stochastic.expand(b, t).clone()
    return Trajectory(
        latents=latents, log_probs=torch.zeros(b, t), stochastic=stochastic,
        sigmas=torch.linspace(1, 0, t + 1) if sigmas is None else sigmas, jump=torch.ones(b, t, dtype=torch.long),
        group_ids=torch.arange(b), prompt_ids=torch.arange(b), embeds=PromptEmbeds({"e": torch.zeros(b, 1)}),
        images=torch.zeros(b, 3, 2, 2), prompts=[""] * b, metadata=[{}] * b, guidance_scale=1.0,
    )


def _plan(cfg, traj, epoch: int = 0, seed: int = 0, timestep_fraction: float = 1.0, **settings):
    """The plan of chunker settings ``cfg`` (a settings object, or a name with ``settings``) under the objective's
    ``timestep_fraction``."""
    from flowgrpo.algo.chunkers import build_chunker, chunker_settings

    cfg = chunker_settings(cfg, **settings) if isinstance(cfg, str) else cfg
    return build_chunker(cfg, timestep_fraction).plan(traj, epoch, torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ 3. fractions
def test_a_flow_grpo_port_trains_nine_steps_with_the_releases_kl():
    """Flow-GRPO's geneval_sd3 (timestep_fraction 0.99, beta 0.04, T = 10): train_sd3.py trains steps
    range(int(10 * 0.99)) = 0..8 with kl = mean((mu - mu_ref)^2) / (2 std_dev_t^2)."""
    cfg = load_config(REPO / "configs" / "sd35_grpo.yaml")
    assert (cfg.objective.timestep_fraction, cfg.sampling.num_steps, cfg.objective.kl_beta) == (0.99, 10, 0.04)
    sigmas = _sd35_sigmas(10)
    traj = _traj(torch.randn(2, 11, 4, generator=torch.Generator().manual_seed(0)), sigmas)
    plan = _plan(cfg.objective.chunker, traj, timestep_fraction=cfg.objective.timestep_fraction)
    release_steps = list(range(int(cfg.sampling.num_steps * 0.99)))
    trained = [plan.chunks[k][0] for k in range(plan.num_chunks) if bool(plan.selected[:, k].all())]
    assert trained == release_steps == list(range(9))
    assert not plan.selected[:, 9:].any()
    for t in trained:  # and each trained step's KL has the release's magnitude
        s, sn = float(sigmas[t]), float(sigmas[t + 1])
        mean, ref_mean, std = _means(t, s, sn, "flow_sde", cfg.sampling.noise_level)
        ours = kl_to_reference(mean, ref_mean, std, s, sn, kind="flow_sde", form=cfg.objective.kl_form)
        torch.testing.assert_close(ours.double(), _release_flow_grpo_kl(mean, ref_mean, s, sigmas, 0.7), rtol=1e-5,
                                   atol=0)


def test_dancegrpo_count_is_int_of_t_minus_one_times_the_fraction_random_per_sample():
    """DanceGRPO train_grpo_flux.py: samples drop the last transition ([:, :-1]), each sample's steps are permuted
    (randperm) and the first int(len(timesteps) * timestep_fraction) are trained."""
    t_count, fraction = 16, 0.6
    traj = _traj(torch.randn(400, t_count + 1, 2, generator=torch.Generator().manual_seed(1)))
    plan = _plan("per_step", traj, timestep_fraction=fraction, step_selection="random", drop_last_step=True)
    n = int((t_count - 1) * fraction)
    assert n == 9 and plan.num_chunks == t_count - 1
    assert plan.selected.sum(1).tolist() == [n] * 400
    assert len({tuple(r.tolist()) for r in plan.selected}) > 300  # a new subset per sample
    freq = plan.selected.double().mean(0)  # each of the 15 steps with probability 9/15
    assert float((freq - n / (t_count - 1)).abs().max()) < 0.1


# ------------------------------------------------------------------------------------------------ 7. GCPO
def _release_gcpo_weights(latents: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """GCPO train_grpo_flux_hpsv3.py (--sample_weight normalized): on the trained steps ([:, :-1]),
    l1 = |next - latents|.mean(latent dims) / (|latents|.mean(latent dims) + 1e-8); split by chunk sizes; chunk
    mean + 1e-8; F.normalize(p=1) per sample."""
    lat, nxt = latents[:, :-1][:, :-1], latents[:, 1:][:, :-1]
    dims = tuple(range(2, latents.ndim))
    l1 = (nxt - lat).abs().mean(dim=dims) / (lat.abs().mean(dim=dims) + 1e-8)
    w = torch.cat([c.mean(dim=1, keepdim=True) for c in torch.split(l1, sizes, dim=1)], dim=1) + 1e-8
    return torch.nn.functional.normalize(w, p=1, dim=1)


def test_gcpo_chunk_weights_are_the_releases_per_sample_x_t_weights():
    from flowgrpo.algo.chunkers import chunk_weights

    sizes = [2, 3, 4, 7]
    latents = torch.randn(5, 18, 6, 4, generator=torch.Generator().manual_seed(2)).cumsum(1)
    steps = list(range(16))
    edges = [0, 2, 5, 9, 16]
    ours = chunk_weights(latents, steps, list(zip(edges[:-1], edges[1:], strict=True)), "x_t")
    torch.testing.assert_close(ours, _release_gcpo_weights(latents, sizes), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(ours[0], ours[1])  # per sample, not one curve for the batch


def test_gcpo_script_trains_two_uniformly_chosen_chunks_per_sample():
    """finetune_hpsv3_chunk.sh: --timestep_fraction 0.5 over 4 chunks → int(4 * 0.5) = 2 per sample, from
    randperm(4) (uniform, --sample_weight off)."""
    cfg = load_config(REPO / "configs" / "flux_chunk.yaml")
    b = 3000
    traj = _traj(torch.randn(b, 18, 2, generator=torch.Generator().manual_seed(3)))
    plan = _plan(cfg.objective.chunker, traj, seed=4)
    assert plan.chunks == (tuple(range(0, 2)), tuple(range(2, 5)), tuple(range(5, 9)), tuple(range(9, 16)))
    assert plan.selected.sum(1).tolist() == [int(4 * 0.5)] * b
    pairs = torch.tensor([[int(a), int(c)] for a, c in (r.nonzero().flatten().tolist() for r in plan.selected)])
    counts = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).double()
    observed = counts[[1, 2, 3, 6, 7, 11]]  # the 6 unordered pairs, each 1/6 under uniform choice
    assert float((observed / b - 1 / 6).abs().max()) < 0.03


# ------------------------------------------------------------------------------------------------ 8. MixGRPO
def _release_mixgrpo_windows(num_steps: int, iterations: int, size=4, overlap_step=1, every=25) -> list[list[int]]:
    """MixGRPO grpo_states.py GRPOTrainingStates (progressive, prog_overlap, roll_back), max_timesteps = T − 2:
    each iteration takes get_current_timesteps() = range(cur, min(cur + size, max)), then update_iteration()."""
    max_t, cur, it_in_group, out = num_steps - 2, 0, 0, []
    for _ in range(iterations):
        out.append(list(range(cur, min(cur + size, max_t))))
        it_in_group += 1
        if it_in_group >= every:
            it_in_group = 0
            cur += overlap_step
        if cur > max_t:
            cur, it_in_group = 0, 0
    return out


def test_mixgrpo_window_follows_the_release_until_its_empty_window():
    from flowgrpo.algo.chunkers import build_chunker

    cfg = load_config(REPO / "configs" / "flux_mix.yaml")
    chunker = build_chunker(cfg.objective.chunker)
    t_count = cfg.sampling.num_steps
    release = _release_mixgrpo_windows(t_count, 1300)
    assert release[500] == [20, 21, 22]  # the issue's figure
    ours = [chunker.sde_steps(t_count, e).nonzero().flatten().tolist() for e in range(1300)]
    first_empty = release.index([])
    assert first_empty == 23 * 25
    assert ours[:first_empty] == release[:first_empty]
    # the release trains nothing for 25 iterations at start T − 2, then rolls back; ours rolls back at once
    assert ours[first_empty : first_empty + 25] == release[first_empty + 25 : first_empty + 50] == [[0, 1, 2, 3]] * 25
    stay = build_chunker(cfg.objective.chunker.model_copy(update={"window_end": "stay"}))
    assert stay.sde_steps(t_count, 500).nonzero().flatten().tolist() == [20, 21, 22, 23]


# ------------------------------------------------------------------------------------------------ 6. E-GRPO
class TanhAdapter(LinearAdapter):
    """v = tanh(x)·(1 + σ): nonlinear, so an ODE run from the wrong σ gives a different latent."""

    def velocity(self, latents, sigma, embeds, guidance_scale):
        return torch.tanh(latents) * (1 + sigma.view(-1, 1, 1, 1))


def _egrpo(adapter, ode_after_jump: str, guard: str, steps=(0, 3), lengths=(3, 2), t_count=8):
    from flowgrpo.algo.chunkers import build_chunker, chunker_settings

    chunker = build_chunker(chunker_settings("entropy_merge", merge_steps=list(steps), merge_lengths=list(lengths),
                                             ode_after_jump=ode_after_jump))
    settings = SamplingConfig(num_steps=t_count, guidance_scale=1.0, sde_kind="flow_sde", noise_level=0.7,
                               sigma_one_guard=guard)
    request = RolloutRequest(["p"] * 2, [{}] * 2, torch.tensor([0, 0]), torch.tensor([0, 1]), settings=settings,
                             batch_size=2, seed=1, epoch=0)
    return chunker.rollout(adapter, request)


def test_egrpo_jump_from_sigma_one_has_the_releases_mean_and_std():
    """flux_sampler.py _flow_grpo_step with merge_step m from index 0: std_dev_t = eta·√(1/(1 − sigmas[1])),
    mean = x(1 + s²dt/2) + v·dt (σ = 1), sample std s·√(−dt), dt = sigmas[m] − 1; log-prob mean over dims."""
    adapter = TanhAdapter()
    traj = _egrpo(adapter, "next_step", "grid")
    sig = traj.sigmas.double()
    for row in range(2):  # the two rows of branch step 0 (jump of 3 grid steps from σ = 1)
        assert int(traj.jump[row, 0]) == 3 and bool(traj.stochastic[row, 0])
        x = traj.latents[row, 0].double()
        v = torch.tanh(x) * 2.0
        s = 0.7 * math.sqrt(1 / (1 - float(sig[1])))
        dt = float(sig[3]) - 1.0
        mean = x * (1 + s**2 * dt / 2) + v * dt
        std = s * math.sqrt(-dt)
        expected = torch.distributions.Normal(mean, std).log_prob(traj.latents[row, 3].double()).mean()
        assert float(traj.log_probs[row, 0]) == pytest.approx(float(expected), rel=1e-5)
    ours = _egrpo(adapter, "next_step", "next")  # the jump's own σ_next: std = a
    assert not torch.allclose(ours.log_probs[:2, 0], traj.log_probs[:2, 0])


def test_egrpo_ode_after_a_merged_jump_runs_from_the_next_grid_step_as_the_release():
    """flux_sampler.py _run_ode_sample(input = the jump's output, start_step = s): for i in s+1 .. T−1,
    x ← x + (σ_{i+1} − σ_i)·v(x, σ_i); its last x̂₀ is decoded (the last step is to σ = 0, so x̂₀ = x)."""
    adapter = TanhAdapter()
    t_count = 8
    traj = _egrpo(adapter, "next_step", "grid", t_count=t_count)
    sig = traj.sigmas.double()

    def ode(x, start):
        for i in range(start, t_count):
            x = x + (sig[i + 1] - sig[i]) * torch.tanh(x) * (1 + sig[i])
        return x

    for row, (s, m) in [(0, (0, 3)), (2, (3, 2))]:
        landed = traj.latents[row, s + m].double()
        torch.testing.assert_close(traj.images[row].double(), ode(landed, s + 1), rtol=1e-5, atol=1e-5)
        assert float((traj.images[row].double() - ode(landed, s + m)).abs().max()) > 1e-3
    landing = _egrpo(adapter, "landing", "grid", t_count=t_count)
    for row, (s, m) in [(0, (0, 3)), (2, (3, 2))]:
        torch.testing.assert_close(landing.images[row].double(), ode(landing.latents[row, s + m].double(), s + m),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guard", ["grid", "next"])
def test_egrpo_training_scores_a_merged_jump_from_sigma_one_with_the_rollouts_guard(guard):

    from flowgrpo.sampling.packed_forward import chunk_forward

    adapter = TanhAdapter()
    traj = _egrpo(adapter, "next_step", guard)
    settings = SamplingConfig(num_steps=8, guidance_scale=1.0, sde_kind="flow_sde", noise_level=0.7,
                               sigma_one_guard=guard)
    with torch.no_grad():
        lp = chunk_forward(adapter, traj, torch.arange(2), (0,), settings, with_ref=False).log_probs
    torch.testing.assert_close(lp[:, 0], traj.log_probs[:2, 0], rtol=1e-6, atol=1e-6)
