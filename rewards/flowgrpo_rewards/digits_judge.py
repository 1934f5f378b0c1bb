"""``digit_judge``: the digits task's independent judge, for evaluation only.

Per image: 1.0 when the judge (an RBF SVM on a split of the real digits disjoint from the reward classifier's,
see :mod:`flowgrpo.tasks.digits.scoring`) reads the digit named in ``metadata["digit"]``, else 0.0 — the task's
strict correctness. Per batch (:meth:`DigitJudge.batch_metrics`): ``correctness`` (the mean), ``diversity``
(intra-digit diversity of the images, 0–16 ink units at 8×8) and ``diversity_real`` (the same measure on the
real digits); per digit d, ``digit_<d>/correctness``, ``digit_<d>/diversity`` and ``digit_<d>/diversity_real``;
``digit_images_min``, the fewest images of any digit (0 when one is missing); and ``diversity_min_ratio``, the
minimum over digits of the images' diversity divided by the same digit's real diversity (near 0: some digit
collapsed to one prototype, which the average hides). ``eval_only``: the trainer refuses to optimise it, so images
that fool the reward cannot count as correct. At the end of a run it hands the report its per-digit table
(:meth:`DigitJudge.report_table`) and the summary its time to quality
(:meth:`DigitJudge.summary_figures`).
"""

from __future__ import annotations

import logging

import torch

from flowgrpo.records import GroupTable
from flowgrpo.rewards.base import BaseReward
from flowgrpo.tasks.digits.report import digit_table, quality_figures
from flowgrpo.tasks.digits.scoring import (
    judge_correctness,
    min_diversity_ratio,
    per_digit_diversity,
    real_diversity,
    real_diversity_per_digit,
)
from flowgrpo_rewards.digits import labels_from_metadata

logger = logging.getLogger(__name__)


def _labels(metadata: list[dict]) -> list[int]:
    return labels_from_metadata(metadata, "digit_judge").tolist()


def _warn_left_out(labels: list[int], per_digit: dict[int, float], real: dict[int, float]) -> None:
    """Log a warning naming the digits (of 0-9, the real set's) that have fewer than two images, so are left out
    of the mean diversity and of ``diversity_min_ratio``."""
    one = sorted(d for d in set(labels) if d not in per_digit)
    none = sorted(set(real) - set(labels))
    if not one and not none:
        return
    counts = ", ".join(part for part in (f"one image: {one}" if one else "", f"no image: {none}" if none else "")
                       if part)
    logger.warning(
        "digit_judge: diversity and diversity_min_ratio leave out digits %s (%s), which need two images each; "
        "use a data.eval_num_prompts that is a multiple of 10 with at least 2 per digit (e.g. 20)",
        sorted(one + none), counts)


class DigitJudge(BaseReward):
    """Strict digit correctness by the independent judge (evaluation only)."""

    name = "digit_judge"
    eval_only = True

    def check_prompts(self, prompts) -> None:
        """Every prompt of ``prompts`` (a PromptSet) names its digit (``ValueError`` otherwise)."""
        _labels(prompts.metadata)

    def score(self, images, prompts, metadata):
        return judge_correctness(images.detach().float().cpu(), _labels(metadata)).float()

    def batch_metrics(self, images, prompts, metadata) -> dict[str, float]:
        """Whole-set figures of ``images`` (B, 3, H, H) in [0, 1] (see the module docstring); diversity figures
        need two samples of a digit and are NaN (with a warning) when no digit has them; the digits with fewer
        are left out of ``diversity`` and ``diversity_min_ratio``, with a warning naming them
        (:func:`_warn_left_out`). Raises ``ValueError`` for a metadata entry without its digit."""
        labels = _labels(metadata)
        ok = self.score(images, prompts, metadata)  # (B,) float32 0/1
        per_digit = per_digit_diversity(images.detach().float().cpu(), labels)
        real = real_diversity_per_digit()
        if not per_digit:
            logger.warning("digit_judge: no digit has two samples; diversity not measured (raise eval_num_prompts)")
        else:
            _warn_left_out(labels, per_digit, real)
        out = {
            "correctness": float(ok.mean()),
            "diversity": sum(per_digit.values()) / len(per_digit) if per_digit else float("nan"),
            "diversity_real": real_diversity(),
            "diversity_min_ratio": min_diversity_ratio(per_digit, real) if per_digit else float("nan"),
            # the fewest images of any digit 0-9: how precise diversity_min_ratio is (the time to quality's gate)
            "digit_images_min": float(min(labels.count(d) for d in real)),
        }
        lab = torch.tensor(labels)
        for d in sorted(set(labels)):
            out[f"digit_{d}/correctness"] = float(ok[lab == d].mean())
            out[f"digit_{d}/diversity"] = per_digit.get(d, float("nan"))
            out[f"digit_{d}/diversity_real"] = real[d]
        return out

    def report_table(self, summary: dict) -> GroupTable | None:
        """The per-digit table of the run's ``summary`` (:func:`flowgrpo.tasks.digits.report.digit_table`)."""
        return digit_table(summary)

    def summary_figures(self, summary: dict, records: list[dict]) -> dict:
        """The run's time to quality (:func:`flowgrpo.tasks.digits.report.quality_figures`) from its summary and
        its ``metrics.jsonl`` ``records``."""
        return quality_figures(records, summary)
