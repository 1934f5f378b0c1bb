"""OCR reward: does the image show the text that the prompt quotes? (Flow-GRPO's text-rendering reward.)

Source: Flow-GRPO (Liu et al. 2025, arXiv 2505.05470), ``flow_grpo/ocr.py`` (``OcrScorer``):

* target ``t`` = the text between the first pair of double quotes (``"``) of the prompt;
* recognised ``r`` = the texts of all detected lines, in detection order, joined with nothing;
* both with spaces removed and lowercased (here: in the Unicode-canonical form of :func:`flowgrpo.text.fold_text`,
  so curly quotes in the prompt, a no-break space or a full-width letter cannot keep a perfect rendering
  below 1); then::

      reward = 1                                   if t is a substring of r
             = 1 - min(lev(r, t), len(t)) / len(t)  otherwise

  where ``lev`` is the Levenshtein edit distance (unit-cost insert, delete, substitute).

Flow-GRPO reads text with PaddleOCR (English PP-OCR models, no angle classifier). Here the engine is
``rapidocr-onnxruntime``: the same PP-OCR family exported to ONNX and shipped inside the wheel, so it runs
offline with no model download (about 0.3 s per 512 x 512 image on this project's 2-core machines). Its
recogniser is PP-OCRv4's Chinese + English model, so readings can differ from PaddleOCR's English-only model
on hard images; the detector's input size follows PaddleOCR's defaults (:data:`PADDLE_DETECTOR_SETTINGS`).
Lines with a recognition confidence below ``text_score`` (0.5, both engines' default) are dropped.

The engine and the edit distance (``rapidfuzz``) are the ``[ocr]`` extra: ``pip install 'flowgrpo-rewards[ocr]'``.
``rapidocr-onnxruntime`` supports Python 3.6 - 3.12.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from flowgrpo.images import to_uint8
from flowgrpo.rewards.base import BaseReward
from flowgrpo.text import fold_text
from flowgrpo.text import quoted_text as find_quoted_text

logger = logging.getLogger(__name__)

OCR_EXTRA_HINT = "pip install 'flowgrpo-rewards[ocr]'"

#: Text-detector input size of PaddleOCR 2.x, the engine Flow-GRPO uses (``det_limit_side_len=960``,
#: ``det_limit_type="max"``: shrink images whose longest side exceeds 960 px, never enlarge). RapidOCR's own
#: default (enlarge until the shortest side is 736 px) turns a 512 px image into 736 px and is about 2x slower.
PADDLE_DETECTOR_SETTINGS = {"det_limit_side_len": 960, "det_limit_type": "max"}


def _require(module: str, package: str):
    """Import ``module`` or raise ``ImportError`` saying which package is missing and how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"the 'ocr' reward needs the package {package!r}, which is not installed; install the extra with: "
            f"{OCR_EXTRA_HINT}"
        ) from err


def quoted_text(prompt: str) -> str:
    """The text between the first pair of double quotes of ``prompt``: straight ``"`` as in Flow-GRPO, or any
    other double-quote form (``“…”``, ``„…“``, ``«…»``, ``＂…＂``): :func:`flowgrpo.text.quoted_text`, the rule
    ``flowgrpo prompts ocr`` also keeps prompts by.

    Raises:
        ValueError: the prompt has fewer than two double quotes (no quoted target), or the quoted text is
            empty once normalised (the reward would divide by zero).
    """
    target = find_quoted_text(prompt)
    if target is None:
        raise ValueError('the ocr reward needs a non-empty target text in double quotes ("..." or \u201c...\u201d) '
                         f"in the prompt; got {prompt!r}")
    return target


def normalize_text(text: str) -> str:
    """Flow-GRPO's comparison form (spaces removed, lower case) on the Unicode-canonical text: every form of
    whitespace removed, quotes, dashes and full-width characters unified, case-folded
    (:func:`flowgrpo.text.fold_text`). For plain ASCII text this is exactly Flow-GRPO's ``replace(" ", "").lower()``
    except that tabs and newlines are removed too."""
    return fold_text(text).replace(" ", "")


def ocr_text_reward(recognized: str, target: str) -> float:
    """Flow-GRPO's OCR reward of one image: 1 - min(lev(r, t), len(t)) / len(t), or 1 if t is in r.

    Args:
        recognized: all text read in the image (raw; normalised here).
        target: the quoted prompt text (raw; normalised here); must not be empty once normalised.

    Returns:
        A float in [0, 1].

    Raises:
        ValueError: ``target`` is empty once normalised.
        ImportError: ``rapidfuzz`` (the ``[ocr]`` extra) is not installed.
    """
    r, t = normalize_text(recognized), normalize_text(target)
    if not t:
        raise ValueError(f"ocr target text {target!r} is empty once spaces are removed")
    if t in r:
        return 1.0
    levenshtein = _require("rapidfuzz.distance", "rapidfuzz").Levenshtein
    distance = min(levenshtein.distance(r, t), len(t))
    return 1.0 - distance / len(t)


def images_to_bgr_uint8(images: torch.Tensor) -> list[np.ndarray]:
    """(B, 3, H, W) float in [0, 1] (RGB) -> B contiguous (H, W, 3) uint8 BGR arrays (OpenCV's order, which
    RapidOCR assumes for arrays). Rounds to the nearest level, as Flow-GRPO's ``(x * 255).round()``."""
    return [np.ascontiguousarray(img[:, :, ::-1]) for img in to_uint8(images)]


class OcrReward(BaseReward):
    """Flow-GRPO's OCR reward with RapidOCR: edit-distance match of the read text to the prompt's quoted text.

    Args:
        text_score: recognised lines with confidence below this are ignored (default 0.5).
        use_cls: run the 180-degree text-direction classifier (Flow-GRPO: off).
        engine_kwargs: keyword arguments for ``rapidocr_onnxruntime.RapidOCR``, on top of
            :data:`PADDLE_DETECTOR_SETTINGS` (e.g. ``{"intra_op_num_threads": 4}``).

    Calling it: ``images`` (B, 3, H, W) float in [0, 1], ``prompts`` B strings each with a ``"quoted"`` target
    -> (B,) float32 in [0, 1] (metadata unused).

    Raises:
        ValueError: ``text_score`` outside [0, 1] (construction); a prompt without quoted text (call).
        ImportError: the ``[ocr]`` extra is missing (in :meth:`setup`), with the pip command to install it.
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "ocr"

    def __init__(self, text_score: float = 0.5, use_cls: bool = False, engine_kwargs: dict | None = None) -> None:
        if not 0.0 <= float(text_score) <= 1.0:
            raise ValueError(f"text_score must be in [0, 1], got {text_score!r}")
        self.text_score = float(text_score)
        self.use_cls = bool(use_cls)
        self.engine_kwargs = {**PADDLE_DETECTOR_SETTINGS, **(engine_kwargs or {})}
        self.engine = None

    def setup(self, device: torch.device) -> None:
        """Build the RapidOCR engine (ONNX Runtime on the CPU, whatever ``device`` is)."""
        super().setup(device)
        rapidocr = _require("rapidocr_onnxruntime", "rapidocr-onnxruntime")
        _require("rapidfuzz.distance", "rapidfuzz")
        self.engine = rapidocr.RapidOCR(**self.engine_kwargs)

    def read_text(self, image_bgr: np.ndarray) -> str:
        """All text RapidOCR reads in one (H, W, 3) uint8 BGR image, lines joined in detection order."""
        if self.engine is None:
            raise RuntimeError("OcrReward.setup(device) must be called before reading text")
        result, _ = self.engine(image_bgr, use_cls=self.use_cls, text_score=self.text_score)
        if not result:  # None when nothing is detected
            return ""
        return "".join(text for _box, text, _confidence in result)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """OCR reward of each (image, prompt) pair: (B,) float32 on the CPU, in [0, 1]."""
        targets = [quoted_text(p) for p in prompts]  # fail on bad prompts before the slow OCR
        if self.engine is None:
            raise RuntimeError("OcrReward.setup(device) must be called before scoring")
        rewards = []
        for image, target in zip(images_to_bgr_uint8(images), targets, strict=True):
            recognized = self.read_text(image)
            rewards.append(ocr_text_reward(recognized, target))
            logger.debug("ocr: read %r for target %r -> %.3f", recognized, target, rewards[-1])
        return torch.tensor(rewards, dtype=torch.float32)
