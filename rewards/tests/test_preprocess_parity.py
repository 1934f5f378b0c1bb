"""Preprocessing parity with the official scorers' own transforms, at the real input sizes.

Each reference is rebuilt here from its published settings, independently of ``ImagePreprocess``:

* HPSv2's ``preprocess_val`` (``image_transform(224, resize_longest_max=True)`` in HPSv2's open_clip copy):
  ``ToTensor``, then ``ResizeMaxSize(224)`` on the float tensor (scale = 224 / max(H, W), each edge
  ``round(edge * scale)``, torchvision's bicubic tensor resize, no clamp), pad with 0 centered
  (left/top = pad // 2), then ``Normalize`` with the openai mean/std.
* Flow-GRPO's ``clip_scorer.py``: torchvision ``Resize(224)`` (bilinear, antialiased) and ``CenterCrop(224)``
  on the float tensor, then ``Normalize``.
* transformers' PIL ``CLIPImageProcessor`` and open_clip's ``image_transform`` on 8-bit PIL images (the
  tolerance there is the measured torch-vs-PIL resize bound on smooth images; see docs/rewards.md).

Sizes cover square and non-square generated images up to 1344 x 704, for images on the 8-bit grid and for
arbitrary float images.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402

tv = pytest.importorskip("torchvision.transforms")
tvf = pytest.importorskip("torchvision.transforms.functional")

from flowgrpo_rewards._clip_common import (  # noqa: E402
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImagePreprocess,
    center_crop_or_pad,
)
from flowgrpo_rewards.clip_score import CLIP_SCORE_VARIANTS, flowgrpo_tensor_preprocess  # noqa: E402
from flowgrpo_rewards.hps import HPSV2_PREPROCESS  # noqa: E402

SIZES = [(224, 224), (256, 256), (512, 512), (1024, 1024), (768, 420), (1216, 832), (832, 1216), (1344, 704)]
# (H, W) whose torchvision center-crop offset (round half to even) differs from the floor offset after a resize
# of the short edge to 224: margins 103, 103 and 203 (3 mod 4)
ROUND_CROP_SIZES = [(1216, 832), (832, 1216), (1344, 704)]


def sharp_square(height: int, width: int) -> torch.Tensor:
    """(1, 3, H, W) a white square on black, on the 8-bit grid: sharp edges, the worst case for overshoot."""
    x = torch.zeros(1, 3, height, width)
    x[..., height // 3 : height - height // 3, width // 3 : width - width // 3] = 1.0
    return x


def noise(height: int, width: int, seed: int, eight_bit: bool) -> torch.Tensor:
    """(1, 3, H, W) uniform pixel noise, on the 8-bit grid or arbitrary floats in [0, 1]."""
    x = torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(seed))
    return (x * 255).round() / 255 if eight_bit else x


def smooth(height: int, width: int, seed: int, eight_bit: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(1, 3, max(height // 32, 2), max(width // 32, 2), generator=g)
    x = F.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)
    return (x * 255).round() / 255 if eight_bit else x


def normalize(x: torch.Tensor) -> torch.Tensor:
    return tv.Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)(x)


def hpsv2_resize_max_size(x: torch.Tensor, max_size: int = 224) -> torch.Tensor:
    """HPSv2's ResizeMaxSize on a (3, H, W) float tensor, re-derived from its published settings."""
    height, width = x.shape[1:]
    scale = max_size / float(max(height, width))
    if scale == 1.0:
        return x
    new_size = [round(dim * scale) for dim in (height, width)]
    x = tvf.resize(x, new_size, interpolation=tv.InterpolationMode.BICUBIC, antialias=True)
    pad_h, pad_w = max_size - new_size[0], max_size - new_size[1]
    return tvf.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)


def hpsv2_preprocess_val(image: torch.Tensor) -> torch.Tensor:
    """(1, 3, H, W) float -> (1, 3, 224, 224): HPSv2's eval transform (ToTensor of the image is the tensor)."""
    return normalize(hpsv2_resize_max_size(image[0]))[None]


def hps_preprocess(**changes) -> ImagePreprocess:
    """The preprocessing HPSv2Reward builds: its overrides on open_clip's ViT-H-14 defaults (224, openai stats)."""
    return ImagePreprocess(size=224, **{**HPSV2_PREPROCESS, **changes})


# ------------------------------------------------------------------------------------------------------------
# HPSv2
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("kind", ["sharp", "noise_8bit", "noise_float"])
def test_hpsv2_preprocess_equals_hpsv2_preprocess_val(shape, kind):
    image = {"sharp": lambda: sharp_square(*shape), "noise_8bit": lambda: noise(*shape, 1, True),
             "noise_float": lambda: noise(*shape, 2, False)}[kind]()
    expected = hpsv2_preprocess_val(image)
    ours = hps_preprocess()(image)
    assert ours.shape == expected.shape == (1, 3, 224, 224)
    torch.testing.assert_close(ours, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("shape", [(512, 512), (256, 256), (1216, 832)])
def test_hpsv2_keeps_the_bicubic_overshoot(shape):
    """HPSv2 resizes the float tensor and does not clamp: a clamp would move pixels by 11-25/255 here."""
    resized = hpsv2_resize_max_size(sharp_square(*shape)[0])
    assert resized.min() < -5 / 255 and resized.max() > 1 + 5 / 255  # the reference really overshoots
    expected = hpsv2_preprocess_val(sharp_square(*shape))
    gap = (hps_preprocess(clamp_after_resize=True)(sharp_square(*shape)) - expected).abs().max()
    assert gap > 5 / 255 / max(OPENAI_CLIP_STD)  # a clamp is visible at this size, so the parity test can fail
    torch.testing.assert_close(hps_preprocess()(sharp_square(*shape)), expected, atol=2e-6, rtol=0)


def test_hpsv2_longest_side_rounding_is_hpsv2s():
    """Every size up to 1400 x 1400 (step 4 on one side) resizes to HPSv2's round(edge * 224 / max(H, W))."""
    pre = ImagePreprocess(size=224, resize_mode="longest")
    ties = 0
    for height in range(225, 1401, 7):
        for width in range(100, 1401, 4):
            scale = 224 / float(max(height, width))
            expected = (round(height * scale), round(width * scale))
            assert pre.resized_size(height, width) == expected, (height, width)
            ratio = max(height / 224, width / 224)
            ties += (round(height / ratio), round(width / ratio)) != expected
    # open_clip's edge / ratio rounding differs on some of these sizes, so the loop can tell the two apart
    assert ties > 0
    assert pre.resized_size(768, 420) == (224, 123)  # 420 * (224 / 768) = 122.50000000000001


# ------------------------------------------------------------------------------------------------------------
# CLIP score (Flow-GRPO variant): torchvision Resize + CenterCrop on float tensors
# ------------------------------------------------------------------------------------------------------------


def flowgrpo_clip_transform(image: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's clip_scorer.py preprocessing, re-derived: torchvision on the float tensor."""
    return tv.Compose([tv.Resize(224), tv.CenterCrop(224), tv.Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)])(image)


def flowgrpo_preprocess() -> ImagePreprocess:
    """What ClipScoreReward('flowgrpo') builds on the released processor's settings (224, openai stats)."""
    assert CLIP_SCORE_VARIANTS["flowgrpo"].tensor_transform
    return flowgrpo_tensor_preprocess(ImagePreprocess(size=224))


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("kind", ["sharp", "noise_float"])
def test_clip_score_flowgrpo_preprocess_equals_torchvision(shape, kind):
    image = sharp_square(*shape) if kind == "sharp" else noise(*shape, 3, False)
    torch.testing.assert_close(flowgrpo_preprocess()(image), flowgrpo_clip_transform(image), atol=2e-6, rtol=0)


@pytest.mark.parametrize("shape", ROUND_CROP_SIZES)
def test_clip_score_flowgrpo_crop_offset_rounds_as_torchvision(shape):
    """At these sizes the floor offset is one pixel short of torchvision's: the crop must round."""
    image = noise(*shape, 4, False)
    expected = flowgrpo_clip_transform(image)
    torch.testing.assert_close(flowgrpo_preprocess()(image), expected, atol=2e-6, rtol=0)
    resized = tvf.resize(image, 224, interpolation=tv.InterpolationMode.BILINEAR, antialias=True)
    floor = normalize(center_crop_or_pad(resized, (224, 224), offset="floor"))
    assert not torch.allclose(floor, expected, atol=1e-3)  # the floor offset fails here


@pytest.mark.parametrize("margin,expected", [(0, 0), (1, 0), (2, 1), (3, 2), (5, 2), (7, 4), (103, 52), (203, 102)])
def test_round_crop_offset_is_python_round_of_half_the_margin(margin, expected):
    """torchvision: int(round(margin / 2)), half to even: one pixel past the floor only for margin = 3 mod 4."""
    x = torch.arange(224 + margin, dtype=torch.float32).view(1, 1, -1).expand(1, 224, -1)
    out = center_crop_or_pad(x, (224, 224), offset="round")
    assert int(out[0, 0, 0]) == expected
    assert int(center_crop_or_pad(x, (224, 224), offset="floor")[0, 0, 0]) == margin // 2


# ------------------------------------------------------------------------------------------------------------
# 8-bit PIL references (PickScore / openai CLIP score / aesthetic; DFN5B)
# ------------------------------------------------------------------------------------------------------------

# measured torch-vs-PIL resize bound on smooth images (docs/rewards.md), in normalised units
SMOOTH_ATOL = 3.0 / 255 / min(OPENAI_CLIP_STD)


def to_pil(image: torch.Tensor) -> Image.Image:
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(array))


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("eight_bit", [True, False])
def test_shortest_edge_floor_crop_matches_transformers_pil_processor(shape, eight_bit):
    transformers = pytest.importorskip("transformers")
    processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    image = smooth(*shape, 5, eight_bit)
    expected = processor_cls()(images=[to_pil(image[0])], return_tensors="pt")["pixel_values"].float()
    ours = ImagePreprocess(size=224)(image)  # hf_image_preprocess's settings for the released processors
    torch.testing.assert_close(ours, expected, atol=SMOOTH_ATOL, rtol=0)


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("eight_bit", [True, False])
def test_squash_matches_open_clip_transform(shape, eight_bit):
    open_clip = pytest.importorskip("open_clip")
    image = smooth(*shape, 6, eight_bit)
    transform = open_clip.image_transform(378, is_train=False, resize_mode="squash")
    expected = transform(to_pil(image[0]))[None]
    ours = ImagePreprocess(size=378, resize_mode="squash", crop_offset="round")(image)
    torch.testing.assert_close(ours, expected, atol=SMOOTH_ATOL, rtol=0)


@pytest.mark.parametrize("shape", [(224, 224), (512, 512)])
def test_images_at_the_model_size_or_an_exact_multiple_are_bit_exact_on_the_8bit_grid(shape):
    """No resampling at 224: the PIL reference and ours agree to float rounding on 8-bit images."""
    transformers = pytest.importorskip("transformers")
    processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    image = noise(*shape, 7, True)
    expected = processor_cls()(images=[to_pil(image[0])], return_tensors="pt")["pixel_values"].float()
    ours = ImagePreprocess(size=224)(image)
    if shape == (224, 224):
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    else:  # a real resize: PIL's 8-bit two-pass result differs, by the measured noise bound at most
        torch.testing.assert_close(ours, expected, atol=21 / 255 / min(OPENAI_CLIP_STD), rtol=0)


# ------------------------------------------------------------------------------------------------------------
# resize_backend="pil": the PIL references' own 8-bit resize, exactly
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("kind", ["sharp", "noise_8bit", "noise_float"])
def test_pil_backend_equals_transformers_pil_processor_exactly(shape, kind):
    transformers = pytest.importorskip("transformers")
    processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    image = {"sharp": lambda: sharp_square(*shape), "noise_8bit": lambda: noise(*shape, 8, True),
             "noise_float": lambda: noise(*shape, 9, False)}[kind]()
    expected = processor_cls()(images=[to_pil(image[0])], return_tensors="pt")["pixel_values"].float()
    ours = ImagePreprocess(size=224, resize_backend="pil")(image)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(512, 512), (1216, 832), (1344, 704)])
def test_pil_backend_equals_open_clip_and_image_reward_transforms_exactly(shape):
    open_clip = pytest.importorskip("open_clip")
    from flowgrpo_rewards.image_reward import preprocess as image_reward_preprocess

    image = noise(*shape, 10, False)
    squash = open_clip.image_transform(378, is_train=False, resize_mode="squash")
    ours = ImagePreprocess(size=378, resize_mode="squash", crop_offset="round", resize_backend="pil")(image)
    torch.testing.assert_close(ours, squash(to_pil(image[0]))[None], atol=1e-5, rtol=0)
    blip = tv.Compose([tv.Resize(224, interpolation=tv.InterpolationMode.BICUBIC), tv.CenterCrop(224), tv.ToTensor(),
                       tv.Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)])  # ImageReward's _transform
    torch.testing.assert_close(image_reward_preprocess(image, 224, "pil"), blip(to_pil(image[0]))[None],
                               atol=1e-5, rtol=0)


def test_resize_backend_is_checked_and_wired():
    with pytest.raises(ValueError, match="resize_backend 'cv2'"):
        ImagePreprocess(size=224, resize_backend="cv2")
    from flowgrpo_rewards.clip_score import ClipScoreReward
    from flowgrpo_rewards.image_reward import ImageReward
    from flowgrpo_rewards.pickscore import PickScoreReward

    with pytest.raises(ValueError, match="resize_backend must be one of"):
        PickScoreReward(resize_backend="PIL")
    with pytest.raises(ValueError, match="float-tensor pipeline"):
        ClipScoreReward("flowgrpo", resize_backend="pil")
    assert ImageReward(resize_backend="pil").resize_backend == "pil"
