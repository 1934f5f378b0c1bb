"""The editing consistency reward (flowgrpo_rewards.image_similarity) on a tiny random CLIP: the cosine of
transformers' own ``CLIPModel.get_image_features`` of the image and of its source file, the reward protocol
(conformance suite), and its errors."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

from flowgrpo_rewards import tiny_models as tm  # noqa: E402
from flowgrpo_rewards._clip_common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # noqa: E402
from flowgrpo_rewards.image_similarity import ImageSimilarityReward  # noqa: E402

from flowgrpo.testing.rewards import RewardConformance, default_images  # noqa: E402

SIZE = 32  # the tiny CLIP's input size: no resize, so the reference needs no resampling code


@functools.lru_cache(maxsize=1)
def root() -> Path:
    """A tiny CLIP and four source PNGs, written once per process (factories run before fixtures)."""
    path = Path(tempfile.mkdtemp(prefix="flowgrpo_imgsim_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    tm.save_tiny_hf_clip(path / "clip", path / "proc", seed=3, image_size=SIZE)
    for i, img in enumerate(default_images(4, SIZE, SIZE, torch.Generator().manual_seed(7))):
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(path / f"src{i}.png")
    return path


def _reward() -> ImageSimilarityReward:
    return ImageSimilarityReward(checkpoint=str(root() / "clip"), processor=str(root() / "proc"), batch_size=2)


def _meta(n: int) -> list[dict]:
    return [{"images": [str(root() / f"src{i % 4}.png")]} for i in range(n)]


class TestImageSimilarityConformance(RewardConformance):
    reward_factory = staticmethod(_reward)
    metadata_factory = staticmethod(_meta)
    required_metadata_fields = ("images",)
    image_size = (SIZE, SIZE)


def _reference_features(model, pixels: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        f = model.get_image_features(pixel_values=(pixels - mean) / std)
    f = f if isinstance(f, torch.Tensor) else f.pooler_output
    return f / f.norm(dim=-1, keepdim=True)


def test_cosine_of_clip_image_features_with_the_source():
    reward = _reward()
    reward.setup("cpu")
    images = default_images(3, SIZE, SIZE, torch.Generator().manual_seed(1))
    meta = _meta(3)
    got = reward(images, ["p"] * 3, meta)
    model = transformers.CLIPModel.from_pretrained(str(root() / "clip")).eval()
    sources = torch.stack([torch.from_numpy(np.asarray(Image.open(m["images"][0]).convert("RGB")).copy())
                           for m in meta]).permute(0, 3, 1, 2).float() / 255
    expected = (_reference_features(model, images) * _reference_features(model, sources)).sum(-1)
    assert got.shape == (3,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the source itself scores 1, another image less
    same = reward(sources, ["p"] * 3, meta)
    torch.testing.assert_close(same, torch.ones(3), rtol=0, atol=1e-5)
    assert float((got - 1).abs().min()) > 1e-3


def test_records_without_a_source_are_refused():
    reward = _reward()
    reward.setup("cpu")
    with pytest.raises(ValueError, match="needs metadata 'images'"):
        reward(default_images(1, SIZE, SIZE, torch.Generator()), ["p"], [{"tag": 1}])
