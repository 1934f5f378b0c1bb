"""The pictures a run writes (flowgrpo.plots): the reward curve's panels, the smoothing, a sample grid whose
captions never overlap. Expected values are computed here by hand or from the inputs."""

from __future__ import annotations

import itertools

import torch


def test_smooth_is_a_trailing_mean():
    from flowgrpo.plots import smooth

    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 1) == [2.0, 4.0]


def test_reward_curve_one_panel_per_component_no_duplicate_total():
    from flowgrpo.plots import reward_curve_figure

    one = [{"epoch": e, "reward/jpeg/mean": float(e), "reward/total/mean": float(e)} for e in range(20)]
    fig = reward_curve_figure(one)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["reward: jpeg"]
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["per epoch", "smoothed"]
    two = [{**r, "reward/clip/mean": 1.0, "eval/jpeg/mean": 2.0, "eval/correctness": 0.5,
            "eval/digit_3/diversity": 1.0, "eval/diversity_real": 36.0} for r in one]
    assert [ax.get_title() for ax in reward_curve_figure(two).axes] == [
        "reward: clip", "reward: jpeg", "reward: total", "evaluation: correctness", "evaluation: jpeg"]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_sample_grid_captions_never_overlap():
    from flowgrpo.plots import sample_grid_figure

    images = torch.rand(20, 3, 32, 32)
    long = "a very long prompt about a handwritten digit seven drawn on a napkin in a dark bar at night"
    fig = sample_grid_figure(images, [f"before: {long} {i}" for i in range(20)], ncols=10, title="t",
                             footer=[f"digit {d}\ncorrect 0.50→1.00\ndiversity 38→10\n0.250× real collapsed"
                                     for d in range(10)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t.get_window_extent(renderer) for ax in fig.axes for t in ax.texts]
    images_ = [ax.get_window_extent(renderer) for ax in fig.axes if ax.images]
    assert len(texts) == 30 and len(images_) == 20
    for a, b in itertools.combinations(texts, 2):
        assert not _overlap(a, b)
    for t in texts:
        assert not any(_overlap(t, im) for im in images_)
