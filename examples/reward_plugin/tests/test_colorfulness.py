"""The example plugin's tests: flowgrpo's conformance suite plus values computed by hand from the paper's formula."""

import math

import torch
from flowgrpo_colorfulness import Colorfulness

from flowgrpo.testing.rewards import RewardConformance


class TestColorfulnessConformance(RewardConformance):
    reward_factory = Colorfulness


def test_solid_colours_by_hand():
    images = torch.zeros(3, 3, 4, 4)
    images[0, 0] = 1.0  # solid red: rg = 255, yb = 127.5, no spread
    images[1] = 0.5  # grey: rg = yb = 0
    images[2, :, :, :2] = 1.0  # left half white, right half black: rg = 0, yb = 0 everywhere
    reward = Colorfulness()
    reward.setup("cpu")
    scores = reward(images, ["a", "b", "c"], [{}, {}, {}])
    expected = torch.tensor([0.3 * math.hypot(255.0, 127.5), 0.0, 0.0])
    torch.testing.assert_close(scores, expected)


def test_half_red_half_green_by_hand():
    images = torch.zeros(1, 3, 2, 2)
    images[0, 0, :, 0] = 1.0  # red column: rg = 255, yb = 127.5
    images[0, 1, :, 1] = 1.0  # green column: rg = -255, yb = 127.5
    # σ_rg = 255, σ_yb = 0; μ_rg = 0, μ_yb = 127.5
    expected = 255.0 + 0.3 * 127.5
    reward = Colorfulness(scale=10.0)
    reward.setup("cpu")
    assert math.isclose(reward(images, ["x"], [{}]).item(), expected / 10.0, rel_tol=1e-6)
