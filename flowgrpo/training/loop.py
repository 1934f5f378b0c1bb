"""The epoch loop: one trainer for every model adapter, objective, chunker, SDE kind and reward.

An epoch is a flat list of timed phases (as verl's driver loop): ``rollout`` → ``reward`` → ``filter`` →
``advantage`` → ``plan`` → ``recompute`` (when the plan asks for it) → ``update``, with ``eval`` and ``save``
around it. What each phase does beyond the rewards is the objective's (:mod:`flowgrpo.algo.objectives`: the
order and what each phase receives and returns are in its ``base`` module); the update phase is the one update
loop of every objective (:func:`~flowgrpo.training.update.run_update`), and every gradient is applied by
:class:`~flowgrpo.training.optim.Optimization`; the run folder's life is :mod:`flowgrpo.training.run_folder`, the
end-of-run report :mod:`flowgrpo.training.report`.

Owns the epoch's phases and their order, the per-epoch records (metrics, plots, rollout statistics, the
low-signal warning) and the saves. The held-out evaluation is :mod:`flowgrpo.training.evaluation`, the health
watch (divergence, non-finite images, the resumed weights' probe, the best metric's collapse guard, the x0-norm
drift) :mod:`flowgrpo.watch.run_health`: the loop says when each runs.
"""

from __future__ import annotations

import json
import logging
import math
import time

import torch

from flowgrpo.algo.advantages import solved_group_frac
from flowgrpo.checkpoints.health import health_record
from flowgrpo.checkpoints.state_dicts import save_final_weights
from flowgrpo.compile import CompileWatch
from flowgrpo.data.prompts import GroupSampler, PromptSet, group_keys
from flowgrpo.distributed import dist
from flowgrpo.models import DTYPES
from flowgrpo.plots import reward_curve, sample_grid
from flowgrpo.records import Advantages, Rewards
from flowgrpo.rewards.background import AsyncRewardScorer, ScoreHandle, score_components_named
from flowgrpo.rewards.compose import ComposedReward, compose_rewards
from flowgrpo.rewards.remote import server_metrics
from flowgrpo.sampling.rollout import RolloutRequest
from flowgrpo.training import report
from flowgrpo.training.evaluation import Evaluation
from flowgrpo.training.optim import Optimization, saved_line
from flowgrpo.training.run_folder import RunFolder
from flowgrpo.training.update import run_update
from flowgrpo.watch.divergence import WeightHealth, check_weights
from flowgrpo.watch.run_health import HealthWatch
from flowgrpo.watch.x0_norm import x0_norm_metrics
from flowgrpo.writing.metrics import MetricsSink, epoch_line, read_metrics
from flowgrpo.writing.outputs import save_tensors, write_text_file

logger = logging.getLogger(__name__)


class Trainer:
    """The training loop of any objective.

    Args:
        config: the validated :class:`~flowgrpo.config.Config`.
        adapter: a model adapter whose transformer is already set up for training (LoRA or full,
            :func:`~flowgrpo.models.lora.setup_trainable`); the trained parameters are those of the prepared module
            (:class:`~flowgrpo.training.optim.Optimization`).
        rewards: the optimised rewards; eval_rewards: rewards scored only at evaluation (may be None).
        objective: the objective strategy (:func:`~flowgrpo.algo.objectives.build_objective` of ``config``).
        prompts: the training prompt set; eval_prompts: held-out prompts (None: no evaluation).
        accelerator: an ``accelerate.Accelerator``.
        reward_origins: provenance of every reward plugin, written to ``rewards.json``.
    """

    def __init__(self, config, *, adapter, rewards: ComposedReward, eval_rewards: ComposedReward | None,
                 objective, prompts: PromptSet, eval_prompts: PromptSet | None, accelerator,
                 reward_origins: list | None = None) -> None:
        self.cfg = config
        self.adapter = adapter
        self.rewards = rewards
        self.eval_rewards = eval_rewards
        self.objective = objective
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.run = RunFolder(config)
        self.out = self.run.out
        self.main = accelerator.is_main_process
        self.optim = Optimization(config, adapter=adapter, accelerator=accelerator)
        objective.prepare(self.optim)  # what the objective keeps of the prepared weights (an old copy)
        attach = getattr(objective, "attach", None)  # optional: an update that needs the model and the rewards
        if attach is not None:  # (ReFL / DRaFT's differentiable rewards, a distillation teacher)
            attach(adapter, rewards)
        self.compile_watch = (CompileWatch(config.model.compile.dynamic) if config.model.compile.name != "none"
                              else None)  # compile/… figures of a compiled transformer (flowgrpo.compile)
        self.sampler = GroupSampler(len(prompts), config.train.prompts_per_epoch, config.train.seed)
        self.epoch = 0  # 0-based: the epoch training (or next to train)
        self.stage = "before"  # "before" (set-up, the evaluation before training), "epochs", "final" (the final
        # evaluation and save): what an interruption report names
        self.settings = config.sampling
        self.metrics = MetricsSink(self.out / "metrics.jsonl", accelerator, self.main)
        self.reward_origins = reward_origins or []
        self.scorer = AsyncRewardScorer(rewards)
        self.tables: list = []  # the rewards' per-group tables of the final summary (report.report_tables)
        self.finished_before = False  # the run had finished all its epochs before this command: nothing written
        self._low_signal_warned = False
        # whether the objective trains on the group advantages (a plugin objective that does not say: it does)
        self._on_advantages = getattr(objective, "trains_on_advantages", True)
        self.forward_count = [0, 0]  # transformer calls and rows, for the rollout/update cost metrics
        self.rollouts = None  # None: the rollout runs here; else the engine that samples it (flowgrpo.runtime)
        adapter.transformer.register_forward_pre_hook(self._count_forward, with_kwargs=True)
        if config.train.resume_from:
            self.epoch = self.optim.resume(config.train.resume_from, sampler=self.sampler, objective=objective)
        self.health = HealthWatch(config, adapter=adapter, params=self.optim.params, prompts=prompts, rewards=rewards,
                                  eval_rewards=eval_rewards, out=self.out, main=self.main, epoch=self.epoch,
                                  guidance_scale=self.settings.guidance_scale)
        self._record: dict = {}  # the last epoch's record (the final checkpoint's health record)
        self.evaluation = Evaluation(config, adapter=adapter, optim=self.optim, rewards=rewards,
                                     eval_rewards=eval_rewards, prompts=prompts, eval_prompts=eval_prompts,
                                     main=self.main)

    def _count_forward(self, module, args, kwargs) -> None:
        x = kwargs.get("hidden_states", kwargs.get("x", args[0] if args else None))
        self.forward_count[0] += 1
        self.forward_count[1] += 0 if x is None else len(x)  # a batch tensor, or a list of samples (Z-Image)

    def save_checkpoint(self, epoch: int, record: dict | None = None) -> None:
        """Every process takes part (under FSDP2 each writes its own shards, :mod:`flowgrpo.checkpoints.save_load`),
        only from finite weights (:func:`~flowgrpo.watch.divergence.check_weights`) that ``record`` (the epoch's
        figures, already passed by :class:`~flowgrpo.watch.divergence.DivergenceWatch`) showed healthy; its ``health/*``
        figures and evaluation figure go into the checkpoint's ``health.json``."""
        check_weights(self.optim.named_weights(), epoch, self.cfg.train.num_epochs, self.out / "checkpoints")
        best = self.health.best_metric if self.cfg.logging.keep_best else None
        self.optim.save(self.out / "checkpoints", epoch, sampler=self.sampler,
                        keep=self.cfg.logging.checkpoints_total_limit, objective=self.objective,
                        health=health_record(record or {}, best))
        logger.info("%s", saved_line(epoch, self.cfg.train.num_epochs))  # epoch_N counts from 0, the lines from 1

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train for ``train.num_epochs`` epochs; returns the summary also written to ``summary.json``.

        Logs one line per epoch (:func:`~flowgrpo.writing.metrics.epoch_line`: progress, elapsed time and ETA, reward,
        trained fraction, the off-policy updates' clip fraction and KL). A resumed run that is already finished
        returns the run's existing summary (or ``{}``) untouched."""
        cfg = self.cfg
        if self.run.finished(self.epoch):
            return self._already_finished()
        if self.main:
            self.run.claim(self.epoch)
            self.run.write_config(self.epoch)
            write_text_file(self.out / "rewards.json", json.dumps([o.__dict__ for o in self.reward_origins], indent=1))
        t0 = time.perf_counter()  # the evaluations and the final save are timed here, outside the epochs' records
        before, img_before, captions = self.run.before(self.evaluate, self.main)
        self.health.check_best_metric(before)
        self.health.check_resumed_weights(self.epoch)
        self.health.collapse.observe(before, "before training")
        eval_seconds = time.perf_counter() - t0
        last, first = cfg.train.num_epochs - 1, self.epoch
        start = time.perf_counter()
        self.stage = "epochs"
        for epoch in range(self.epoch, cfg.train.num_epochs):
            self.epoch = epoch
            every = cfg.logging.eval_every
            record = self.train_epoch(epoch, evaluate=bool(every) and (epoch + 1) % every == 0 and epoch < last)
            self.health.check_epoch(record, epoch)  # before any save
            self._record = record
            if cfg.logging.save_every and (epoch + 1) % cfg.logging.save_every == 0 and epoch < last:
                self.save_checkpoint(epoch, record)
            if self.main:
                elapsed = time.perf_counter() - start
                eta = elapsed / (epoch + 1 - first) * (last - epoch)
                logger.info("%s", epoch_line(record, epoch, cfg.train.num_epochs, elapsed, eta,
                                             advantages=self._on_advantages))
        self.stage = "final"  # the final evaluation and save (what an interruption report names)
        summary = self._finish(before, img_before, captions, eval_seconds)
        self.scorer.close()
        return summary

    def _already_finished(self) -> dict:
        """The existing summary of a finished run (its ``outputs`` those of this output_dir; a copied run folder's
        summary names the folder it was copied from), or ``{}``."""
        self.scorer.close()
        self.finished_before = True
        summary = self.out / "summary.json"
        if not summary.is_file():
            return {}
        summary = {**json.loads(summary.read_text()), "outputs": report.outputs(self.out, self.run.weights_dir)}
        self.tables = report.report_tables((self.rewards, self.eval_rewards), summary)
        return summary

    def _finish(self, before, img_before, captions, eval_seconds: float) -> dict:
        """The final evaluation, checkpoint, weights, summary and model card."""
        t0 = time.perf_counter()
        after, img_after, captions_after = self.evaluate("after")
        self.health.warn_collapse(after, "the final evaluation")
        eval_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.save_checkpoint(self.cfg.train.num_epochs - 1, {**self._record, **after})
        with self.optim.eval_weights():
            self.save_weights()
        save_seconds = time.perf_counter() - t0
        summary, self.tables = report.write_summary(
            self.run, before, after, img_before, img_after, captions or captions_after,
            extra_seconds={"eval": eval_seconds, "save": save_seconds}, main=self.main,
            composed_rewards=(self.rewards, self.eval_rewards), eval_metadata=self.evaluation.eval_set()[1])
        if self.main:
            report.write_card(self.run, summary, adapter=self.adapter, prompt=self.prompts.prompts[0],
                              tables=self.tables)
        return summary

    def train_epoch(self, epoch: int, evaluate: bool = False) -> dict:
        """One epoch's phases; with ``evaluate`` the held-out evaluation joins the epoch's record."""
        m, objective = self.metrics, self.objective
        self.optim.begin_epoch(epoch)
        traj, handles = self._timed_rollout()
        with m.timed("reward"):  # only the wait for scores not finished during the rollout
            rewards, group_ids = self.reward_phase(traj, handles)
        with m.timed("filter"):
            kept = objective.filter_groups(rewards, group_ids)
        with m.timed("advantage"):
            adv = objective.advantages(rewards, group_ids, kept.keep)
        with m.timed("plan"):
            work = objective.plan(traj, adv, kept.keep, epoch)
        m.log(kept.metrics)
        if work.recompute:
            with m.timed("recompute"):
                work = objective.recompute(self.adapter, work)
        self.health.weights.begin()  # (in the first epoch, a probe call: not the update's)
        calls0, rows0 = self.forward_count
        with m.timed("update"):
            upd = run_update(objective, self.adapter, self.optim, work, inner_epochs=self.cfg.train.inner_epochs,
                             progress=self.cfg.logging.progress and self.main)
        counted = list(self.forward_count)
        with m.timed("health"):
            health = self.health.weights.measure()
        self.forward_count[:] = counted  # the probe's transformer calls are not the update's
        m.log(health)
        if WeightHealth.flag(health) or not all(math.isfinite(v) for v in health.values()):
            evaluate = False  # the record stops the run (DivergenceWatch) before these weights are evaluated
        m.log({"update/transformer_calls": self.forward_count[0] - calls0,
               "update/transformer_rows": self.forward_count[1] - rows0})
        if self.cfg.logging.save_rollout_stats:
            self.save_rollout_stats(epoch, traj, rewards, group_ids, adv)
        m.log(_reward_metrics(rewards))
        m.log(server_metrics(self.rewards))  # reward/<name>/server/<i>/…: a remote reward's servers
        self._warn_low_signal(epoch, adv, rewards.total, group_ids)
        m.log({"adv/zero_spread_frac": adv.zero_spread_frac, "adv/nan_frac": adv.nan_frac,
               "adv/learning_frac": adv.learning_frac,
               "adv/kept_frac": float(adv.train_mask.double().mean()), "adv/abs_mean": float(adv.values.abs().mean()),
               **work.metrics})
        m.log(upd)
        if self.rollouts is not None:  # the rollout engine's off-policy figures (flowgrpo.runtime)
            m.log(self.rollouts.after_update(upd, work))
        if evaluate:
            with m.timed("eval"):
                m.log(self.evaluate(f"epoch {epoch + 1}")[0])  # 1-based, as the epoch lines
        every = self.cfg.logging.plot_every
        if self.main and (epoch == self.cfg.train.num_epochs - 1 or (every and (epoch + 1) % every == 0)):
            with self.metrics.timed("plots"):
                self._plot(epoch, traj, rewards)
        if self.compile_watch is not None:
            m.log(self.compile_watch.epoch_metrics(epoch))
        return m.commit(epoch)

    # ------------------------------------------------------------------ rollout and rewards
    def _timed_rollout(self):
        """The ``rollout`` phase and its cost metrics (transformer calls and rows, prompts cut at a text
        encoder's limit over all processes)."""
        m = self.metrics
        calls0, rows0 = self.forward_count
        truncation = getattr(self.adapter, "truncation", None)
        cut0 = truncation.total if truncation is not None else 0
        self._nonfinite = 0
        with m.timed("rollout"):
            traj, handles = self.rollout_phase()
        if not self._nonfinite and sum(h.batch_size for h in handles) != traj.batch_size:  # not scored as made
            self._nonfinite = int((~torch.isfinite(traj.images)).sum())
        self.health.check_images(float(self._nonfinite), "rollout's", collective=True, made_by=self.epoch - 1,
                                 epoch=self.epoch)
        m.log({"rollout/transformer_calls": self.forward_count[0] - calls0,
               "rollout/transformer_rows": self.forward_count[1] - rows0, "rollout/trajectories": traj.batch_size})
        m.log(x0_norm_metrics(traj))  # rollout/x0_norm and its max (flowgrpo.watch.x0_norm)
        if truncation is not None:
            cut = dist.all_reduce_sum(torch.tensor([float(truncation.total - cut0)], dtype=torch.float64))
            m.log({"rollout/truncated_prompts": float(cut[0])})
        return traj, handles

    def rollout_phase(self):
        """Sample this process's share of the epoch's P×G trajectories (the objective's rollout, or the rollout
        source's: :attr:`rollouts`); each decoded micro-batch is handed to the background reward scorer at once.
        Returns the rollout record and the score handles in sample order."""
        handles = []
        lead = dist.context_leader()  # a context group's first rank scores the group's samples (reward_phase)

        def score_in_background(images: torch.Tensor, batch_prompts: list[str], batch_meta: list[dict]) -> None:
            bad = int((~torch.isfinite(images)).sum())
            if bad:  # not scored: the run stops after the rollout (check_images), every process together
                self._nonfinite += bad
            elif lead:
                handles.append(self.scorer.submit(images, batch_prompts, batch_meta))

        def scored_elsewhere(batch_size: int, bad: int, components) -> None:  # a Ray reward worker's scores
            if bad:
                self._nonfinite += bad
            elif lead:
                handles.append(ScoreHandle.scored(components, batch_size))

        prompt_ids = self.sampler.next_prompt_ids()
        n = len(prompt_ids) * self.cfg.train.group_size
        request = self.rollout_request(self.epoch, prompt_ids, dist.local_slice(n), score_in_background)
        if self.rollouts is not None:  # another engine samples it (flowgrpo.runtime)
            return self.rollouts.rollout(self, prompt_ids, request, scored_elsewhere), handles
        return self.objective.rollout(self.adapter, request), handles

    def rollout_request(self, epoch: int, prompt_ids: torch.Tensor, local: slice, on_images=None) -> RolloutRequest:
        """The :class:`RolloutRequest` of epoch ``epoch`` (0-based) for the samples ``local`` of the epoch's
        global P×G layout (groups adjacent) drawn from the (P,) ``prompt_ids``; ``on_images`` as the request's."""
        t = self.cfg.train
        # a prompt drawn twice in one epoch (only when P > the set's size) is two groups with their own noise
        keys = group_keys(prompt_ids, len(self.prompts))
        all_keys = keys.repeat_interleave(t.group_size)  # (B,) global layout: groups adjacent
        all_pids = prompt_ids.repeat_interleave(t.group_size)
        all_j = torch.arange(t.group_size).repeat(len(prompt_ids))
        pids, js = all_pids[local], all_j[local]
        return RolloutRequest(
            prompts=[self.prompts.prompts[i] for i in pids], metadata=[self.prompts.metadata[i] for i in pids],
            prompt_ids=all_keys[local], sample_index=js, settings=self.settings, batch_size=t.rollout_batch_size,
            seed=t.seed, epoch=epoch, same_noise_in_group=self.cfg.sampling.same_noise_in_group,
            progress=self.cfg.logging.progress and self.main, on_images=on_images, latents_on_cpu=t.latents_on_cpu,
        )

    def reward_phase(self, traj, handles: list) -> tuple[Rewards, torch.Tensor]:
        """Wait for the background scores of the local images (scored during the rollout; a rollout that did not
        report its micro-batches is scored here), then gather components and group ids of the whole batch. In a
        context group (its ranks hold the same samples) only the first rank scores; the others' NaN placeholders
        are never gathered (:func:`~flowgrpo.distributed.dist.gather_cat` takes a group's copy once)."""
        lead = dist.context_leader()
        if not lead:
            comps = {k: torch.full((traj.batch_size,), float("nan")) for k in self.rewards.rewards}
        elif sum(h.batch_size for h in handles) == traj.batch_size:
            comps = self.scorer.gather(handles)
        else:
            comps = score_components_named(self.rewards, traj.images, traj.prompts, traj.metadata)
        group_ids = dist.gather_cat(traj.group_ids)
        if self.rewards.group_wise:  # scored now that every group is complete (point-wise ones skipped them)
            _check_whole_groups(traj.group_ids, group_ids, self.rewards.group_wise)
            if lead:
                comps.update(score_components_named(_only(self.rewards, self.rewards.group_wise), traj.images,
                                                    traj.prompts, traj.metadata, traj.group_ids))
        gathered = {k: dist.gather_cat(comps[k]) for k in self.rewards.rewards}
        return compose_rewards(gathered, self.rewards.weights), group_ids

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tag: str) -> tuple[dict[str, float], torch.Tensor, list[str]]:
        """The held-out evaluation (:meth:`~flowgrpo.training.evaluation.Evaluation.evaluate`: metrics, images,
        captions), its images checked as made by the weights of the epoch they follow."""
        # "before": the weights the run starts from; the others follow this epoch's update (the last one's, for
        # "after" in a resume that finds every epoch trained)
        made_by = self.epoch - 1 if tag == "before" else min(self.epoch, self.cfg.train.num_epochs - 1)
        return self.evaluation.evaluate(tag, lambda bad: self.health.check_images(
            bad, f"evaluation ({tag})", collective=False, made_by=made_by, epoch=self.epoch))

    # ------------------------------------------------------------------ records of the run
    def _plot(self, epoch: int, traj, rewards: Rewards) -> None:
        """``reward_curve.png`` (every epoch so far, this one included) and ``samples_latest.png`` (the first 16
        samples of this epoch's rollout with their rewards)."""
        reward_curve(read_metrics(self.out / "metrics.jsonl") + [self.metrics.pending(epoch)],
                     self.out / "reward_curve.png")
        k = min(16, traj.batch_size)
        caps = [f"{p[:28]}\n{r:.3g}" for p, r in zip(traj.prompts[:k], rewards.total[:k].tolist(), strict=True)]
        sample_grid(traj.images[:k], caps, self.out / "samples_latest.png", title=f"epoch {epoch + 1}")

    def _warn_low_signal(self, epoch: int, adv: Advantages, total: torch.Tensor | None = None,
                         group_ids: torch.Tensor | None = None) -> None:
        """Metric ``adv/low_signal`` (1.0 or 0.0) each epoch; a console warning, with what to change, the first
        epoch the fraction of samples with a learning signal falls below ``advantage.min_learning_frac`` (the epoch
        numbered from 1, as the epoch lines). Only for an objective that trains on the group advantages
        (:attr:`~flowgrpo.algo.objectives.base.Objective.trains_on_advantages`): for the others (a dataset, the
        reward's gradient, a teacher) groups of equal rewards are no lack of signal, and neither is logged.
        ``total`` (B,) and ``group_ids`` (B,), the epoch's gathered rewards and groups: when most equal groups sit at
        the epoch's highest reward while others score lower (:func:`solved_group_frac`), the warning says the
        prompts are solved (a capped reward's steady state) instead of advising a denser reward."""
        if not self._on_advantages:
            return
        low = adv.learning_frac < self.cfg.advantage.min_learning_frac
        self.metrics.log({"adv/low_signal": float(low)})
        if not low or self._low_signal_warned or not self.main:
            return
        self._low_signal_warned = True
        solved = solved_group_frac(total, group_ids) if total is not None and group_ids is not None else None
        if solved is not None and solved >= 0.5:
            logger.warning(
                "epoch %d: only %.1f%% of the samples carry a learning signal (%.1f%% of the groups have equal "
                "rewards, %.0f%% of those at the epoch's highest reward; advantage.min_learning_frac=%g): those "
                "prompts are solved. With a capped reward (every sample past the cap scores the same, as the digits "
                "task's cap 0.8) that is the intended steady state, not a fault; raise the cap or give harder prompts "
                "to keep training them, or lower advantage.min_learning_frac to silence this. Metric adv/low_signal "
                "marks each such epoch; this warning is shown once.",
                epoch + 1, 100 * adv.learning_frac, 100 * adv.zero_spread_frac, 100 * solved,
                self.cfg.advantage.min_learning_frac)
            return
        logger.warning(
            "epoch %d: only %.1f%% of the samples carry a learning signal (%.1f%% of the groups have equal rewards, "
            "%.1f%% of the samples a NaN reward; advantage.min_learning_frac=%g): the update moves the policy little "
            "or not at all. Make the rewards differ within a group: a denser reward (a probability, not a 0/1 "
            "verdict), a larger train.group_size, more sampling.num_steps or a higher sampling.noise_level. "
            "Metric adv/low_signal marks each such epoch; this warning is shown once.",
            epoch + 1, 100 * adv.learning_frac, 100 * adv.zero_spread_frac, 100 * adv.nan_frac,
            self.cfg.advantage.min_learning_frac)

    def save_rollout_stats(self, epoch: int, traj, rewards: Rewards, group_ids: torch.Tensor,
                           adv: Advantages) -> None:
        """Gathered per-sample statistics of the epoch (global sample order) as safetensors; with the rollout's
        log-probabilities (B, T) when its record has them (the SDE objectives' ``Trajectory``)."""
        init = dist.gather_cat(traj.initial_noise.float().contiguous())
        log_probs = getattr(traj, "log_probs", None)
        extra = {} if log_probs is None else {"log_probs": dist.gather_cat(log_probs.float().contiguous()).cpu()}
        if not self.main:
            return
        folder = self.out / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        save_tensors({"reward_total": rewards.total.contiguous(), "advantages": adv.values.contiguous(),
                   "group_ids": group_ids.contiguous(), "train_mask": adv.train_mask.contiguous(),
                   "initial_latents": init.cpu().contiguous(), **extra,
                   **{f"reward/{k}": v.contiguous() for k, v in rewards.components.items()}},
                  folder / f"epoch_{epoch}.safetensors")

    @property
    def weights_dir(self):
        """Where the final weights go: ``output_dir/lora`` (LoRA) or ``output_dir/transformer`` (full)."""
        return self.run.weights_dir

    def save_weights(self) -> None:
        """The trained LoRA (diffusers ``load_lora_weights`` format) or full transformer (``from_pretrained``,
        weights in ``model.dtype``); every process takes part (a sharded model is gathered), the main one writes."""
        save_final_weights(self.adapter, self.optim.unwrapped, self.weights_dir, finetune=self.cfg.model.finetune,
                           dtype=DTYPES[self.cfg.model.dtype], main=self.main)


def _reward_metrics(rewards: Rewards) -> dict[str, float]:
    out = {}
    items = {**rewards.components, "total": rewards.total}
    for name, r in items.items():
        valid = r[~torch.isnan(r)]
        out[f"reward/{name}/mean"] = float(valid.mean()) if valid.numel() else math.nan
        out[f"reward/{name}/std"] = float(valid.std(unbiased=False)) if valid.numel() else math.nan
        out[f"reward/{name}/nan_frac"] = float(torch.isnan(r).double().mean())
    return out


def _only(composed: ComposedReward, names: list[str]) -> ComposedReward:
    return ComposedReward({k: composed.rewards[k] for k in names}, {k: composed.weights[k] for k in names})


def _check_whole_groups(local_ids: torch.Tensor, all_ids: torch.Tensor, names: list[str]) -> None:
    """A group-wise reward needs each process to hold whole groups (else it would rank part of a group)."""
    uniq, local_counts = torch.unique(local_ids, return_counts=True)
    total = torch.stack([(all_ids == g).sum() for g in uniq])
    if not torch.equal(local_counts, total):
        raise ValueError(f"rewards {names} score whole groups, but a group is split over processes; choose "
                         "train.prompts_per_epoch divisible by the number of processes")
