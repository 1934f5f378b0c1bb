"""GenEval as a training reward (``geneval``, ``geneval_strict``) and the scorer ``eval/geneval.py`` uses.

:class:`GenEvalScorer` runs the whole GenEval pipeline on images: Mask2Former detection
(:mod:`~flowgrpo_rewards.geneval.detector`), GenEval's selection and verdict rules
(:mod:`~flowgrpo_rewards.geneval.rules`) and CLIP colour classification
(:mod:`~flowgrpo_rewards.geneval.colors`). :class:`GenEvalReward` wraps it in flowgrpo's Reward protocol:

* ``mode="partial"`` (default, entry point ``geneval``): the dense
  :func:`~flowgrpo_rewards.geneval.rules.partial_credit` in [0, 1] (after Flow-GRPO, arXiv 2505.05470);
* ``mode="strict"`` (or entry point ``geneval_strict``): GenEval's own verdict, 1.0 correct / 0.0 not.

Each prompt's metadata must be a GenEval spec (``tag``, ``include``, optional ``exclude``), as written by
:mod:`~flowgrpo_rewards.geneval.prompts`. The detector and CLIP are heavy (a Swin-S Mask2Former and CLIP
ViT-L/14, about 0.5 B parameters together): run the reward on a GPU in the trainer, or behind flowgrpo's
remote reward server (the spec travels as JSON).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from flowgrpo.images import to_uint8
from flowgrpo.rewards.base import BaseReward
from flowgrpo_rewards.geneval.colors import DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED, ClipColorClassifier
from flowgrpo_rewards.geneval.detector import DEFAULT_DETECTOR, DEFAULT_SCALE, Mask2FormerDetector
from flowgrpo_rewards.geneval.prompts import check_overlap
from flowgrpo_rewards.geneval.rules import (
    Detection,
    RuleConfig,
    Verdict,
    evaluate,
    partial_credit,
    select_objects,
    validate_metadata,
)

logger = logging.getLogger(__name__)

MODES = ("partial", "strict")


@dataclass(frozen=True)
class ImageResult:
    """GenEval's outcome for one image.

    Attributes:
        verdict: the official verdict and its reasons.
        partial: :func:`~flowgrpo_rewards.geneval.rules.partial_credit` in [0, 1].
        objects: the selected detections, ``{classname: [Detection, ...]}`` by descending score.
    """

    verdict: Verdict
    partial: float
    objects: dict[str, list[Detection]]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(B, 3, H, W) float in [0, 1] → B RGB PIL images, quantised as saved PNGs are (round(255·x))."""
    return [Image.fromarray(a) for a in to_uint8(images)]  # (H, W, 3) uint8 each


class GenEvalScorer:
    """Detector + colour classifier + rules: GenEval on PIL images.

    Args:
        detector: Mask2Former checkpoint (hub id or folder), see :class:`Mask2FormerDetector`.
        clip_model, clip_pretrained: the colour classifier's open_clip model (:class:`ClipColorClassifier`).
        image_scale: the detector's keep-ratio resize limits (long, short); mmdet's (1333, 800).
        batch_size: images per detector forward.
        rules: thresholds and options (GenEval's defaults).
    """

    def __init__(self, detector: str = DEFAULT_DETECTOR, clip_model: str = DEFAULT_CLIP_MODEL,
                 clip_pretrained: str | None = DEFAULT_CLIP_PRETRAINED,
                 image_scale: Sequence[int] = DEFAULT_SCALE, batch_size: int = 4,
                 rules: RuleConfig | None = None) -> None:
        self.detector = Mask2FormerDetector(detector, scale=image_scale, batch_size=batch_size)
        self.colors = ClipColorClassifier(clip_model, clip_pretrained)
        self.rules = rules or RuleConfig()

    def setup(self, device: torch.device | str) -> None:
        """Load both models onto ``device``."""
        self.detector.setup(device)
        self.colors.setup(device)

    def score_images(self, images: Sequence[Image.Image], metadata: Sequence[Mapping],
                     where: Sequence[str] | None = None) -> list[ImageResult]:
        """GenEval on ``images`` (PIL), image i judged against the spec ``metadata[i]``.

        Args:
            where: a name per image for error messages (a file path); default ``metadata[i]``.

        Raises:
            ValueError: a length mismatch, or an invalid spec (naming ``where[i]`` and the field), checked for
                every image before any model runs.
        """
        if len(images) != len(metadata):
            raise ValueError(f"got {len(images)} images but {len(metadata)} metadata entries")
        names = list(where) if where is not None else [f"metadata[{i}]" for i in range(len(metadata))]
        for md, name in zip(metadata, names, strict=True):
            validate_metadata(md, name)
        thresholds = [self.rules.threshold_for(md["tag"]) for md in metadata]
        detections = self.detector.detect(images, min_score=min(thresholds, default=0.0))
        results = []
        for image, md, dets, threshold in zip(images, metadata, detections, thresholds, strict=True):
            objects = select_objects(dets, threshold, max_objects=self.rules.max_objects,
                                     nms_threshold=self.rules.nms_threshold)
            scorer = self.colors.scorer(image)
            pos = self.rules.position_threshold
            verdict = evaluate(objects, md, scorer, pos)
            results.append(ImageResult(verdict, partial_credit(objects, md, scorer, pos), objects))
        return results


class GenEvalReward(BaseReward):
    """The ``geneval`` reward: GenEval partial credit (default) or the strict official verdict, per image.

    Args:
        mode: ``"partial"`` (dense, in [0, 1]) or ``"strict"`` (1.0 / 0.0).
        detector, clip_model, clip_pretrained, image_scale, batch_size: see :class:`GenEvalScorer`.
        threshold, counting_threshold, max_objects, nms_threshold, position_threshold: GenEval's rule options
            (:class:`~flowgrpo_rewards.geneval.rules.RuleConfig`), defaults as the benchmark.

    ``__call__(images (B, 3, H, W) float in [0, 1], prompts, metadata) -> (B,) float32`` on the CPU. Every
    ``metadata[i]`` needs ``tag`` and ``include``; a missing or invalid field raises ``ValueError`` naming it.
    """

    name = "geneval"

    def __init__(self, mode: str = "partial", detector: str = DEFAULT_DETECTOR,
                 clip_model: str = DEFAULT_CLIP_MODEL, clip_pretrained: str | None = DEFAULT_CLIP_PRETRAINED,
                 image_scale: Sequence[int] = DEFAULT_SCALE, batch_size: int = 4, threshold: float = 0.3,
                 counting_threshold: float = 0.9, max_objects: int = 16, nms_threshold: float = 1.0,
                 position_threshold: float = 0.1) -> None:
        if mode not in MODES:
            raise ValueError(f"geneval mode must be one of {list(MODES)}, got {mode!r}")
        self.mode = mode
        rules = RuleConfig(threshold, counting_threshold, max_objects, nms_threshold, position_threshold)
        self.scorer = GenEvalScorer(detector, clip_model, clip_pretrained, image_scale, batch_size, rules)

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.scorer.setup(self.device)

    def check_training_prompts(self, prompts) -> None:
        """The trainer's setup hook (:mod:`flowgrpo.rewards.base`): warn when training prompts overlap GenEval's
        evaluation prompts (:func:`~flowgrpo_rewards.geneval.prompts.check_overlap`), since training on them
        inflates the GenEval score. ``prompts``: a :class:`~flowgrpo.data.prompts.PromptSet`."""
        records = [{"prompt": p, **m} for p, m in zip(prompts.prompts, prompts.metadata, strict=True)]
        overlap = check_overlap(records)
        if overlap:
            logger.warning("%d training prompts of %r overlap GenEval's evaluation set (e.g. %r): scores on GenEval "
                           "will be inflated", len(overlap), prompts.source, overlap[0])

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32: strict verdicts as 1.0/0.0, or partial credit in [0, 1]."""
        results = self.scorer.score_images(to_pil(images), metadata)
        if self.mode == "strict":
            values = [1.0 if r.verdict.correct else 0.0 for r in results]
        else:
            values = [r.partial for r in results]
        return torch.tensor(values, dtype=torch.float32)


class GenEvalStrictReward(GenEvalReward):
    """The ``geneval_strict`` reward: :class:`GenEvalReward` with ``mode="strict"`` (1.0 correct, 0.0 not)."""

    name = "geneval_strict"

    def __init__(self, **kwargs) -> None:
        if kwargs.setdefault("mode", "strict") != "strict":
            raise ValueError(f"geneval_strict has mode 'strict'; got mode={kwargs['mode']!r} (use 'geneval')")
        super().__init__(**kwargs)
