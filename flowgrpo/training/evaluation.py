"""Evaluation: ODE images of a fixed held-out prompt set, scored by every reward and evaluation reward.

Owns the evaluation set (:meth:`Evaluation.eval_set`), its seeds (never a training seed), the scoring of the images
(per-image means and whole-set figures) and the ``eval (<tag>)`` console line. The loop
(:mod:`flowgrpo.training.loop`) says when to evaluate (before training, every ``logging.eval_every`` epochs, after);
whether the images are finite is the health watch's (:mod:`flowgrpo.training.health_watch`), called back by
:meth:`Evaluation.evaluate` before any reward scores them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from flowgrpo.rewards.background import score_components_named
from flowgrpo.rewards.compose import ComposedReward
from flowgrpo.rng import derive_seed
from flowgrpo.sampling.rollout import generate_images

#: the loop's logger: the ``eval (<tag>)`` line keeps the name it carried before evaluation had its own module
logger = logging.getLogger("flowgrpo.training.loop")


class Evaluation:
    """The held-out evaluation of one run.

    Args:
        config: the validated :class:`~flowgrpo.config.Config` (``data.eval_num_prompts``, ``eval_sampling``,
            ``train.seed`` and ``train.rollout_batch_size``, ``logging.progress``).
        adapter: the model adapter; optim: the run's :class:`~flowgrpo.training.optim.Optimization` (its
            evaluation weights: the EMA's when there is one).
        rewards: the optimised rewards; eval_rewards: rewards scored only at evaluation (may be None).
        prompts: the training prompt set; eval_prompts: held-out prompts (None: the training prompts stand in).
        main: whether this is the main process (it alone logs the line).
    """

    def __init__(self, config, *, adapter, optim, rewards: ComposedReward, eval_rewards: ComposedReward | None,
                 prompts, eval_prompts, main: bool) -> None:
        self.cfg = config
        self.adapter = adapter
        self.optim = optim
        self.rewards = rewards
        self.eval_rewards = eval_rewards
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.main = main

    def eval_set(self) -> tuple[list[str], list[dict]]:
        """The evaluation prompts and metadata: ``data.eval_num_prompts`` held-out prompts, cycled; without
        evaluation prompts, the training prompts (cycled, at most one epoch's B = P·G of them), which the seeds
        below still make held-out images."""
        if self.eval_prompts is not None:
            source, n = self.eval_prompts, self.cfg.data.eval_num_prompts
        else:
            source, n = self.prompts, min(self.cfg.data.eval_num_prompts, self.cfg.batch_size)
        idx = [i % len(source) for i in range(n)]
        return [source.prompts[i] for i in idx], [source.metadata[i] for i in idx]

    @torch.no_grad()
    def evaluate(self, tag: str, check: Callable[[float], None]) -> tuple[dict[str, float], torch.Tensor, list[str]]:
        """ODE images of the fixed evaluation set (:meth:`eval_set`; image i seeded
        ``derive_seed(train.seed, "eval", i)``, never a training seed), scored by every reward and eval reward.

        Returns (metrics ``eval/<name>/mean`` and batch metrics, the images (N, 3, H, W) in [0, 1], captions).
        A reward with ``batch_metrics`` reports its whole-set figures under their own names (``eval/correctness``,
        a per-group ``eval/<group>/<figure>`` …) instead of its per-image mean; the console line leaves the
        per-group figures out. ``check``: called with the count of NaN or infinite image values before any reward
        scores the images (the health watch's :meth:`~flowgrpo.training.health_watch.HealthWatch.check_images`,
        which stops the run when it is not 0)."""
        ps, meta = self.eval_set()
        seeds = [derive_seed(self.cfg.train.seed, "eval", i) for i in range(len(ps))]
        self.optim.eval_mode()
        with self.optim.eval_weights():
            images = generate_images(
                self.adapter, ps, seeds, num_steps=self.cfg.eval_sampling.num_steps,
                guidance_scale=self.cfg.eval_sampling.guidance_scale, batch_size=self.cfg.train.rollout_batch_size,
                progress=self.cfg.logging.progress and self.main, metadata=meta, cache=self.cfg.eval_sampling.cache,
            )
        check(float((~torch.isfinite(images)).sum()))  # before any reward scores them
        out: dict[str, float] = {}
        grouped: set[str] = set()
        for composed in (self.rewards, self.eval_rewards):
            if composed is None:
                continue
            for name, scores in score_components_named(composed, images, ps, meta).items():
                if hasattr(composed.rewards.get(name), "batch_metrics"):
                    continue
                valid = scores[~torch.isnan(scores)]
                out[f"eval/{name}/mean"] = float(valid.mean()) if valid.numel() else float("nan")
            for reward in composed.rewards.values():
                if hasattr(reward, "batch_metrics"):  # whole-set figures (correctness, diversity) under their own name
                    for k, v in reward.batch_metrics(images, ps, meta).items():
                        out[f"eval/{k}"] = float(v)
                        if "/" in k:  # a per-group figure <group>/<figure>
                            grouped.add(f"eval/{k}")
        captions = [p[:40] for p in ps]
        if self.main:  # every process evaluates the same images; one reports them
            logger.info("eval (%s): %s", tag, ", ".join(f"{k}={v:.4f}" for k, v in out.items() if k not in grouped))
        return out, images, captions
