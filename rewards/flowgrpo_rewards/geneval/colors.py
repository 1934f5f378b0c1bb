"""GenEval's colour classifier: zero-shot CLIP on each object's mask pasted on a grey canvas.

As in GenEval's scorer (``color_classification`` in djghosh13/geneval ``evaluation/evaluate_images.py``, which
uses CLIP_benchmark's ``zero_shot_classifier``): for an object of class ``k`` the image is composited over a
``#999`` grey canvas through the object's binary mask, cropped to the object's box and passed through CLIP's
evaluation transform; the text side averages, per colour c, the L2-normalised embeddings of three templates
("a photo of a {c} {k}", "a photo of a {c}-colored {k}", "a photo of a {c} object") and renormalises. The
score of colour c is 100 · cos(image, text_c); the colour is the arg-max (Radford et al. 2021, CLIP,
arXiv 2103.00020, zero-shot classification with prompt ensembling).

The default model is OpenAI's ViT-L/14 through open_clip. The name is ``ViT-L-14-quickgelu``: the original
loaded OpenAI's weights with the QuickGELU activation they were trained with; open_clip ≥ 2.24 builds plain
``ViT-L-14`` with GELU unless asked, which changes the features.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from flowgrpo.rewards.base import hub_weights
from flowgrpo_rewards.geneval.rules import COLORS, ColorScorer, Detection

logger = logging.getLogger(__name__)

DEFAULT_CLIP_MODEL = "ViT-L-14-quickgelu"
DEFAULT_CLIP_PRETRAINED = "openai"
#: The grey the original pastes masked objects on (its ``bgcolor`` option, default "#999").
BACKGROUND = "#999"


def color_templates(classname: str) -> list[str]:
    """GenEval's three colour templates for ``classname``, with ``{c}`` left for the colour.

    The article is always "a", as in the original ("a photo of a orange car").
    """
    return [
        f"a photo of a {{c}} {classname}",
        f"a photo of a {{c}}-colored {classname}",
        "a photo of a {c} object",
    ]


def object_crops(image: Image.Image, objects: Sequence[Detection],
                 background: str = BACKGROUND) -> list[Image.Image]:
    """The images CLIP sees, one per object: ``image`` where the object's mask is set, ``background``
    elsewhere, cropped to the object's box (PIL rounds the float box to whole pixels). Objects without a mask
    are cropped from the unmasked image.

    Raises:
        ValueError: a mask whose (H, W) is not the image's.
    """
    rgb = image.convert("RGB")
    canvas = Image.new("RGB", rgb.size, color=background)
    crops = []
    for i, obj in enumerate(objects):
        if obj.mask is not None:
            mask = np.asarray(obj.mask, dtype=bool)
            if mask.shape != (rgb.height, rgb.width):
                size = (rgb.height, rgb.width)
                raise ValueError(f"object {i}: mask is {mask.shape}, image is {size} (H, W)")
            composite = Image.composite(rgb, canvas, Image.fromarray(mask))
        else:
            composite = rgb
        crops.append(composite.crop(tuple(float(v) for v in obj.box[:4])))
    return crops


class ClipColorClassifier:
    """Zero-shot colour classification of detected objects with an open_clip model.

    Args:
        model: open_clip model name (``ViT-L-14-quickgelu``), or ``local-dir:/path`` holding
            ``open_clip_config.json`` and the weights (see :func:`build_tiny_clip`).
        pretrained: open_clip pretrained tag or checkpoint file (ignored for ``local-dir:``).
        background: the canvas colour behind the masked object.
        batch_size: crops per CLIP forward.

    No weights load until :meth:`setup`.
    """

    def __init__(self, model: str = DEFAULT_CLIP_MODEL, pretrained: str | None = DEFAULT_CLIP_PRETRAINED,
                 background: str = BACKGROUND, batch_size: int = 16) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_name = model
        self.pretrained = pretrained
        self.background = background
        self.batch_size = batch_size
        self.model = None
        self._text_weights: dict[str, torch.Tensor] = {}

    def setup(self, device: torch.device | str) -> None:
        """Load CLIP onto ``device`` (float32, eval mode)."""
        import open_clip

        self.device = torch.device(device)
        local = self.model_name.startswith("local-dir:")
        pretrained = None if local else self.pretrained
        # a tag such as "openai" is downloaded from the hub repo of open_clip's pretrained config
        hub = (open_clip.get_pretrained_cfg(self.model_name, pretrained) if pretrained else {}).get("hf_hub", "")
        repo = "/".join(hub.strip("/").split("/")[:2])
        fetching = hub_weights("geneval", "clip_pretrained", repo, local_hint="DIR/<its checkpoint file>")
        with fetching if repo else contextlib.nullcontext():
            model, _, transform = open_clip.create_model_and_transforms(
                self.model_name, pretrained=pretrained, device=self.device
            )
        self.model = model.eval()
        self.transform = transform
        self.tokenizer = open_clip.get_tokenizer(self.model_name)
        self._text_weights = {}

    def _require_setup(self) -> None:
        if self.model is None:
            raise RuntimeError("ClipColorClassifier.setup(device) must be called before classifying")

    @torch.no_grad()
    def text_weights(self, classname: str) -> torch.Tensor:
        """(D, 10) float32 unit text embeddings of the ten colours for ``classname`` (cached per class)."""
        self._require_setup()
        if classname not in self._text_weights:
            columns = []
            for color in COLORS:
                texts = [t.format(c=color) for t in color_templates(classname)]
                emb = self.model.encode_text(self.tokenizer(texts).to(self.device)).float()  # (3, D)
                mean = F.normalize(emb, dim=-1).mean(dim=0)
                columns.append(mean / mean.norm())
            self._text_weights[classname] = torch.stack(columns, dim=1)  # (D, 10)
        return self._text_weights[classname]

    @torch.no_grad()
    def scores(self, image: Image.Image, classname: str, objects: Sequence[Detection]) -> np.ndarray:
        """(N, 10) float32 zero-shot logits 100·cos(image crop, colour text) for the N ``objects``."""
        self._require_setup()
        weights = self.text_weights(classname)
        crops = object_crops(image, objects, self.background)
        out = []
        for start in range(0, len(crops), self.batch_size):
            chunk = crops[start : start + self.batch_size]
            batch = torch.stack([self.transform(c) for c in chunk]).to(self.device)  # (n, 3, S, S)
            features = F.normalize(self.model.encode_image(batch).float(), dim=-1)
            out.append(100.0 * features @ weights)
        if not out:
            return np.zeros((0, len(COLORS)), dtype=np.float32)
        return torch.cat(out).cpu().numpy()

    def scorer(self, image: Image.Image) -> ColorScorer:
        """A :data:`~flowgrpo_rewards.geneval.rules.ColorScorer` bound to ``image`` for the rule functions."""
        return lambda classname, objects: self.scores(image, classname, objects)


def build_tiny_clip(folder: str | Path, seed: int = 0) -> str:
    """Write a tiny random open_clip CLIP (1-layer ViT and text transformer, width 32, 32×32 input, the real
    49,408-token BPE tokenizer) to ``folder`` as ``open_clip_config.json`` + ``open_clip_model.safetensors``.

    For tests and offline trials: it runs every stage of the colour classifier but classifies at random.

    Returns:
        the model name to pass on, ``"local-dir:<folder>"`` (loads through open_clip's own local-dir code).
    """
    import open_clip
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_cfg = {
        "embed_dim": 16,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    preprocess_cfg = {
        "mean": [0.48145466, 0.4578275, 0.40821073],
        "std": [0.26862954, 0.26130258, 0.27577711],
        "interpolation": "bicubic",
        "resize_mode": "shortest",
    }
    torch.manual_seed(seed)
    model = open_clip.CLIP(**model_cfg)
    (folder / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2), encoding="utf-8"
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "open_clip_model.safetensors"))
    return f"local-dir:{folder}"
