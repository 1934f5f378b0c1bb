"""Which rewards are differentiable in the images, and that their ``score_differentiable`` is their score with the
right gradient (the path ReFL / DRaFT backpropagates through, flowgrpo/algo/objectives/reward_backprop.py).

For each differentiable reward on tiny random models of its architecture (``flowgrpo_rewards.tiny_models``, as the
other reward tests) and for the digits reward: the values equal ``__call__``'s, and the autograd directional
derivative ⟨∇R, d⟩ equals the central finite difference (R(x + εd) − R(x − εd)) / 2ε of ``__call__`` (the scoring
path, no autograd): an independent computation of the gradient. The declarations are checked for every built-in.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from flowgrpo.rewards.base import differentiable_scores, is_differentiable  # noqa: E402
from flowgrpo.rewards.registry import resolve_reward_factory  # noqa: E402

PROMPTS = ["a photo of a cat", "a red car", "a photo of a cat"]
MLP_DIMS = (16, 32, 16, 8, 4, 1)


@functools.lru_cache(maxsize=1)
def _root() -> Path:
    from flowgrpo_rewards import tiny_models as tm

    root = Path(tempfile.mkdtemp(prefix="flowgrpo_diff_rewards_"))
    import atexit

    atexit.register(shutil.rmtree, root, ignore_errors=True)
    tm.save_tiny_hf_clip(root / "hf_clip", root / "hf_proc", seed=1)
    tm.save_tiny_hps_checkpoint(root / "hps" / "HPS_v2.1_compressed.pt", seed=3)
    tm.save_tiny_open_clip_dir(root / "dfn", seed=4)
    tm.save_tiny_aesthetic_mlp(root / "sac+logos+ava1-l14-linearMSE.pth", dims=MLP_DIMS, seed=5)
    return root


def _build(kind: str):
    pytest.importorskip("open_clip")
    pytest.importorskip("transformers")
    from flowgrpo_rewards import tiny_models as tm
    from flowgrpo_rewards.aesthetic import AestheticReward
    from flowgrpo_rewards.clip_score import ClipScoreReward
    from flowgrpo_rewards.hps import HPSv2Reward
    from flowgrpo_rewards.pickscore import PickScoreReward

    r = _root()
    hf = {"checkpoint": str(r / "hf_clip"), "processor": str(r / "hf_proc")}
    return {
        "hpsv2": lambda: HPSv2Reward(checkpoint=str(r / "hps"), architecture=tm.TINY_OPEN_CLIP),
        "pickscore": lambda: PickScoreReward(divisor=26.0, **hf),
        "clip_openai": lambda: ClipScoreReward("openai", **hf),
        "clip_flowgrpo": lambda: ClipScoreReward("flowgrpo", **hf),
        "clip_dfn5b": lambda: ClipScoreReward("dfn5b", checkpoint=str(r / "dfn")),
        "aesthetic": lambda: AestheticReward(clip_checkpoint=str(r / "hf_clip"), clip_processor=str(r / "hf_proc"),
                                             mlp_checkpoint=str(r), architecture={"mlp_dims": MLP_DIMS}),
    }[kind]()


def _images(n: int, size: int, seed: int) -> torch.Tensor:
    """Smooth images in [0.2, 0.8] (a finite-difference step stays inside [0, 1])."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    return 0.2 + 0.6 * torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)


def _check_gradient(reward, images, prompts, metadata, *, eps=1e-3, rtol=2e-2):
    x = images.clone().requires_grad_(True)
    out = differentiable_scores(reward, x, prompts, metadata, getattr(reward, "name", "r"))
    torch.testing.assert_close(out.detach().cpu(), reward(images, prompts, metadata), atol=1e-5, rtol=1e-5)
    assert out.requires_grad and out.shape == (len(images),)
    d = torch.randn(images.shape, generator=torch.Generator().manual_seed(7)) * 0.05
    (grad,) = torch.autograd.grad(out.sum(), x)
    for i in range(len(images)):  # each row's own directional derivative
        di = torch.zeros_like(d)
        di[i] = d[i]
        auto = float((grad * di).sum())
        fd = float((reward(images + eps * di, prompts, metadata)[i] - reward(images - eps * di, prompts, metadata)[i])
                   / (2 * eps))
        assert abs(auto - fd) <= rtol * max(abs(fd), 1e-3), (i, auto, fd)
    assert float(grad.abs().max()) > 0


@pytest.mark.parametrize("kind", ["hpsv2", "pickscore", "clip_openai", "clip_flowgrpo", "clip_dfn5b", "aesthetic"])
def test_model_rewards_score_differentiably(kind):
    reward = _build(kind)
    reward.setup("cpu")
    assert is_differentiable(reward)
    size = 40 if kind == "clip_dfn5b" else 32  # dfn5b squashes: a resize in the graph
    _check_gradient(reward, _images(3, size, seed=11), PROMPTS, [{}] * 3)
    assert all(p.grad is None for p in reward.clip.model.parameters())  # the reward's weights stay frozen


def test_the_digits_reward_scores_differentiably():
    from flowgrpo_rewards.digits import DigitCorrectness

    from flowgrpo.tasks.digits.data import digits_to_images, load_digit_split

    x, y = load_digit_split("test")
    images = digits_to_images(torch.from_numpy(x[:4])) * 0.6 + 0.2  # inside [0, 1] with a margin
    meta = [{"digit": int(v)} for v in y[:4]]
    reward = DigitCorrectness()
    reward.setup("cpu")
    _check_gradient(reward, images, ["p"] * 4, meta)
    capped = DigitCorrectness(cap=0.5)
    capped.setup("cpu")
    x_in = images.clone().requires_grad_(True)
    out = capped.score_differentiable(x_in, ["p"] * 4, meta)
    (grad,) = torch.autograd.grad(out.sum(), x_in)
    above = (reward(images, ["p"] * 4, meta) > 0.5).nonzero().flatten()
    assert len(above) and all(float(grad[i].abs().max()) == 0 for i in above)  # past the cap: no gradient


@pytest.mark.parametrize("name,expected", [
    ("digit_correctness", True), ("hpsv2", True), ("pickscore", True), ("clip_score", True), ("aesthetic", True),
    ("digit_correctness_strict", False), ("jpeg_compressibility", False), ("jpeg_incompressibility", False),
    ("ocr", False), ("geneval", False), ("image_reward", False), ("hpsv3", False), ("pickscore_rank", False),
    ("vlm_judge", False), ("unifiedreward", False), ("digit_judge", False),
])
def test_which_rewards_declare_a_differentiable_score(name, expected):
    factory, _ = resolve_reward_factory(name)
    assert is_differentiable(factory) is expected


def test_settings_without_a_gradient_are_not_differentiable():
    from flowgrpo_rewards.digits import DigitCorrectness

    assert not is_differentiable(DigitCorrectness(strict=True))
    assert not is_differentiable(_build("pickscore").__class__(resize_backend="pil"))
    with pytest.raises(ValueError, match="reward 'x' has no differentiable score"):
        differentiable_scores(DigitCorrectness(strict=True), torch.full((1, 3, 8, 8), 0.5), ["p"], [{"digit": 1}],
                              "x")
