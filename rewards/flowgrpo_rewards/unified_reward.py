"""UnifiedReward judges over an OpenAI-compatible API: point-wise scores and pairwise (think) preferences.

UnifiedReward (Wang et al., "Unified Reward Model for Multimodal Understanding and Generation", arXiv 2503.05236;
UnifiedReward-Think, arXiv 2505.03318; models ``CodeGoat24/UnifiedReward-*``) is a family of Qwen-VL / LLaVA judges
that answer in text. Served by vLLM or SGLang (``vllm serve CodeGoat24/UnifiedReward-2.0-qwen3vl-8b
--served-model-name UnifiedReward``), they are asked here exactly as the releases that train with them ask:

* ``final_score`` (point, images): ``Final Score: X`` (1–5), reward X/5 — Flow-GRPO's
  ``unifiedreward_score_sglang`` (UnifiedReward-7b-v1.5);
* ``alignment_coherence_style`` (point, images): ``<Dim> Score (1-5): X`` for Alignment, Coherence and Style, the
  reward is X of ``dimension`` — Pref-GRPO's ``get_unifiedreward_image_template`` (UnifiedReward-2.0);
* ``alignment_physics_style`` (point, videos): the same for Alignment, Physics and Style — UnifiedReward-2.0's
  ``point_score_APS_video_generation.py``;
* ``think`` (pairwise, images or videos): ``<answer>Image 1 is better</answer>`` (``Video …`` for videos) —
  Pref-GRPO's ``get_unifiedreward_think_*_template`` (UnifiedReward-Think);
* ``pair_rank`` (pairwise, images): "Image 1 is better." in the reply — UnifiedReward's
  ``qwen_pair_rank_image_generation.py``.

The pairwise judge (:class:`UnifiedRewardPairwise`) is group-wise: every pair (i < j) of a prompt's G samples is
judged once with sample i as "Image 1" (itertools.combinations order, as Pref-GRPO's ``cal_win_rate_images``), a
win counts 1, an answer naming neither (or none) ½ to each, and the reward is each sample's win rate, rounded to
3 decimals as the release rounds (Pref-GRPO, Wang et al., arXiv 2508.20751, Sec. 3.2: the pairwise-preference
reward). A video pair is sent as ``frames`` frames of video 1 then of video 2, as one image list (8 each,
``numpy.linspace``-spaced, JPEG quality 95: Pref-GRPO's ``cal_win_rate_videos``).

Request settings follow the releases: greedy decoding (``temperature: 0``), ``max_tokens`` 4096 (Pref-GRPO's
client), images as data URLs (Flow-GRPO's ``final_score``: the 8-bit image resized to 512 x 512 with PIL's bicubic
filter, PNG; the UnifiedReward-2.0 templates: native size, JPEG quality 95).

Documented differences from the releases (each is an option): a reply without a parsable score is NaN ("not
applicable"; the sample leaves its group's statistics) where Flow-GRPO scores 0.0 and Pref-GRPO the batch mean of
that dimension (which would make a score depend on its batch-mates) — ``unparsed: zero`` gives Flow-GRPO's; the
UnifiedReward-2.0 video reference samples frames ``int(i·F/k)`` where ``frames: k`` here spaces them by
``numpy.linspace`` (pass a list of indices for the other rule).
"""

from __future__ import annotations

import itertools
import logging
import math
import re

import torch

from flowgrpo_rewards.video import check_frames
from flowgrpo_rewards.vlm_judge import ChatJudgeBase, VlmJudgeError, media_parts

logger = logging.getLogger(__name__)

#: Flow-GRPO's question to UnifiedReward-7b-v1.5 (``flow_grpo/rewards.py``, ``unifiedreward_score_sglang``).
FINAL_SCORE = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
#: Pref-GRPO's point-score template for UnifiedReward-2.0 (``fastvideo/rewards/templates.py``).
ALIGNMENT_COHERENCE_STYLE = (
    "You are presented with a generated image and its associated text caption. Your task is to analyze the image "
    "across multiple dimensions in relation to the caption. Specifically:\n"
    "Provide overall assessments for the image along the following axes (each rated from 1 to 5):\n"
    "- Alignment Score: How well the image matches the caption in terms of content.\n"
    "- Coherence Score: How logically consistent the image is (absence of visual glitches, object distortions, "
    "etc.).\n"
    "- Style Score: How aesthetically appealing the image looks, regardless of caption accuracy.\n\n"
    "Output your evaluation using the format below:\n\n"
    "Alignment Score (1-5): X\nCoherence Score (1-5): Y\nStyle Score (1-5): Z\n\n"
    "Your task is provided as follows:\nText Caption: [{prompt}]"
)
#: UnifiedReward-2.0's video point-score prompt (``point_score_APS_video_generation.py``).
ALIGNMENT_PHYSICS_STYLE = (
    "You are presented with a generated video and its associated text caption. Your task is to analyze the video "
    "across multiple dimensions in relation to the caption. Specifically:\n"
    "Provide overall assessments for the video along the following axes (each rated from 1 to 5):\n"
    "- Alignment Score: How well the video matches the caption in terms of content.\n"
    "- Physics Score: How well the gravity, movements, collisions, and interactions make physical sense.\n"
    "- Style Score: How visually appealing the video looks, regardless of caption accuracy.\n\n"
    "Output your evaluation using the format below:\n\n"
    "Alignment Score (1-5): X\nPhysics Score (1-5): Y\nStyle Score (1-5): Z\n\n"
    "Your task is provided as follows:\nText Caption: [{prompt}]"
)
#: UnifiedReward's pair-rank prompt (``inference_qwen/image_generation/qwen_pair_rank_image_generation.py``).
PAIR_RANK = (
    "You are given a text caption and two generated images based on that caption. Your task is to evaluate and "
    "compare these images based on two key criteria:\n1. Alignment with the Caption: Assess how well each image "
    "aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, and "
    "attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of each image, "
    "including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nCompare both images "
    "using the above criteria and select the one that better aligns with the caption while exhibiting superior "
    "visual quality.\nProvide a clear conclusion such as \"Image 1 is better.\", \"Image 2 is better.\" and \"Both "
    "images are equally good.\"\nYour task is provided as follows:\nText Caption: [{prompt}]"
)

_THINK_IMAGE_STEPS = [
    "You are an objective and precise evaluator for image quality comparison. I will provide you with a text "
    "caption and two images generated based on this caption. You must analyze the two images carefully and "
    "determine which image is better.",
    "",
    "        Evaluation procedure:",
    "",
    "        1. The caption for the generated images is: 「{prompt}」. You must evaluate the two images across these "
    "core dimensions:",
    "        - Semantic consistency (how closely the image content aligns with the caption)",
    "        - Aesthetics (composition, color usage, artistic expression)",
    "        - Authenticity (realism and attention to detail)",
    "",
    "        2. You are also encouraged to add up to two additional evaluation dimensions if they are relevant to the "
    "specific caption or images (e.g., creativity, spatial layout, fine-grained detail). If no extra dimensions are "
    "relevant, just keep the three core dimensions.",
    "",
    "        3. For each evaluation dimension:",
    "        - Provide a score between 1–10 for both Image 1 and Image 2",
    "        - Provide a short rationale for each score (2–5 short sentences)",
    "        - The evaluation must follow exactly this format with line breaks and indentation:",
    "            Dimension name: ",
    "                Image 1 (x/10) - rationale; ",
    "                Image 2 (y/10) - rationale",
    "",
    "        4. After evaluating all dimensions, calculate the total score for each image and show the calculation "
    "explicitly, following this exact format:",
    "            Total score:",
    "            Image 1: x+x+x=total",
    "            Image 2: y+y+y=total",
    "",
    "        5. Wrap all reasoning and scoring strictly within <think> and </think> tags.",
    "",
    "        6. After </think>, output the final judgment strictly inside <answer> and </answer> tags, containing "
    "only one of:",
    "        - Image 1 is better",
    "        - Image 2 is better",
    "",
    "        Constraints:",
    "        - You must strictly follow the line breaks, indentation, and formatting shown in the example below.",
    "        - Do not merge multiple dimensions into one line. Each dimension must follow the 3-line block format "
    "shown below.",
    "        - Do not use Markdown formatting, bullet points, bold text, or headings.",
    "        - Do not output explanations outside <think> and <answer>.",
    "        - The <answer> tag must contain only the final string with no extra words.",
    "",
    "        Required output format:",
    "",
    "        <think>",
    "        1. Semantic consistency: ",
    "            Image 1 (9/10) - ...; ",
    "            Image 2 (7/10) - ...",
    "        2. Aesthetics: ",
    "            Image 1 (8/10) - ...; ",
    "            Image 2 (8/10) - ...",
    "        3. Authenticity: ",
    "            Image 1 (8/10) - ...; ",
    "            Image 2 (5/10) - ...",
    "        [Additional dimension if any]: ",
    "            Image 1 (7/10) - ...; ",
    "            Image 2 (8/10) - ...",
    "        [Additional dimension if any]: ",
    "            Image 1 (6/10) - ...; ",
    "            Image 2 (7/10) - ...",
    "        Total score:",
    "        Image 1: 9+8+8+7+6=38",
    "        Image 2: 7+8+5+8+7=35",
    "        </think>",
    "        <answer>Image 1 is better</answer>",
    "",
    "        Note: The example above is only to illustrate the exact format (line breaks, indentation, symbols, and "
    "style). Your actual evaluation must follow this format exactly, but be based on the given caption and images.",
    "        ",
]
#: Pref-GRPO's UnifiedReward-Think image template (``get_unifiedreward_think_image_template``), its indentation kept.
THINK_IMAGE = "\n".join(_THINK_IMAGE_STEPS)

_THINK_VIDEO_STEPS = [
    "You are an objective and precise evaluator for video quality comparison. I will provide you with a text "
    "caption and a sequence of consecutive frames extracted from two generated videos based on this caption. The "
    "first half of the frames belong to Video 1, and the second half of the frames belong to Video 2. You must "
    "analyze these two videos carefully and determine which video is better.",
    "",
    "        Instructions (MUST follow strictly):",
    "        1. All reasoning, analysis, explanations, and scores MUST be written strictly inside <think> and "
    "</think> tags.",
    "        2. The <think> block must start immediately with the first evaluation dimension. Do NOT include any "
    "introduction, notes, or explanations before the first numbered dimension.",
    "        3. After </think>, output the final judgment strictly inside <answer> and </answer> tags, containing "
    "only one of:",
    "        - Video 1 is better",
    "        - Video 2 is better",
    "        4. Do NOT output anything outside <think> and <answer>. No extra explanations, notes, or prefaces.",
    "",
    "        Evaluation procedure:",
    "",
    "        1. The caption for the generated videos is: 「{prompt}」. The provided frames represent two candidate "
    "videos:",
    "        - First half: Video 1",
    "        - Second half: Video 2",
    "",
    "        2. You must evaluate the two videos across these core dimensions:",
    "        - Semantic consistency (how closely the video content aligns with the caption)",
    "        - Temporal coherence (smoothness and logical flow of motion across frames)",
    "        - Authenticity (realism and attention to detail)",
    "",
    "        3. You may also add up to two additional evaluation dimensions if they are clearly relevant (e.g., "
    "camera stability, lighting consistency, creativity). If no extra dimensions are relevant, keep only the three "
    "core dimensions.",
    "",
    "        4. For each evaluation dimension:",
    "        - Provide a score between 1–10 for both Video 1 and Video 2.",
    "        - Provide a short rationale for each score (2–5 short sentences).",
    "        - Each dimension must follow exactly this 3-line block format with numbering, line breaks, and "
    "indentation:",
    "            N. Dimension name: ",
    "                Video 1 (x/10) - rationale; ",
    "                Video 2 (y/10) - rationale",
    "",
    "        5. After evaluating all dimensions, calculate the total score for each video and show the calculation "
    "explicitly, following this exact format:",
    "            Total score:",
    "            Video 1: x+x+x(+...)=total",
    "            Video 2: y+y+y(+...)=total",
    "",
    "        6. All reasoning, analysis, scoring, and totals must be written strictly inside <think> and </think> "
    "tags. Nothing related to reasoning or scores may appear outside <think>.",
    "",
    "        Required output format (follow this exactly, including line breaks and indentation):",
    "",
    "        <think>",
    "        1. Semantic consistency: ",
    "            Video 1 (9/10) - ...; ",
    "            Video 2 (7/10) - ...",
    "        2. Temporal coherence: ",
    "            Video 1 (8/10) - ...; ",
    "            Video 2 (6/10) - ...",
    "        3. Authenticity: ",
    "            Video 1 (7/10) - ...; ",
    "            Video 2 (5/10) - ...",
    "        [Additional dimension if any]: ",
    "            Video 1 (8/10) - ...; ",
    "            Video 2 (6/10) - ...",
    "        [Additional dimension if any]: ",
    "            Video 1 (7/10) - ...; ",
    "            Video 2 (7/10) - ...",
    "        Total score:",
    "        Video 1: 9+8+7+8+7=39",
    "        Video 2: 7+6+5+6+7=31",
    "        </think>",
    "        <answer>Video 1 is better</answer>",
    "",
    "        Note: The example above is only to illustrate the exact format (numbering, line breaks, indentation, and "
    "style). Your actual evaluation must follow this format exactly, but be based on the given caption and the two "
    "provided videos (frames divided into two halves).",
    "        ",
]
#: Pref-GRPO's UnifiedReward-Think video template (``get_unifiedreward_think_video_template``).
THINK_VIDEO = "\n".join(_THINK_VIDEO_STEPS)

#: point templates: name → (text, the dimensions it asks for, the input form)
POINT_TEMPLATES = {
    "final_score": (FINAL_SCORE, ("final",), "image"),
    "alignment_coherence_style": (ALIGNMENT_COHERENCE_STYLE, ("alignment", "coherence", "style"), "image"),
    "alignment_physics_style": (ALIGNMENT_PHYSICS_STYLE, ("alignment", "physics", "style"), "video"),
}
PAIR_TEMPLATES = ("think", "pair_rank")
_DIMENSION_SCORE = r"(\w+) Score \(1-5\):\s*([0-5](?:\.\d+)?)"  # Pref-GRPO's extract_normalized_rewards
_FINAL_SCORE = r"Final Score:\s*([1-5](?:\.\d+)?)"  # Flow-GRPO's _extract_scores
_ANSWER = r"<answer>(.*?)</answer>"  # Pref-GRPO's _extract_answer


def parse_point_score(text: str, template: str, dimension: str) -> float:
    """The score a point-template reply gives (NaN when it has none): ``Final Score: X`` → X/5 (Flow-GRPO), or
    the ``dimension``'s ``<Dim> Score (1-5): X`` → X (Pref-GRPO; the last of repeated lines, as its dict keeps)."""
    if template == "final_score":
        m = re.search(_FINAL_SCORE, text)
        return float(m.group(1)) / 5.0 if m else math.nan
    found = {k.lower(): float(v) for k, v in re.findall(_DIMENSION_SCORE, text)}
    return found.get(dimension, math.nan)


def parse_preference(text: str, template: str, noun: str = "Image") -> int | None:
    """1 or 2 for the sample a pairwise reply prefers, None for a tie or no verdict. ``think``: the text inside
    the first ``<answer>…</answer>`` (none: no verdict); ``pair_rank``: the whole reply."""
    if template == "think":
        m = re.search(_ANSWER, text, re.DOTALL)
        if not m:
            return None
        text = m.group(1).strip()
    if f"{noun} 1 is better" in text:
        return 1
    if f"{noun} 2 is better" in text:
        return 2
    return None


def _reply_text(reply: dict, url: str) -> str:
    try:
        return str(reply["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError) as err:
        raise VlmJudgeError(f"UnifiedReward endpoint {url} replied without choices[0].message.content "
                            f"({type(err).__name__}: {err}); reply: {str(reply)[:300]}") from None


class UnifiedRewardScore(ChatJudgeBase):
    """A UnifiedReward point score of each image or video (module docstring).

    Args:
        template: ``"final_score"`` (default: Flow-GRPO's), ``"alignment_coherence_style"`` (images) or
            ``"alignment_physics_style"`` (videos), the UnifiedReward-2.0 prompts of Pref-GRPO.
        dimension: for the UnifiedReward-2.0 templates, which score is the reward (``alignment``, ``coherence``,
            ``style``, ``physics``); default ``alignment``.
        unparsed: ``"nan"`` (default) or ``"zero"`` (Flow-GRPO) for a reply without the score.
        image_size: side the image is resized to before it is sent (None: as generated); default 512 for
            ``final_score`` (Flow-GRPO), None otherwise. image_format: ``"png"`` or ``"jpeg"``; default PNG for
            ``final_score`` (Flow-GRPO), JPEG for the others (Pref-GRPO).
        frames: for videos, which frames are sent (default 16, the UnifiedReward-2.0 video reference's count).
        max_tokens: the reply's token limit (default 4096).
        base_url, model, timeout, retries, backoff, max_backoff, max_concurrency, api_key_env: the endpoint.

    Calling it: images (B, 3, H, W) or, for the video template, videos (B, F, 3, H, W) float in [0, 1] → (B,)
    float32 (final_score: 0.2–1; the others: 1–5).

    Raises:
        ValueError: an unknown template, a dimension it does not ask for, or bad settings (at construction).
        VlmJudgeError: the endpoint failed or replied without a message (at :meth:`setup` or when scoring).
    """

    name = "unifiedreward"

    def __init__(self, template: str = "final_score", dimension: str | None = None, unparsed: str = "nan",
                 image_size: int | None = -1, image_format: str | None = None, frames=16, max_tokens: int = 4096,
                 base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None, timeout: float = 300.0,
                 retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8,
                 api_key_env: str | None = None) -> None:
        if template not in POINT_TEMPLATES:
            raise ValueError(f"template must be one of {sorted(POINT_TEMPLATES)}, got {template!r}")
        self.question, dims, form = POINT_TEMPLATES[template]
        dimension = dimension or dims[0]
        if dimension not in dims:
            raise ValueError(f"template {template!r} asks for {list(dims)}, not dimension {dimension!r}")
        if unparsed not in ("nan", "zero"):
            raise ValueError(f"unparsed must be 'nan' or 'zero', got {unparsed!r}")
        fmt = image_format or ("png" if template == "final_score" else "jpeg")
        if fmt not in ("png", "jpeg"):
            raise ValueError(f"image_format must be 'png' or 'jpeg', got {image_format!r}")
        super().__init__(base_url, model, timeout, retries, backoff, max_backoff, max_concurrency, api_key_env)
        self.template, self.dimension, self.unparsed, self.image_format = template, dimension, unparsed, fmt
        self.image_size = (512 if template == "final_score" else None) if image_size == -1 else image_size
        self.frames = check_frames(frames)
        self.max_tokens = int(max_tokens)
        self.modalities = (form,)
        if template != "final_score":
            self.name = f"unifiedreward_{dimension}"

    def _score_one(self, parts: list[dict], prompt: str) -> float:
        reply = self.chat(parts + [{"type": "text", "text": self.question.format(prompt=prompt)}],
                          max_tokens=self.max_tokens, temperature=0.0)
        value = parse_point_score(_reply_text(reply, self.base_url), self.template, self.dimension)
        if math.isnan(value):
            logger.warning("%s: no %s score in the reply: %s", self.name, self.dimension,
                           "0.0" if self.unparsed == "zero" else "NaN")
            return 0.0 if self.unparsed == "zero" else value
        return value

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 CPU scores; at most ``max_concurrency`` requests in flight."""
        parts = media_parts(self, images, self.frames, self.image_format, self.image_size)
        return torch.tensor(self.pooled(self._score_one, parts, list(prompts)), dtype=torch.float32)


class UnifiedRewardPairwise(ChatJudgeBase):
    """Win rate of each sample in its group under a UnifiedReward pairwise judge (module docstring).

    Args:
        template: ``"think"`` (default: UnifiedReward-Think, Pref-GRPO's) or ``"pair_rank"`` (images only).
        frames: for videos, which frames of each video are sent (default 8, Pref-GRPO's).
        round_digits: the win rate is rounded to this many decimals (default 3, as Pref-GRPO); None: exact.
        image_format: ``"jpeg"`` (default, Pref-GRPO's client) or ``"png"``.
        max_tokens: the reply's token limit (default 4096).
        base_url, model, timeout, retries, backoff, max_backoff, max_concurrency, api_key_env: the endpoint.

    Calling it: the G images (G, 3, H, W) or videos (G, F, 3, H, W) of one prompt → (G,) float32 in [0, 1]; G(G−1)/2
    requests.

    Raises:
        ValueError: bad settings (at construction); ``pair_rank`` given videos (when scoring).
        VlmJudgeError: the endpoint failed or replied without a message.
    """

    name = "unifiedreward_pairwise"
    group_wise = True
    modalities = ("image", "video")

    def __init__(self, template: str = "think", frames=8, round_digits: int | None = 3, image_format: str = "jpeg",
                 max_tokens: int = 4096, base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0,
                 max_concurrency: int = 8, api_key_env: str | None = None) -> None:
        if template not in PAIR_TEMPLATES:
            raise ValueError(f"template must be one of {list(PAIR_TEMPLATES)}, got {template!r}")
        if image_format not in ("png", "jpeg"):
            raise ValueError(f"image_format must be 'png' or 'jpeg', got {image_format!r}")
        super().__init__(base_url, model, timeout, retries, backoff, max_backoff, max_concurrency, api_key_env)
        self.template, self.image_format, self.max_tokens = template, image_format, int(max_tokens)
        self.frames = check_frames(frames)
        self.round_digits = None if round_digits is None else int(round_digits)

    def _judge(self, first: list[dict], second: list[dict], question: str, noun: str) -> int | None:
        reply = self.chat(first + second + [{"type": "text", "text": question}], max_tokens=self.max_tokens,
                          temperature=0.0)
        return parse_preference(_reply_text(reply, self.base_url), self.template, noun)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(G,) float32 CPU win rates of one group (all prompts equal)."""
        video = images.ndim == 5
        if video and self.template != "think":
            raise ValueError(f"{self.name}: template {self.template!r} judges images; use 'think' for videos")
        g = images.shape[0]
        if g == 1:
            return torch.full((1,), 0.5)
        parts = media_parts(self, images, self.frames, self.image_format)
        question = (THINK_VIDEO if video else THINK_IMAGE if self.template == "think" else PAIR_RANK).format(
            prompt=prompts[0])
        pairs = list(itertools.combinations(range(g), 2))
        verdicts = self.pooled(lambda i, j: self._judge(parts[i], parts[j], question, "Video" if video else "Image"),
                               [i for i, _ in pairs], [j for _, j in pairs])
        wins = torch.zeros(g, dtype=torch.float64)
        for (i, j), v in zip(pairs, verdicts, strict=True):
            if v is None:
                wins[i] += 0.5
                wins[j] += 0.5
            else:
                wins[i if v == 1 else j] += 1.0
        rate = wins / (g - 1)  # each sample meets the other G − 1
        if self.round_digits is not None:
            rate = torch.round(rate, decimals=self.round_digits)
        return rate.float()
