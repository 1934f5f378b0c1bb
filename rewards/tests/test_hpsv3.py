"""The ``hpsv3`` plugin against the official ``hpsv3`` package, on a tiny random checkpoint.

Expected values are not computed by flowgrpo: ``data/hpsv3/reference.json`` holds what the official package
(hpsv3 1.0.0 under transformers 4.45.2, in a separate environment) returned through its own
``HPSv3RewardInferencer.reward`` for the committed checkpoint ``data/hpsv3/HPSv3.safetensors`` (the official format:
the package's own ``Qwen2VLRewardModelBT`` state dict, random weights, tiny sizes) with the tiny base folder
``data/hpsv3/base``. ``rewards/scripts/hpsv3_reference.py`` rebuilds that environment and regenerates the data.
"""

from __future__ import annotations

import copy
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

pytest.importorskip("transformers")

from flowgrpo_rewards.hpsv3 import HPSv3Reward, convert_state_dict, smart_resize  # noqa: E402

from flowgrpo.testing.rewards import RewardConformance  # noqa: E402

DATA = Path(__file__).parent / "data" / "hpsv3"
REF = json.loads((DATA / "reference.json").read_text())
# torch's antialiased bicubic of the float image against PIL's 8-bit bicubic (512² and 300x500 → the 200,704-pixel
# target): measured at most 1.5e-4 on these images (scores spanning 0.025); allowed 5e-4.
TORCH_RESIZE_ATOL = 5e-4


def make_reward(**kwargs) -> HPSv3Reward:
    return HPSv3Reward(**{"checkpoint": str(DATA), "base_model": str(DATA / "base"), "dtype": "float32", **kwargs})


def load_png(name: str) -> torch.Tensor:
    """(3, H, W) float32: the 8-bit pixels / 255."""
    return torch.from_numpy(np.array(Image.open(DATA / name).convert("RGB"))).permute(2, 0, 1).float() / 255.0


def rows_of(rows: list[dict]) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    images = torch.stack([load_png(r["image"]) for r in rows])
    prompts = [REF["prompts"][r["prompt"]] for r in rows]
    return images, prompts, torch.tensor([[r["mu"], r["sigma"]] for r in rows], dtype=torch.float64)


@pytest.fixture(scope="module")
def loaded() -> HPSv3Reward:
    r = make_reward(batch_size=4)  # 6 pairs → batches of 4 and 2
    r.setup(torch.device("cpu"))
    return r


def test_reference_data_belongs_to_the_committed_checkpoint():
    digest = hashlib.sha256((DATA / "HPSv3.safetensors").read_bytes()).hexdigest()
    assert digest == REF["checkpoint_sha256"], "HPSv3.safetensors and reference.json come from different runs"
    assert REF["versions"]["hpsv3"] == "1.0.0" and REF["versions"]["transformers"] == "4.45.2"


def test_checkpoint_keys_are_the_official_layout():
    keys = REF["checkpoint_keys"]
    assert {k.split(".")[0] for k in keys} == {"visual", "model", "lm_head", "rm_head"}
    body, head = convert_state_dict({k: torch.zeros(1) for k in keys})
    assert sorted(head) == ["0.bias", "0.weight", "3.bias", "3.weight", "5.bias", "5.weight"]
    assert all(k.startswith(("visual.", "language_model.")) for k in body) and "lm_head.weight" not in body
    with pytest.raises(ValueError, match="unexpected key 'score.weight'"):
        convert_state_dict({"score.weight": torch.zeros(1)})


def test_tokens_match_the_official_package(loaded):
    reward = loaded
    """Chat template, instruction, ``<|Reward|>`` id and the expansion of the image placeholder (256 tokens)."""
    images, prompts, _ = rows_of(REF["square"])
    batch = reward.inputs(images, prompts)
    assert reward.reward_token_id == REF["reward_token_id"]
    for row, ids, mask in zip(REF["square"], batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                              strict=True):
        assert [i for i, m in zip(ids, mask, strict=True) if m] == row["input_ids"]
    assert batch["image_grid_thw"].tolist() == [[1, 32, 32]] * len(prompts)  # 448 / 14 = 32 patches a side


def test_mu_and_sigma_match_the_official_package(loaded):
    reward = loaded
    """Every (prompt, 448² image) pair, padded batches, to 1e-5 of the package's (mu, sigma); the score is mu."""
    images, prompts, expected = rows_of(REF["square"])
    got = torch.cat([reward.mu_sigma(images[i : i + 4], prompts[i : i + 4]) for i in range(0, len(prompts), 4)])
    assert expected[:, 0].max() - expected[:, 0].min() > 0.01, "reference scores too alike to have power"
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    scores = reward(images, prompts, [{}] * len(prompts))
    assert scores.dtype == torch.float32 and scores.shape == (len(prompts),)
    torch.testing.assert_close(scores.double(), expected[:, 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend, atol", [("pil", 1e-5), ("torch", TORCH_RESIZE_ATOL)])
def test_other_sizes(loaded, backend, atol):
    """512² and 300 x 500 images are resized to about 200,704 pixels: exact with PIL's resize, close with torch's."""
    r = copy.copy(loaded)  # the same loaded model, another setting
    r.resize_backend = backend
    for row in [row for row in REF["other_sizes"] if row["prompt"] == 0]:
        images, prompts, expected = rows_of([row])
        torch.testing.assert_close(r(images, prompts, [{}]).double(), expected[:, 0], atol=atol, rtol=0)


def test_smart_resize_by_hand():
    """The qwen_vl_utils rule at min = max = 200,704 pixels, worked by hand: 448² stays; 512² rounds to 504²
    (254,016 > max), so sides scale by √(512²/200,704) = 8/7 and floor to 448; 300 x 500 rounds to 308 x 504
    (155,232 < min), so sides scale by √(200,704/150,000) ≈ 1.1567 and ceil to 364 x 588."""
    assert smart_resize(448, 448) == (448, 448)
    assert smart_resize(512, 512) == (448, 448)
    assert smart_resize(300, 500) == (364, 588)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300)


def test_a_prompt_with_the_reward_token_is_refused(loaded):
    reward = loaded
    images, _, _ = rows_of(REF["square"][:1])
    with pytest.raises(ValueError, match="exactly one"):
        reward(images, ["a <|Reward|> cat"], [{}])


class TestHPSv3Conformance(RewardConformance):
    reward_factory = staticmethod(lambda: make_reward(pixels=112 * 112))
    image_size = (32, 32)

    @pytest.fixture(scope="class")
    def reward(self, loaded):
        """The module's loaded model (loading takes seconds on a busy CPU) with a smaller target area, which keeps
        the many conformance calls fast (the formula is the same at any area)."""
        r = copy.copy(loaded)
        r.pixels = 112 * 112
        return r
