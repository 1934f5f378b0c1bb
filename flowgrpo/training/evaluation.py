"""Evaluation: ODE images of a fixed held-out prompt set, scored by every reward and evaluation reward.

Owns the evaluation set (:meth:`Evaluation.eval_set`), its seeds (never a training seed), the scoring of the images
(per-image means and whole-set figures) and the ``eval (<tag>)`` console line. The loop
(:mod:`flowgrpo.training.loop`) says when to evaluate (before training, every ``logging.eval_every`` epochs, after);
every process evaluates together, each data rank sampling its share of the set (:meth:`Evaluation.evaluate`);
whether the images are finite is the health watch's (:mod:`flowgrpo.watch.run_health`), called back by
:meth:`Evaluation.evaluate` before any reward scores them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from flowgrpo.distributed import dist
from flowgrpo.rewards.base import is_group_wise
from flowgrpo.rewards.compose import ComposedReward, RewardError, score_components_named
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

    def splits(self) -> bool:
        """Whether the evaluation set is split over the data ranks: always, except with a feature cache
        (``eval_sampling.cache``), whose skip decisions depend on the batch: the images are reproduced only by the
        same batching (``flowgrpo sample --batch-size``), and under FSDP2 ranks with other batches would skip other
        blocks and stall each other's collectives; then every data rank makes the whole set, as one process does."""
        cache = self.cfg.eval_sampling.cache
        return cache is None or cache.name == "none"

    @torch.no_grad()
    def evaluate(self, tag: str, check: Callable[[float], None]) -> tuple[dict[str, float], torch.Tensor, list[str]]:
        """ODE images of the fixed evaluation set (:meth:`eval_set`; image i seeded
        ``derive_seed(train.seed, "eval", i)``, never a training seed), scored by every reward and eval reward.
        Every process calls it.

        Split over the data ranks (:meth:`splits`): data rank d makes images ``d·k … d·k + k − 1`` of the N, k =
        ceil(N / data ranks) (:func:`~flowgrpo.distributed.dist.padded_share`; the last shares are padded with repeats,
        so
        every rank makes the same transformer calls, and the padding is dropped), in batches of
        ``train.rollout_batch_size``. An image depends only on its prompt and seed, so the images equal one
        process's up to float rounding of another batch layout. In a context group only the first rank decodes
        and scores (:func:`~flowgrpo.distributed.dist.context_leader`). The images are gathered onto every process; each
        rank's per-image scores are gathered for the means; whole-set figures (``batch_metrics``) are computed by
        the main process from the gathered images and sent to the others, so every process returns the same.

        Returns (metrics ``eval/<name>/mean`` and batch metrics, the images (N, 3, H, W) in [0, 1], captions).
        A reward with ``batch_metrics`` reports its whole-set figures under their own names (``eval/correctness``,
        a per-group ``eval/<group>/<figure>`` …) instead of its per-image mean; the console line leaves the
        per-group figures out. ``check``: called with the count of NaN or infinite values of the whole set's
        images (the same on every process) before any reward scores them (the health watch's
        :meth:`~flowgrpo.watch.run_health.HealthWatch.check_images`, which stops the run when it is not 0).

        Raises:
            flowgrpo.rewards.compose.RewardError: a reward failed, on this process or (split) on another one.
        """
        ps, meta = self.eval_set()
        split = self.splits()
        idx, real = dist.padded_share(len(ps)) if split else (list(range(len(ps))), len(ps))
        lead = dist.context_leader() or not split
        mine_ps, mine_meta = [ps[i] for i in idx], [meta[i] for i in idx]
        self.optim.eval_mode()
        with self.optim.eval_weights():
            local = generate_images(
                self.adapter, mine_ps, [derive_seed(self.cfg.train.seed, "eval", i) for i in idx],
                num_steps=self.cfg.eval_sampling.num_steps, guidance_scale=self.cfg.eval_sampling.guidance_scale,
                batch_size=self.cfg.train.rollout_batch_size, progress=self.cfg.logging.progress and self.main,
                metadata=mine_meta, cache=self.cfg.eval_sampling.cache, decode=lead,
            )
        images = _whole_set(local, lead, len(ps)) if split else local
        check(float((~torch.isfinite(images)).sum()))  # before any reward scores them
        mine = (local[:real], mine_ps[:real], mine_meta[:real]) if lead else None
        out: dict[str, float] = {}
        grouped: set[str] = set()
        for composed in (self.rewards, self.eval_rewards):
            if composed is None:
                continue
            out.update(_means(composed, mine, split, len(idx), len(ps)))
            for k, v in _whole_set_figures(composed, images, ps, meta, split).items():
                out[f"eval/{k}"] = v
                if "/" in k:  # a per-group figure <group>/<figure>
                    grouped.add(f"eval/{k}")
        captions = [p[:40] for p in ps]
        if self.main:  # every process returns the same figures; one reports them
            logger.info("eval (%s): %s", tag, ", ".join(f"{k}={v:.4f}" for k, v in out.items() if k not in grouped))
        return out, images, captions


def _whole_set(local: torch.Tensor, lead: bool, n: int) -> torch.Tensor:
    """The N images of the set on every process from each data rank's (k, 3, H, W) share (padded; a context
    group's other ranks hold latents, replaced by zeros of the images' shape, which the gather skips)."""
    if dist.context_degree() > 1:
        shape = dist.broadcast_object(tuple(local.shape) if dist.rank() == 0 else None)  # rank 0 leads a group
        if not lead:
            local = torch.zeros(shape)
    return dist.gather_cat(local.contiguous())[:n]


def _means(composed: ComposedReward, mine, split: bool, k: int, n: int) -> dict[str, float]:
    """``eval/<name>/mean`` of each point-wise reward without ``batch_metrics`` over the N images (NaN scores
    left out). ``mine``: (images, prompts, metadata) of this process's real images, or None where it scores
    nothing (a context group's other ranks); split: each process's scores, NaN-padded to its share's ``k``, are
    gathered and cut to the first ``n``. A reward error on any process raises on all (:func:`_raise_if_any`)."""
    names = [name for name, r in composed.rewards.items() if not is_group_wise(r) and not hasattr(r, "batch_metrics")]
    if not names:
        return {}
    part = ComposedReward({x: composed.rewards[x] for x in names}, {x: composed.weights[x] for x in names})
    scores, err = {}, None
    if mine is not None and len(mine[1]):
        try:
            scores = score_components_named(part, *mine)
        except RewardError as e:
            if not split:
                raise
            err = e
    if split:
        _raise_if_any(err)
        nan = torch.full((k,), float("nan"))
        scores = {x: dist.gather_cat(torch.cat([scores[x], nan])[:k] if x in scores else nan)[:n] for x in names}
    out = {}
    for name in names:
        valid = scores[name][~torch.isnan(scores[name])]
        out[f"eval/{name}/mean"] = float(valid.mean()) if valid.numel() else float("nan")
    return out


def _raise_if_any(err: RewardError | None) -> None:
    """Raise on every process when a reward failed on one (else the others would wait in the next gather): the
    failing process its own error, the others one naming it as elsewhere."""
    failed = float(dist.all_reduce_max(torch.tensor([0.0 if err is None else 1.0]))[0])
    if err is not None:
        raise err
    if failed:
        raise RewardError("evaluation", "a reward failed on another process while scoring its share of the "
                                        "evaluation images (that process's error names the reward)")


def _whole_set_figures(composed: ComposedReward, images: torch.Tensor, ps: list[str], meta: list[dict],
                       split: bool) -> dict[str, float]:
    """The ``batch_metrics`` figures of every reward of ``composed`` that has them, over the whole set: computed
    by the main process and sent to the others when split, else by each process."""
    rewards = [r for r in composed.rewards.values() if hasattr(r, "batch_metrics")]
    if not rewards:
        return {}
    figures, err = None, None
    if not split or dist.rank() == 0:
        try:
            figures = {k: float(v) for r in rewards for k, v in r.batch_metrics(images, ps, meta).items()}
        except Exception as e:
            if not split:
                raise
            err = e
    if not split:
        return figures
    sent = dist.broadcast_object(figures if err is None else f"{type(err).__name__}: {err}")
    if err is not None:
        raise err
    if isinstance(sent, str):
        raise RuntimeError(f"the main process failed to compute the whole-set evaluation figures: {sent}")
    return sent
