"""HPSv2 / HPSv2.1: Human Preference Score v2 (Wu et al. 2023, arXiv 2306.09341).

The model is an open_clip ``ViT-H-14`` fine-tuned on human preference pairs (HPD v2). The released
checkpoints ``HPS_v2_compressed.pt`` (v2.0) and ``HPS_v2.1_compressed.pt`` (v2.1) in the hub repo
``xswu/HPSv2`` hold the full CLIP state dict under the key ``state_dict``.

Score (``hpsv2/img_score.py`` of github.com/tgxs002/HPSv2, used unchanged by Flow-GRPO's
``flow_grpo/hpsv2_scorer.py`` and DanceGRPO/MixGRPO's ``hps_score.py``)::

    hps = <f_img / |f_img|, f_txt / |f_txt|>        # cosine of the normalised features, no temperature

so scores are about 0.2 - 0.35 for real images. Preprocessing is HPSv2's ``preprocess_val`` (its
``image_transform`` with ``resize_longest_max=True``): convert to a float tensor, resize it so the longest
edge is 224 (bicubic, antialiased, each edge ``round(edge * 224 / max(H, W))``, no clamp: values may overshoot
[0, 1] as in HPSv2), pad the short edge with black to 224 x 224, normalise with the openai CLIP mean/std. HPSv2
gets the image as 8-bit PIL and resizes the float tensor of those 8 bits, so images on the 8-bit grid agree to
float rounding; other float images differ by the 8-bit rounding the reference applies (at most 0.62/255 after
the resize, measured by ``bench/reward_parity.py``).
(HPSv2 resizes with torchvision's tensor ``resize``, antialiased since torchvision 0.17, the version matched.
HPSv2 leaves an image whose longest edge is already 224 unpadded, which its ViT cannot take when the image is
not square; here such an image is padded like any other.)
The text is
tokenised with open_clip's CLIP BPE tokenizer (77 tokens). This module does not import the ``hpsv2``
package (it pins old pytest/protobuf and downloads 3.9 GB of LAION weights it then overwrites); it builds
the same architecture with ``open_clip.create_model("ViT-H-14", pretrained=<checkpoint>)``.
"""

from __future__ import annotations

import torch

from flowgrpo.rewards.base import BaseReward
from flowgrpo_rewards._clip_common import (
    check_positive_int,
    cosine_rows,
    encode_unique,
    in_chunks,
    load_open_clip,
    log_loaded,
    n_parameters,
    parse_dtype,
    resolve_file,
)

#: Hub repo of the official HPSv2 checkpoints.
HPS_HUB_REPO = "xswu/HPSv2"
#: Checkpoint file of each HPS version (as in ``hpsv2/utils.py``'s ``hps_version_map``).
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
#: open_clip architecture of both versions.
HPS_ARCHITECTURE = "ViT-H-14"
#: HPSv2's ``preprocess_val`` as :class:`~flowgrpo_rewards._clip_common.ImagePreprocess` fields (on top of
#: ViT-H-14's 224 px and the openai mean/std): ``ToTensor``, then ``ResizeMaxSize`` (longest edge to 224, bicubic,
#: on the float tensor, overshoot kept), black padding.
HPSV2_PREPROCESS = {"resize_mode": "longest", "interpolation": "bicubic", "fill": 0.0, "clamp_after_resize": False}


class HPSv2Reward(BaseReward):
    """HPSv2 / HPSv2.1 preference score: cosine of normalised open_clip ViT-H-14 image and text features.

    Args:
        version: ``"v2.1"`` (default; ``HPS_v2.1_compressed.pt``) or ``"v2.0"`` (``HPS_v2_compressed.pt``).
        checkpoint: where the checkpoint is: ``None`` (download from the hub repo ``xswu/HPSv2``), a hub
            repo id holding the version's file, a local folder holding it, or the path of the ``.pt`` file.
        architecture: open_clip model-config keys (``embed_dim``, ``vision_cfg``, ``text_cfg``) that replace
            those of ``ViT-H-14``; for tiny test models. ``None`` for the released checkpoints.
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``; the official scorer runs under fp16
            autocast on GPU.
        batch_size: images per forward pass.

    Calling it: ``images`` (B, 3, H, W) float in [0, 1], ``prompts`` B strings -> (B,) float32 in [-1, 1].

    Raises:
        ValueError: unknown ``version`` or ``dtype``, non-positive ``batch_size`` (at construction).
        FileNotFoundError / OSError: the checkpoint cannot be found or downloaded (in :meth:`setup`).
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "hpsv2"
    #: the score is differentiable in the images (:meth:`score_differentiable`)
    differentiable = True
    #: the score reads the prompt (the image scored against its text: a control phrase in the prompt changes it)
    text_conditioned = True
    #: where the released checkpoints' cosines of ordinary images lie (about 0.2 - 0.35, docs/rewards.md); None
    #: with ``architecture`` (a stand-in model). Read by ReFL's margin check
    typical_range = (0.2, 0.35)

    def __init__(
        self,
        version: str = "v2.1",
        checkpoint: str | None = None,
        architecture: dict | None = None,
        dtype: str = "float32",
        batch_size: int = 32,
    ) -> None:
        if version not in HPS_FILES:
            raise ValueError(f"HPS version {version!r} is not one of {sorted(HPS_FILES)}")
        self.version = version
        self.checkpoint = checkpoint or HPS_HUB_REPO
        self.architecture = architecture
        self.typical_range = None if architecture else type(self).typical_range
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.clip = None

    def setup(self, device: torch.device) -> None:
        """Download (if needed) and load the checkpoint onto ``device``."""
        super().setup(device)
        path = resolve_file(self.checkpoint, HPS_FILES[self.version], f"HPS{self.version} checkpoint",
                            reward=self.name, key="checkpoint")
        self.clip = load_open_clip(
            HPS_ARCHITECTURE,
            pretrained=path,
            architecture=self.architecture,
            device=self.device,
            dtype=self.dtype,
            preprocess_overrides=HPSV2_PREPROCESS,
        )
        log_loaded(self.name, path, n_parameters(self.clip.model))

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """HPS of each (image, prompt) pair: (B,) float32 on the CPU."""
        if self.clip is None:
            raise RuntimeError("HPSv2Reward.setup(device) must be called before scoring")
        text = encode_unique(prompts, self.clip.text_features)  # (B, D), normalised

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return cosine_rows(self.clip.image_features(pixels), text[sl])

        return in_chunks(images, self.batch_size, chunk).cpu()

    def score_differentiable(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """:meth:`score` with the autograd graph back to ``images`` (the model frozen): (B,) float32 on the
        reward's device."""
        if self.clip is None:
            raise RuntimeError("HPSv2Reward.setup(device) must be called before scoring")
        text = encode_unique(prompts, self.clip.text_features)

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return cosine_rows(self.clip.image_features_differentiable(pixels), text[sl])

        return in_chunks(images, self.batch_size, chunk)
