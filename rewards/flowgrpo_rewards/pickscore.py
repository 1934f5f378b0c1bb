"""PickScore (Kirstain et al. 2023, "Pick-a-Pic", arXiv 2305.01569).

A transformers ``CLIPModel`` (ViT-H-14 architecture) fine-tuned on Pick-a-Pic preference pairs, released as
the hub repo ``yuvalkirstain/PickScore_v1``; it has no processor of its own and uses the tokenizer and image
processor of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``.

Score (the README of github.com/yuvalkirstain/PickScore, "Inference with PickScore")::

    pickscore = exp(logit_scale) * <f_img / |f_img|, f_txt / |f_txt|>

where ``f_img = model.get_image_features(...)``, ``f_txt = model.get_text_features(...)`` and
``exp(logit_scale) = 100`` in the released model, so scores are about 18 - 24. Flow-GRPO's
``flow_grpo/pickscore_scorer.py`` divides by 26 to bring them near [0, 1]: ``divisor=26`` reproduces it.
Preprocessing is the laion processor's: shortest edge to 224 (bicubic), center crop 224, openai mean/std.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flowgrpo.rewards.base import BaseReward
from flowgrpo_rewards._clip_common import (
    check_positive_int,
    check_resize_backend,
    cosine_rows,
    encode_unique,
    in_chunks,
    load_hf_clip,
    log_loaded,
    n_parameters,
    parse_dtype,
)

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


class PickScoreReward(BaseReward):
    """PickScore: exp(logit_scale) * cosine of normalised CLIP image and text embeddings, divided by ``divisor``.

    Args:
        checkpoint: transformers ``CLIPModel`` folder or hub id (default ``yuvalkirstain/PickScore_v1``).
        processor: folder or hub id of the tokenizer + ``CLIPImageProcessor`` (default
            ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
        architecture: a ``transformers.CLIPConfig`` dict replacing the checkpoint's ``config.json``.
        divisor: the score is divided by this (1 = the paper's score; 26 = Flow-GRPO's reward).
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        batch_size: images per forward pass.
        resize_backend: ``"torch"`` (default: antialiased resize of the float tensor on the device, within the
            bounds of ``docs/rewards.md`` of the reference) or ``"pil"`` (the reference's own 8-bit PIL resize,
            exact, on the CPU).

    Calling it: ``images`` (B, 3, H, W) float in [0, 1], ``prompts`` B strings -> (B,) float32.

    Raises:
        ValueError: non-positive ``divisor`` or ``batch_size``, unknown ``dtype`` (at construction).
        OSError: the checkpoint or processor cannot be found or downloaded (in :meth:`setup`).
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "pickscore"
    #: differentiable in the images with the torch resize (:meth:`score_differentiable`); not with the 8-bit PIL one
    differentiable = True
    #: the score reads the prompt (the image scored against its text: a control phrase in the prompt changes it)
    text_conditioned = True
    #: where the released model's scores of ordinary images lie (module docstring: about 18 - 24), divided by
    #: ``divisor``; None with ``architecture`` (a stand-in model of another scale). Read by ReFL's margin check
    typical_range = (18.0, 24.0)

    def __init__(
        self,
        checkpoint: str = PICKSCORE_MODEL,
        processor: str = PICKSCORE_PROCESSOR,
        architecture: dict | None = None,
        divisor: float = 1.0,
        dtype: str = "float32",
        batch_size: int = 32,
        resize_backend: str = "torch",
    ) -> None:
        if not float(divisor) > 0:
            raise ValueError(f"divisor must be positive, got {divisor!r}")
        self.checkpoint = checkpoint
        self.processor = processor
        self.architecture = architecture
        self.divisor = float(divisor)
        self.typical_range = None if architecture else (18.0 / self.divisor, 24.0 / self.divisor)
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.resize_backend = check_resize_backend(resize_backend)
        self.differentiable = self.resize_backend == "torch"
        self.clip = None

    def setup(self, device: torch.device) -> None:
        """Load the model, tokenizer and image processor onto ``device``."""
        super().setup(device)
        self.clip = load_hf_clip(
            self.checkpoint, self.processor, self.architecture, self.device, self.dtype, reward=self.name
        )
        self.clip.preprocess = replace(self.clip.preprocess, resize_backend=self.resize_backend)
        log_loaded(self.name, self.checkpoint, n_parameters(self.clip.model))

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """PickScore of each (image, prompt) pair: (B,) float32 on the CPU."""
        if self.clip is None:
            raise RuntimeError("PickScoreReward.setup(device) must be called before scoring")
        text = encode_unique(prompts, self.clip.text_features)  # (B, D), normalised
        scale = self.clip.logit_scale() / self.divisor

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return scale * cosine_rows(self.clip.image_features(pixels), text[sl])

        return in_chunks(images, self.batch_size, chunk).cpu()

    def score_differentiable(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """:meth:`score` with the autograd graph back to ``images`` (the model frozen; the torch resize): (B,)
        float32 on the reward's device."""
        if self.clip is None:
            raise RuntimeError("PickScoreReward.setup(device) must be called before scoring")
        if not self.differentiable:
            raise ValueError("pickscore: resize_backend='pil' rounds to 8 bits (no gradient); use 'torch'")
        text = encode_unique(prompts, self.clip.text_features)
        scale = self.clip.logit_scale() / self.divisor

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return scale * cosine_rows(self.clip.image_features_differentiable(pixels), text[sl])

        return in_chunks(images, self.batch_size, chunk)
