"""Video rewards (``video_frames``, ``temporal_consistency``) and the video form of the reward contract.

Expected values are derived here by hand (frame choices, aggregates, a static video) or computed with the
encoders' own transformers modules and the VBench formula written out below, never from the rewards' output.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from flowgrpo_rewards.video import TemporalConsistency, VideoFrames, select_frames  # noqa: E402

from flowgrpo.rewards.base import check_reward_inputs  # noqa: E402
from flowgrpo.testing.rewards import RewardConformance, default_videos  # noqa: E402


def _videos(b: int = 2, f: int = 4, size: int = 16) -> torch.Tensor:
    return default_videos(b, f, size, size, torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------------ the contract
def test_the_contract_takes_videos_only_where_declared():
    v = _videos()
    check_reward_inputs(v, ["a", "b"], [{}, {}], "r", ("video",))
    with pytest.raises(ValueError, match=r"r: scores images .*video_frames, kwargs: \{base: r\}"):
        check_reward_inputs(v, ["a", "b"], [{}, {}], "r")
    with pytest.raises(ValueError, match="r: scores videos"):
        check_reward_inputs(v[:, 0], ["a", "b"], [{}, {}], "r", ("video",))
    with pytest.raises(ValueError, match="lie in"):
        check_reward_inputs(v * 2, ["a", "b"], [{}, {}], "r", ("video",))


def test_frame_selection_by_hand():
    assert select_frames(5, "all") == [0, 1, 2, 3, 4]
    assert [select_frames(5, k) for k in ("first", "middle", "last")] == [[0], [2], [4]]
    assert select_frames(81, 8) == [0, 11, 22, 34, 45, 57, 68, 80]  # floor(i·80/7), Pref-GRPO's 8 of 81
    assert select_frames(5, 1) == [0] and select_frames(5, [0, -1]) == [0, 4]
    with pytest.raises(ValueError, match="out of range"):
        select_frames(3, [3])
    with pytest.raises(ValueError, match="frames must be"):
        VideoFrames(base="jpeg_compressibility", frames="some")


# ------------------------------------------------------------------------------------------------ video_frames
class MeanPixel:
    """An image reward by hand: the mean pixel of each image (NaN for the prompt "skip")."""

    name = "mean_pixel"

    def setup(self, device):
        pass

    def __call__(self, images, prompts, metadata):
        check_reward_inputs(images, prompts, metadata, self.name)
        m = images.float().mean((1, 2, 3))
        return torch.where(torch.tensor([p == "skip" for p in prompts]), torch.nan, m)


def test_video_frames_scores_chosen_frames_and_aggregates():
    v = torch.stack([torch.stack([torch.full((3, 4, 4), x) for x in (0.1, 0.5, 0.9)]),
                     torch.stack([torch.full((3, 4, 4), x) for x in (0.6, 0.2, 0.4)])])  # (2, 3, 3, 4, 4)
    base = f"{__name__}:MeanPixel"
    cases = {("all", "mean"): [0.5, 0.4], ("first", "mean"): [0.1, 0.6], ("last", "mean"): [0.9, 0.4],
             ("all", "min"): [0.1, 0.2], ("all", "max"): [0.9, 0.6], ((0, 2), "mean"): [0.5, 0.5]}
    for (frames, agg), expected in cases.items():
        r = VideoFrames(base=base, frames=list(frames) if isinstance(frames, tuple) else frames, aggregate=agg)
        r.setup("cpu")
        torch.testing.assert_close(r(v, ["a", "b"], [{}, {}]), torch.tensor(expected), atol=1e-6, rtol=0)
    r = VideoFrames(base=base, aggregate="max")
    r.setup("cpu")
    assert torch.isnan(r(v, ["skip", "b"], [{}, {}])).tolist() == [True, False]
    assert r.name == "mean_pixel_frames" and r.modalities == ("video",)


class TestVideoFramesConformance(RewardConformance):
    reward_factory = staticmethod(lambda: VideoFrames(base="jpeg_compressibility", frames=2))
    image_size = (16, 16)


# ------------------------------------------------------------------------------------------------ temporal consistency
@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Tiny random DINO (ViTModel) and CLIP vision encoders saved as transformers folders."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, ViTConfig, ViTModel

    root = tmp_path_factory.mktemp("encoders")
    torch.manual_seed(0)
    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       image_size=32, patch_size=8), add_pooling_layer=False).save_pretrained(root / "dino")
    CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=32, image_size=32, patch_size=8,
                                                   projection_dim=8)).save_pretrained(root / "clip")
    return root


def _consistency(encoders, backbone, mode="vbench"):
    r = TemporalConsistency(backbone=backbone, checkpoint=str(encoders / backbone), mode=mode, image_size=32)
    r.setup("cpu")
    return r


def test_a_static_video_is_fully_consistent(encoders):
    still = _videos(2, 1, 32).expand(2, 4, 3, 32, 32)  # every frame the same
    for backbone in ("dino", "clip"):
        for mode in ("vbench", "consecutive"):
            s = _consistency(encoders, backbone, mode)(still, ["a", "b"], [{}, {}])
            torch.testing.assert_close(s, torch.ones(2), atol=1e-5, rtol=0)


def test_vbench_formula_against_the_encoder_itself(encoders):
    """Features from the transformers module directly; VBench's per-frame mean of (cos to previous, clamped at 0
    + cos to first, clamped at 0) / 2, written out frame by frame."""
    from transformers import ViTModel

    v = torch.rand(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # unrelated frames
    model = ViTModel.from_pretrained(encoders / "dino", add_pooling_layer=False).eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    expected = []
    for video in v:
        with torch.no_grad():
            feats = model(pixel_values=(video - mean) / std).last_hidden_state[:, 0]
        feats = feats / feats.norm(dim=-1, keepdim=True)
        total = 0.0
        for i in range(1, len(video)):
            total += (max(0.0, float(feats[i - 1] @ feats[i])) + max(0.0, float(feats[0] @ feats[i]))) / 2
        expected.append(total / (len(video) - 1))
    got = _consistency(encoders, "dino")(v, ["a", "b"], [{}, {}])
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)
    assert float((1 - got).min()) > 1e-4  # unrelated frames score below a static video's 1 (10x the tolerance)


def test_consecutive_mode_is_order_symmetric_and_one_frame_is_refused(encoders):
    r = _consistency(encoders, "clip", "consecutive")
    v = _videos(2, 4, 32)
    torch.testing.assert_close(r(v, ["a", "b"], [{}, {}]), r(v.flip(1), ["a", "b"], [{}, {}]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="at least 2 frames"):
        r(v[:, :1], ["a", "b"], [{}, {}])


class TestTemporalConsistencyConformance(RewardConformance):
    image_size = (32, 32)
    reward_factory = None

    @pytest.fixture(scope="class", autouse=True)
    def _factory(self, encoders):
        type(self).reward_factory = staticmethod(
            lambda: TemporalConsistency(checkpoint=str(encoders / "dino"), image_size=32))
        yield
