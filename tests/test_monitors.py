"""The rollout's x0 norm and its drift warning (flowgrpo.watch.x0_norm). Expected values are computed here by hand from
the hand-made latents and streams (DiffusionNFT's x0_norm: the mean of x0^2; here per sample, then over the batch)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.records import FinalSamples, PromptEmbeds, Trajectory


def _final(x0: torch.Tensor) -> FinalSamples:
    b = x0.shape[0]
    return FinalSamples(embeds=PromptEmbeds({}), images=torch.zeros(b, 3, 1, 1), prompts=["p"] * b,
                        metadata=[{}] * b, guidance_scale=1.0, x0=x0, initial_noise=torch.zeros_like(x0),
                        sigmas=torch.linspace(1, 0, 3), group_ids=torch.zeros(b, dtype=torch.long),
                        sample_index=torch.arange(b))


def test_x0_norm_of_a_forward_rollout_and_of_a_trajectory():
    from flowgrpo.watch.x0_norm import x0_norm_metrics

    # two samples of 2 x 2 latents: mean x0^2 = (1 + 1 + 1 + 1) / 4 = 1 and (4 + 0 + 0 + 0) / 4 = 1 ... and 9
    x0 = torch.tensor([[[1.0, -1.0], [1.0, 1.0]], [[2.0, 0.0], [0.0, 0.0]], [[3.0, 3.0], [-3.0, 3.0]]])
    m = x0_norm_metrics(_final(x0))
    assert m == {"rollout/x0_norm": pytest.approx((1 + 1 + 9) / 3), "rollout/x0_norm_max": pytest.approx(9.0)}
    # a trajectory: its last latents (sigma = 0), not the noise it started from
    lat = torch.zeros(2, 3, 4)
    lat[:, 0] = 5.0  # the initial noise
    lat[0, -1] = torch.tensor([2.0, 2.0, 0.0, 0.0])  # (4 + 4) / 4 = 2
    lat[1, -1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # 1 / 4
    traj = Trajectory(embeds=PromptEmbeds({}), images=torch.zeros(2, 3, 1, 1), prompts=["p"] * 2,
                      metadata=[{}] * 2, guidance_scale=1.0, latents=lat, log_probs=torch.zeros(2, 2),
                      sigmas=torch.linspace(1, 0, 3), stochastic=torch.ones(2, 2, dtype=torch.bool),
                      jump=torch.ones(2, 2, dtype=torch.long), group_ids=torch.zeros(2, dtype=torch.long),
                      prompt_ids=torch.zeros(2, dtype=torch.long))
    m = x0_norm_metrics(traj)
    assert m == {"rollout/x0_norm": pytest.approx((2 + 0.25) / 2), "rollout/x0_norm_max": pytest.approx(2.0)}
    with pytest.raises(ValueError, match="FinalSamples or a Trajectory"):
        x0_norm_metrics(object())


def _records(values):
    return [{"epoch": e, "rollout/x0_norm": v} for e, v in enumerate(values)]


def test_a_sustained_drift_warns_once_naming_the_epoch_the_value_and_the_baseline():
    from flowgrpo.watch.x0_norm import X0NormWatch

    watch = X0NormWatch(window=3, drift=0.25)
    stream = [1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    # baseline: the first 3 epochs, 1.0; the last 3 epochs' mean at record 5: 1.1, 6: 1.2, 7: 1.3 > 1.25
    lines = {r["epoch"]: watch.observe(r) for r in _records(stream)}
    assert [e for e, line in lines.items() if line] == [7]  # once, not again while it keeps drifting
    line = lines[7]
    assert line.startswith("epoch 8: ") and "drifted up" in line and "\n" not in line
    assert "1.3 over the last 3 epochs against 1 over the first 3" in line  # value and baseline
    # back inside ((1.6 + 1.0 + 1.0) / 3 = 1.2 at the second 1.0), then a new drift warns again
    again = [watch.observe(r) for r in _records(stream + [1.0, 1.0, 1.0, 1.4, 1.4, 1.4])[10:]]
    assert [bool(x) for x in again] == [False, False, False, False, True, False]  # 1.267 at the 2nd 1.4


def test_a_spike_is_not_a_drift_and_a_fall_is():
    from flowgrpo.watch.x0_norm import X0NormWatch

    spike = [1.0] * 6 + [1.6] + [1.0] * 5  # one epoch 60% up: the 3-epoch mean reaches 1.2 only
    watch = X0NormWatch(window=3, drift=0.25)
    assert not any(watch.observe(r) for r in _records(spike))
    watch = X0NormWatch(window=1, drift=0.25)  # a window of one epoch sees it
    assert [bool(watch.observe(r)) for r in _records(spike)].index(True) == 6
    fall = [2.0, 2.0, 2.0, 1.8, 1.6, 1.4, 1.2]  # 3-epoch means 1.8 (x0.9), 1.6 (x0.8 = 1/1.25: inside), 1.4
    watch = X0NormWatch(window=3, drift=0.25)
    lines = [watch.observe(r) for r in _records(fall)]
    assert [bool(x) for x in lines] == [False] * 6 + [True] and "drifted down" in lines[6]


def test_a_resumed_run_keeps_its_baseline_and_bad_settings_are_refused():
    from flowgrpo.watch.x0_norm import X0NormWatch

    history = _records([1.0, 1.0, 1.0, 1.2, 1.2])[::-1]  # any order; last 2: 1.2, inside x1.25 of 1.0
    watch = X0NormWatch(window=2, drift=0.25, history=history)
    assert watch.observe({"epoch": 5, "rollout/x0_norm": 1.4}).startswith("epoch 6: ")  # (1.2 + 1.4) / 2 = 1.3
    # a drift the run already had before it resumed (and warned about then) is not warned again
    watch = X0NormWatch(window=2, drift=0.25, history=_records([1.0, 1.0, 1.3, 1.3]))
    assert watch.observe({"epoch": 4, "rollout/x0_norm": 1.3}) is None
    assert watch.observe({"epoch": 6}) is None  # an epoch without the figure
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 0"):
        X0NormWatch(window=0)
    with pytest.raises(ValueError, match="drift must be > 0, got 0"):
        X0NormWatch(drift=0)


def test_a_drifting_rollout_through_the_metrics_warns():
    """Rollouts whose final latents grow 10% an epoch after 4 steady ones: the record's figure is (scale)^2, so
    with window 2 and f = 0.5 the last two epochs' mean passes 1.5 x the first two's (1.0) at epoch 7."""
    from flowgrpo.config import build_config
    from flowgrpo.watch.x0_norm import X0NormWatch, x0_norm_metrics

    cfg = build_config({})
    assert (cfg.logging.x0_norm_window, cfg.logging.x0_norm_drift) == (5, 0.25)  # the defaults
    cfg = build_config({"logging": {"x0_norm_window": 2, "x0_norm_drift": 0.5}})
    watch = X0NormWatch(cfg.logging.x0_norm_window, cfg.logging.x0_norm_drift)
    scales = [1.0, 1.0, 1.0, 1.0, 1.1, 1.21, 1.331, 1.4641]  # squares 1, 1, 1, 1, 1.21, 1.464, 1.772, 2.144
    base = torch.ones(4, 2, 8)
    warned = []
    for epoch, s in enumerate(scales):
        record = {"epoch": epoch, **x0_norm_metrics(_final(base * s))}
        assert record["rollout/x0_norm"] == pytest.approx(s * s)
        if watch.observe(record):
            warned.append(epoch)
    assert warned == [6]  # (1.464 + 1.772) / 2 = 1.618 > 1.5; at epoch 5 (1.21 + 1.464) / 2 = 1.337
