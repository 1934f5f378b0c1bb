"""``digit_judge``: the digits task's independent judge, for evaluation only.

Per image: 1.0 when the judge (an RBF SVM on a split of the real digits disjoint from the reward classifier's,
see :mod:`flowgrpo.models.digits_eval`) reads the digit named in ``metadata["digit"]``, else 0.0 — the task's
strict correctness. Per batch (:meth:`DigitJudge.batch_metrics`): ``correctness`` (the mean), ``diversity``
(intra-digit diversity of the images, 0–16 ink units at 8×8) and ``diversity_real`` (the same measure on the
real digits). ``eval_only``: the trainer refuses to optimise it, so images that fool the reward cannot count as
correct.
"""

from __future__ import annotations

import logging

from flowgrpo.rewards.base import BaseReward

logger = logging.getLogger(__name__)


def _labels(metadata: list[dict]) -> list[int]:
    from flowgrpo.models.digits import check_digit

    out = []
    for i, m in enumerate(metadata):
        if "digit" not in m:
            raise ValueError(f"digit_judge needs metadata field 'digit' (an integer 0-9); sample {i} has {m!r}")
        out.append(check_digit(m["digit"]))
    return out


class DigitJudge(BaseReward):
    """Strict digit correctness by the independent judge (evaluation only)."""

    name = "digit_judge"
    eval_only = True

    def score(self, images, prompts, metadata):
        from flowgrpo.models.digits_eval import judge_correctness

        return judge_correctness(images.detach().float().cpu(), _labels(metadata)).float()

    def batch_metrics(self, images, prompts, metadata) -> dict[str, float]:
        from flowgrpo.models.digits_eval import intra_digit_diversity, real_diversity

        labels = _labels(metadata)
        if max(labels.count(d) for d in set(labels)) < 2:  # diversity needs two samples of some digit
            logger.warning("digit_judge: no digit has two samples; diversity not measured (raise eval_num_prompts)")
            diversity = float("nan")
        else:
            diversity = intra_digit_diversity(images.detach().float().cpu(), labels)
        return {
            "correctness": float(self.score(images, prompts, metadata).mean()),
            "diversity": diversity,
            "diversity_real": real_diversity(),
        }
