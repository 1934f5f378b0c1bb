"""Model-based rewards (HPSv2, PickScore, CLIP score, aesthetic) on tiny random models, offline.

Every model is a tiny random network of the real architecture family, saved in its official checkpoint format
(``flowgrpo_rewards.tiny_models``) and loaded through the reward's real loading code. Expected scores come from
the reference path, built independently here: the published preprocessing on 8-bit PIL images (transformers'
PIL ``CLIPImageProcessor``, open_clip's ``image_transform``), the model's own forward pass as the reference
scorers call it (``CLIPModel.forward`` logits, open_clip ``CLIP`` with ``output_dict``), and each score
formula written out by hand on the embeddings.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402

open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

from flowgrpo_rewards import tiny_models as tm  # noqa: E402
from flowgrpo_rewards._clip_common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImagePreprocess  # noqa: E402
from flowgrpo_rewards.aesthetic import AestheticReward  # noqa: E402
from flowgrpo_rewards.clip_score import ClipScoreReward  # noqa: E402
from flowgrpo_rewards.hps import HPSv2Reward  # noqa: E402
from flowgrpo_rewards.pickscore import PickScoreReward  # noqa: E402

from flowgrpo.testing.rewards import RewardConformance  # noqa: E402

# PIL-backed CLIP image processor: transformers 5 names it CLIPImageProcessorPil; in 4.x the plain one is PIL.
PilClipImageProcessor = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor

PROMPTS = ["a photo of a cat", "a red car on a street", "a photo of a cat", 'a sign that says "open"']
MLP_DIMS = (16, 32, 16, 8, 4, 1)
# A learned temperature that is not the released 100, so that exp(logit_scale)*cos and 100*cos differ.
TINY_LOGIT_SCALE = math.log(60.0)
# Pixel tolerance of torch's antialiased resize against PIL's (8-bit) resize, in normalised units.
PIXEL_ATOL = 1.5 / 255 / min(OPENAI_CLIP_STD)


# ------------------------------------------------------------------------------------------------------------
# helpers and fixtures
# ------------------------------------------------------------------------------------------------------------


def smooth_images(n: int, height: int, width: int, seed: int) -> torch.Tensor:
    """(n, 3, H, W) smooth random images on the 8-bit grid (k / 255), as decoded images are once saved."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, max(height // 6, 2), max(width // 6, 2), generator=g)
    x = F.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)
    return (x * 255).round() / 255


def to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) float in [0, 1] -> 8-bit RGB PIL image, as the reference scorers receive images."""
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(array))


@functools.lru_cache(maxsize=1)
def tiny_root() -> Path:
    """Every tiny checkpoint, written once per test process (the conformance classes need them at import of
    their factories, before fixtures exist); removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="flowgrpo_reward_ckpts_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    cfg = tm.tiny_hf_clip_config()
    cfg["logit_scale_init_value"] = TINY_LOGIT_SCALE
    tm.save_tiny_hf_clip(root / "hf_clip", root / "hf_proc", seed=1, config=cfg)
    tm.save_tiny_hps_checkpoint(root / "hps" / "HPS_v2_compressed.pt", seed=2)
    tm.save_tiny_hps_checkpoint(root / "hps" / "HPS_v2.1_compressed.pt", seed=3)
    tm.save_tiny_open_clip_dir(root / "dfn", seed=4)
    tm.save_tiny_aesthetic_mlp(root / "sac+logos+ava1-l14-linearMSE.pth", dims=MLP_DIMS, seed=5)
    return root


@pytest.fixture(scope="module")
def ckpts():
    return tiny_root()


@pytest.fixture(scope="module")
def hf_reference(ckpts):
    """The transformers reference: CLIPModel.forward on PIL-processor inputs (PickScore's README recipe)."""
    model = transformers.CLIPModel.from_pretrained(str(ckpts / "hf_clip")).eval()
    processor = PilClipImageProcessor.from_pretrained(str(ckpts / "hf_proc"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpts / "hf_proc"))

    def forward(images: torch.Tensor, prompts: list[str]):
        pixels = processor(images=[to_pil(im) for im in images], return_tensors="pt")["pixel_values"]
        text = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        with torch.no_grad():
            return model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)

    return forward


# ------------------------------------------------------------------------------------------------------------
# preprocessing (torch ops) against the reference PIL pipelines
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 40), (37, 64), (24, 20), (32, 32)])
def test_shortest_edge_preprocess_matches_transformers_pil_processor(shape):
    images = smooth_images(2, *shape, seed=11)
    processor = PilClipImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, resample=3)
    expected = processor(images=[to_pil(im) for im in images], return_tensors="pt")["pixel_values"]
    ours = ImagePreprocess(size=(32, 32), resize_mode="shortest", interpolation="bicubic")(images)
    assert ours.shape == expected.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, expected.float(), atol=PIXEL_ATOL, rtol=0)


def test_shortest_edge_preprocess_matches_at_the_released_224_size():
    images = smooth_images(1, 512, 384, seed=12)  # portrait: resize 384 -> 224, crop the long side
    processor = PilClipImageProcessor()  # defaults: shortest edge 224, crop 224, bicubic, openai mean/std
    expected = processor(images=[to_pil(im) for im in images], return_tensors="pt")["pixel_values"]
    ours = ImagePreprocess(size=(224, 224))(images)
    torch.testing.assert_close(ours, expected.float(), atol=PIXEL_ATOL, rtol=0)


@pytest.mark.parametrize("shape", [(48, 40), (20, 64), (32, 32)])
def test_longest_edge_preprocess_matches_open_clip_longest_mode(shape):
    """open_clip image_transform(resize_mode='longest') on PIL images: fit, pad with black. (HPSv2's own
    preprocess_val resizes the float tensor instead: test_preprocess_parity.py.)"""
    images = smooth_images(2, *shape, seed=13)
    transform = open_clip.image_transform(32, is_train=False, resize_mode="longest")
    expected = torch.stack([transform(to_pil(im)) for im in images])
    ours = ImagePreprocess(size=(32, 32), resize_mode="longest", fill=0.0)(images)
    torch.testing.assert_close(ours, expected, atol=PIXEL_ATOL, rtol=0)
    if shape == (20, 64):  # padded rows exist and hold the normalised black
        black = (0 - torch.tensor(OPENAI_CLIP_MEAN)) / torch.tensor(OPENAI_CLIP_STD)
        torch.testing.assert_close(ours[0, :, 0, 0], black)


def test_squash_preprocess_matches_open_clip_squash():
    images = smooth_images(2, 48, 40, seed=14)
    transform = open_clip.image_transform(32, is_train=False, resize_mode="squash")
    expected = torch.stack([transform(to_pil(im)) for im in images])
    ours = ImagePreprocess(size=(32, 32), resize_mode="squash")(images)
    torch.testing.assert_close(ours, expected, atol=PIXEL_ATOL, rtol=0)


def test_bilinear_preprocess_matches_flowgrpo_torchvision_transform():
    """Flow-GRPO's clip_scorer: torchvision Resize(224) (bilinear, antialias) + CenterCrop on float tensors."""
    torchvision_transforms = pytest.importorskip("torchvision.transforms")
    images = smooth_images(2, 64, 48, seed=15)
    transform = torchvision_transforms.Compose(
        [
            torchvision_transforms.Resize(32),
            torchvision_transforms.CenterCrop(32),
            torchvision_transforms.Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
        ]
    )
    ours = ImagePreprocess(size=(32, 32), interpolation="bilinear")(images)
    torch.testing.assert_close(ours, transform(images), atol=1e-5, rtol=0)


def test_preprocess_runs_on_batches_and_keeps_gradients():
    images = smooth_images(3, 40, 40, seed=16).requires_grad_(True)
    out = ImagePreprocess(size=(32, 32))(images)
    out.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_preprocess_rejects_unknown_modes():
    with pytest.raises(ValueError, match="resize_mode 'crop'"):
        ImagePreprocess(size=32, resize_mode="crop")
    with pytest.raises(ValueError, match="interpolation 'nearest'"):
        ImagePreprocess(size=32, interpolation="nearest")


def test_tiny_tokenizer_is_the_real_clip_bpe(ckpts):
    """The HF tokenizer rebuilt from open_clip's vocab file tokenises exactly as open_clip's SimpleTokenizer."""
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpts / "hf_proc"))
    prompts = ["A photo of a Cat, sitting!", 'Sign saying "Hello World 2024"', "naïve café résumé"]
    oc = open_clip.get_tokenizer("ViT-H-14")(prompts)
    for prompt, ids in zip(prompts, oc.tolist(), strict=True):
        hf_ids = hf(prompt)["input_ids"]
        assert hf_ids == ids[: len(hf_ids)] and hf_ids[-1] == 49407 and len(hf_ids) > 3


# ------------------------------------------------------------------------------------------------------------
# HPSv2
# ------------------------------------------------------------------------------------------------------------


def hpsv2_preprocess_val(image: torch.Tensor, size: int = 32) -> torch.Tensor:
    """HPSv2's eval transform on a (3, H, W) float image (ToTensor's output): ResizeMaxSize on the tensor
    (scale = size / max(H, W), edges round(edge * scale), bicubic, no clamp), pad with 0 centered, Normalize."""
    tv = pytest.importorskip("torchvision.transforms")
    tvf = pytest.importorskip("torchvision.transforms.functional")
    height, width = image.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_size = [round(dim * scale) for dim in (height, width)]
        image = tvf.resize(image, new_size, interpolation=tv.InterpolationMode.BICUBIC, antialias=True)
        pad_h, pad_w = size - new_size[0], size - new_size[1]
        image = tvf.pad(image, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return tv.Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)(image)


def hps_reference(checkpoint: str, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """hpsv2/img_score.py: open_clip CLIP, load_state_dict(checkpoint['state_dict']), preprocess_val,
    logits = image_features @ text_features.T (both normalised by output_dict), diagonal."""
    model = open_clip.model.CLIP(**tm.TINY_OPEN_CLIP, output_dict=True).eval()
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    preprocess_val = hpsv2_preprocess_val
    tokenizer = open_clip.get_tokenizer("ViT-H-14")
    scores = []
    with torch.no_grad():
        for image, prompt in zip(images, prompts, strict=True):
            out = model(preprocess_val(image).unsqueeze(0), tokenizer([prompt]))
            scores.append(torch.diagonal(out["image_features"] @ out["text_features"].T)[0])
    return torch.stack(scores)


@pytest.mark.parametrize("version,filename", [("v2.0", "HPS_v2_compressed.pt"), ("v2.1", "HPS_v2.1_compressed.pt")])
def test_hpsv2_matches_reference_scorer(ckpts, version, filename):
    images = smooth_images(4, 32, 32, seed=21)
    reward = HPSv2Reward(version=version, checkpoint=str(ckpts / "hps"), architecture=tm.TINY_OPEN_CLIP)
    reward.setup("cpu")
    scores = reward(images, PROMPTS, [{}] * 4)
    expected = hps_reference(str(ckpts / "hps" / filename), images, PROMPTS)
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert scores.std() > 1e-3  # the pairs really score differently


def test_hpsv2_versions_load_different_files(ckpts):
    images = smooth_images(2, 32, 32, seed=22)
    scores = {}
    for version in ("v2.0", "v2.1"):
        reward = HPSv2Reward(version=version, checkpoint=str(ckpts / "hps"), architecture=tm.TINY_OPEN_CLIP)
        reward.setup("cpu")
        scores[version] = reward(images, PROMPTS[:2], [{}] * 2)
    assert not torch.allclose(scores["v2.0"], scores["v2.1"], atol=1e-3)


@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (61, 37)])
def test_hpsv2_resized_images_score_as_the_reference(ckpts, shape):
    """Non-square images go through resize + pad, on the float tensor in both: equal to float rounding."""
    images = torch.rand(3, 3, *shape, generator=torch.Generator().manual_seed(23))
    path = ckpts / "hps" / "HPS_v2.1_compressed.pt"
    reward = HPSv2Reward(checkpoint=str(path), architecture=tm.TINY_OPEN_CLIP, batch_size=2)
    reward.setup("cpu")
    reference_pixels = torch.stack([hpsv2_preprocess_val(im) for im in images])
    torch.testing.assert_close(reward.clip.preprocess(images), reference_pixels, atol=2e-6, rtol=0)
    scores = reward(images, PROMPTS[:3], [{}] * 3)
    torch.testing.assert_close(scores, hps_reference(str(path), images, PROMPTS[:3]), atol=1e-5, rtol=0)


def test_hpsv2_rejects_bad_settings_and_missing_files(ckpts, tmp_path):
    with pytest.raises(ValueError, match="'v3'.*v2.0.*v2.1"):
        HPSv2Reward(version="v3")
    with pytest.raises(ValueError, match="batch_size"):
        HPSv2Reward(batch_size=0)
    with pytest.raises(FileNotFoundError, match="HPS_v2.1_compressed.pt"):
        HPSv2Reward(checkpoint=str(tmp_path), architecture=tm.TINY_OPEN_CLIP).setup("cpu")
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        HPSv2Reward(checkpoint=str(tmp_path / "missing" / "x.pt")).setup("cpu")
    with pytest.raises(RuntimeError, match="setup"):
        HPSv2Reward()(smooth_images(1, 32, 32, 0), ["x"], [{}])


def test_hpsv2_wrong_architecture_fails_loudly(ckpts):
    wrong = {**tm.TINY_OPEN_CLIP, "embed_dim": 24}
    with pytest.raises(RuntimeError, match="size mismatch"):
        HPSv2Reward(checkpoint=str(ckpts / "hps"), architecture=wrong).setup("cpu")


# ------------------------------------------------------------------------------------------------------------
# PickScore
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divisor", [1.0, 26.0])
def test_pickscore_matches_clipmodel_logits(ckpts, hf_reference, divisor):
    images = smooth_images(4, 32, 32, seed=31)
    reward = PickScoreReward(checkpoint=str(ckpts / "hf_clip"), processor=str(ckpts / "hf_proc"), divisor=divisor)
    reward.setup("cpu")
    scores = reward(images, PROMPTS, [{}] * 4)
    out = hf_reference(images, PROMPTS)
    # PickScore = exp(logit_scale) * cos = CLIPModel's logits_per_image; Flow-GRPO divides by 26.
    expected = out.logits_per_image.diagonal() / divisor
    torch.testing.assert_close(scores, expected, atol=1e-4 / divisor, rtol=1e-5)
    # ... and, by hand on the model's own embeddings, with its learned temperature (60 here, 100 released):
    by_hand = 60.0 * (F.normalize(out.image_embeds, dim=-1) * F.normalize(out.text_embeds, dim=-1)).sum(-1)
    torch.testing.assert_close(scores, by_hand / divisor, atol=1e-3 / divisor, rtol=1e-5)


def test_pickscore_rank_is_the_rank_of_pickscore_within_the_group(ckpts, hf_reference):
    from flowgrpo_rewards.group import pickscore_rank

    images = smooth_images(5, 32, 32, seed=33)
    prompts = ["a photo of a cat"] * 5
    reward = pickscore_rank(checkpoint=str(ckpts / "hf_clip"), processor=str(ckpts / "hf_proc"))
    assert reward.group_wise and reward.name == "pickscore_rank"
    reward.setup("cpu")
    logits = hf_reference(images, prompts).logits_per_image[:, 0]  # the transformers reference PickScore
    assert torch.unique(logits).numel() == 5
    rank = torch.argsort(torch.argsort(logits)).double()  # 0 = lowest
    torch.testing.assert_close(reward(images, prompts, [{}] * 5), (rank / 4).float())


def test_pickscore_preprocessing_chunking_and_prompt_dedup(ckpts):
    images = smooth_images(5, 40, 36, seed=32)
    prompts = PROMPTS + ["a photo of a cat"]
    kwargs = {"checkpoint": str(ckpts / "hf_clip"), "processor": str(ckpts / "hf_proc")}
    whole, chunked = PickScoreReward(**kwargs), PickScoreReward(batch_size=2, **kwargs)
    whole.setup("cpu")
    chunked.setup("cpu")
    # the preprocessing read from preprocessor_config.json is the PIL processor's
    processor = PilClipImageProcessor.from_pretrained(str(ckpts / "hf_proc"))
    reference_pixels = processor(images=[to_pil(im) for im in images], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(whole.clip.preprocess(images), reference_pixels.float(), atol=PIXEL_ATOL, rtol=0)
    together = whole(images, prompts, [{}] * 5)
    one_by_one = torch.cat([whole(images[i : i + 1], prompts[i : i + 1], [{}]) for i in range(5)])
    torch.testing.assert_close(together, one_by_one, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(chunked(images, prompts, [{}] * 5), together, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("reward_cls", ["pickscore", "clip_score", "aesthetic"])
def test_pil_resize_backend_scores_resized_images_as_the_pil_reference(ckpts, hf_reference, reward_cls):
    """resize_backend='pil' reproduces the PIL processor's pixels, so resized images score as the reference."""
    images = smooth_images(3, 48, 37, seed=34)  # resized and cropped to 32 x 32
    kwargs = {"checkpoint": str(ckpts / "hf_clip"), "processor": str(ckpts / "hf_proc"), "resize_backend": "pil"}
    if reward_cls == "pickscore":
        reward = PickScoreReward(**kwargs)
    elif reward_cls == "clip_score":
        reward = ClipScoreReward("openai", **kwargs)
    else:
        reward = AestheticReward(clip_checkpoint=kwargs["checkpoint"], clip_processor=kwargs["processor"],
                                 mlp_checkpoint=str(ckpts), architecture={"mlp_dims": MLP_DIMS}, resize_backend="pil")
    reward.setup("cpu")
    assert reward.clip.preprocess.resize_backend == "pil"
    processor = PilClipImageProcessor.from_pretrained(str(ckpts / "hf_proc"))
    reference_pixels = processor(images=[to_pil(im) for im in images], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(reward.clip.preprocess(images), reference_pixels.float(), atol=1e-5, rtol=0)
    if reward_cls == "pickscore":
        expected = hf_reference(images, PROMPTS[:3]).logits_per_image.diagonal()
        torch.testing.assert_close(reward(images, PROMPTS[:3], [{}] * 3), expected, atol=1e-4, rtol=1e-5)


def test_hf_architecture_override_replaces_config_json(ckpts):
    """``architecture`` (a CLIPConfig dict) is used instead of config.json; weights that do not fit it fail."""
    images = smooth_images(2, 32, 32, seed=33)
    kwargs = {"checkpoint": str(ckpts / "hf_clip"), "processor": str(ckpts / "hf_proc")}
    cfg = tm.tiny_hf_clip_config()
    cfg["logit_scale_init_value"] = TINY_LOGIT_SCALE
    plain, overridden = PickScoreReward(**kwargs), PickScoreReward(architecture=cfg, **kwargs)
    plain.setup("cpu")
    overridden.setup("cpu")
    torch.testing.assert_close(overridden(images, PROMPTS[:2], [{}] * 2), plain(images, PROMPTS[:2], [{}] * 2))
    wider = tm.tiny_hf_clip_config(projection_dim=24)
    with pytest.raises(RuntimeError, match="mismatch"):
        PickScoreReward(architecture=wider, **kwargs).setup("cpu")
    deeper = tm.tiny_hf_clip_config()
    deeper["text_config"]["num_hidden_layers"] = 3  # layer 2 is not in the checkpoint: never random weights
    with pytest.raises(RuntimeError, match=r"does not fit its architecture: missing \[.*layers\.2"):
        PickScoreReward(architecture=deeper, **kwargs).setup("cpu")


def test_pickscore_rejects_bad_input(ckpts):
    with pytest.raises(ValueError, match="divisor"):
        PickScoreReward(divisor=0)
    with pytest.raises(ValueError, match="dtype 'float64'"):
        PickScoreReward(dtype="float64")
    reward = PickScoreReward(checkpoint=str(ckpts / "hf_clip"), processor=str(ckpts / "hf_proc"))
    reward.setup("cpu")
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        reward(torch.rand(2, 32, 32), ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(torch.rand(2, 3, 32, 32), ["a"], [{}])


# ------------------------------------------------------------------------------------------------------------
# CLIP score variants
# ------------------------------------------------------------------------------------------------------------


def test_clip_score_openai_is_100_cosine(ckpts, hf_reference):
    images = smooth_images(4, 32, 32, seed=41)
    reward = ClipScoreReward("openai", checkpoint=str(ckpts / "hf_clip"), processor=str(ckpts / "hf_proc"))
    reward.setup("cpu")
    out = hf_reference(images, PROMPTS)
    cosine = (F.normalize(out.image_embeds, dim=-1) * F.normalize(out.text_embeds, dim=-1)).sum(-1)
    torch.testing.assert_close(reward(images, PROMPTS, [{}] * 4), 100.0 * cosine, atol=1e-3, rtol=1e-5)


def test_clip_score_flowgrpo_is_logits_over_30(ckpts, hf_reference):
    images = smooth_images(4, 32, 32, seed=42)
    reward = ClipScoreReward("flowgrpo", checkpoint=str(ckpts / "hf_clip"), processor=str(ckpts / "hf_proc"))
    reward.setup("cpu")
    expected = hf_reference(images, PROMPTS).logits_per_image.diagonal() / 30  # flow_grpo/clip_scorer.py
    torch.testing.assert_close(reward(images, PROMPTS, [{}] * 4), expected, atol=1e-5, rtol=1e-5)
    assert reward.clip.preprocess.interpolation == "bilinear"  # torchvision Resize's default, as Flow-GRPO


def test_clip_score_dfn5b_is_plain_cosine_of_open_clip(ckpts):
    """MixGRPO's clip_score.py: create_model_from_pretrained(hub folder), its preprocess on PIL, cosine."""
    images = smooth_images(3, 48, 40, seed=43)  # squashed to 32 x 32
    model, preprocess = open_clip.create_model_from_pretrained(f"local-dir:{ckpts / 'dfn'}")
    tokenizer = open_clip.get_tokenizer("ViT-H-14")
    with torch.no_grad():
        pixels = torch.stack([preprocess(to_pil(im)) for im in images])
        image_features = F.normalize(model.encode_image(pixels), dim=-1)
        text_features = F.normalize(model.encode_text(tokenizer(PROMPTS[:3], context_length=77)), dim=-1)
    expected = (image_features * text_features).sum(-1)
    reward = ClipScoreReward("dfn5b", checkpoint=str(ckpts / "dfn"))
    reward.setup("cpu")
    # the preprocessing read from open_clip_config.json (squash, bicubic, mean/std) is the reference's
    torch.testing.assert_close(reward.clip.preprocess(images), pixels, atol=PIXEL_ATOL, rtol=0)
    torch.testing.assert_close(reward(images, PROMPTS[:3], [{}] * 3), expected, atol=5e-3, rtol=0)
    native = smooth_images(2, 32, 32, seed=44)  # no resampling: exact
    with torch.no_grad():
        img = F.normalize(model.encode_image(torch.stack([preprocess(to_pil(im)) for im in native])), dim=-1)
    exact = (img * text_features[:2]).sum(-1)
    torch.testing.assert_close(reward(native, PROMPTS[:2], [{}] * 2), exact, atol=1e-5, rtol=0)


def test_clip_score_variant_errors():
    with pytest.raises(ValueError, match="'hessel'.*dfn5b.*flowgrpo.*openai"):
        ClipScoreReward("hessel")
    with pytest.raises(ValueError, match="drop processor"):
        ClipScoreReward("dfn5b", processor="x/y")


# ------------------------------------------------------------------------------------------------------------
# aesthetic
# ------------------------------------------------------------------------------------------------------------


def test_aesthetic_is_the_mlp_on_normalised_clip_embeddings(ckpts, hf_reference):
    images = smooth_images(4, 32, 32, seed=51)
    mlp_path = ckpts / "sac+logos+ava1-l14-linearMSE.pth"
    reward = AestheticReward(
        clip_checkpoint=str(ckpts / "hf_clip"),
        clip_processor=str(ckpts / "hf_proc"),
        mlp_checkpoint=str(ckpts),  # a folder holding sac+logos+ava1-l14-linearMSE.pth
        architecture={"mlp_dims": MLP_DIMS},
    )
    reward.setup("cpu")
    scores = reward(images, ["ignored"] * 4, [{}] * 4)
    # By hand: e = CLIP image embedding / |.|, then the five affine maps of simple_inference.py's MLP.
    e = F.normalize(hf_reference(images, ["x"] * 4).image_embeds, dim=-1)
    state = torch.load(mlp_path, weights_only=True)
    h = e
    for i in (0, 2, 4, 6, 7):
        h = h @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(scores, h.squeeze(-1), atol=1e-5, rtol=1e-5)
    assert scores.std() > 0


def test_aesthetic_checkpoint_must_fit_the_mlp_dims(ckpts):
    reward = AestheticReward(
        clip_checkpoint=str(ckpts / "hf_clip"),
        clip_processor=str(ckpts / "hf_proc"),
        mlp_checkpoint=str(ckpts / "sac+logos+ava1-l14-linearMSE.pth"),
    )  # default dims 768-1024-... do not fit the tiny file
    with pytest.raises(ValueError, match="dims=.*768"):
        reward.setup("cpu")
    with pytest.raises(ValueError, match="6 positive int widths"):
        AestheticReward(architecture={"mlp_dims": (16, 1)})
    with pytest.raises(ValueError, match="unknown"):
        AestheticReward(architecture={"mlp": (16,)})


# ------------------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------------------


def test_entry_points_register_every_model_reward():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="flowgrpo.rewards")}
    expected = {
        "hpsv2": HPSv2Reward,
        "pickscore": PickScoreReward,
        "clip_score": ClipScoreReward,
        "aesthetic": AestheticReward,
    }
    for name, cls in expected.items():
        assert name in eps, f"entry point {name!r} missing; reinstall with pip install -e ./rewards"
        assert eps[name].load() is cls
        assert cls.name == name


# ------------------------------------------------------------------------------------------------------------
# the Reward protocol (flowgrpo's conformance suite) on each tiny stand-in
# ------------------------------------------------------------------------------------------------------------


def _hf_kwargs() -> dict:
    return {"checkpoint": str(tiny_root() / "hf_clip"), "processor": str(tiny_root() / "hf_proc")}


class TestHPSv2Conformance(RewardConformance):
    reward_factory = staticmethod(
        lambda: HPSv2Reward(checkpoint=str(tiny_root() / "hps"), architecture=tm.TINY_OPEN_CLIP, batch_size=2)
    )


class TestPickScoreConformance(RewardConformance):
    reward_factory = staticmethod(lambda: PickScoreReward(batch_size=2, **_hf_kwargs()))
    atol = 1e-4  # scores are ~60 x cosine


class TestClipScoreOpenaiConformance(RewardConformance):
    reward_factory = staticmethod(lambda: ClipScoreReward("openai", batch_size=2, **_hf_kwargs()))
    atol = 1e-4  # scores are 100 x cosine


class TestClipScoreDfn5bConformance(RewardConformance):
    reward_factory = staticmethod(lambda: ClipScoreReward("dfn5b", checkpoint=str(tiny_root() / "dfn")))


class TestAestheticConformance(RewardConformance):
    reward_factory = staticmethod(
        lambda: AestheticReward(
            clip_checkpoint=str(tiny_root() / "hf_clip"),
            clip_processor=str(tiny_root() / "hf_proc"),
            mlp_checkpoint=str(tiny_root() / "sac+logos+ava1-l14-linearMSE.pth"),
            architecture={"mlp_dims": MLP_DIMS},
            batch_size=2,
        )
    )
