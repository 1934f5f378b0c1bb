"""Specification of E-GRPO (Zhang et al., arXiv 2601.00423): entropy-merged SDE jumps, shared-anchor branching
and (prompt, branch step) groups — the ``entropy_merge`` chunker.

Expected values are derived by hand from the closed forms (transition std of flow_sde / dance_sde, Gaussian
entropy, torch.distributions.Normal for the log-density), from the authors' released hand-set lists, or by
counting; most tests use a fake adapter with a tiny elementwise velocity, the last one trains the tiny FLUX.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.algo.chunkers import EntropyMerge, build_chunker, chunker_settings, merge_plan, step_entropies
from flowgrpo.config import SamplingConfig, build_config
from flowgrpo.records import PromptEmbeds, Rewards
from flowgrpo.rng import make_generator
from flowgrpo.sampling.rollout import RolloutRequest

A = 0.7  # flow_sde noise level a


class FakeAdapter:
    """The adapter interface with a 4×3 latent and v = tanh(x·W) + σ·e(prompt); records every velocity call."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.w = torch.randn(3, 3, generator=torch.Generator().manual_seed(0)) * 0.5
        self.vocab: dict[str, int] = {}
        self.calls: list[tuple[list[int], list[float]]] = []  # (prompt tags, sigmas) of each call

    def encode_prompts(self, prompts):
        tags = torch.tensor([float(self.vocab.setdefault(p, len(self.vocab))) for p in prompts])
        e = (tags + 1).view(-1, 1, 1) * torch.tensor([0.1, -0.2, 0.3]).view(1, 1, 3)
        return PromptEmbeds({"e": e, "tag": tags})

    def initial_latents(self, batch_size, generator):
        return torch.stack([torch.randn(4, 3, generator=g) for g in generator])

    def velocity(self, latents, sigma, embeds, guidance_scale):
        self.calls.append((embeds["tag"].long().tolist(), sigma.tolist()))
        return torch.tanh(latents @ self.w) + sigma.view(-1, 1, 1) * embeds["e"]

    def decode(self, latents):
        return torch.sigmoid(latents.mean(dim=(1, 2))).view(-1, 1, 1, 1).expand(-1, 3, 4, 4).clone()

    def sigmas(self, num_steps):
        return torch.cat([torch.linspace(1.0, 1.0 / num_steps, num_steps), torch.zeros(1)])


def _rollout(adapter, *, steps=(0, 1, 4), lengths=(1, 3, 1), num_prompts=2, group=3, num_steps=6, batch_size=4,
             kind="flow_sde", seed=5, epoch=2, **chunker):
    cfg = chunker_settings(name="entropy_merge", merge_steps=list(steps), merge_lengths=list(lengths), **chunker)
    chunker = build_chunker(cfg)
    pids = torch.tensor([10, 11, 12, 13][:num_prompts]).repeat_interleave(group)
    js = torch.arange(group).repeat(num_prompts)
    prompts = [f"prompt {int(p)}" for p in pids]
    settings = SamplingConfig(num_steps=num_steps, guidance_scale=1.0, sde_kind=kind, noise_level=A)
    request = RolloutRequest(prompts, [{} for _ in prompts], pids, js, settings=settings, batch_size=batch_size,
                             seed=seed, epoch=epoch)
    traj = chunker.rollout(adapter, request)
    return chunker, traj


def _branch_step(traj) -> torch.Tensor:
    return traj.stochastic.float().argmax(dim=1)


# ------------------------------------------------------------------ entropies and the merge rule
def test_step_entropies_equal_closed_form():
    sig = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.1, 0.0])
    # flow_sde: std² = a²·σ/(1−σ)·(σ−σ_next); at σ = 1 the guard puts 1−σ_next in the denominator, so std = a
    var = [A**2] + [A**2 * s / (1 - s) * (s - n) for s, n in zip([0.9, 0.7, 0.4, 0.1], [0.7, 0.4, 0.1, 0.0],
                                                                 strict=True)]
    expected = torch.tensor([0.5 * math.log(2 * math.pi * math.e * v) for v in var])
    torch.testing.assert_close(step_entropies(sig, kind="flow_sde", noise_level=A), expected.float(),
                               atol=1e-5, rtol=0)
    # dance_sde: std² = η²·(σ − σ_next)
    eta = 0.3
    d = [0.1, 0.2, 0.3, 0.3, 0.1]
    expected = torch.tensor([0.5 * math.log(2 * math.pi * math.e * eta**2 * x) for x in d])
    torch.testing.assert_close(step_entropies(sig, kind="dance_sde", noise_level=eta), expected.float(),
                               atol=1e-5, rtol=0)


def _tau(gap: float) -> float:
    """The threshold a dance_sde (η = 1) jump crosses exactly when σ_s − σ_{s+m} ≥ gap."""
    return 0.5 * math.log(2 * math.pi * math.e * gap)


UNIFORM = torch.linspace(1.0, 0.0, 11)  # steps of 0.1


@pytest.mark.parametrize(
    ("grid", "gap", "limit", "expected"),
    [
        # no merge needed: every single step (0.1) already crosses 0.05
        (UNIFORM, 0.05, None, [(i, 1) for i in range(10)]),
        (UNIFORM, 0.05, 5, [(i, 1) for i in range(5)]),
        # gap 0.25 needs 3 steps of 0.1 (2 give 0.2); at 9 the grid ends after one step (0.1): left to the ODE
        (UNIFORM, 0.25, None, [(0, 3), (3, 3), (6, 3)]),
        # window of 5: at 3 only 2 steps fit (0.2 < 0.25), at 4 only 1: both left to the ODE
        (UNIFORM, 0.25, 5, [(0, 3)]),
        # uneven grid, diffs 0.4, 0.15, 0.05, 0.02, 0.13, 0.25: 0 alone; 1 needs 2 (0.2); 3 needs 3 (0.4)
        (torch.tensor([1.0, 0.6, 0.45, 0.4, 0.38, 0.25, 0.0]), 0.18, None, [(0, 1), (1, 2), (3, 3)]),
    ],
)
def test_merge_length_is_the_smallest_that_crosses_tau(grid, gap, limit, expected):
    assert merge_plan(grid, kind="dance_sde", noise_level=1.0, tau=_tau(gap), limit=limit) == expected


def test_entropy_rule_reproduces_the_released_hand_lists():
    # E-GRPO's script (shengjun-zhang/VisualGRPO, scripts/finetune/finetune_g2rpo_hps_merge.sh): 16 steps,
    # shift 3, eta 0.7, --eta_step_list 0 1 2 4 --eta_step_merge_list 1 1 2 3; SDE in the first half (8 steps)
    t = torch.linspace(1, 0, 17, dtype=torch.float64)
    grid = (3 * t / (1 + 2 * t)).float()
    assert merge_plan(grid, kind="flow_sde", noise_level=A, tau=0.9, limit=8) == [(0, 1), (1, 1), (2, 2), (4, 3)]


def test_merge_plan_errors():
    with pytest.raises(ValueError, match="largest reachable entropy"):
        merge_plan(UNIFORM, kind="dance_sde", noise_level=1.0, tau=_tau(2.0))  # even the whole grid is 1.0
    with pytest.raises(ValueError, match="cps"):
        merge_plan(UNIFORM, kind="cps", noise_level=0.8, tau=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        merge_plan(UNIFORM, kind="flow_sde", noise_level=A)
    with pytest.raises(ValueError, match="exactly one"):
        merge_plan(UNIFORM, kind="flow_sde", noise_level=A, tau=0.5, steps=[0])
    with pytest.raises(ValueError, match="window"):
        merge_plan(UNIFORM, kind="flow_sde", noise_level=A, tau=0.5, limit=11)


def test_hand_lists():
    kw = {"kind": "flow_sde", "noise_level": A}
    assert merge_plan(UNIFORM, steps=[0, 1, 2, 4], lengths=[1, 1, 2, 3], **kw) == [(0, 1), (1, 1), (2, 2), (4, 3)]
    assert merge_plan(UNIFORM, steps=[2, 5], **kw) == [(2, 1), (5, 1)]
    assert merge_plan(UNIFORM, steps=[7], lengths=[3], **kw) == [(7, 3)]  # may end on the last grid point
    with pytest.raises(ValueError, match="overlap"):
        merge_plan(UNIFORM, steps=[0, 1], lengths=[2, 1], **kw)
    with pytest.raises(ValueError, match="overlap"):
        merge_plan(UNIFORM, steps=[3, 1], **kw)
    with pytest.raises(ValueError, match="leaves the grid"):
        merge_plan(UNIFORM, steps=[8], lengths=[3], **kw)
    with pytest.raises(ValueError, match="equal length"):
        merge_plan(UNIFORM, steps=[0, 2], lengths=[1], **kw)


def test_chunker_construction_checks_the_config():
    with pytest.raises(ValueError, match="exactly one"):
        chunker_settings(name="entropy_merge")
    with pytest.raises(ValueError, match="exactly one"):
        chunker_settings(name="entropy_merge", entropy_threshold=1.0, merge_steps=[0])
    with pytest.raises(ValueError, match="merge_lengths needs"):
        chunker_settings(name="entropy_merge", entropy_threshold=1.0, merge_lengths=[2])
    cfg = build_config({"chunker": {"name": "entropy_merge", "entropy_threshold": 0.9, "sde_fraction": 0.5}})
    assert isinstance(build_chunker(cfg.objective.chunker), EntropyMerge)


def test_cps_is_rejected_before_any_model_call():
    fake = FakeAdapter()
    with pytest.raises(ValueError, match="cps"):
        _rollout(fake, kind="cps")
    assert fake.calls == []


# ------------------------------------------------------------------ the rollout
def test_record_layout_and_merged_jump_log_prob():
    fake = FakeAdapter()
    _, traj = _rollout(fake)
    plan = [(0, 1), (1, 3), (4, 1)]
    p, g, t_count = 2, 3, 6
    assert traj.batch_size == p * len(plan) * g
    assert traj.latents.shape == (18, t_count + 1, 4, 3)
    sig = traj.sigmas
    for b in range(traj.batch_size):
        k = (b // g) % len(plan)
        s, m = plan[k]
        assert traj.stochastic[b].nonzero().flatten().tolist() == [s]
        expected_jump = [1] * t_count
        expected_jump[s] = m
        for t in range(s + 1, s + m):
            expected_jump[t] = 0
        assert traj.jump[b].tolist() == expected_jump
        assert int(traj.prompt_ids[b]) == [10, 11][b // (g * len(plan))]
        # positions inside the jump repeat its end
        for t in range(s + 1, s + m):
            assert torch.equal(traj.latents[b, t], traj.latents[b, s + m])
        # the jump's log-prob: N(mean, std²) of flow_sde over [σ_s, σ_{s+m}], averaged over the latent dims
        x, x_next = traj.latents[b, s], traj.latents[b, s + m]
        sg, sn = float(sig[s]), float(sig[s + m])
        emb = fake.encode_prompts([traj.prompts[b]])
        v = fake.velocity(x[None], torch.tensor([sg]), emb, 1.0)[0]
        dt = sn - sg
        std_coef = A * math.sqrt(sg / ((1 - sn) if sg >= 1 else (1 - sg)))
        mean = x * (1 + std_coef**2 / (2 * sg) * dt) + v * (1 + std_coef**2 * (1 - sg) / (2 * sg)) * dt
        std = std_coef * math.sqrt(-dt)
        expected = torch.distributions.Normal(mean.double(), std).log_prob(x_next.double()).mean()
        assert traj.log_probs[b, s].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)
        others = [t for t in range(t_count) if t != s]
        assert bool((traj.log_probs[b, others] == 0).all())
    # the merged jump spans 3 grid steps: its std is that of σ_1 → σ_4, not of one step
    assert traj.jump[3, 1] == 3


def test_group_shares_anchor_bit_for_bit_and_differs_after():
    fake = FakeAdapter()
    _, traj = _rollout(fake)
    plan = [(0, 1), (1, 3), (4, 1)]
    g, sig = 3, traj.sigmas
    for a, pid in enumerate([10, 11]):
        # the anchor, by hand: the prompt's shared initial noise, then Euler steps x + (σ_{t+1} − σ_t)·v
        x = fake.initial_latents(1, [make_generator(5, 2, pid, "init", 0)])
        emb = fake.encode_prompts([f"prompt {pid}"])
        anchor = [x[0]]
        for t in range(4):
            x = x + (sig[t + 1] - sig[t]) * fake.velocity(x, sig[t].view(1), emb, 1.0)
            anchor.append(x[0])
        rows = range(a * len(plan) * g, (a + 1) * len(plan) * g)
        for b in rows:
            s = int(_branch_step(traj)[b])
            torch.testing.assert_close(traj.latents[b, : s + 1], torch.stack(anchor[: s + 1]), atol=1e-6, rtol=0)
            # any two samples of the prompt hold the same anchor latents, bit for bit, up to the earlier branch
            for c in rows:
                u = min(s, int(_branch_step(traj)[c]))
                assert torch.equal(traj.latents[b, : u + 1], traj.latents[c, : u + 1])
        for k, (s, _m) in enumerate(plan):
            group = [rows[0] + k * g + j for j in range(g)]
            assert len({int(traj.group_ids[b]) for b in group}) == 1
            for i in group[1:]:
                assert torch.equal(traj.latents[i, : s + 1], traj.latents[group[0], : s + 1])
                for t in range(s + 1, 7):  # after the branch step no latent is shared
                    assert not torch.equal(traj.latents[i, t], traj.latents[group[0], t])
                    assert not torch.isclose(traj.latents[i, t], traj.latents[group[0], t]).any()


@pytest.mark.parametrize("ode_after_jump", ["landing", "next_step"])
def test_transformer_calls_one_per_shared_prefix_step_per_prompt(ode_after_jump):
    fake = FakeAdapter()
    plan = [(0, 1), (1, 3), (4, 1)]
    p, g, t_count = 2, 3, 6
    _rollout(fake, num_prompts=p, group=g, batch_size=4, ode_after_jump=ode_after_jump)
    # the ODE after a jump (s, m) starts at grid step s + m (landing) or s + 1 (next_step, the release)
    ode_from = {(s, m): s + m if ode_after_jump == "landing" else s + 1 for s, m in plan}
    sig = fake.sigmas(t_count).tolist()
    rows = {}  # (prompt tag, step) -> rows evaluated
    for tags, sigmas in fake.calls:
        for tag, s in zip(tags, sigmas, strict=True):
            key = (tag, sig.index(s))
            rows[key] = rows.get(key, 0) + 1
    s_max = plan[-1][0]
    for tag in range(p):
        for t in range(t_count):
            # the anchor: one row per step up to the last branch step; each branch: G rows per ODE step after
            # its jump (the jump itself reuses the anchor's velocity)
            expected = int(t <= s_max) + g * sum(1 for jump in plan if ode_from[jump] <= t)
            assert rows.get((tag, t), 0) == expected, (tag, t)
    total = sum(rows.values())
    # landing: 58 rows for 18 samples; next_step: 2 more per sample of the (1, 3) jump, 70 rows
    assert total == p * ((s_max + 1) + g * sum(t_count - ode_from[jump] for jump in plan))
    assert total == {"landing": 58, "next_step": 70}[ode_after_jump]
    # calls are batched: no call holds more than batch_size rows
    assert max(len(tags) for tags, _ in fake.calls) <= 4


def test_rollout_does_not_depend_on_batch_size():
    _, a = _rollout(FakeAdapter(), batch_size=1)
    _, b = _rollout(FakeAdapter(), batch_size=7)
    assert torch.equal(a.latents, b.latents)
    assert torch.equal(a.log_probs, b.log_probs)


def test_groups_are_prompt_and_branch_step():
    fake = FakeAdapter()
    chunker, traj = _rollout(fake)
    plan = [(0, 1), (1, 3), (4, 1)]
    g, t_count = 3, 6
    steps = _branch_step(traj)
    assert traj.group_ids.tolist() == [int(p) * (t_count + 1) + int(s)
                                       for p, s in zip(traj.prompt_ids, steps, strict=True)]
    _, counts = torch.unique(traj.group_ids, return_counts=True)
    assert counts.tolist() == [g] * (2 * len(plan))
    # rewards 10·k + j (k the branch index, j the sample): per (prompt, step) every group is {0, 1, 2} + const,
    # so A = (j − 1)/(√(2/3) + 1e-4); grouping by prompt alone would mix the branch steps
    k = torch.tensor([[s for s, _ in plan].index(int(x)) for x in steps])
    j = torch.arange(traj.batch_size) % g
    r = (10.0 * k + j).float()
    adv = compute_advantages(Rewards({"r": r}, {"r": 1.0}, r), traj.group_ids)
    expected = (j.double() - 1) / (math.sqrt(2 / 3) + 1e-4)
    torch.testing.assert_close(adv.values.double(), expected, atol=1e-6, rtol=0)
    # the plan: one chunk per branch step, each sample trains only its own jump
    cp = chunker.plan(traj, 0, torch.Generator())
    assert cp.chunks == ((0,), (1,), (4,))
    for b in range(traj.batch_size):
        assert cp.selected[b].tolist() == [int(steps[b]) == s for s, _ in plan]


# ------------------------------------------------------------------ configs
def test_configs_give_the_released_branch_steps():
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowgrpo.config import load_config

    cfg = load_config("configs/flux_egrpo.yaml")
    chunker = build_chunker(cfg.objective.chunker)
    released = [(0, 1), (1, 1), (2, 2), (4, 3)]  # --eta_step_list 0 1 2 4 --eta_step_merge_list 1 1 2 3
    t = torch.linspace(1, 0, 17, dtype=torch.float64)
    assert chunker.branch_plan((3 * t / (1 + 2 * t)).float(), "flow_sde", 0.7) == released  # released grid
    # FLUX.1-dev's scheduler (its scheduler_config.json) at 720 px: 45×45 packed tokens, mu by linear interpolation
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    mu = 0.5 + (1.15 - 0.5) * (45 * 45 - 256) / (4096 - 256)
    sched.set_timesteps(16, sigmas=np.linspace(1.0, 1 / 16, 16), mu=mu)
    assert chunker.branch_plan(sched.sigmas.float(), cfg.sampling.sde_kind, cfg.sampling.noise_level) == released
    assert cfg.train.group_size == 12 and cfg.sampling.num_steps == 16
    assert cfg.train.group_size % cfg.train_batch_size == 0
    digits = load_config("configs/digits_egrpo.yaml")
    assert isinstance(build_chunker(digits.objective.chunker), EntropyMerge)
    assert digits.model.pretrained == "digits" and digits.rewards[0].name == "digit_correctness"


# ------------------------------------------------------------------ end to end on the tiny FLUX
def _tiny_run_config(tiny_flux_dir, tmp_path, **train):
    """E-GRPO on the tiny FLUX, 4 steps: σ = 1, .826, .613, .345, 0; entropies (flow_sde, a 0.7) 1.062, 1.068,
    then 0.633 for one step from .613 and 1.047 for two: τ = 1 gives [(0, 1), (1, 1), (2, 2)], one merged jump."""
    return build_config({
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 32, "height": 64, "width": 64,
                  "lora_rank": 4, "lora_alpha": 8},
        "sampling": {"num_steps": 4, "guidance_scale": 3.5, "sde_kind": "flow_sde", "noise_level": A},
        "eval_sampling": {"num_steps": 2},
        "chunker": {"name": "entropy_merge", "entropy_threshold": 1.0, "sde_fraction": 1.0},
        "algo": {"clip_range": 1e-3},
        "train": {"group_size": 2, "lr": 1e-3, **train},
        "rewards": [{"name": "jpeg_compressibility"}],
        "data": {"train_prompts": "t2i_compbench", "eval_num_prompts": 2},
        "logging": {"progress": False},
    })


@pytest.mark.slow
def test_training_run_tiny_flux(tiny_flux_dir, tmp_path):
    from flowgrpo.runner import run

    run(_tiny_run_config(tiny_flux_dir, tmp_path, num_epochs=2, prompts_per_epoch=1, rollout_batch_size=2,
                         train_batch_size=2))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "policy/logprob_mismatch_max" in r]
    assert len(epochs) == 2
    for r in epochs:
        assert r["policy/logprob_mismatch_max"] == 0.0
        assert r["plan/chunks"] == 3
        assert r["plan/trained_frac"] == pytest.approx((1 + 1 + 2) / 3 / 4)  # jumps of 1, 1, 2 of 4 steps
        assert r["policy/pairs"] == 6  # 1 prompt × 3 branch steps × 2 samples, one jump each
        assert r["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert math.isfinite(r["reward/jpeg_compressibility/mean"])
        assert "timing/recompute" in r


def test_training_forwards_each_shared_anchor_once(tiny_flux):
    """E-GRPO's G rows of a (prompt, branch step) group start their jump from one anchor latent: the training
    forward runs the transformer once per group; log-probs and gradients equal G separate forwards."""
    from flowgrpo.sampling.packed_forward import chunk_forward

    cfg = chunker_settings(name="entropy_merge", merge_steps=[0, 1], merge_lengths=[1, 2])
    chunker = build_chunker(cfg)
    assert chunker.shares_inputs
    g = 3
    pids = torch.tensor([0, 1]).repeat_interleave(g)
    settings = SamplingConfig(num_steps=4, guidance_scale=3.5, sde_kind="flow_sde", noise_level=A)
    request = RolloutRequest(["a red cube"] * g + ["a blue ball"] * g,
                             [{}] * (2 * g), pids, torch.arange(g).repeat(2), settings=settings, batch_size=2 * g,
                             seed=0, epoch=0)
    traj = chunker.rollout(tiny_flux, request)
    rows = torch.nonzero(traj.stochastic[:, 1]).flatten()  # the rows that branched at step 1: 2 groups × G
    assert len(rows) == 2 * g
    seen = []
    hook = tiny_flux.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("hidden_states", a[0] if a else None).shape[0]), with_kwargs=True)
    params = [p for p in tiny_flux.transformer.parameters() if p.requires_grad][:3]
    assert params, "the test needs trainable parameters to compare gradients"
    grads = []
    try:
        for shared in (None, traj.group_ids[rows]):
            tiny_flux.transformer.zero_grad()
            lp = chunk_forward(tiny_flux, traj, rows, (1,), settings, with_ref=False, shared_inputs=shared).log_probs
            (lp * torch.arange(1.0, len(rows) + 1).unsqueeze(1)).sum().backward()  # a different weight per row
            grads.append([p.grad.clone() for p in params])
            if shared is None:
                separate = lp.detach()
            else:
                together = lp.detach()
    finally:
        hook.remove()
    assert seen == [2 * g, 2]  # one row per group instead of G
    torch.testing.assert_close(together, separate, rtol=0, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_packed_forward_of_two_chunks_equals_their_separate_forwards(tiny_flux):
    """Two chunks' shared-anchor rows forwarded in one transformer call (the trainer packs a micro-batch's chunks
    up to train_batch_size transformer rows): the same log-probs and gradients as one call per chunk."""
    from flowgrpo.sampling.packed_forward import chunk_forward, packed_forward

    chunker = build_chunker(chunker_settings(name="entropy_merge", merge_steps=[0, 1], merge_lengths=[1, 2]))
    g = 3
    settings = SamplingConfig(num_steps=4, guidance_scale=3.5, sde_kind="flow_sde", noise_level=A)
    request = RolloutRequest(["a red cube"] * g + ["a blue ball"] * g, [{}] * (2 * g),
                             torch.tensor([0, 1]).repeat_interleave(g), torch.arange(g).repeat(2),
                             settings=settings, batch_size=2 * g, seed=0, epoch=0)
    traj = chunker.rollout(tiny_flux, request)
    items = [(torch.nonzero(traj.stochastic[:, t]).flatten(), (t,)) for t in (0, 1)]  # 2 groups × G rows each
    shared = [traj.group_ids[rows] for rows, _ in items]
    seen = []
    hook = tiny_flux.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("hidden_states", a[0] if a else None).shape[0]), with_kwargs=True)
    params = [p for p in tiny_flux.transformer.parameters() if p.requires_grad][:3]
    weights = [torch.arange(1.0, len(rows) + 1).unsqueeze(1) * (k + 1) for k, (rows, _) in enumerate(items)]
    try:
        tiny_flux.transformer.zero_grad()
        together = packed_forward(tiny_flux, traj, items, settings, with_ref=False, shared_inputs=shared)
        sum((f.log_probs * w).sum() for f, w in zip(together, weights, strict=True)).backward()
        grads_together = [p.grad.clone() for p in params]
        tiny_flux.transformer.zero_grad()
        separate = [chunk_forward(tiny_flux, traj, rows, chunk, settings, with_ref=False, shared_inputs=s)
                    for (rows, chunk), s in zip(items, shared, strict=True)]
        sum((f.log_probs * w).sum() for f, w in zip(separate, weights, strict=True)).backward()
        grads_separate = [p.grad.clone() for p in params]
    finally:
        hook.remove()
    assert seen == [4, 2, 2]  # one call of 2 groups × 2 steps, then one call of 2 groups per chunk
    for a, b in zip(together, separate, strict=True):
        assert a.log_probs.shape == b.log_probs.shape == (2 * g, 1)
        torch.testing.assert_close(a.log_probs.detach(), b.log_probs.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(a.means, b.means, rtol=0, atol=1e-6)
    for a, b in zip(grads_together, grads_separate, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_pack_fills_calls_in_order_up_to_the_limit():
    from flowgrpo.algo.microbatches import pack as _pack

    items = [("a", 1), ("b", 2), ("c", 1), ("d", 9), ("e", 3), ("f", 2)]
    assert _pack(items, lambda name, cost: cost, 4) == [
        [("a", 1), ("b", 2), ("c", 1)], [("d", 9)], [("e", 3)], [("f", 2)]]
    assert _pack([], lambda name, cost: cost, 4) == []


@pytest.mark.slow
def test_training_packs_a_micro_batchs_branch_steps_into_one_call(tiny_flux_dir, tmp_path):
    """train_batch_size 4 over E-GRPO's 12 trajectories (2 prompts × 3 branch steps × G 2): 3 micro-batches of
    two (prompt, branch step) groups, each one transformer call of 2 rows (a group's samples share their input);
    the recompute uses the same packs, so the first ratio is still exactly 1."""
    from flowgrpo.runner import run

    run(_tiny_run_config(tiny_flux_dir, tmp_path, num_epochs=1, prompts_per_epoch=2, rollout_batch_size=4,
                         train_batch_size=4))
    (r,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert r["policy/pairs"] == 12
    assert r["policy/logprob_mismatch_max"] == 0.0
    assert r["update/transformer_calls"] == 3 and r["update/transformer_rows"] == 6


@pytest.mark.slow
def test_too_many_optimizer_steps_for_the_branch_trajectories_is_one_error_before_any_evaluation(tiny_flux_dir,
                                                                                                   tmp_path):
    """E-GRPO's micro-batch count (P·|S|·G / train_batch_size) is known only on the σ grid: with 3 micro-batches
    (2 prompts × 3 branch steps × G 2 / 4) two optimizer steps would be unequal shares, four would have an empty
    one; both are refused once the model is loaded, before the evaluation writes anything."""
    from flowgrpo.runner import run

    for steps in (2, 4):
        cfg = _tiny_run_config(tiny_flux_dir, tmp_path, num_epochs=1, prompts_per_epoch=2, rollout_batch_size=4,
                               train_batch_size=4, optimizer_steps_per_epoch=steps)
        with pytest.raises(ValueError, match=rf"optimizer_steps_per_epoch={steps} must divide the 3 training "
                           r"micro-batches of 12 trajectories a process \(4 samples × 3 branch steps"):
            run(cfg)
        assert not (tmp_path / "run").exists()
    cfg = _tiny_run_config(tiny_flux_dir, tmp_path, num_epochs=1, prompts_per_epoch=2, rollout_batch_size=4,
                           train_batch_size=4, optimizer_steps_per_epoch=3)
    from flowgrpo.preflight import check_batch

    check_batch(cfg, 1, per_sample=3)  # 3 micro-batches, 3 steps: accepted
    with pytest.raises(ValueError, match="must divide the 4 training micro-batches"):
        check_batch(cfg, 1, per_sample=4)  # 4 micro-batches do not split into 3 equal shares
