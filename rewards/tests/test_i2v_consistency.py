"""The image-to-video consistency reward (``i2v_consistency``) on tiny random DINO and CLIP encoders: expected
values from the encoders' own transformers modules and VBench-I2V's subject-consistency formula written out frame
by frame here, and by hand (a video that repeats its image)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from flowgrpo_rewards.video import ImageToVideoConsistency  # noqa: E402
from PIL import Image  # noqa: E402

from flowgrpo.testing.rewards import RewardConformance, default_images  # noqa: E402

SIZE = 32  # the tiny encoders' input side: frames and images need no resize


@functools.lru_cache(maxsize=1)
def root() -> Path:
    """Tiny random DINO (ViTModel) and CLIP vision encoders and four conditioning PNGs, written once per process
    (the conformance factories run before fixtures)."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, ViTConfig, ViTModel

    path = Path(tempfile.mkdtemp(prefix="flowgrpo_i2v_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(0)
    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       image_size=SIZE, patch_size=8), add_pooling_layer=False).save_pretrained(path / "dino")
    CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=32, image_size=SIZE, patch_size=8,
                                                   projection_dim=8)).save_pretrained(path / "clip")
    for i, img in enumerate(default_images(4, SIZE, SIZE, torch.Generator().manual_seed(7))):
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(path / f"first{i}.png")
    return path


def _meta(n: int) -> list[dict]:
    return [{"images": [str(root() / f"first{i % 4}.png")]} for i in range(n)]


def _reward(backbone: str = "dino", mode: str = "vbench") -> ImageToVideoConsistency:
    r = ImageToVideoConsistency(backbone=backbone, checkpoint=str(root() / backbone), mode=mode, image_size=SIZE)
    r.setup("cpu")
    return r


def _image(i: int) -> torch.Tensor:
    """(3, H, W) float in [0, 1]: conditioning image i as the reward reads it (8-bit RGB / 255)."""
    import numpy as np

    return torch.from_numpy(np.asarray(Image.open(root() / f"first{i}.png").convert("RGB")).copy()).permute(
        2, 0, 1).float() / 255


class TestImageToVideoConsistencyConformance(RewardConformance):
    reward_factory = staticmethod(lambda: _reward("dino"))
    metadata_factory = staticmethod(_meta)
    required_metadata_fields = ("images",)
    image_size = (SIZE, SIZE)


def test_a_video_that_repeats_its_image_scores_one():
    """Every frame the conditioning image: every cosine is 1, so both modes give 1 (by hand)."""
    still = torch.stack([_image(0), _image(1)])[:, None].expand(2, 4, 3, SIZE, SIZE)
    for backbone in ("dino", "clip"):
        for mode in ("vbench", "mean"):
            s = _reward(backbone, mode)(still, ["a", "b"], _meta(2))
            torch.testing.assert_close(s, torch.ones(2), atol=1e-5, rtol=0)


def test_vbench_i2v_subject_formula_against_the_encoder_itself():
    """Features from the transformers module directly (ImageNet mean/std, no resize at the encoder's size);
    0.5·max over frames of the clamped cosine to the image + 0.5·mean over frames 2..F of the clamped cosine to
    the previous frame; and the ``mean`` mode's average cosine to the image."""
    from transformers import ViTModel

    v = torch.rand(2, 4, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))  # unrelated frames
    model = ViTModel.from_pretrained(root() / "dino", add_pooling_layer=False).eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def feats(x):
        with torch.no_grad():
            f = model(pixel_values=(x - mean) / std).last_hidden_state[:, 0]
        return f / f.norm(dim=-1, keepdim=True)

    vbench, plain = [], []
    for b, video in enumerate(v):
        frames, image = feats(video), feats(_image(b)[None])[0]
        to_image = [float(image @ frames[i]) for i in range(len(video))]
        consec = [max(0.0, float(frames[i - 1] @ frames[i])) for i in range(1, len(video))]
        vbench.append(0.5 * max(max(0.0, s) for s in to_image) + 0.5 * sum(consec) / len(consec))
        plain.append(sum(to_image) / len(to_image))
    torch.testing.assert_close(_reward("dino")(v, ["a", "b"], _meta(2)), torch.tensor(vbench), atol=1e-5, rtol=0)
    got = _reward("dino", "mean")(v, ["a", "b"], _meta(2))
    torch.testing.assert_close(got, torch.tensor(plain), atol=1e-5, rtol=0)
    assert float((1 - got).min()) > 1e-4  # unrelated frames score below a repeated image's 1


def test_the_conditioning_image_matters_and_bad_input_is_refused():
    v = torch.stack([_image(0), _image(0)])[:, None].expand(2, 3, 3, SIZE, SIZE)  # both videos repeat image 0
    s = _reward("clip", "mean")(v, ["a", "b"], _meta(2))  # row 1 is scored against image 1
    assert abs(float(s[0]) - 1) < 1e-5 and float(s[1]) < 1 - 1e-4
    with pytest.raises(ValueError, match="i2v_consistency needs metadata 'images'"):
        _reward("dino")(v, ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="at least 2 frames"):
        _reward("dino")(v[:, :1], ["a", "b"], _meta(2))
    with pytest.raises(ValueError, match="mode must be"):
        ImageToVideoConsistency(mode="max")
