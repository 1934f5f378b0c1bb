"""CLIP score: image-text agreement of a plain (not preference-tuned) CLIP model.

"CLIP score" names several incompatible numbers in the literature; this reward implements three, chosen
with ``variant``. Scores of different variants cannot be compared with each other.

=============  ========================================  ==================================  ==================
variant        model                                     score                               typical range
=============  ========================================  ==================================  ==================
``openai``     transformers ``openai/clip-vit-large-``   ``100 * cos``                       ~15 - 35
               ``patch14``
``flowgrpo``   same model                                ``exp(logit_scale) * cos / 30``     ~0.5 - 1.2
               (exp(logit_scale) = 100 in it)
``dfn5b``      open_clip ``apple/DFN5B-CLIP-ViT-H-14-``  ``cos``                             ~0.1 - 0.4
               ``378`` (formerly ``-384``)
=============  ========================================  ==================================  ==================

``cos`` is the cosine of the L2-normalised projected image and text embeddings.

* ``openai``: the scale of torchmetrics' ``CLIPScore`` (whose default model is this one) without its
  clamp at 0. The original CLIPScore of Hessel et al. 2021 (arXiv 2104.08718) is ``2.5 * max(cos, 0)`` with
  ViT-B/32: yet another number.
* ``flowgrpo``: Flow-GRPO's training reward ``flow_grpo/clip_scorer.py`` (``logits_per_image.diagonal() / 30``),
  with its preprocessing: torchvision ``Resize(224)`` — *bilinear*, antialiased — on the float tensors,
  torchvision ``CenterCrop(224)`` (offset rounded half to even, not floored), openai mean/std (the other
  variants resize bicubic, as their processors do).
* ``dfn5b``: MixGRPO's evaluation ``fastvideo/models/reward_model/clip_score.py``: open_clip
  ``create_model_from_pretrained("hf-hub:apple/DFN5B-CLIP-ViT-H-14-384")``, its preprocess (squash-resize to
  378 x 378, bicubic, openai mean/std), plain cosine. The hub repo was renamed ``...-378``; the old name
  redirects to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flowgrpo.rewards.base import BaseReward
from flowgrpo_rewards._clip_common import (
    ImagePreprocess,
    check_positive_int,
    check_resize_backend,
    cosine_rows,
    encode_unique,
    in_chunks,
    load_hf_clip,
    load_open_clip,
    log_loaded,
    n_parameters,
    open_clip_model_name,
    parse_dtype,
)


@dataclass(frozen=True)
class ClipScoreVariant:
    """One CLIP-score convention: which model, how it is loaded, and how the cosine is scaled."""

    backend: str  # "hf" (transformers CLIPModel) or "open_clip"
    checkpoint: str
    processor: str | None  # hf only: tokenizer + image-processor source
    scale: str  # "100", "logit_scale/30" or "1": the factor applied to the cosine
    # True: torchvision's Resize (bilinear) + CenterCrop (rounded offset) on float tensors instead of the processor's
    # PIL pipeline (Flow-GRPO's clip_scorer.py)
    tensor_transform: bool = False


CLIP_SCORE_VARIANTS = {
    "openai": ClipScoreVariant("hf", "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14", "100"),
    "flowgrpo": ClipScoreVariant(
        "hf", "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14", "logit_scale/30", True
    ),
    "dfn5b": ClipScoreVariant("open_clip", "apple/DFN5B-CLIP-ViT-H-14-378", None, "1"),
}

#: each variant's typical range of ordinary images' scores (the module docstring's table)
CLIP_SCORE_TYPICAL_RANGES = {"openai": (15.0, 35.0), "flowgrpo": (0.5, 1.2), "dfn5b": (0.1, 0.4)}


def flowgrpo_tensor_preprocess(preprocess: ImagePreprocess) -> ImagePreprocess:
    """``preprocess`` (the processor's size, mean, std) with Flow-GRPO's ``clip_scorer.py`` transform: torchvision
    ``Resize`` (bilinear, antialiased) and ``CenterCrop`` (offset rounded half to even) on the float tensor, no
    clamp (a bilinear resize cannot overshoot)."""
    return replace(preprocess, interpolation="bilinear", crop_offset="round", clamp_after_resize=False)


class ClipScoreReward(BaseReward):
    """CLIP score in one of three named conventions (see the module docstring's table).

    Args:
        variant: ``"openai"`` (100·cos, default), ``"flowgrpo"`` (exp(logit_scale)·cos/30, Flow-GRPO) or
            ``"dfn5b"`` (cos with DFN5B ViT-H-14, MixGRPO's evaluation).
        checkpoint: replaces the variant's model: a hub id or local folder (a transformers ``CLIPModel``
            folder for ``openai``/``flowgrpo``; an open_clip folder with ``open_clip_config.json`` and
            weights for ``dfn5b``).
        processor: replaces the tokenizer + image-processor source (``openai``/``flowgrpo`` only; defaults
            to ``checkpoint`` when that is given, else to the variant's hub repo).
        architecture: replaces the checkpoint's architecture config (a ``transformers.CLIPConfig`` dict, or
            open_clip model-config keys for ``dfn5b``); for tiny test models.
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        batch_size: images per forward pass.
        resize_backend: ``"torch"`` (default: antialiased resize of the float tensor on the device, within the
            bounds of ``docs/rewards.md`` of the reference) or ``"pil"`` (the reference's own 8-bit PIL resize,
            exact, on the CPU; not for ``flowgrpo``, whose reference resizes the float tensor).

    Calling it: ``images`` (B, 3, H, W) float in [0, 1], ``prompts`` B strings -> (B,) float32.

    Raises:
        ValueError: unknown ``variant``/``dtype``, ``processor`` given with ``dfn5b``, bad ``batch_size``.
        OSError: the checkpoint cannot be found or downloaded (in :meth:`setup`).
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "clip_score"
    #: differentiable in the images with the torch resize (:meth:`score_differentiable`); not with the 8-bit PIL one
    differentiable = True
    #: the score reads the prompt (the image scored against its text: a control phrase in the prompt changes it)
    text_conditioned = True
    #: the variant's typical range (module docstring's table), set per instance; None with ``architecture`` (a
    #: stand-in model). Read by ReFL's margin check
    typical_range = None

    def __init__(
        self,
        variant: str = "openai",
        checkpoint: str | None = None,
        processor: str | None = None,
        architecture: dict | None = None,
        dtype: str = "float32",
        batch_size: int = 32,
        resize_backend: str = "torch",
    ) -> None:
        if variant not in CLIP_SCORE_VARIANTS:
            raise ValueError(f"clip_score variant {variant!r} is not one of {sorted(CLIP_SCORE_VARIANTS)}")
        spec = CLIP_SCORE_VARIANTS[variant]
        if processor is not None and spec.backend != "hf":
            raise ValueError(f"clip_score variant {variant!r} takes its tokenizer from the model; drop processor")
        self.variant = variant
        self.spec = spec
        self.checkpoint = checkpoint or spec.checkpoint
        self.processor = processor or checkpoint or spec.processor
        self.architecture = architecture
        self.typical_range = None if architecture else CLIP_SCORE_TYPICAL_RANGES[variant]
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.resize_backend = check_resize_backend(resize_backend)
        self.differentiable = self.resize_backend == "torch"
        if spec.tensor_transform and resize_backend != "torch":
            raise ValueError(f"clip_score variant {variant!r} follows a float-tensor pipeline (torchvision on "
                             "tensors): resize_backend must be 'torch'")
        self.clip = None

    def setup(self, device: torch.device) -> None:
        """Load the variant's model, tokenizer and preprocessing onto ``device``."""
        super().setup(device)
        if self.spec.backend == "hf":
            clip = load_hf_clip(
                self.checkpoint, self.processor, self.architecture, self.device, self.dtype, reward=self.name
            )
            if self.spec.tensor_transform:
                clip.preprocess = flowgrpo_tensor_preprocess(clip.preprocess)
        else:
            clip = load_open_clip(
                open_clip_model_name(self.checkpoint), None, self.architecture, self.device, self.dtype,
                reward=self.name, key="checkpoint",
            )
        clip.preprocess = replace(clip.preprocess, resize_backend=self.resize_backend)
        self.clip = clip
        log_loaded(f"{self.name}[{self.variant}]", self.checkpoint, n_parameters(clip.model))

    def _scale(self) -> torch.Tensor | float:
        if self.spec.scale == "100":
            return 100.0
        if self.spec.scale == "logit_scale/30":
            return self.clip.logit_scale() / 30.0
        return 1.0

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """CLIP score of each (image, prompt) pair in this variant's convention: (B,) float32 on the CPU."""
        if self.clip is None:
            raise RuntimeError("ClipScoreReward.setup(device) must be called before scoring")
        text = encode_unique(prompts, self.clip.text_features)  # (B, D), normalised
        scale = self._scale()

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return scale * cosine_rows(self.clip.image_features(pixels), text[sl])

        return in_chunks(images, self.batch_size, chunk).cpu()

    def score_differentiable(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """:meth:`score` with the autograd graph back to ``images`` (the model frozen; the torch resize): (B,)
        float32 on the reward's device."""
        if self.clip is None:
            raise RuntimeError("ClipScoreReward.setup(device) must be called before scoring")
        if not self.differentiable:
            raise ValueError("clip_score: resize_backend='pil' rounds to 8 bits (no gradient); use 'torch'")
        text = encode_unique(prompts, self.clip.text_features)
        scale = self._scale()

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return scale * cosine_rows(self.clip.image_features_differentiable(pixels), text[sl])

        return in_chunks(images, self.batch_size, chunk)
