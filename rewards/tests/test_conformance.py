"""The Reward protocol's conformance suite (flowgrpo.testing.rewards) over the weight-free JPEG rewards.

Model rewards join by subclassing ``RewardConformance`` with a factory that points at tiny checkpoints.
"""

from __future__ import annotations

import re

import pytest
import torch
from flowgrpo_rewards.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_size_kb

from flowgrpo.testing.rewards import RewardConformance


class TestJpegCompressibility(RewardConformance):
    reward_factory = JpegCompressibility


class TestJpegIncompressibilityQuality50(RewardConformance):
    reward_factory = staticmethod(lambda: JpegIncompressibility(quality=50))
    image_size = (48, 80)


def test_conformance_inputs_give_distinct_jpeg_scores():
    """The suite's default images differ in detail, so its order tests can see a permutation."""
    images, _, _ = TestJpegCompressibility().make_inputs(5)
    assert torch.unique(jpeg_size_kb(images)).numel() == 5


class _ShuffledReward(JpegCompressibility):
    """A broken reward that returns the scores in reverse order: the suite must catch it."""

    def score(self, images, prompts, metadata):
        return super().score(images, prompts, metadata).flip(0)


class _WeightsInInit(JpegCompressibility):
    """A broken reward that builds a model in __init__."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(512, 512)


def test_suite_catches_a_reward_that_breaks_batch_order():
    suite = TestJpegCompressibility()
    reward = _ShuffledReward()
    with pytest.raises(AssertionError, match="permuted"):
        suite.test_batch_order_equivariance(reward)


def test_suite_catches_weights_built_in_init(monkeypatch):
    class Suite(RewardConformance):
        reward_factory = _WeightsInInit

    with pytest.raises(AssertionError, match="before setup"):
        Suite().test_init_loads_no_weights(monkeypatch)


def test_suite_catches_a_checkpoint_read_in_init(monkeypatch, tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(2)}, path)

    class Loads(JpegCompressibility):
        def __init__(self):
            super().__init__()
            self.state = torch.load(path)

    class Suite(RewardConformance):
        reward_factory = Loads

    with pytest.raises(AssertionError, match="read weights"):
        Suite().test_init_loads_no_weights(monkeypatch)


def test_suite_catches_undocumented_nan():
    class NanSometimes(JpegCompressibility):
        def score(self, images, prompts, metadata):
            s = super().score(images, prompts, metadata)
            s[-1] = torch.nan
            return s

    with pytest.raises(AssertionError, match="NaN on ordinary inputs"):
        TestJpegCompressibility().test_no_nan_unless_documented(NanSometimes())


# the keyword arguments a built-in reward cannot be constructed without
_REQUIRED_KWARGS = {
    "group_rank": {"base": "jpeg_compressibility"},
    "pairwise_preference": {"base": "jpeg_compressibility"},
    "remote": {"url": "http://127.0.0.1:9"},
    "video_frames": {"base": "jpeg_compressibility"},
}
_GENEVAL_META = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}


def _builtin_reward_names() -> list[str]:
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group="flowgrpo.rewards")
                  if ep.value.startswith(("flowgrpo_rewards.", "flowgrpo.")))


@pytest.mark.parametrize("bad", ["uint8", "0_255"])
@pytest.mark.parametrize("name", _builtin_reward_names())
def test_every_builtin_reward_refuses_8bit_and_out_of_range_images_by_name(name, bad):
    """Before any weights are loaded: the input check comes first, and its message names the reward."""
    from flowgrpo.rewards.base import modalities_of
    from flowgrpo.rewards.registry import load_reward

    reward, _ = load_reward(name, **_REQUIRED_KWARGS.get(name, {}))
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 255
    images = images.round().to(torch.uint8) if bad == "uint8" else images
    if "image" not in modalities_of(reward):  # a video reward: two-frame videos (B, F, 3, H, W)
        images = images[:, None].expand(2, 2, 3, 32, 32)
    with pytest.raises(ValueError, match=re.escape(f"{reward.name}: image")):
        reward(images, ['a sign that says "b"'] * 2, [dict(_GENEVAL_META)] * 2)
