"""The run's health watch: the checks that stop a diverging run in one line and keep a resume off weights that
diverged, applied around the epochs :mod:`flowgrpo.training.loop` runs (the rules are
:mod:`flowgrpo.watch.divergence`'s).

Owns, for one run: the watch over each epoch's record (:class:`~flowgrpo.watch.divergence.DivergenceWatch`), the
weights' own figures (:class:`~flowgrpo.watch.divergence.WeightHealth`: measured after each update, probed on
resume), the images' finiteness (the checkpoint holding weights that made NaN or infinite images is marked unhealthy,
:func:`~flowgrpo.checkpoints.health.mark_unhealthy`), the evaluation figure ``logging.best_metric`` names and the
collapse guard that watches it (:class:`~flowgrpo.watch.divergence.CollapseWatch`), and the x0-norm drift warning
(:class:`~flowgrpo.watch.x0_norm.X0NormWatch`).
"""

from __future__ import annotations

import logging
import math

import torch

from flowgrpo.checkpoints.health import checkpoint_folders, is_healthy, mark_unhealthy
from flowgrpo.distributed import dist
from flowgrpo.rewards.compose import ComposedReward
from flowgrpo.strategies.settings import ConfigError
from flowgrpo.watch.divergence import (
    CollapseWatch,
    DivergenceWatch,
    TrainingDiverged,
    WeightHealth,
    run_history,
    stop_line,
)
from flowgrpo.watch.x0_norm import X0NormWatch

#: the loop's logger: the collapse and drift warnings keep the name they carried before the watch had its own module
logger = logging.getLogger("flowgrpo.training.loop")


class HealthWatch:
    """The health watch of one run, made once the run's start epoch is known (after a resume).

    Args:
        config: the validated :class:`~flowgrpo.config.Config` (``train``, ``logging``).
        adapter: the model adapter; params: the trained parameters (:class:`~flowgrpo.watch.divergence.WeightHealth`).
        prompts: the training prompt set (its first prompt is the fixed probe's).
        rewards, eval_rewards: the optimised and the evaluation-only rewards (what ``logging.best_metric`` may
            name).
        out: the run folder; main: whether this is the main process (it alone warns and marks checkpoints).
        epoch: the epoch (0-based) the run starts or resumes at; guidance_scale: the probe's.

    Raises:
        flowgrpo.strategies.settings.ConfigError: ``logging.best_metric`` names no evaluation figure of this run.
    """

    def __init__(self, config, *, adapter, params, prompts, rewards: ComposedReward,
                 eval_rewards: ComposedReward | None, out, main: bool, epoch: int, guidance_scale: float) -> None:
        self.cfg = config
        self.rewards = rewards
        self.eval_rewards = eval_rewards
        self.out = out
        self.main = main
        history = run_history(out, config.train.resume_from, epoch)
        self.divergence = DivergenceWatch(history)
        start = next((r["health/probe_rms_start"] for r in reversed(history) if "health/probe_rms_start" in r), None)
        self.weights = WeightHealth(adapter, params, prompt=prompts.prompts[0], metadata=prompts.metadata[0],
                                    guidance_scale=guidance_scale, seed=config.train.seed, start=start)
        self.best_metric = self._best_metric()
        self.collapse = CollapseWatch(self.best_metric, config.logging.collapse_fraction, history,
                                      keep_best=config.logging.keep_best)
        self.x0_norm = X0NormWatch(config.logging.x0_norm_window, config.logging.x0_norm_drift, history)

    def _best_metric(self) -> str | None:
        """``logging.best_metric`` resolved: ``auto`` is ``eval/<first optimised reward>/mean`` (None when every
        optimised reward reports whole-set figures instead)."""
        metric = self.cfg.logging.best_metric
        names = [n for n, r in self.rewards.rewards.items() if not hasattr(r, "batch_metrics")]
        if metric == "auto":
            return f"eval/{names[0]}/mean" if names else None
        every = [c for c in (self.rewards, self.eval_rewards) if c is not None]
        known = [f"eval/{n}/mean" for c in every for n, r in c.rewards.items() if not hasattr(r, "batch_metrics")]
        whole_set = any(hasattr(r, "batch_metrics") for c in every for r in c.rewards.values())
        if metric not in known and not (whole_set and metric.startswith("eval/")):
            raise ConfigError(f"logging.best_metric={metric!r} is no evaluation figure of this run; choose one of "
                              f"{known} (or auto)")
        return metric

    def check_images(self, bad: float, what: str, collective: bool, made_by: int, epoch: int) -> None:
        """Stop the run (:class:`~flowgrpo.watch.divergence.TrainingDiverged`, one line) when ``bad`` (a count of NaN or
        infinite image values) is not 0: the weights that made the images diverged. ``made_by``: the epoch
        (0-based) after whose update those weights are (-1: the base model's). The newest checkpoint, when it is
        that epoch's (written after the previous epoch, or the one this run resumed from), is marked unhealthy, so
        ``train.resume_from=auto`` skips it. ``collective``: every process calls it (a rollout; each counts its
        own images), so all stop together. ``epoch``: the epoch (0-based) the run is at."""
        if collective:
            bad = float(dist.all_reduce_sum(torch.tensor([bad], dtype=torch.float64))[0])
        if not bad:
            return
        root = self.out / "checkpoints"
        done = checkpoint_folders(root)
        marked = ""
        if done and int(done[-1].name[6:]) == made_by and is_healthy(done[-1]):
            marked = f"; checkpoint {done[-1]} holds these weights and is now marked unhealthy"
            if self.main:
                mark_unhealthy(root, done[-1], f"{what} made non-finite images at epoch {epoch + 1}")
            dist.barrier()
        raise TrainingDiverged(stop_line(epoch, self.cfg.train.num_epochs,
                                         f"{int(bad)} values of the {what} images are NaN or infinite{marked}", root))

    def check_resumed_weights(self, epoch: int) -> None:
        """A resumed run's weights pass the probe rule (:meth:`~flowgrpo.watch.divergence.WeightHealth.flag`, against
        the run's first start) before they are trained. A checkpoint without ``health.json`` (older versions) or
        edited by hand may hold weights that diverged past every check yet make finite images: each resume from it
        diverged again in its first epoch and named it intact. It is marked unhealthy (``latest`` pointed back at
        the newest healthy one) and the run stops in one line. ``epoch``: the epoch (0-based) the run resumes at."""
        start = self.weights.start
        if not self.cfg.train.resume_from or start is None:
            return
        rms = self.weights.probe()
        why = WeightHealth.flag({"health/probe_rms": rms, "health/probe_rms_start": start})
        if why is None and math.isfinite(rms):
            return
        why = why or f"health/probe_rms = {rms} (the resumed weights' velocity on the fixed probe is not finite)"
        root = self.out / "checkpoints"
        resumed = root / f"epoch_{epoch - 1}"
        marked = ""
        if resumed in checkpoint_folders(root) and is_healthy(resumed):
            marked = f"; checkpoint {resumed} holds these weights and is now marked unhealthy"
            if self.main:
                mark_unhealthy(root, resumed, f"its weights fail the health probe on resume: {why}")
            dist.barrier()
        raise TrainingDiverged(stop_line(epoch, self.cfg.train.num_epochs, f"before its update, {why}{marked}",
                                         root))

    def check_epoch(self, record: dict, epoch: int) -> None:
        """An epoch's record, before any save: stop a diverging run
        (:class:`~flowgrpo.watch.divergence.DivergenceWatch`,
        one line), then warn of a collapse and of the x0 norm's drift (main process)."""
        self.divergence.check(record, epoch, self.cfg.train.num_epochs, self.out / "checkpoints")
        self.warn_collapse(record, f"epoch {epoch + 1}")
        drift = self.x0_norm.observe(record)
        if drift and self.main:
            logger.warning("%s", drift)

    def check_best_metric(self, before: dict) -> None:
        """Check ``logging.best_metric`` against what the "before" evaluation reported: a whole-set reward's
        figures are known only once evaluated, so ``eval/<typo>`` passes :meth:`_best_metric` where one is used,
        and would leave the collapse guard and ``logging.keep_best`` watching nothing. A figure named by hand that
        was not reported is refused (``ValueError``, one line naming what was); ``auto`` becomes the first
        reported ``eval/<reward>/mean`` of the optimised rewards, then of the evaluation-only ones (a group-wise
        reward reports none on an evaluation's one sample per prompt), or nothing to watch."""
        metric = self.best_metric
        if metric is None or not before or metric in before:
            return
        if self.cfg.logging.best_metric == "auto":
            names = [n for c in (self.rewards, self.eval_rewards) if c is not None for n in c.rewards]
            self.best_metric = next((f"eval/{n}/mean" for n in names if f"eval/{n}/mean" in before), None)
            self.collapse.metric = self.best_metric
            return
        known = sorted(k for k in before if isinstance(before[k], int | float))
        raise ConfigError(f"logging.best_metric={metric!r} is no evaluation figure of this run: its evaluation "
                          f"reports {known}; choose one of them (or auto) and start the run again with "
                          "train.resume_from=auto logging.best_metric=<figure>")

    def warn_collapse(self, figures: dict, where: str) -> None:
        """The collapse guard's warning (:class:`~flowgrpo.watch.divergence.CollapseWatch`), from the main process."""
        warning = self.collapse.observe(figures, where)
        if warning and self.main:
            logger.warning("%s", warning)
