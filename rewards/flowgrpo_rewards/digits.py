"""Digit correctness: does the image show the digit its prompt asks for?

The reward of the embedded digits task (:mod:`flowgrpo.tasks.digits`). The intended digit comes from the prompt
file's metadata (``{"prompt": "a handwritten digit seven", "digit": 7}``), never from the prompt text or the
image's position in the batch. Images are brought back to load_digits' 8×8 grid
(:func:`flowgrpo.tasks.digits.data.images_to_digits`) and scored by the reward classifier, a multinomial logistic
regression trained on the ``reward`` split of the real digits (:func:`flowgrpo.tasks.digits.scoring.reward_classifier`,
held-out accuracy 0.967). Correctness reported for evaluation should come from the independent judge
(:func:`flowgrpo.tasks.digits.scoring.judge_correctness`), which this reward never uses.

Entry points: ``digit_correctness`` (probability of the intended digit, in [0, 1]; ``strict=True`` gives the 0/1
variant) and ``digit_correctness_strict`` (always 0/1).
"""

from __future__ import annotations

import numbers

import torch

from flowgrpo.rewards.base import BaseReward
from flowgrpo.tasks.digits.scoring import (
    digit_probabilities,
    digit_probabilities_differentiable,
    reward_classifier,
)

DIGIT_FIELD = "digit"


def labels_from_metadata(metadata: list[dict], reward_name: str = "digit_correctness") -> torch.Tensor:
    """The intended digit of each sample, ``metadata[i]["digit"]``: (B,) int64.

    Raises ``ValueError`` naming the field, the sample index and the allowed range when a dict lacks the field or
    its value is not an integer 0–9 (``True``, ``7.0`` and ``"7"`` are rejected too: bad input is not repaired).
    """
    out = []
    for i, meta in enumerate(metadata):
        if not isinstance(meta, dict) or DIGIT_FIELD not in meta:
            has = (f"fields {sorted(meta)}" if meta else "no metadata fields") if isinstance(meta, dict) \
                else type(meta).__name__
            raise ValueError(
                f"{reward_name} needs metadata[{DIGIT_FIELD!r}] (an integer digit 0–9) for every prompt; "
                f"sample {i} has {has}"
            )
        value = meta[DIGIT_FIELD]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= 9:
            raise ValueError(
                f"{reward_name}: metadata[{DIGIT_FIELD!r}] of sample {i} must be an integer 0–9, got {value!r}"
            )
        out.append(int(value))
    return torch.tensor(out, dtype=torch.int64)


class DigitCorrectness(BaseReward):
    """Reward = p(intended digit | image) under the reward classifier, or 1[argmax = intended] if ``strict``.

    ``cap`` < 1 scores ``min(p, cap)``: once the classifier is that sure, a sample is as good as any other, so a
    group whose samples all pass the cap has zero spread and stops pulling its digit toward the classifier's most
    confident prototype. This is the threshold ("proxy point") form of constrained reward optimisation against
    reward over-optimisation (Moskovitz et al., "Confronting Reward Model Overoptimization with Constrained
    RLHF", ICLR 2024, arXiv 2310.04373): optimise the proxy up to the point where it stops tracking the goal.

    ``__call__(images (B, 3, H, H) float in [0, 1], prompts, metadata) -> (B,) float32`` on the CPU, in [0, 1].
    Each ``metadata[i]`` needs ``"digit"``: an integer 0–9 (``ValueError`` otherwise). The classifier is fitted in
    :meth:`setup` (well under a second; cached per process), not in ``__init__``.
    """

    name = "digit_correctness"
    #: the probability (capped or not) is differentiable in the images (:meth:`score_differentiable`); the 0/1
    #: ``strict`` variant is not (an instance with ``strict=True`` sets it False)
    differentiable = True
    #: the score's bounds: a probability in [0, 1], or [0, cap] (set per instance). Read by ReFL's margin check
    typical_range = (0.0, 1.0)

    def __init__(self, strict: bool = False, cap: float = 1.0) -> None:
        if not isinstance(strict, bool):
            raise ValueError(f"digit_correctness: strict must be true or false, got {strict!r}")
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < cap <= 1:
            raise ValueError(f"digit_correctness: cap must be a number in (0, 1], got {cap!r}")
        if strict and cap != 1.0:
            raise ValueError("digit_correctness: cap applies to the probability reward, not to strict=true")
        self.strict = strict
        self.cap = float(cap)
        self.typical_range = (0.0, self.cap)
        self.name = "digit_correctness_strict" if strict else "digit_correctness"
        self.differentiable = not strict
        self._ready = False

    def check_prompts(self, prompts) -> None:
        """Every prompt of ``prompts`` (a PromptSet) names its digit (else ``ValueError``, see
        :func:`labels_from_metadata`)."""
        labels_from_metadata(prompts.metadata, self.name)

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        reward_classifier()  # fit now (cached), so the first scoring is not slower than the rest
        self._ready = True

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        labels = labels_from_metadata(metadata, self.name)
        if not self._ready:
            self.setup(images.device)
        probs = digit_probabilities(images)  # (B, 10) float32, CPU
        if self.strict:
            return (probs.argmax(dim=1) == labels).to(torch.float32)
        p = probs[torch.arange(len(labels)), labels]
        return p.clamp(max=self.cap).contiguous() if self.cap < 1 else p.contiguous()


    def score_differentiable(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """:meth:`score` (the probability, capped at ``cap``) with the graph back to ``images``: (B,) float32 on
        the images' device (:func:`~flowgrpo.tasks.digits.scoring.digit_probabilities_differentiable`); past the
        cap the gradient is 0. Raises ``ValueError`` for the strict (0/1) variant, which has no gradient."""
        if self.strict:
            raise ValueError(f"{self.name}: the 0/1 verdict has no gradient; use digit_correctness without strict")
        labels = labels_from_metadata(metadata, self.name).to(images.device)
        if not self._ready:
            self.setup(images.device)
        p = digit_probabilities_differentiable(images).gather(1, labels[:, None])[:, 0]
        return p.clamp(max=self.cap) if self.cap < 1 else p


class DigitCorrectnessStrict(DigitCorrectness):
    """:class:`DigitCorrectness` with ``strict=True``: 1.0 when the reward classifier's most probable digit is the
    intended one, else 0.0."""

    differentiable = False  # a 0/1 verdict: no gradient

    def __init__(self) -> None:
        super().__init__(strict=True)
