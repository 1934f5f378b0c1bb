"""The ``image_reward`` plugin against the original ``image-reward`` package, on a tiny random checkpoint.

Expected values are not computed by flowgrpo: ``data/image_reward/reference.json`` holds what the original
package (image-reward 1.5 under transformers 4.36 and timm 0.6.13, in a separate environment) returned for the
committed checkpoint ``data/image_reward/ImageReward.pt`` (the official format: a ``torch.save`` of the original
module's state dict, random weights, tiny sizes). ``rewards/scripts/image_reward_reference.py`` rebuilds that
environment and regenerates the data. The preprocessing is checked against torchvision's PIL pipeline, the one
the original uses.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

transformers = pytest.importorskip("transformers")

from flowgrpo_rewards.image_reward import (  # noqa: E402
    ImageReward,
    convert_state_dict,
    load_image_reward,
    preprocess,
)

from flowgrpo.testing.rewards import RewardConformance  # noqa: E402

DATA = Path(__file__).parent / "data" / "image_reward"
REF = json.loads((DATA / "reference.json").read_text())
# The published normalisation, written out here rather than imported (Xu et al. 2023, ImageReward.score).
PUBLISHED_MEAN = 0.16717362830052426
PUBLISHED_STD = 1.0333394966054072
# torch's antialiased bicubic resize of the float image against PIL's 8-bit bicubic resize: measured at most
# 1.1e-3 on these images (scores spanning 0.36); allowed 3e-3.
PIL_RESIZE_SCORE_ATOL = 3e-3


def make_reward(**kwargs) -> ImageReward:
    args = {"model": str(DATA), "tokenizer": str(DATA / "tokenizer"), "vision_config": REF["vision_config"]}
    return ImageReward(**{**args, **kwargs})


def load_png(name: str) -> torch.Tensor:
    """(3, H, W) float32 in [0, 1]: the 8-bit pixels / 255, as torchvision's ToTensor gives them."""
    return torch.from_numpy(np.array(Image.open(DATA / name).convert("RGB"))).permute(2, 0, 1).float() / 255.0


def pairs(rows: list[dict]) -> tuple[torch.Tensor, list[str], torch.Tensor, torch.Tensor]:
    """(images (B, 3, H, W), prompts, reference scores (B,), reference raw head outputs (B,)) of equal-size rows."""
    images = torch.stack([load_png(r["image"]) for r in rows])
    prompts = [REF["prompts"][r["prompt"]] for r in rows]
    scores = torch.tensor([r["score"] for r in rows], dtype=torch.float64)
    raw = torch.tensor([r["raw"] for r in rows], dtype=torch.float64)
    return images, prompts, scores, raw


@pytest.fixture(scope="module")
def reward() -> ImageReward:
    r = make_reward(batch_size=5)  # 12 pairs → chunks of 5, 5, 2
    r.setup(torch.device("cpu"))
    return r


# ------------------------------------------------------------------------------------------------------------
# parity with the original package
# ------------------------------------------------------------------------------------------------------------


def test_reference_data_belongs_to_the_committed_checkpoint():
    digest = hashlib.sha256((DATA / "ImageReward.pt").read_bytes()).hexdigest()
    assert digest == REF["checkpoint_sha256"], "ImageReward.pt and reference.json come from different runs"
    assert REF["versions"]["transformers"].startswith("4.") and REF["versions"]["image-reward"] == "1.5"


def test_tokenizer_matches_original(reward):
    """Same ids as the original's BertTokenizer with [DEC]/[ENC] added: case, accents, punctuation, unknown
    characters, ##pieces, padding to 35 and truncation of the long prompt."""
    ids, mask = reward.tokenize(REF["prompts"])
    assert ids.shape == (len(REF["prompts"]), 35)
    assert ids.tolist() == REF["input_ids"]
    assert torch.equal(mask, (ids != 0).long())
    tok = REF["tokenizer"]
    assert reward.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [tok["dec_token_id"], tok["enc_token_id"]]
    assert len(reward.tokenizer) == tok["vocab_size"]


def test_scores_match_original_package(reward):
    """Every (prompt, 224 x 224 image) pair, in one batch, to 1e-5 of the original ``ImageReward.score``."""
    images, prompts, expected, _ = pairs(REF["square"])
    scores = reward(images, prompts, [{}] * len(prompts))
    assert scores.dtype == torch.float32 and scores.shape == (len(prompts),)
    assert expected.max() - expected.min() > 0.1, "reference scores too alike for the comparison to have power"
    torch.testing.assert_close(scores.double(), expected, atol=1e-5, rtol=0)


def test_raw_head_output_and_published_normalisation(reward):
    images, prompts, expected_score, expected_raw = pairs(REF["square"])
    ids, mask = reward.tokenize(prompts)
    with torch.no_grad():
        out = reward.model(preprocess(images), ids, mask)
    torch.testing.assert_close(out.raw.double(), expected_raw, atol=1e-5, rtol=0)
    assert (REF["mean"], REF["std"]) == (PUBLISHED_MEAN, PUBLISHED_STD)
    by_hand = (out.raw.double() - PUBLISHED_MEAN) / PUBLISHED_STD
    torch.testing.assert_close(out.score.double(), by_hand, atol=1e-6, rtol=0)
    torch.testing.assert_close(by_hand, expected_score, atol=1e-5, rtol=0)


def test_other_sizes_close_to_original_pil_path(reward):
    """Non-square images of other sizes: the only difference left is the resize (torch float vs PIL 8-bit)."""
    for row in REF["other_sizes"]:
        images, prompts, expected, _ = pairs([row])
        score = reward(images, prompts, [{}])
        assert abs(score.item() - expected.item()) < PIL_RESIZE_SCORE_ATOL, (row, score.item())


def test_checkpoint_key_mapping_uses_every_weight_of_the_score():
    """Only the contrastive projections (unused by ImageReward's score) and the position_ids buffer are left."""
    state_dict = torch.load(DATA / "ImageReward.pt", map_location="cpu", weights_only=True)
    converted, dropped = convert_state_dict(state_dict)
    assert sorted(dropped) == [
        "blip.text_encoder.embeddings.position_ids",
        "blip.text_proj.bias",
        "blip.text_proj.weight",
        "blip.vision_proj.bias",
        "blip.vision_proj.weight",
    ]
    assert len(converted) + len(dropped) == len(state_dict)
    cls_token = state_dict["blip.visual_encoder.cls_token"]
    assert torch.equal(converted["vision_model.embeddings.class_embedding"], cls_token)
    assert torch.equal(converted["head.4.weight"], state_dict["mlp.layers.7.weight"])


def test_loads_from_a_pt_file_path_too():
    folder = load_image_reward(str(DATA), REF["vision_config"])
    file = load_image_reward(str(DATA / "ImageReward.pt"), REF["vision_config"])
    for (k, a), (_, b) in zip(folder.state_dict().items(), file.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


# ------------------------------------------------------------------------------------------------------------
# preprocessing against torchvision's PIL pipeline (what the original applies)
# ------------------------------------------------------------------------------------------------------------


def torchvision_reference(pil: Image.Image) -> torch.Tensor:
    tv = pytest.importorskip("torchvision.transforms")
    t = tv.Compose(
        [
            tv.Resize(224, interpolation=tv.InterpolationMode.BICUBIC),
            tv.CenterCrop(224),
            tv.ToTensor(),
            tv.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )
    return t(pil)


@pytest.mark.parametrize("width", [224, 227, 230])
def test_preprocess_equals_torchvision_without_resampling(width):
    """Shorter side already 224: no resampling, only the centre crop, whose offset is torchvision's
    int(round((W − 224) / 2)) (227: 2 by round-half-even, where a floor would give 1)."""
    g = torch.Generator().manual_seed(width)
    pixels = torch.randint(0, 256, (224, width, 3), generator=g, dtype=torch.uint8)
    expected = torchvision_reference(Image.fromarray(pixels.numpy()))
    got = preprocess(pixels.permute(2, 0, 1)[None].float() / 255.0)[0]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["img3_256x320.png", "img4_300x240.png"])
def test_preprocess_close_to_torchvision_with_resampling(name):
    """Resized images agree with PIL's 8-bit bicubic to about one grey level (measured: max 1.1/255, mean 0.28/255,
    of which 0.25/255 is PIL's rounding of its output to 8 bits)."""
    expected = torchvision_reference(Image.open(DATA / name).convert("RGB"))
    got = preprocess(load_png(name)[None])[0]
    assert got.shape == expected.shape == (3, 224, 224)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)
    pixel_error = ((got - expected) * std).abs()  # back in [0, 1] pixel units
    assert pixel_error.max() <= 1.5 / 255 and pixel_error.mean() < 0.4 / 255


# ------------------------------------------------------------------------------------------------------------
# bad input and configuration
# ------------------------------------------------------------------------------------------------------------


def test_scoring_before_setup_raises():
    with pytest.raises(RuntimeError, match="setup"):
        make_reward()(torch.zeros(1, 3, 8, 8), ["a cat"], [{}])


@pytest.mark.parametrize(("value", "why"), [(-0.1, r"\[0, 1\]"), (1.5, r"\[0, 1\]"),
                                            (float("nan"), "NaN or infinite.*diverged")])
def test_images_outside_unit_range_raise(reward, value, why):
    images = torch.full((1, 3, 224, 224), 0.5)
    images[0, 0, 0, 0] = value
    with pytest.raises(ValueError, match=why):
        reward(images, ["a cat"], [{}])


def test_bad_constructor_arguments_raise():
    with pytest.raises(ValueError, match="dtype"):
        make_reward(dtype="float64")
    with pytest.raises(ValueError, match="batch_size"):
        make_reward(batch_size=0)


def test_missing_model_path_raises_without_network(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        load_image_reward(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="med_config.json"):
        (tmp_path / "ImageReward.pt").write_bytes((DATA / "ImageReward.pt").read_bytes())
        load_image_reward(str(tmp_path), REF["vision_config"])


def test_unknown_vision_config_key_lists_allowed():
    with pytest.raises(ValueError, match="allowed.*hidden_size"):
        load_image_reward(str(DATA), {"width": 48})


@pytest.mark.parametrize(
    "override, message",
    [({"num_hidden_layers": 3}, "missing"), ({"patch_size": 8}, "do not fit"), ({}, "missing")],
)
def test_architecture_that_does_not_fit_the_checkpoint_raises(override, message):
    config = {**REF["vision_config"], **override} if override else None  # None: the full ViT-L defaults
    with pytest.raises(ValueError, match=message):
        load_image_reward(str(DATA), config)


def test_checkpoint_without_head_raises(tmp_path):
    state_dict = torch.load(DATA / "ImageReward.pt", map_location="cpu", weights_only=True)
    torch.save({k: v for k, v in state_dict.items() if not k.startswith("mlp.")}, tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text((DATA / "med_config.json").read_text())
    with pytest.raises(ValueError, match="head"):
        load_image_reward(str(tmp_path), REF["vision_config"])


def test_tokenizer_of_another_vocabulary_raises(tmp_path):
    vocab = (DATA / "tokenizer" / "vocab.txt").read_text().splitlines()
    (tmp_path / "vocab.txt").write_text("\n".join(vocab + ["extra"]) + "\n")
    with pytest.raises(ValueError, match="vocabulary"):
        make_reward(tokenizer=str(tmp_path)).setup(torch.device("cpu"))


def test_bfloat16_encoders_stay_close(reward):
    images, prompts, expected, _ = pairs(REF["square"][:3])
    low = make_reward(dtype="bfloat16")
    low.setup(torch.device("cpu"))
    scores = low(images, prompts, [{}] * 3)
    assert scores.dtype == torch.float32
    assert (scores.double() - expected).abs().max() < 0.05


# ------------------------------------------------------------------------------------------------------------
# the Reward protocol
# ------------------------------------------------------------------------------------------------------------


class TestImageRewardConformance(RewardConformance):
    reward_factory = staticmethod(lambda: make_reward(batch_size=2))


def test_registered_as_image_reward_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="flowgrpo.rewards")}
    assert "image_reward" in names, "reinstall the plugins: pip install -e ./rewards"
    assert names["image_reward"] == "flowgrpo_rewards.image_reward:ImageReward"
