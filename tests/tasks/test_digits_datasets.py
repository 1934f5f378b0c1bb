"""The digits task's datasets for the dataset objectives (flowgrpo/tasks/digits/datasets.py): the real set holds the
split's digits as drawn by digits_to_images (to PNG's 8-bit rounding) with a prompt naming their digit; the
preference set's chosen image scores higher under the reward classifier than its rejected one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flowgrpo.data.image_sets import load_image
from flowgrpo.tasks.digits.data import DIGIT_WORDS, digits_to_images, load_digit_split


def test_real_set_is_the_split_with_prompts_of_its_digits(tmp_path):
    from flowgrpo.tasks.digits.datasets import build_real_set

    path = build_real_set(tmp_path / "real", "test")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    grids, labels = load_digit_split("test")
    assert len(recs) == len(labels) == 359
    want = digits_to_images(grids[:5])
    for i in range(5):
        assert recs[i]["digit"] == int(labels[i])
        assert DIGIT_WORDS[labels[i]] in recs[i]["prompt"] or str(labels[i]) in recs[i]["prompt"]
        img = load_image(path.parent / recs[i]["target"], 32, 32)
        assert float((img - want[i]).abs().max()) <= 0.5 / 255 + 1e-6


@pytest.mark.slow
def test_preference_set_prefers_the_higher_reward(tmp_path):
    from flowgrpo.tasks.digits.datasets import build_preference_set
    from flowgrpo.tasks.digits.scoring import digit_probabilities

    path = build_preference_set(tmp_path / "pairs", rounds=1, group_size=3)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert 0 < len(recs) <= 30
    for r in recs[:6]:
        imgs = torch.stack([load_image(path.parent / r[k], 32, 32) for k in ("chosen", "rejected")])
        p = digit_probabilities(imgs)[:, r["digit"]]
        assert r["chosen_score"] > r["rejected_score"]
        assert p.tolist() == pytest.approx([r["chosen_score"], r["rejected_score"]], abs=0.05)  # PNG rounding
        assert np.isfinite(r["chosen_score"])
