"""Specification of reward discovery (flowgrpo.rewards.registry), reward composition (flowgrpo.rewards.compose)
and the name → strategy registry (flowgrpo.registry)."""

from __future__ import annotations

import io
import math
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.registry import Registry
from flowgrpo.rewards.compose import ComposedReward, compose_rewards
from flowgrpo.rewards.registry import GROUP, RewardLoadError, load_reward, resolve_reward_factory

# ----------------------------------------------------------------------------------------------- discovery


def test_unknown_reward_lists_the_registered_names_and_the_closest():
    names = sorted({ep.name for ep in entry_points(group=GROUP)})
    assert "jpeg_compressibility" in names  # the flowgrpo-rewards distribution is installed
    with pytest.raises(RewardLoadError) as err:
        resolve_reward_factory("jpeg_compresibility")
    msg = str(err.value)
    assert "did you mean 'jpeg_compressibility'" in msg
    for name in names:
        assert name in msg
    assert "module:attr" in msg


def test_entry_point_name_loads_the_plugin_with_its_origin():
    reward, origin = load_reward("jpeg_compressibility", quality=80)
    assert type(reward).__name__ == "JpegCompressibility" and reward.quality == 80
    assert origin.target == "flowgrpo_rewards.jpeg:JpegCompressibility"
    assert origin.distribution == "flowgrpo-rewards" and origin.version


def test_module_attr_name_loads_without_the_registry():
    from flowgrpo_rewards.jpeg import JpegCompressibility

    reward, origin = load_reward("flowgrpo_rewards.jpeg:JpegCompressibility")
    assert isinstance(reward, JpegCompressibility)
    assert origin.name == origin.target == "flowgrpo_rewards.jpeg:JpegCompressibility"


@pytest.mark.parametrize(("name", "needle"), [
    ("flowgrpo_rewards.jpeg:NoSuchReward", "NoSuchReward"),
    ("no_such_module_xyz:Reward", "no_such_module_xyz"),
])
def test_bad_module_attr_is_a_load_error(name, needle):
    with pytest.raises(RewardLoadError, match=needle):
        load_reward(name)


def test_rejected_kwargs_are_a_load_error_naming_them():
    with pytest.raises(RewardLoadError, match="qualty"):
        load_reward("jpeg_compressibility", qualty=3)


# ----------------------------------------------------------------------------------------------- JPEG reward


def _images() -> tuple[torch.Tensor, np.ndarray]:
    """(B, 3, H, W) float images in [0, 1] whose 8-bit values are exactly ``arr`` (B, H, W, 3) uint8."""
    g = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 32)[None, :, None] * np.ones((32, 1, 3))
    arr = np.stack([
        ramp.astype(np.uint8),                                           # smooth: compresses well
        g.integers(0, 256, (32, 32, 3)).astype(np.uint8),                # noise: compresses badly
        np.clip(ramp + g.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8),
    ])
    images = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255
    return images, arr


def _pil_jpeg_kb(arr: np.ndarray, quality: int) -> list[float]:
    sizes = []
    for a in arr:
        buf = io.BytesIO()
        Image.fromarray(a, mode="RGB").save(buf, format="JPEG", quality=quality)
        sizes.append(len(buf.getvalue()) / 1000)
    return sizes


@pytest.mark.parametrize("quality", [95, 50])
def test_jpeg_reward_is_minus_the_pil_jpeg_size(quality):
    images, arr = _images()
    expected = _pil_jpeg_kb(arr, quality)
    assert expected[0] < expected[2] < expected[1]
    comp, _ = load_reward("jpeg_compressibility", quality=quality)
    incomp, _ = load_reward("jpeg_incompressibility", quality=quality)
    scores = comp(images, ["p"] * 3, [{}] * 3)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores.double(), -torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(incomp(images, ["p"] * 3, [{}] * 3), -scores)


def test_jpeg_reward_default_quality_is_95():
    images, arr = _images()
    comp, _ = load_reward("jpeg_compressibility")
    torch.testing.assert_close(comp(images, ["p"] * 3, [{}] * 3).double(),
                               -torch.tensor(_pil_jpeg_kb(arr, 95), dtype=torch.float64), rtol=1e-6, atol=0)


def test_reward_rejects_mismatched_inputs():
    comp, _ = load_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="3 images"):
        comp(torch.zeros(3, 3, 8, 8), ["a", "b"], [{}] * 3)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        comp(torch.zeros(3, 8, 8), ["a"] * 3, [{}] * 3)


# ----------------------------------------------------------------------------------------------- composition


def test_composition_is_the_weighted_sum_of_present_components():
    nan = float("nan")
    a = torch.tensor([1.0, nan, 3.0, nan, -2.0])
    b = torch.tensor([2.0, 4.0, nan, nan, 0.5])
    out = compose_rewards({"a": a, "b": b}, {"a": 1.0, "b": 3.0})
    # sample 0: 1·1 + 3·2 = 7; 1: only b → 3·4 = 12; 2: only a → 1·3 = 3; 3: none → NaN;
    # 4: 1·(−2) + 3·0.5 = −0.5
    assert out.total[:3].tolist() == [7.0, 12.0, 3.0]
    assert math.isnan(out.total[3])
    assert out.total[4].item() == pytest.approx(-0.5)
    assert out.total.dtype == torch.float32
    torch.testing.assert_close(out.components["a"], a, equal_nan=True)
    assert out.weights == {"a": 1.0, "b": 3.0}


@pytest.mark.parametrize("weights, expected", [
    # a penalty: the weighted mean's denominator 1 − 1 = 0 made every total NaN
    ({"quality": 1.0, "penalty": -1.0}, [0.5 - 0.25, 0.75 - 1.0]),
    # 0.5·q − 1.0·p: the weighted mean divided by −0.5 and flipped the sign of every total
    ({"quality": 0.5, "penalty": -1.0}, [0.25 - 0.25, 0.375 - 1.0]),
])
def test_negative_weights_are_penalties_not_nan_or_sign_flips(weights, expected):
    q = torch.tensor([0.5, 0.75])
    p = torch.tensor([0.25, 1.0])
    out = compose_rewards({"quality": q, "penalty": p}, weights)
    assert out.total.tolist() == pytest.approx(expected)


def test_one_reward_composes_to_its_weighted_score():
    r = torch.tensor([0.25, -1.5, 7.0])
    assert torch.equal(compose_rewards({"r": r}, {"r": 1.0}).total, r)
    assert compose_rewards({"r": r}, {"r": 2.5}).total.tolist() == [0.625, -3.75, 17.5]


def test_composition_rejects_mismatched_names_and_shapes():
    with pytest.raises(ValueError, match="differ"):
        compose_rewards({"a": torch.zeros(2)}, {"b": 1.0})
    with pytest.raises(ValueError, match="shapes"):
        compose_rewards({"a": torch.zeros(2), "b": torch.zeros(3)}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="shapes"):
        compose_rewards({"a": torch.zeros(2, 2)}, {"a": 1.0})


class _Const:
    name = "const"

    def __init__(self, values):
        self.values = values

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        return torch.tensor(self.values)


def test_composed_reward_scores_each_and_checks_shapes():
    composed = ComposedReward({"x": _Const([1.0, 2.0]), "y": _Const([3.0, float("nan")])}, {"x": 1.0, "y": 1.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert out.total.tolist() == [4.0, 2.0]  # 1 + 3, and 2 + (y not applicable)
    bad = ComposedReward({"x": _Const([1.0, 2.0, 3.0])}, {"x": 1.0})
    from flowgrpo.rewards.compose import RewardError

    with pytest.raises(RewardError, match="'x' returned shape"):
        bad.score_components(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


# ----------------------------------------------------------------------------------------------- Registry


def test_registry_lists_names_suggests_and_refuses_duplicates():
    reg: Registry = Registry("widget")
    reg.register("alpha")(1)
    reg.register("beta")(2)
    assert reg.get("beta") == 2 and reg.names() == ["alpha", "beta"] and "alpha" in reg
    with pytest.raises(KeyError) as err:
        reg.get("alpah")
    assert "unknown widget 'alpah'" in str(err.value) and "['alpha', 'beta']" in str(err.value)
    assert "did you mean 'alpha'" in str(err.value)
    with pytest.raises(ValueError, match="twice"):
        reg.register("alpha")(3)


def test_an_infinite_reward_is_an_error_naming_the_reward():
    from flowgrpo.rewards.compose import RewardError

    composed = ComposedReward({"bad": _Const([1.0, float("inf")])}, {"bad": 1.0})
    with pytest.raises(RewardError, match=r"reward 'bad' returned an infinite score for sample\(s\) \[1\]"):
        composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_none_is_not_applicable():
    composed = ComposedReward({"x": _Const([0.5, 1.0]), "maybe": _List([None, 2.0])}, {"x": 1.0, "maybe": 2.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert torch.isnan(out.components["maybe"][0]) and out.total.tolist() == [0.5, 5.0]


class _List(_Const):
    def __call__(self, images, prompts, metadata):
        return list(self.values)


def test_nan_stays_not_applicable():
    composed = ComposedReward({"ok": _Const([1.0, float("nan")])}, {"ok": 1.0})
    out = composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert out.total[0] == 1.0 and torch.isnan(out.total[1])
