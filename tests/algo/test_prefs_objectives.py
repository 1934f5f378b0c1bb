"""The preference and supervised objectives' pure functions (flowgrpo.algo.objectives.dpo, dpo_offline, sft),
against values derived here by hand in float64 from the formulas of the releases:

- Diffusion-DPO (arXiv 2311.12908 eq. 14; SalesforceAIResearch/DiffusionDPO train.py 1125–1145; Flow-Factory
  trainers/dpo.py 597–611): e = mean((v − (ε − x₀))²) per image, s = −β/2·((e_θʷ − e_refʷ) − (e_θˡ − e_refˡ)),
  loss = log(1 + exp(−s)) (softplus, an independent form of −log σ(s));
- the pairs of a group by advantage (Flow-Factory ``_form_pairs_from_advantages``: argmax against argmin);
- the flow-matching loss mean((v − (ε − x₀))²) (SD3, arXiv 2403.03206; diffusers' SD3 DreamBooth script).
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.algo.objectives.dpo import DPOConfig, dpo_terms, pair_slots, preference_pairs
from flowgrpo.algo.objectives.dpo_offline import dataset_pairs
from flowgrpo.algo.objectives.sft import SFTConfig, seeded_draws, sft_terms, train_sigmas

# two pairs of 3-dim "latents": chosen/rejected clean latents, the shared noise, four velocities each
X0_W = [[0.2, -0.1, 0.4], [1.0, 0.5, -0.3]]
X0_L = [[-0.5, 0.3, 0.0], [0.1, -0.2, 0.6]]
EPS = [[0.3, 0.8, -1.1], [-0.4, 0.9, 0.2]]
V_W = [[0.0, 0.9, -1.2], [-1.3, 0.2, 0.6]]
V_L = [[0.9, 0.4, -1.0], [-0.6, 1.0, -0.5]]
R_W = [[0.2, 0.8, -1.6], [-1.5, 0.5, 0.4]]
R_L = [[0.7, 0.6, -1.1], [-0.4, 1.2, -0.3]]


def _hand_dpo(beta: float) -> list[float]:
    """Per pair, by hand: the four squared errors, s and softplus(−s)."""
    out = []
    def err(v, x0, i):
        return sum((v[i][d] - (EPS[i][d] - x0[i][d])) ** 2 for d in range(3)) / 3

    for i in range(2):
        s = -beta / 2 * ((err(V_W, X0_W, i) - err(R_W, X0_W, i)) - (err(V_L, X0_L, i) - err(R_L, X0_L, i)))
        out.append(math.log1p(math.exp(-s)))
    return out


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("beta", [1.0, 7.5])
def test_dpo_loss_is_the_release_formula_by_hand(beta):
    terms = dpo_terms(_t(V_W), _t(V_L), _t(R_W), _t(R_L), _t(EPS), _t(X0_W), _t(X0_L), beta)
    assert terms.loss.tolist() == pytest.approx(_hand_dpo(beta), rel=1e-6)
    # the hand values are not symmetric in the pair or the sign: a swapped pair or a flipped sign differs
    swapped = dpo_terms(_t(V_L), _t(V_W), _t(R_L), _t(R_W), _t(EPS), _t(X0_L), _t(X0_W), beta)
    assert swapped.loss.tolist() != pytest.approx(_hand_dpo(beta), rel=1e-3)


def test_dpo_gradient_lowers_the_chosen_error_against_the_rejected_one():
    """d loss / d e_θʷ = β/2·σ(−s) > 0 and d loss / d e_θˡ = −β/2·σ(−s): one gradient step on the velocities
    lowers the chosen image's error and raises the rejected one's."""
    beta = 4.0
    v_w, v_l = _t(V_W).requires_grad_(), _t(V_L).requires_grad_()
    terms = dpo_terms(v_w, v_l, _t(R_W), _t(R_L), _t(EPS), _t(X0_W), _t(X0_L), beta)
    terms.loss.sum().backward()
    for i in range(2):
        s = float(terms.stats["margin"][i])
        scale = beta / 2 / (1 + math.exp(s))  # β/2·σ(−s)
        # d e / d v = 2(v − target)/3 per dim
        want_w = [scale * 2 * (V_W[i][d] - (EPS[i][d] - X0_W[i][d])) / 3 for d in range(3)]
        want_l = [-scale * 2 * (V_L[i][d] - (EPS[i][d] - X0_L[i][d])) / 3 for d in range(3)]
        assert v_w.grad[i].tolist() == pytest.approx(want_w, rel=1e-5, abs=1e-6)
        assert v_l.grad[i].tolist() == pytest.approx(want_l, rel=1e-5, abs=1e-6)


def test_dpo_stats_and_refusals():
    terms = dpo_terms(_t(V_W), _t(V_L), _t(R_W), _t(R_L), _t(EPS), _t(X0_W), _t(X0_L), 2.0)
    assert terms.stats["implicit_acc"].tolist() == [float(m > 0) for m in terms.stats["margin"].tolist()]
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_terms(_t(V_W), _t(V_L), _t(R_W), _t(R_L), _t(EPS), _t(X0_W), _t(X0_L), 0.0)
    with pytest.raises(ValueError, match="equal shapes"):
        dpo_terms(_t(V_W)[:1], _t(V_L), _t(R_W), _t(R_L), _t(EPS), _t(X0_W), _t(X0_L), 1.0)
    with pytest.raises(ValueError, match="pairs\n  Input should be 'best_worst' or 'all'"):
        DPOConfig(pairs="random")


def test_best_worst_pairs_by_hand():
    adv = torch.tensor([0.3, -1.0, 2.0, 0.1, 0.5, 0.5, 0.5, 0.5, 1.0, 9.0, -2.0, 0.0])
    groups = torch.tensor([7] * 4 + [8] * 4 + [9] * 4)
    valid = torch.ones(12, dtype=torch.bool)
    valid[9] = False  # the best of group 9 left out by the advantages: its next best is chosen
    w, lo, ok = preference_pairs(adv, groups, valid, "best_worst")
    # group 7: best 2 (2.0), worst 1 (−1.0); group 8: all equal, no pair; group 9: best 8 (1.0), worst 10 (−2.0)
    assert w.tolist() == [2, 4, 8] and lo.tolist() == [1, 4, 10] and ok.tolist() == [True, False, True]


def test_all_pairs_by_hand():
    adv = torch.tensor([0.3, -1.0, 2.0, 0.3])
    valid = torch.tensor([True, True, True, False])
    w, lo, ok = preference_pairs(adv, torch.zeros(4, dtype=torch.long), valid, "all")
    assert pair_slots(4, "all") == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    pairs = [(a, b) for a, b, k in zip(w.tolist(), lo.tolist(), ok.tolist(), strict=True) if k]
    assert pairs == [(0, 1), (2, 0), (2, 1)]  # the higher advantage chosen; sample 3 invalid
    assert ok.tolist() == [True, True, False, True, False, False]


def test_pairs_refuse_split_groups():
    with pytest.raises(ValueError, match="adjacent"):
        preference_pairs(torch.zeros(4), torch.tensor([1, 2, 1, 2]), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="one size"):
        preference_pairs(torch.zeros(5), torch.tensor([1, 1, 1, 2, 2]), torch.ones(5, dtype=torch.bool))


def test_dataset_pairs_chosen_first():
    w, lo, ok = dataset_pairs(torch.tensor([0, 1, 0, 1, 0, 1]))
    assert w.tolist() == [0, 2, 4] and lo.tolist() == [1, 3, 5] and ok.all()
    with pytest.raises(ValueError, match="groups of 2"):
        dataset_pairs(torch.tensor([0, 1, 2, 0, 1, 2]))


def test_sft_loss_by_hand():
    v, eps, x0, ref = _t(V_W), _t(EPS), _t(X0_W), _t(R_W)
    want = [sum((V_W[i][d] - (EPS[i][d] - X0_W[i][d])) ** 2 for d in range(3)) / 3 for i in range(2)]
    kl = [sum((V_W[i][d] - R_W[i][d]) ** 2 for d in range(3)) / 3 for i in range(2)]
    assert sft_terms(v, eps, x0, SFTConfig()).loss.tolist() == pytest.approx(want, rel=1e-6)
    got = sft_terms(v, eps, x0, SFTConfig(kl_beta=0.5), v_ref=ref).loss.tolist()
    assert got == pytest.approx([a + 0.5 * b for a, b in zip(want, kl, strict=True)], rel=1e-6)
    with pytest.raises(ValueError, match="needs the reference"):
        sft_terms(v, eps, x0, SFTConfig(kl_beta=0.5))


def test_train_sigmas_are_the_logit_normal_density():
    """σ = sigmoid(m + s·z), z standard normal from the generator (diffusers' logit_normal scheme)."""
    s = SFTConfig(logit_mean=0.4, logit_std=2.0, num_train_timesteps=5)
    got = train_sigmas(5, s, torch.Generator().manual_seed(3))
    z = torch.randn(5, generator=torch.Generator().manual_seed(3))
    assert got.tolist() == pytest.approx(torch.sigmoid(0.4 + 2.0 * z).tolist(), rel=1e-6)
    u = train_sigmas(4, SFTConfig(weighting_scheme="uniform"), torch.Generator().manual_seed(1))
    assert u.tolist() == pytest.approx(torch.rand(4, generator=torch.Generator().manual_seed(1)).tolist())


def test_seeded_draws_are_each_rows_own():
    """dpo's and sft's draws (:func:`seeded_draws`): row r's K σ's and then its K noises come from one generator
    seeded by sha256 of "parts/group/sample" (:func:`flowgrpo.rng.derive_seed`); σ = sigmoid(m + s·z) (the
    logit-normal density); the same row in another micro-batch draws the same numbers."""
    import hashlib
    from types import SimpleNamespace

    samples = SimpleNamespace(group_ids=torch.tensor([5, 5, 9, 9]), sample_index=torch.tensor([0, 1, 0, 1]),
                              x0=torch.zeros(4, 2, 3))
    density = SFTConfig(num_train_timesteps=3, logit_mean=0.4, logit_std=2.0)
    draws = seeded_draws(samples, torch.tensor([1, 2]), 3, density, 7, 0, 1, "sft")
    assert len(draws) == 3
    for i, r in enumerate((1, 2)):
        text = f"7/0/1/sft/{int(samples.group_ids[r])}/{int(samples.sample_index[r])}"
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)
        g = torch.Generator().manual_seed(seed)
        z, eps = torch.randn(3, generator=g), torch.randn((3, 2, 3), generator=g)
        for j, d in enumerate(draws):
            assert d.rows.tolist() == [1, 2]
            assert float(d.sigma[i]) == pytest.approx(float(torch.sigmoid(0.4 + 2.0 * z[j])), rel=1e-6)
            assert torch.equal(d.noise[i], eps[j])
    alone = seeded_draws(samples, torch.tensor([2]), 3, density, 7, 0, 1, "sft")
    assert all(torch.equal(a.noise[0], d.noise[1]) and a.sigma[0] == d.sigma[1] for a, d in zip(alone, draws,
                                                                                                 strict=True))


@pytest.mark.parametrize(("name", "why"), [("dpo", "pairs the samples of a group"),
                                           ("dpo_offline", "pairs the samples of a group"),
                                           ("dgpo", "sums its preference over each group's rows")])
def test_groups_spanning_processes_are_refused(name, why, monkeypatch):
    """3 prompts x G = 2 on 2 data ranks: 3 samples each, a group across both (its pair or group sum would be cut);
    4 prompts: two whole groups each, accepted."""
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config import build_config
    from flowgrpo.distributed import dist

    monkeypatch.setattr(dist, "data_world_size", lambda: 2)
    grid = torch.linspace(1, 0, 4)
    o = {"name": name, **({"trunc_steps": 1, "num_train_timesteps": 2} if name == "dgpo" else {})}
    cfg = build_config({"objective": o, "train": {"group_size": 2, "prompts_per_epoch": 3, "rollout_batch_size": 2}})
    with pytest.raises(ValueError, match=rf"objective '{name}' {why}: the 3 samples each of 2 data ranks holds must "
                                         r"be whole groups of train.group_size=2"):
        build_objective(cfg).check_grid(grid)
    cfg = build_config({"objective": o, "train": {"group_size": 2, "prompts_per_epoch": 4, "rollout_batch_size": 2}})
    build_objective(cfg).check_grid(grid)
