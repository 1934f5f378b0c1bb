"""GenEval's object detector: Mask2Former instance segmentation through transformers.

GenEval scores with mmdetection's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco`` (Mask2Former, Cheng et
al. 2022, arXiv 2112.01527, Swin-S backbone, COCO instance segmentation). mmdetection does not install with
current torch, so this module runs the same architecture from transformers
(``Mask2FormerForUniversalSegmentation``, default checkpoint
``facebook/mask2former-swin-small-coco-instance``) and reproduces mmdetection's test-time pipeline around it:

1. **Resize** keeping the aspect ratio so the image fits (1333, 800) (mmcv ``rescale_size``: factor
   min(1333 / long side, 800 / short side), sizes rounded half up), bilinear; **normalise** with the ImageNet
   mean/std on the 0–255 scale; **pad** at the bottom/right to a multiple of 32.
2. Mask logits (1/4 resolution) are upsampled bilinearly to the padded size, cropped to the resized image and
   resized bilinearly to the original size (mmdet ``Mask2FormerHead.predict`` + ``MaskFormerFusionHead``).
3. **Instance post-processing** (:func:`instance_postprocess`, mmdet ``MaskFormerFusionHead
   .instance_postprocess``): class probabilities softmax over the classes + "no object", the last dropped;
   the top 100 (query, class) pairs over all queries × classes; mask = logit > 0; score = class probability ×
   mean of the mask sigmoid inside the binary mask (+1e-6 in the denominator); box = the mask's tight box
   (:func:`mask_to_box`, x2/y2 one past the last pixel; all zeros for an empty mask). No NMS.

Known differences from GenEval's mmdet checkpoint (see the README): the weights are a different training run
of the same architecture (the original Mask2Former authors' Detectron2 model converted to transformers, not
mmdetection's own), so scores differ slightly and verdicts near the thresholds can flip; images are resized in
float32 by torch rather than by OpenCV on uint8; padding (only for sizes that are not multiples of 32 after
resizing — GenEval's square 512/1024 images become 800×800 and are not padded) is zero after normalisation.
Detector classes map to GenEval's object names by COCO index; the checkpoint must have exactly the 80 COCO
instance classes in COCO order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from flowgrpo.rewards.base import hub_weights
from flowgrpo_rewards.geneval.rules import ImageDetections, object_names

logger = logging.getLogger(__name__)

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
#: mmdetection's test scale for the GenEval config: the image fits within 1333 × 800 (long × short side).
DEFAULT_SCALE = (1333, 800)
IMAGENET_MEAN = (123.675, 116.28, 103.53)  # mmdet img_norm_cfg, RGB, 0–255 scale
IMAGENET_STD = (58.395, 57.12, 57.375)


def rescale_size(width: int, height: int, scale: Sequence[int] = DEFAULT_SCALE) -> tuple[int, int]:
    """(new_width, new_height) of a keep-ratio resize into ``scale`` = (long, short) edge limits (any order).

    factor = min(max(scale) / max(w, h), min(scale) / min(w, h)); new size = int(size·factor + 0.5), as mmcv's
    ``rescale_size``. Example: 512×512 into (1333, 800) → 800×800.
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    long_edge, short_edge = max(scale), min(scale)
    factor = min(long_edge / max(width, height), short_edge / min(width, height))
    return int(width * factor + 0.5), int(height * factor + 0.5)


def mask_to_box(masks: torch.Tensor) -> torch.Tensor:
    """(N, 4) float32 tight boxes (x1, y1, x2, y2) of (N, H, W) bool masks, x2/y2 one past the last set pixel
    (mmdet ``mask2bbox``); an empty mask gives (0, 0, 0, 0)."""
    n, h, w = masks.shape
    boxes = torch.zeros((n, 4), dtype=torch.float32, device=masks.device)
    if n == 0:
        return boxes
    cols = masks.any(dim=1)  # (N, W)
    rows = masks.any(dim=2)  # (N, H)
    nonempty = cols.any(dim=1)
    xs = torch.arange(w, device=masks.device)
    ys = torch.arange(h, device=masks.device)
    big = max(h, w) + 1
    x1 = torch.where(cols, xs, big).min(dim=1).values
    x2 = torch.where(cols, xs, -1).max(dim=1).values + 1
    y1 = torch.where(rows, ys, big).min(dim=1).values
    y2 = torch.where(rows, ys, -1).max(dim=1).values + 1
    stacked = torch.stack([x1, y1, x2, y2], dim=1).float()
    return torch.where(nonempty[:, None], stacked, boxes)


def instance_postprocess(
    class_logits: torch.Tensor, mask_logits: torch.Tensor, top_k: int = 100, min_score: float | None = None,
    resize_masks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ImageDetections:
    """mmdetection's Mask2Former instance post-processing for one image.

    Args:
        class_logits: (Q, C+1) float, the last column "no object".
        mask_logits: (Q, h, w) float mask logits.
        top_k: number of (query, class) pairs kept, by class probability (mmdet ``max_per_image``, 100).
        min_score: drop detections whose final score is <= this (an optimisation: GenEval's selection drops
            them anyway); None keeps all ``top_k``.
        resize_masks: maps selected mask logits (q, h, w) to the output size (q, H, W); applied before
            thresholding, only to the queries that were selected (bilinear resizing acts per query, so this
            equals resizing all queries first).

    Returns:
        :class:`ImageDetections` on the CPU: score = p(class) · mean(sigmoid(logit) over the mask),
        mask = logit > 0, box = :func:`mask_to_box`, label = the class index in [0, C).
    """
    if class_logits.ndim != 2 or mask_logits.ndim != 3 or class_logits.shape[0] != mask_logits.shape[0]:
        raise ValueError(
            f"expected class_logits (Q, C+1) and mask_logits (Q, h, w), got {tuple(class_logits.shape)} and "
            f"{tuple(mask_logits.shape)}"
        )
    probs = class_logits.float().softmax(dim=-1)[:, :-1]  # (Q, C)
    num_classes = probs.shape[1]
    class_scores, flat = probs.flatten().topk(min(top_k, probs.numel()))  # (k,)
    if min_score is not None:
        # the mask score is < 1, so a pair whose class probability is <= min_score cannot pass: skip its mask
        promising = class_scores > min_score
        class_scores, flat = class_scores[promising], flat[promising]
    labels = flat % num_classes
    queries = flat // num_classes
    unique_queries, inverse = torch.unique(queries, return_inverse=True)
    masks = mask_logits[unique_queries].float()
    if resize_masks is not None:
        masks = resize_masks(masks)
    binary = masks > 0
    inside = binary.flatten(1).float()
    mask_scores = (masks.sigmoid().flatten(1) * inside).sum(1) / (inside.sum(1) + 1e-6)  # (q,)
    scores = class_scores * mask_scores[inverse]
    keep = torch.arange(len(scores), device=scores.device) if min_score is None else torch.nonzero(
        scores > min_score).flatten()
    rows = inverse[keep]
    kept_masks = binary[rows]
    return ImageDetections(
        boxes=mask_to_box(kept_masks).cpu().numpy(),
        scores=scores[keep].cpu().numpy().astype(np.float32),
        labels=labels[keep].cpu().numpy().astype(np.int64),
        masks=kept_masks.cpu().numpy(),
    )


class Mask2FormerDetector:
    """Mask2Former instance segmentation with mmdetection's pre- and post-processing (see the module doc).

    Args:
        model: transformers hub id or local folder of a ``Mask2FormerForUniversalSegmentation`` checkpoint
            with the 80 COCO instance classes.
        scale: keep-ratio resize limits (long, short), mmdet's (1333, 800).
        size_divisor: pad the resized image to a multiple of this (32).
        top_k: (query, class) pairs kept per image (100).
        batch_size: images per forward pass.

    No weights load until :meth:`setup`.
    """

    def __init__(self, model: str = DEFAULT_DETECTOR, scale: Sequence[int] = DEFAULT_SCALE,
                 size_divisor: int = 32, top_k: int = 100, batch_size: int = 4) -> None:
        if len(scale) != 2 or min(scale) < 1:
            raise ValueError(f"scale must be two positive edge lengths (long, short), got {scale!r}")
        if size_divisor < 1 or top_k < 1 or batch_size < 1:
            raise ValueError(
                f"size_divisor, top_k and batch_size must be >= 1, got {size_divisor}, {top_k}, {batch_size}"
            )
        self.model_name = str(model)
        self.scale = (int(scale[0]), int(scale[1]))
        self.size_divisor = size_divisor
        self.top_k = top_k
        self.batch_size = batch_size
        self.model = None

    def setup(self, device: torch.device | str) -> None:
        """Load the checkpoint onto ``device`` in float32.

        Raises:
            ValueError: the checkpoint does not have exactly the 80 COCO instance classes.
        """
        from transformers import Mask2FormerForUniversalSegmentation

        self.device = torch.device(device)
        with hub_weights("geneval", "detector", self.model_name):
            model = Mask2FormerForUniversalSegmentation.from_pretrained(self.model_name)
        n = model.config.num_labels
        if n != len(object_names()):
            raise ValueError(
                f"detector {self.model_name!r} has {n} classes; GenEval needs a COCO instance-segmentation "
                f"model with the 80 COCO classes in COCO order (a panoptic model has 133)"
            )
        first = model.config.id2label.get(0) if model.config.id2label else None
        if first not in (None, "person", "LABEL_0"):
            logger.warning("detector %s: class 0 is %r, not 'person'; classes are mapped by COCO index",
                           self.model_name, first)
        self.model = model.to(self.device).eval()

    @torch.no_grad()
    def detect(self, images: Sequence[Image.Image], min_score: float | None = None) -> list[ImageDetections]:
        """Detect objects in ``images`` (PIL, any sizes; converted to RGB).

        Args:
            images: the images.
            min_score: drop detections with score <= this (see :func:`instance_postprocess`).

        Returns:
            one :class:`ImageDetections` per image, boxes and (H, W) masks at the image's own size.
        """
        if self.model is None:
            raise RuntimeError("Mask2FormerDetector.setup(device) must be called before detect()")
        out: list[ImageDetections] = []
        for start in range(0, len(images), self.batch_size):
            out.extend(self._detect_batch(images[start : start + self.batch_size], min_score))
        return out

    def _detect_batch(self, images: Sequence[Image.Image], min_score: float | None) -> list[ImageDetections]:
        # 1. resize each image (keep ratio) and normalise, on the 0–255 scale as mmdet
        mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=self.device).view(3, 1, 1)
        resized, originals = [], []
        for image in images:
            rgb = np.asarray(image.convert("RGB"), dtype=np.float32)  # (H, W, 3)
            x = torch.from_numpy(rgb).permute(2, 0, 1).to(self.device)  # (3, H, W)
            new_w, new_h = rescale_size(x.shape[2], x.shape[1], self.scale)
            x = F.interpolate(x[None], size=(new_h, new_w), mode="bilinear", align_corners=False)[0]
            resized.append((x - mean) / std)
            originals.append((x.shape[1], x.shape[2], rgb.shape[0], rgb.shape[1]))
        # 2. pad bottom/right to a common size divisible by size_divisor
        d = self.size_divisor
        pad_h = -(-max(r.shape[1] for r in resized) // d) * d
        pad_w = -(-max(r.shape[2] for r in resized) // d) * d
        batch = torch.zeros((len(resized), 3, pad_h, pad_w), device=self.device)
        for i, r in enumerate(resized):
            batch[i, :, : r.shape[1], : r.shape[2]] = r
        # 3. forward; class logits (B, Q, C+1), mask logits (B, Q, pad_h/4, pad_w/4)
        outputs = self.model(pixel_values=batch)
        results = []
        for i, (h, w, orig_h, orig_w) in enumerate(originals):

            def resize_masks(m: torch.Tensor, h=h, w=w, orig_h=orig_h, orig_w=orig_w) -> torch.Tensor:
                m = F.interpolate(m[:, None], size=(pad_h, pad_w), mode="bilinear", align_corners=False)
                m = m[:, :, :h, :w]
                return F.interpolate(m, size=(orig_h, orig_w), mode="bilinear", align_corners=False)[:, 0]

            results.append(
                instance_postprocess(
                    outputs.class_queries_logits[i], outputs.masks_queries_logits[i], self.top_k, min_score,
                    resize_masks,
                )
            )
        return results


def build_tiny_mask2former(folder: str | Path, seed: int = 0) -> str:
    """Write a tiny random Mask2Former (Swin backbone of width 8, one layer per stage, 10 queries, the 80 COCO
    classes) to ``folder`` in the transformers format, for tests and offline trials. Its class probabilities
    are near 1/81, so at GenEval's thresholds it detects nothing.

    Returns:
        ``str(folder)``, to pass as ``model=``.
    """
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    names = object_names()
    backbone = SwinConfig(
        image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(
        backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
        encoder_feedforward_dim=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
        dim_feedforward=32, num_queries=10,
        id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
    )
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    return str(folder)
