"""Specification of the step chunkers (flowgrpo.algo.chunkers).

Chunk boundaries of ``adaptive_chunks`` are derived on paper from the rule in its docstring (the derivations are
in the comments); sampling frequencies are checked with a chi-square test against probabilities computed by hand.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from flowgrpo.algo.chunkers import (
    CHUNKERS,
    adaptive_chunks,
    build_chunker,
    chunker_settings,
    relative_l1,
    trainable_steps,
)
from flowgrpo.records import PromptEmbeds, Trajectory


def _traj(latents: torch.Tensor, stochastic: torch.Tensor | None = None) -> Trajectory:
    b, t1 = latents.shape[:2]
    t = t1 - 1
    if stochastic is None:
        stochastic = torch.ones(b, t, dtype=torch.bool)
    elif stochastic.ndim == 1:
        stochastic = stochastic.expand(b, t).clone()
    return Trajectory(
        latents=latents, log_probs=torch.zeros(b, t), sigmas=torch.linspace(1, 0, t + 1), stochastic=stochastic,
        jump=torch.ones(b, t, dtype=torch.long), group_ids=torch.arange(b), prompt_ids=torch.arange(b),
        embeds=PromptEmbeds({"e": torch.zeros(b, 1)}), images=torch.zeros(b, 3, 2, 2), prompts=[""] * b,
        metadata=[{}] * b, guidance_scale=1.0,
    )


def _random_traj(b=3, t=8, seed=0, stochastic=None):
    return _traj(torch.randn(b, t + 1, 4, 2, generator=torch.Generator().manual_seed(seed)), stochastic)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------- relative L1


def test_relative_l1_by_hand():
    # L1_rel(t) = ‖x_{t+1} − x_t‖₁ / ‖x_{t+1}‖₁, averaged over the batch.
    # sample 0: x0 = [1, −1], x1 = [2, 0], x2 = [2, 2]: t=0: (1 + 1)/(2 + 0) = 1;   t=1: (0 + 2)/(2 + 2) = 0.5
    # sample 1: x0 = [0, 4],  x1 = [1, 3], x2 = [1, 2]: t=0: (1 + 1)/(1 + 3) = 0.5; t=1: (0 + 1)/(1 + 2) = 1/3
    # mean: [0.75, 5/12]. Latents carry extra dims (B, T+1, 1, 2): every non-(B, T) dim is summed.
    x = torch.tensor([[[1.0, -1.0], [2.0, 0.0], [2.0, 2.0]], [[0.0, 4.0], [1.0, 3.0], [1.0, 2.0]]]).unsqueeze(2)
    torch.testing.assert_close(relative_l1(x).double(), torch.tensor([0.75, 5 / 12], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------- adaptive chunks


def test_adaptive_chunks_monotone_curve():
    # Monotone curve, 8 positions, min_size 2 (rule: split when n ≥ 2·2 = 4).
    # top, order 1: d = [−40, −25, −15, −8, −4, −2, −1], one sign → no turn → midpoint 4: [0,4) [4,8).
    # [0,4) order 2: curve [100, 60, 35, 20], d1 = [−40, −25, −15], d2 = [15, 10], one sign → midpoint 2.
    # [4,8) order 2: curve [12, 8, 6, 5], d2 = [2, 1] → midpoint 6. Pieces of 2 < 4 stop.
    curve = torch.tensor([100.0, 60, 35, 20, 12, 8, 6, 5], dtype=torch.float64)
    assert adaptive_chunks(curve, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # min_size 3 on 10 positions: top d all negative → midpoint 5; pieces of 5 < 6 stop.
    curve10 = torch.linspace(1.0, 0.1, 10, dtype=torch.float64) ** 2
    assert adaptive_chunks(curve10, 3) == [(0, 5), (5, 10)]


def test_adaptive_chunks_one_bump():
    # 16 positions, min_size 3 (split when n ≥ 6).
    c = [1, 2, 4, 6.5, 9.5, 13, 15, 16, 14, 11, 7.5, 6, 4.8, 4.5, 4.25, 4.125]
    # top, order 1: d = [1, 2, 2.5, 3, 3.5, 2, 1, −2, −3, −3.5, −1.5, −1.2, −0.3, −0.25, −0.125];
    #   the sign turns between d[6] and d[7] → boundary 0 + 6 + 1 + 1//2 = 7 (the peak opens the next chunk);
    #   sides 7 and 9 ≥ 3 → accepted: [0,7) [7,16).
    # [0,7) order 2: d1 = [1, 2, 2.5, 3, 3.5, 2], d2 = [1, .5, .5, .5, −1.5]; turn at i = 3 → 0 + 3 + 1 + 1 = 5;
    #   right side 7 − 5 = 2 < 3 → rejected; no boundary → midpoint 0 + 7//2 = 3: [0,3) [3,7) (3 and 4 < 6: stop).
    # [7,16) order 2: curve [16, 14, 11, 7.5, 6, 4.8, 4.5, 4.25, 4.125]; d1 = [−2, −3, −3.5, −1.5, −1.2, −.3,
    #   −.25, −.125]; d2 = [−1, −.5, 2, .3, .9, .05, .125]: turn at i = 1 → 7 + 1 + 1 + 1 = 10; sides 3 and 6 →
    #   accepted: [7,10) (3 < 6: stop) and [10,16).
    # [10,16) order 3: curve [7.5, 6, 4.8, 4.5, 4.25, 4.125]; d1 = [−1.5, −1.2, −.3, −.25, −.125];
    #   d2 = [.3, .9, .05, .125]; d3 = [.6, −.85, .075]: turns at i = 0 → 10 + 0 + 1 + 3//2 = 12 (left side
    #   2 < 3: rejected) and i = 1 → 13 (sides 3 and 3: accepted): [10,13) [13,16).
    curve = torch.tensor(c, dtype=torch.float64)
    assert adaptive_chunks(curve, 3) == [(0, 3), (3, 7), (7, 10), (10, 13), (13, 16)]


def test_adaptive_chunks_noisy_curve():
    # A zig-zag (noise on every step), 12 positions, min_size 3.
    # top, order 1: d = [2, −3, 2, −3, 2, −3, 2, −3, 2, −3, 2]: a turn at every i, boundary candidate i + 1.
    #   left to right with last = 0: 1 (1 < 3 no), 2 (no), 3 (yes, last = 3), 4, 5 (no), 6 (yes), 7, 8 (no),
    #   9 (yes: 9 − 6 = 3, 12 − 9 = 3), 10 (12 − 10 = 2 < 3: no) → [0,3) [3,6) [6,9) [9,12), all < 6: stop.
    zigzag = torch.tensor([10.0, 12, 9, 11, 8, 10, 7, 9, 6, 8, 5, 7], dtype=torch.float64)
    assert adaptive_chunks(zigzag, 3) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    # A decreasing curve with one blip at position 4, min_size 3:
    # top: d = [−1, −1, −1, .5, −1.5, −1, −1, −1, −1, −1, −1]: turns at i = 2 → 3 (accepted: 3, 9) and
    #   i = 3 → 4 (4 − 3 = 1: rejected) → [0,3) [3,12).
    # [3,12) order 2: curve [9, 9.5, 8, 7, 6, 5, 4, 3, 2], d2 = [−2, .5, 0, 0, 0, 0, 0]: turns at i = 0 → 3 + 0 +
    #   1 + 1 = 5 (5 − 3 = 2: rejected) and i = 1 (+ → 0) → 6 (accepted: 3, 6) → [3,6) [6,12).
    # [6,12) order 3: curve [7, 6, 5, 4, 3, 2] is linear, d3 = [0, 0, 0]: no turn → midpoint 9.
    blip = torch.tensor([12.0, 11, 10, 9, 9.5, 8, 7, 6, 5, 4, 3, 2], dtype=torch.float64)
    assert adaptive_chunks(blip, 3) == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_adaptive_chunks_short_curve_is_one_chunk():
    assert adaptive_chunks(torch.tensor([3.0, 1.0, 2.0]), 2) == [(0, 3)]


@pytest.mark.parametrize("min_size", [1, 2, 3, 4])
def test_adaptive_chunks_partition_and_sizes(min_size):
    # the docstring's invariant: contiguous, covering, each chunk between min_size and 2·min_size − 1 long
    g = _gen(min_size)
    for n in range(2 * min_size, 30):
        curve = torch.rand(n, generator=g, dtype=torch.float64)
        chunks = adaptive_chunks(curve, min_size)
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks[:-1], chunks[1:], strict=True))
        assert all(min_size <= hi - lo <= 2 * min_size - 1 for lo, hi in chunks), (n, chunks)


def test_adaptive_chunks_rejects_min_size_zero():
    with pytest.raises(ValueError, match="min_chunk_size"):
        adaptive_chunks(torch.ones(6), 0)


# ----------------------------------------------------------------------------------------------- chunk chunker


def test_fixed_chunk_sizes_map_to_trainable_steps():
    plan = build_chunker(chunker_settings(name="chunk", chunk_sizes=[2, 3, 3])).plan(_random_traj(t=8), 0, _gen())
    assert plan.chunks == ((0, 1), (2, 3, 4), (5, 6, 7))
    assert plan.selected.shape == (3, 3) and plan.selected.all()
    # with the last step dropped, the sizes cover 7 trainable steps
    cfg = chunker_settings(name="chunk", chunk_sizes=[3, 4], drop_last_step=True)
    assert build_chunker(cfg).plan(_random_traj(t=8), 0, _gen()).chunks == ((0, 1, 2), (3, 4, 5, 6))


def test_fixed_chunk_sizes_that_do_not_sum_raise():
    with pytest.raises(ValueError, match=r"\[2, 3\].*8"):
        build_chunker(chunker_settings(name="chunk", chunk_sizes=[2, 3])).plan(_random_traj(t=8), 0, _gen())


def test_chunks_skip_deterministic_steps():
    # steps 0 and 5 are ODE for everyone, step 3 only for sample 1: trainable = [1, 2, 4, 6, 7]
    st = torch.ones(3, 8, dtype=torch.bool)
    st[:, 0] = st[:, 5] = False
    st[1, 3] = False
    traj = _random_traj(t=8, stochastic=st)
    assert trainable_steps(traj) == [1, 2, 4, 6, 7]
    plan = build_chunker(chunker_settings(name="chunk", chunk_sizes=[2, 3])).plan(traj, 0, _gen())
    assert plan.chunks == ((1, 2), (4, 6, 7))


def _latents_with_l1(l1: list[float], b: int) -> torch.Tensor:
    # x_{t+1} = x_t / (1 − l) makes ‖x_{t+1} − x_t‖₁ / ‖x_{t+1}‖₁ = l for positive latents
    xs = [1.0]
    for v in l1:
        xs.append(xs[-1] / (1 - v))
    return torch.tensor(xs, dtype=torch.float64).float().reshape(1, -1, 1).expand(b, -1, 1).clone()


def test_weighted_chunk_sampling_follows_mean_l1_one_chunk_each():
    # chunks [0,1] [2,3] [4,5] with mean L1_rel 0.1, 0.2, 0.5 → probabilities 1/8, 2/8, 5/8.
    b = 4000
    traj = _traj(_latents_with_l1([0.1, 0.1, 0.2, 0.2, 0.5, 0.5], b))
    cfg = chunker_settings(name="chunk", chunk_sizes=[2, 2, 2], chunk_fraction=1 / 3, chunk_selection="weighted",
                           weight_reference="x_next_batch")
    plan = build_chunker(cfg).plan(traj, 0, _gen(1))
    assert plan.selected.sum(1).tolist() == [1] * b
    counts = plan.selected.sum(0).double()
    expected = torch.tensor([1 / 8, 2 / 8, 5 / 8], dtype=torch.float64) * b
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    # the same draw under uniform probabilities would be rejected outright (the test has power)
    assert chisquare(counts.numpy(), torch.full((3,), b / 3, dtype=torch.float64).numpy()).pvalue < 1e-6


def test_weighted_chunk_sampling_without_replacement():
    # two of three chunks per trajectory, drawn one after the other without replacement (p = 1/8, 2/8, 5/8):
    # P({i, j}) = p_i·p_j/(1 − p_i) + p_j·p_i/(1 − p_j):
    #   {0,1}: (2/64)/(7/8) + (2/64)/(6/8) = 2/56 + 2/48;  {0,2}: 5/56 + 5/24;  {1,2}: 10/48 + 10/24
    b = 4000
    traj = _traj(_latents_with_l1([0.1, 0.1, 0.2, 0.2, 0.5, 0.5], b))
    cfg = chunker_settings(name="chunk", chunk_sizes=[2, 2, 2], chunk_fraction=2 / 3, chunk_selection="weighted",
                           weight_reference="x_next_batch")
    plan = build_chunker(cfg).plan(traj, 0, _gen(2))
    assert plan.selected.sum(1).tolist() == [2] * b  # never the same chunk twice
    pair = {(0, 1): 0, (0, 2): 1, (1, 2): 2}
    counts = torch.zeros(3)
    for row in plan.selected:
        counts[pair[tuple(row.nonzero().flatten().tolist())]] += 1
    probs = [2 / 56 + 2 / 48, 5 / 56 + 5 / 24, 10 / 48 + 10 / 24]
    assert sum(probs) == pytest.approx(1.0)
    assert chisquare(counts.numpy(), (torch.tensor(probs, dtype=torch.float64) * b).numpy()).pvalue > 1e-3


def test_chunk_plan_is_reproducible_from_the_generator():
    traj = _traj(_latents_with_l1([0.1, 0.1, 0.2, 0.2, 0.5, 0.5], 16))
    chunker = build_chunker(chunker_settings(name="chunk", chunk_sizes=[2, 2, 2], chunk_fraction=0.5))
    assert torch.equal(chunker.plan(traj, 0, _gen(5)).selected, chunker.plan(traj, 0, _gen(5)).selected)


def test_adaptive_chunk_chunker_uses_the_batch_l1_curve():
    # the chunker must cut where adaptive_chunks cuts the batch's L1_rel curve over the trainable steps
    traj = _random_traj(b=4, t=10, seed=3)
    plan = build_chunker(chunker_settings(name="chunk", min_chunk_size=2)).plan(traj, 0, _gen())
    bounds = adaptive_chunks(relative_l1(traj.latents), 2)
    assert plan.chunks == tuple(tuple(range(lo, hi)) for lo, hi in bounds)


# ----------------------------------------------------------------------------------------------- trajectory


@pytest.mark.parametrize("drop_last", [False, True])
def test_trajectory_chunker_is_chunk_with_one_chunk(drop_last):
    st = torch.ones(3, 8, dtype=torch.bool)
    st[:, 2] = False
    traj = _random_traj(t=8, stochastic=st)
    k = 6 if drop_last else 7
    whole = build_chunker(chunker_settings(name="trajectory", drop_last_step=drop_last)).plan(traj, 0, _gen())
    one = build_chunker(chunker_settings(name="chunk", chunk_sizes=[k], drop_last_step=drop_last)).plan(traj, 0, _gen())
    assert whole.chunks == one.chunks == (tuple(t for t in range(8 - drop_last) if t != 2),)
    assert torch.equal(whole.selected, one.selected) and whole.selected.shape == (3, 1)
    assert CHUNKERS.get("trajectory").needs_recompute and CHUNKERS.get("chunk").needs_recompute


# ----------------------------------------------------------------------------------------------- window


def test_window_moves_on_schedule():
    # T = 10, w = 4, stride 2, shift every 3 epochs, window_end stay: start = min(2·⌊epoch/3⌋, 10 − 4)
    chunker = build_chunker(chunker_settings(name="window", window_size=4, window_stride=2, window_shift_every=3,
                                             window_end="stay"))
    expected_start = {0: 0, 1: 0, 2: 0, 3: 2, 5: 2, 6: 4, 8: 4, 9: 6, 11: 6, 12: 6, 100: 6}
    for epoch, start in expected_start.items():
        mask = chunker.sde_steps(10, epoch)
        assert mask.tolist() == [start <= t < start + 4 for t in range(10)], epoch


def test_window_trains_only_the_window_steps():
    chunker = build_chunker(chunker_settings(name="window", window_size=3, window_stride=1, window_shift_every=1))
    mask = chunker.sde_steps(8, 2)  # start 2: steps 2, 3, 4
    plan = chunker.plan(_random_traj(t=8, stochastic=mask), 2, _gen())
    assert plan.chunks == ((2,), (3,), (4,))
    assert plan.selected.all()
    assert not chunker.needs_recompute


def test_window_larger_than_the_trajectory_raises():
    chunker = build_chunker(chunker_settings(name="window", window_size=12))
    with pytest.raises(ValueError, match="window_size=12"):
        chunker.sde_steps(10, 0)


# ----------------------------------------------------------------------------------------------- per_step


def test_per_step_trains_every_step_by_default():
    plan = build_chunker(chunker_settings(name="per_step")).plan(_random_traj(t=6), 0, _gen())
    assert plan.chunks == tuple((t,) for t in range(6)) and plan.selected.all()
    dropped = build_chunker(chunker_settings(name="per_step", drop_last_step=True)).plan(_random_traj(t=6), 0, _gen())
    assert dropped.chunks == tuple((t,) for t in range(5))


def test_per_step_fraction_first():
    # int(0.5·6) = 3: the first three transitions for every sample (the releases' int(K·fraction))
    plan = build_chunker(chunker_settings(name="per_step"), 0.5).plan(_random_traj(t=6), 0, _gen())
    assert plan.selected.tolist() == [[True] * 3 + [False] * 3] * 3
    # int(0.4·6) = int(2.4) = 2; int(0.1·6) = 0 trains nothing: an error naming the setting
    plan = build_chunker(chunker_settings(name="per_step"), 0.4).plan(_random_traj(t=6), 0, _gen())
    assert plan.selected.sum(1).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="objective.timestep_fraction=0.1 trains int"):
        build_chunker(chunker_settings(name="per_step"), 0.1).plan(_random_traj(t=6), 0, _gen())


def test_per_step_fraction_random_is_a_uniform_subset_per_sample():
    b, t = 3000, 6
    traj = _traj(torch.randn(b, t + 1, 1, generator=_gen(0)))
    cfg = chunker_settings(name="per_step", step_selection="random")
    plan = build_chunker(cfg, 0.5).plan(traj, 0, _gen(7))
    assert plan.selected.sum(1).tolist() == [3] * b
    assert len({tuple(r.tolist()) for r in plan.selected[:50]}) > 10  # samples differ
    counts = plan.selected.sum(0).double()  # each step is chosen with probability 3/6
    assert chisquare(counts.numpy(), torch.full((t,), b / 2, dtype=torch.float64).numpy()).pvalue > 1e-3


def test_per_step_fraction_count_is_the_releases_int_of_the_float_product():
    # int(0.28·25) = int(7.000000000000001) = 7; int(0.29·100) = int(28.999999999999996) = 28, as the releases count
    plan = build_chunker(chunker_settings(name="per_step"), 0.28).plan(_random_traj(t=25), 0, _gen())
    assert plan.selected.sum(1).tolist() == [7, 7, 7]
    assert 0.29 * 100 < 29
    plan = build_chunker(chunker_settings(name="per_step"), 0.29).plan(_random_traj(t=100), 0,
                                                                                            _gen())
    assert plan.selected.sum(1).tolist() == [28, 28, 28]


def test_a_plan_without_stochastic_steps_is_an_error():
    traj = _random_traj(t=4, stochastic=torch.zeros(4, dtype=torch.bool))
    for name in ("per_step", "trajectory", "window"):
        with pytest.raises(ValueError, match="no stochastic transition"):
            build_chunker(chunker_settings(name=name)).plan(traj, 0, _gen())


def test_unknown_chunker_suggests():
    with pytest.raises(KeyError, match="did you mean 'per_step'"):
        build_chunker(chunker_settings(name="per-step"))


# ----------------------------------------------------------------------------------------------- plan/trained_frac


def _frac(chunker_kwargs, traj, epoch=0, timestep_fraction=1.0):
    from flowgrpo.algo.objectives.sde_ratio import SdeRatioWork

    plan = build_chunker(chunker_settings(**chunker_kwargs), timestep_fraction).plan(traj, epoch, _gen())
    return SdeRatioWork(traj, None, plan, [], traj.log_probs, None, epoch, False).metrics["plan/trained_frac"]


def test_trained_frac_is_the_share_of_the_trajectorys_transitions():
    # the epoch line's "% of steps": the transitions a trained sample trains over T, by hand for every chunker
    t8 = _random_traj(t=8)
    assert _frac({"name": "per_step"}, _random_traj(t=6)) == pytest.approx(1.0)
    assert _frac({"name": "per_step"}, _random_traj(t=6), timestep_fraction=0.5) == pytest.approx(3 / 6)
    assert _frac({"name": "per_step", "drop_last_step": True}, _random_traj(t=6)) == pytest.approx(5 / 6)
    # chunk: sizes 3 + 4 over the 7 trainable of 8 (last dropped): one chunk of 7 steps or two, all trained: 7/8
    assert _frac({"name": "chunk", "chunk_sizes": [3, 4], "drop_last_step": True}, t8) == pytest.approx(7 / 8)
    # chunk_fraction 0.5 of sizes [2, 6]: int(2·0.5) = 1 chunk a sample, of 2 or 6 steps: mean over samples / 8
    traj = _random_traj(b=4, t=8)
    plan = build_chunker(chunker_settings(name="chunk", chunk_sizes=[2, 6], chunk_fraction=0.5)).plan(traj, 0, _gen())
    sizes = [2 if row[0] else 6 for row in plan.selected.tolist()]
    assert plan.trained_transition_frac(traj.jump) == pytest.approx(sum(sizes) / 4 / 8)
    assert _frac({"name": "trajectory"}, t8) == pytest.approx(1.0)
    assert _frac({"name": "trajectory", "drop_last_step": True}, t8) == pytest.approx(7 / 8)
    # MixGRPO: a 4-step SDE window of 8 steps trains half of the trajectory (not 100% of its 4 chunks)
    window = build_chunker(chunker_settings(name="window", window_size=4))
    assert _frac({"name": "window", "window_size": 4}, _random_traj(t=8, stochastic=window.sde_steps(8, 0))) == \
        pytest.approx(4 / 8)


def test_trained_frac_counts_the_grid_steps_of_a_merged_jump():
    # E-GRPO on 8 steps with jumps (0, 1), (1, 1), (2, 2): one row per branch step, each training its jump of
    # 1, 1 and 2 grid steps: (1 + 1 + 2) / 3 / 8 = 1/6
    traj = _random_traj(b=3, t=8, stochastic=torch.zeros(3, 8, dtype=torch.bool))
    for row, (s, m) in enumerate([(0, 1), (1, 1), (2, 2)]):
        traj.stochastic[row, s] = True
        traj.jump[row, s] = m
        traj.jump[row, s + 1:s + m] = 0
    assert _frac({"name": "entropy_merge", "merge_steps": [0, 1, 2], "merge_lengths": [1, 1, 2]}, traj) == \
        pytest.approx(1 / 6)


def test_trained_frac_averages_over_the_trained_samples_only():
    # a filtered-out sample (no chunk selected) does not lower the share of steps (it is in "% of samples");
    # sample 0 trains steps 0 and 2 of 4, sample 1 step 1 (half a trained jump of 2 counts 2), sample 2 nothing
    from flowgrpo.records import ChunkPlan

    jump = torch.tensor([[1, 1, 1, 1], [1, 2, 0, 1], [1, 1, 1, 1]])
    plan = ChunkPlan(((0,), (1,), (2,)), torch.tensor([[True, False, True], [False, True, False], [False] * 3]))
    assert plan.trained_transition_frac(jump) == pytest.approx((2 / 4 + 2 / 4) / 2)
    assert ChunkPlan(((0,),), torch.zeros(2, 1, dtype=torch.bool)).trained_transition_frac(jump[:2]) == 0.0
