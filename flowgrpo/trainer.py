"""The epoch loop: one trainer for every model adapter, chunker, SDE kind and reward.

An epoch is a flat list of timed phases (as verl's driver loop): ``rollout`` → ``reward`` → ``filter`` →
``advantage`` → ``plan`` → ``recompute`` (optional) → ``update``, with ``eval`` and ``save`` around it. The filter
(:mod:`flowgrpo.algo.filters`, ``algo.group_filter``) picks the samples of each group the advantages use; the
update minimises the registered policy loss (:mod:`flowgrpo.algo.losses`, ``algo.policy_loss``) over the chunker's
chunks; every log-prob, in rollout and training,
comes from the adapter's ``velocity`` and :func:`~flowgrpo.sampling.sde.sde_step`, so the first ratio of an
on-policy update is exactly 1 when the training batch layout equals the rollout's (``policy/logprob_mismatch_max``
reports it).

Update semantics (``train.*``): the B local samples are cut into micro-batches of ``train_batch_size``
consecutive samples; ``optimizer_steps_per_epoch`` optimizer steps each take an equal, consecutive share of the
micro-batches (gradients accumulate over that share and all its chunks); ``inner_epochs`` repeats the whole pass
over the same rollout. A micro-batch's chunks share transformer calls of at most ``train_batch_size`` rows
(:meth:`Trainer._work`). Only the first optimizer step of the first pass is on-policy; the ratio statistics of the
later ones are logged under ``policy_later/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from flowgrpo import dist
from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.algo.filters import GROUP_FILTERS, advantages_of_kept
from flowgrpo.algo.losses import POLICY_LOSSES, LossSettings, PolicyLossInput, needs_moments
from flowgrpo.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from flowgrpo.config import Config, flat_dict, save_config
from flowgrpo.data.prompts import GroupSampler, PromptSet, group_keys
from flowgrpo.divergence import DivergenceWatch, TrainingDiverged, check_weights, run_history, stop_line
from flowgrpo.ema import EMA
from flowgrpo.metrics import MetricsSink, epoch_line, read_metrics
from flowgrpo.preflight import latest_run_config, occupied_message
from flowgrpo.records import Advantages, ChunkPlan, Rewards, Trajectory
from flowgrpo.rewards.background import AsyncRewardScorer, score_components_named
from flowgrpo.rewards.compose import ComposedReward, compose_rewards
from flowgrpo.rng import derive_seed, make_generator
from flowgrpo.sampling.rollout import RolloutRequest, SamplerSettings, generate_images
from flowgrpo.sampling.sde import kl_to_reference, sde_step, transition_moments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkForward:
    """One batched forward of n samples' k chunk steps under the training layout.

    Attributes:
        log_probs: (n, k) float32, with gradient.
        kl: (n, k) float32 KL to the reference, or None.
        means: (n, k, …) float32 transition means; stds: (n, k) transition stds; dts: (n, k) σ_next − σ.
    """

    log_probs: torch.Tensor
    kl: torch.Tensor | None
    means: torch.Tensor
    stds: torch.Tensor
    dts: torch.Tensor


_STATS = ("pairs", "ratio", "clipped", "approx_kl", "kl_ref", "loss")


class _Accum:
    """Sums over trained pairs of one group of optimizer steps (on-policy first step, or the later ones).

    Each chunk's detached statistics are kept as they are, on the model's device (a few (N,) tensors), so
    accumulating a chunk launches no work and never waits for the device; :meth:`metrics` reduces them in one pass
    and reads them back once, after the update.
    """

    def __init__(self) -> None:
        self.chunks: list[tuple] = []
        self._reduced: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, terms, mask: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add the pairs of ``mask`` (N,) bool, on the device of ``terms``; ``loss_sum`` a 0-dim tensor there."""
        self._reduced = None
        self.chunks.append((mask, terms.ratio, terms.clipped, terms.approx_kl, terms.kl_ref, loss_sum.detach(),
                            terms.log_ratio_abs_max))

    def _sums(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """((6,) float64 sums in ``_STATS`` order, 0-dim max |Δ log p| over the masked pairs), on the device;
        reduced once, however many figures are read."""
        if self._reduced is None:
            self._reduced = self._reduce(device)
        return self._reduced

    def _reduce(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.chunks:
            return torch.zeros(len(_STATS), dtype=torch.float64, device=device), torch.zeros((), device=device)
        mask, *stats, loss_sums, lr_max = (torch.cat([c[i].reshape(-1) for c in self.chunks])
                                           for i in range(len(self.chunks[0])))
        m = mask.to(torch.float64)
        sums = torch.cat([m.sum().reshape(1), torch.stack([(x.double() * m).sum() for x in stats]),
                          loss_sums.double().sum().reshape(1)])
        return sums, torch.where(mask, lr_max, torch.zeros_like(lr_max)).max()

    def metrics(self, prefix: str, device: torch.device) -> dict[str, float]:
        """The means over all processes' pairs (one collective, one read to the host)."""
        t = dist.all_reduce_sum(self._sums(device)[0]).tolist()
        n = t[0]
        if n == 0:
            return {}
        return {
            f"{prefix}/ratio_mean": t[1] / n,
            f"{prefix}/clipfrac": t[2] / n,
            f"{prefix}/approx_kl": t[3] / n,
            f"{prefix}/kl_ref": t[4] / n,
            f"{prefix}/pairs": n,
        }

    def mismatch_max(self, device: torch.device) -> float:
        """max |Δ log p| over the trained pairs of all processes (0 when none)."""
        return float(dist.all_reduce_max(self._sums(device)[1].double()))


def packed_forward(adapter, traj: Trajectory, work: list[tuple[torch.Tensor, tuple[int, ...]]],
                   settings: SamplerSettings, *, with_ref: bool, kl_form: str = "flow_grpo",
                   shared_inputs: list[torch.Tensor | None] | None = None) -> list[ChunkForward]:
    """One batched forward of several items' transitions: per item (rows, chunk), its log-probs (n, k), KL (n, k)
    or None, and moments.

    Args:
        adapter: the model adapter (its ``velocity`` and, with ``with_ref``, its ``reference``).
        traj: the rollout record; its latents may live on the host or the device.
        work: items (rows, chunk): rows (n,) long sample indices (host), chunk a tuple of k step indices.
        settings: the rollout's SDE settings.
        with_ref: also compute the KL to the reference policy per latent dim
            (:func:`~flowgrpo.sampling.sde.kl_to_reference` of form ``kl_form``, ``algo.kl_form``).
        shared_inputs: per item, (n,) long keys or None; rows with equal keys have bit-identical transformer
            inputs at every step of the chunk (E-GRPO: the G samples of a (prompt, branch step) group start their
            jump from one anchor latent), so the transformer runs once per (key, step) and its velocity is shared;
            the gradient of the shared forward sums over the rows, exactly as separate forwards would.

    The batch is item-major, then sample-major: element Σ_{i'<i} n_i'·k_i' + r·k + j is item i's sample
    ``rows[r]`` at step ``chunk[j]``; for one item of k = 1 and rows a rollout micro-batch this is exactly the
    rollout's layout. Every result is on the adapter's device.
    """
    shared_inputs = shared_inputs or [None] * len(work)
    rows_l, steps_l, keys = [], [], []  # built as host lists: two tensors, whatever the number of items
    for (rows, chunk), shared in zip(work, shared_inputs, strict=True):
        for r in rows.tolist():
            rows_l += [r] * len(chunk)
            steps_l += chunk
        keys += ([None] * (len(rows) * len(chunk)) if shared is None
                 else [(key, t) for key in shared.tolist() for t in chunk])
    rows_e, steps_e = torch.tensor(rows_l), torch.tensor(steps_l)  # (N,) host
    ends_e = steps_e + traj.jump[rows_e, steps_e]  # the transition's end (E-GRPO: m steps on)
    dev, src = adapter.device, traj.latents.device
    rows_s = rows_e.to(src)
    x = traj.latents[rows_s, steps_e.to(src)].to(dev)  # (N, …)
    x_next = traj.latents[rows_s, ends_e.to(src)].to(dev)
    sigma, sigma_next = traj.sigmas.index_select(0, steps_e), traj.sigmas.index_select(0, ends_e)  # (N,) host
    embeds = traj.embeds.index(rows_e.to(traj.embeds.device))
    velocity = _velocity_once_per_input(adapter, x, sigma.to(dev), embeds, traj.guidance_scale, keys)
    guard = settings.guard(traj.sigmas)
    # the rollout's sde_step checked every transition of this grid: no σ check per forward
    out = sde_step(x, velocity(), sigma, sigma_next, kind=settings.sde_kind, noise_level=settings.noise_level,
                   next_latents=x_next, reduction=settings.logprob_reduction,
                   simplified_log_prob=settings.cps_simplified_logprob, sigma_one_next=guard, check_sigmas=False)
    kl = None
    if with_ref:
        with torch.no_grad(), adapter.reference():
            v_ref = velocity()
        ref_mean, _ = transition_moments(x, v_ref, sigma, sigma_next, kind=settings.sde_kind,
                                         noise_level=settings.noise_level, sigma_one_next=guard, check_sigmas=False)
        kl = kl_to_reference(out.mean, ref_mean, out.std, sigma.to(dev), sigma_next.to(dev), kind=settings.sde_kind,
                             form=kl_form)
    dts = (sigma_next - sigma).to(dev)
    sizes = [len(rows) * len(chunk) for rows, chunk in work]
    parts = [[t] * len(work) if t is None else [t] if len(work) == 1 else t.split(sizes)
             for t in (out.log_prob, kl, out.mean, out.std, dts)]
    return [ChunkForward(*(None if t is None else t.reshape(len(rows), len(chunk), *t.shape[1:]) for t in item))
            for (rows, chunk), *item in zip(work, *parts, strict=True)]


def chunk_forward(adapter, traj: Trajectory, rows: torch.Tensor, chunk: tuple[int, ...], settings: SamplerSettings,
                  *, with_ref: bool, kl_form: str = "flow_grpo", shared_inputs: torch.Tensor | None = None
                  ) -> ChunkForward:
    """:func:`packed_forward` of one item (``rows``' transitions ``chunk``): log-probs (n, k), KL (n, k) or None,
    moments (n, k, …)."""
    return packed_forward(adapter, traj, [(rows, chunk)], settings, with_ref=with_ref, kl_form=kl_form,
                          shared_inputs=[shared_inputs])[0]


def _velocity_once_per_input(adapter, x: torch.Tensor, sigma: torch.Tensor, embeds, guidance: float, keys: list):
    """A function computing the (N, …) velocity of :func:`packed_forward`'s batch with the adapter's current
    weights, forwarding one element per distinct key (elements whose key is None are all forwarded)."""
    if all(key is None for key in keys):
        return lambda: adapter.velocity(x, sigma, embeds, guidance)
    slot: dict = {}
    pick, spread = [], []
    for e, key in enumerate(keys):
        key = ("element", e) if key is None else key
        if key not in slot:
            slot[key] = len(pick)
            pick.append(e)
        spread.append(slot[key])
    if len(pick) == len(keys):
        return lambda: adapter.velocity(x, sigma, embeds, guidance)
    dev = x.device
    pick_t, spread_t = torch.tensor(pick, device=dev), torch.tensor(spread, device=dev)
    x_u, sigma_u, embeds_u = x[pick_t], sigma[pick_t], embeds.index(pick_t.to(embeds.device))  # once each

    def velocity() -> torch.Tensor:
        return adapter.velocity(x_u, sigma_u, embeds_u, guidance)[spread_t]

    return velocity


def transformer_rows(rows: torch.Tensor, chunk: tuple[int, ...], shared: torch.Tensor | None) -> int:
    """Transformer rows :func:`packed_forward` spends on one item: distinct inputs × chunk steps."""
    return (len(rows) if shared is None else len(set(shared.tolist()))) * len(chunk)


def _pair_mask(plan: ChunkPlan, adv: Advantages) -> torch.Tensor:
    """(B_local, K) bool host: the (sample, chunk) pairs the update trains (planned, and kept by the advantage)."""
    return plan.selected & adv.train_mask[dist.local_slice(len(adv.values))].unsqueeze(1)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pack(items: list, cost, limit: int) -> list[list]:
    """Consecutive ``items`` in packs whose summed ``cost(*item)`` stays within ``limit``; an item over the limit
    is a pack alone."""
    packs: list[list] = []
    total = limit + 1
    for item in items:
        c = cost(*item)
        if total + c > limit:
            packs.append([])
            total = 0
        packs[-1].append(item)
        total += c
    return packs


@dataclass(frozen=True)
class _OptimizerStep:
    """The work of one optimizer step: its forwards, each a pack of (rows, chunk index) items forwarded in one
    transformer call (:meth:`Trainer._work`), and the pairs trained over all processes."""

    work: list[list[tuple[torch.Tensor, int]]]
    global_pairs: float
    micro_batches: int


class Trainer:
    """GRPO-family trainer.

    Args:
        config: the validated :class:`~flowgrpo.config.Config`.
        adapter: a model adapter whose transformer is already set up for training (LoRA or full).
        params: the trained parameters.
        rewards: the optimised rewards; eval_rewards: rewards scored only at evaluation (may be None).
        chunker: the step chunker strategy.
        prompts: the training prompt set; eval_prompts: held-out prompts (None: no evaluation).
        accelerator: an ``accelerate.Accelerator``.
        reward_origins: provenance of every reward plugin, written to ``rewards.json``.
    """

    def __init__(self, config: Config, *, adapter, params, rewards: ComposedReward,
                 eval_rewards: ComposedReward | None, chunker, prompts: PromptSet, eval_prompts: PromptSet | None,
                 accelerator, reward_origins: list | None = None) -> None:
        self.cfg = config
        self.adapter = adapter
        self.params = params
        self.rewards = rewards
        self.eval_rewards = eval_rewards
        self.chunker = chunker
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.accelerator = accelerator
        self.out = Path(config.output_dir)
        self.main = accelerator.is_main_process
        t = config.train
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.adam_betas), eps=t.adam_eps,
                                           weight_decay=t.weight_decay)
        warm = t.warmup_steps
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warm) if warm else 1.0
        )
        self.model, self.optimizer = accelerator.prepare(adapter.transformer, self.optimizer)
        adapter.forward_module = self.model  # forward through the distributed wrapper (gradient sync)
        self.sampler = GroupSampler(len(prompts), t.prompts_per_epoch, t.seed)
        self.epoch = 0  # 0-based: the epoch training (or next to train)
        self.stage = "epochs"  # "epochs", then "final" (the final evaluation and save)
        self.settings = SamplerSettings.from_config(config.sampling)
        self.policy_loss = POLICY_LOSSES.get(config.algo.policy_loss)
        self.loss_settings = LossSettings.from_config(config)
        self.group_filter = GROUP_FILTERS.get(config.algo.group_filter.name)
        # a loss that reads the rollout policy's transition means gets them from the recompute pass
        self.recompute = config.algo.recompute_old_log_probs or chunker.needs_recompute or needs_moments(
            self.policy_loss)
        self.old_means: torch.Tensor | None = None  # (B, T, …) rollout-policy means, for such a loss
        self.metrics = MetricsSink(self.out / "metrics.jsonl", accelerator, self.main)
        self.reward_origins = reward_origins or []
        self.ema = EMA(params, t.ema_decay) if t.ema_decay is not None else None
        self.scorer = AsyncRewardScorer(rewards)
        self._low_signal_warned = False
        self.forward_count = [0, 0]  # transformer calls and rows, for the rollout/update cost metrics
        adapter.transformer.register_forward_pre_hook(self._count_forward, with_kwargs=True)
        if t.resume_from:
            self.epoch = 1 + load_checkpoint(t.resume_from, model=accelerator.unwrap_model(self.model),
                                             optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                                             sampler=self.sampler, ema=self.ema)
            for group in self.optimizer.param_groups:  # this run's optimiser settings win over the checkpoint's
                group.update(betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay)
            self.lr_scheduler.base_lrs = [t.lr] * len(self.optimizer.param_groups)
            for group in self.optimizer.param_groups:
                group["lr"] = t.lr * self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
            logger.info("resumed from %s at epoch %d", t.resume_from, self.epoch)
        self.watch = DivergenceWatch(run_history(self.out, t.resume_from, self.epoch))  # flowgrpo.divergence

    def _count_forward(self, module, args, kwargs) -> None:
        x = kwargs.get("hidden_states", kwargs.get("x", args[0] if args else None))
        self.forward_count[0] += 1
        self.forward_count[1] += 0 if x is None else len(x)  # a batch tensor, or a list of samples (Z-Image)

    def _eval_weights(self):
        """The weights evaluation and saving use: the EMA when on, else the trained ones."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def save_checkpoint(self, epoch: int) -> None:
        """Write the epoch's checkpoint, only from finite weights (:func:`~flowgrpo.divergence.check_weights`)."""
        named = [(n, p) for n, p in self.accelerator.unwrap_model(self.model).named_parameters() if p.requires_grad]
        named += [(f"EMA {n}", v) for n, v in self.ema.state_dict().items()] if self.ema is not None else []
        check_weights(named, epoch, self.cfg.train.num_epochs, self.out / "checkpoints")
        if self.main:
            save_checkpoint(self.out / "checkpoints", epoch, model=self.accelerator.unwrap_model(self.model),
                            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, sampler=self.sampler,
                            ema=self.ema, keep=self.cfg.logging.checkpoints_total_limit)

    # ------------------------------------------------------------------ phases
    def rollout_phase(self) -> tuple[Trajectory, list]:
        """Sample this process's share of the epoch's P×G trajectories; each decoded micro-batch is handed to the
        background reward scorer at once. Returns the trajectory and the score handles in sample order."""
        t = self.cfg.train
        prompt_ids = self.sampler.next_prompt_ids()
        # a prompt drawn twice in one epoch (only when P > the set's size) is two groups with their own noise
        keys = group_keys(prompt_ids, len(self.prompts))
        all_keys = keys.repeat_interleave(t.group_size)  # (B,) global layout: groups adjacent
        all_pids = prompt_ids.repeat_interleave(t.group_size)
        all_j = torch.arange(t.group_size).repeat(t.prompts_per_epoch)
        local = dist.local_slice(len(all_pids))
        pids, js = all_pids[local], all_j[local]
        prompts = [self.prompts.prompts[i] for i in pids]
        metadata = [self.prompts.metadata[i] for i in pids]
        handles = []

        def score_in_background(images: torch.Tensor, batch_prompts: list[str], batch_meta: list[dict]) -> None:
            handles.append(self.scorer.submit(images, batch_prompts, batch_meta))

        request = RolloutRequest(
            prompts=prompts, metadata=metadata, prompt_ids=all_keys[local], sample_index=js, settings=self.settings,
            batch_size=t.rollout_batch_size, seed=t.seed, epoch=self.epoch,
            same_noise_in_group=self.cfg.sampling.same_noise_in_group, progress=self.cfg.logging.progress and self.main,
            on_images=score_in_background, latents_on_cpu=t.latents_on_cpu,
        )
        traj = self.chunker.rollout(self.adapter, request)
        return traj, handles

    def reward_phase(self, traj: Trajectory, handles: list) -> tuple[Rewards, torch.Tensor]:
        """Wait for the background scores of the local images (scored during the rollout; a chunker that did not
        report its micro-batches is scored here), then gather components and group ids of the whole batch."""
        if sum(h.batch_size for h in handles) == traj.batch_size:
            comps = self.scorer.gather(handles)
        else:
            comps = score_components_named(self.rewards, traj.images, traj.prompts, traj.metadata)
        group_ids = dist.gather_cat(traj.group_ids)
        if self.rewards.group_wise:  # scored now that every group is complete (point-wise ones skipped them)
            _check_whole_groups(traj.group_ids, group_ids, self.rewards.group_wise)
            comps.update(score_components_named(_only(self.rewards, self.rewards.group_wise), traj.images,
                                                traj.prompts, traj.metadata, traj.group_ids))
        gathered = {k: dist.gather_cat(comps[k]) for k in self.rewards.rewards}
        return compose_rewards(gathered, self.rewards.weights), group_ids

    def advantage_phase(self, rewards: Rewards, group_ids: torch.Tensor, keep: torch.Tensor) -> Advantages:
        """Advantages from the samples the group filter kept (all of them without a filter)."""
        a = self.cfg.algo

        def compute(r: Rewards, g: torch.Tensor) -> Advantages:
            return compute_advantages(r, g, estimator=a.advantage, global_std=a.global_std,
                                      multi_reward=a.multi_reward, clip=a.advantage_clip,
                                      drop_zero_spread=a.drop_zero_spread_groups, std_ddof=a.std_ddof,
                                      std_eps=a.std_eps)

        return advantages_of_kept(compute, rewards, group_ids, keep)

    # ------------------------------------------------------------------ log-probs under the training layout
    def _shared_inputs(self, traj: Trajectory, rows: torch.Tensor) -> torch.Tensor | None:
        """Keys of rows whose training inputs are identical (a chunker with ``shares_inputs``: the rows of one
        group start their trained transition from one shared latent), else None."""
        return traj.group_ids[rows] if getattr(self.chunker, "shares_inputs", False) else None

    def _loss_input(self, fwds: list[ChunkForward], items: list[tuple[torch.Tensor, int]], plan: ChunkPlan,
                    batch: dict[str, torch.Tensor]) -> PolicyLossInput:
        """The policy loss's view of the forwards of items (rows, chunk index) of one chunk length, concatenated
        over the items (moments only for a loss that declares it reads them)."""
        dev = fwds[0].log_probs.device
        rows = _cat([r for r, _ in items])
        old = _cat([batch["old_log_probs"][r][:, list(plan.chunks[k])] for r, k in items]).to(dev)
        new, adv = _cat([f.log_probs for f in fwds]), batch["advantages"][rows].to(dev)
        kl = None if fwds[0].kl is None else _cat([f.kl for f in fwds])
        if not needs_moments(self.policy_loss):
            return PolicyLossInput(new, old, adv, kl_ref=kl)
        at = self.old_means.device
        old_means = _cat([self.old_means[r.to(at)][:, list(plan.chunks[k])] for r, k in items]).to(dev)  # (n, k, …)
        drift = ((_cat([f.means for f in fwds]) - old_means) ** 2).flatten(2).mean(dim=2)
        trained = _cat([batch["pair_mask"][r, k] for r, k in items]).to(dev)  # (n,) the pairs the loss counts
        groups = torch.cat([torch.full((len(r),), i) for i, (r, _) in enumerate(items)]).to(dev)  # one an item
        return PolicyLossInput(new, old, adv, kl_ref=kl, std=_cat([f.stds for f in fwds]),
                               dt=_cat([f.dts for f in fwds]), mean_drift_sq=drift, trained=trained, groups=groups)

    def _micro_batches(self, b: int) -> list[torch.Tensor]:
        tb = self.cfg.train_batch_size
        if b % tb:
            raise ValueError(f"train_batch_size={tb} must divide the {b} trajectories this process sampled")
        return [torch.arange(s, s + tb) for s in range(0, b, tb)]

    @torch.no_grad()
    def recompute_old_log_probs(self, traj: Trajectory, plan: ChunkPlan,
                                steps: list[_OptimizerStep] | None = None) -> torch.Tensor:
        """Old log-probs (B, T) float32 on the host, recomputed in the training layout: the packs of ``steps``,
        the update's schedule (:meth:`_schedule`; default every selected pair), so the first ratio is exactly 1;
        for a loss that reads moments, the rollout policy's transition means go to ``self.old_means`` (B, T, …).
        Pairs no pack forwards keep the rollout's log-probs (the update never reads them)."""
        old = traj.log_probs.clone()
        keep_means = needs_moments(self.policy_loss)
        self.old_means = torch.zeros_like(traj.latents[:, :-1]) if keep_means else None
        steps = self._schedule(traj, plan, plan.selected) if steps is None else steps
        for pack in (pack for step in steps for pack in step.work):
            outs = packed_forward(self.adapter, traj, [(rows, plan.chunks[k]) for rows, k in pack], self.settings,
                                  with_ref=False, shared_inputs=[self._shared_inputs(traj, rows) for rows, _ in pack])
            for (rows, k), out in zip(pack, outs, strict=True):
                idx = (rows.unsqueeze(1), torch.tensor(plan.chunks[k]).unsqueeze(0))
                old[idx] = out.log_probs.cpu()
                if keep_means:
                    self.old_means[idx[0].to(self.old_means.device), idx[1].to(self.old_means.device)] = \
                        out.means.to(self.old_means)
        return old

    # ------------------------------------------------------------------ the update, in named steps
    def _work(self, traj: Trajectory, plan: ChunkPlan, pair_mask: torch.Tensor) -> list[list[list[tuple]]]:
        """The forwards of each optimizer step's share of micro-batches, packed.

        The B local samples are cut into micro-batches and the micro-batches into ``optimizer_steps_per_epoch``
        equal consecutive shares. A micro-batch forwards each chunk that has a trained pair in ``pair_mask``
        (B, K) for the rows the plan selects (samples left out by their advantage, NaN reward or dropped group,
        are forwarded and masked); consecutive chunks of one micro-batch share a transformer call while it holds
        at most ``train_batch_size`` transformer rows (identical inputs counted once; a chunk of k steps counts
        k rows per sample). A chunk over that limit is forwarded alone, so a per-step micro-batch still forwards
        one step at a time, while E-GRPO's shared-anchor chunks (one transformer row a group) share one call."""
        t = self.cfg.train
        mbs = self._micro_batches(traj.batch_size)
        if len(mbs) < t.optimizer_steps_per_epoch:
            raise ValueError(f"optimizer_steps_per_epoch={t.optimizer_steps_per_epoch} exceeds the {len(mbs)} "
                             "training micro-batches of this epoch")
        shares = [[mbs[i] for i in ix] for ix in torch.arange(len(mbs)).tensor_split(t.optimizer_steps_per_epoch)]
        limit = self.cfg.train_batch_size
        out = []
        for share in shares:
            packs = []
            for rows in share:
                # host lists, read once a micro-batch: no tensor op per chunk
                row_list, trained = rows.tolist(), pair_mask[rows].any(dim=0).tolist()  # (n,), (K,)
                selected = plan.selected[rows].T.tolist()  # (K, n)
                items = [(torch.tensor([r for r, s in zip(row_list, selected[k], strict=True) if s], dtype=torch.long),
                          k) for k in range(plan.num_chunks) if trained[k]]
                packs += _pack(items, lambda r, k: transformer_rows(r, plan.chunks[k], self._shared_inputs(traj, r)),
                               limit)
            out.append(packs)
        return out

    def _schedule(self, traj: Trajectory, plan: ChunkPlan, pair_mask: torch.Tensor) -> list[_OptimizerStep]:
        """Each optimizer step's packed forwards (:meth:`_work`) and its pair count summed over all processes
        (one collective for all the steps)."""
        t = self.cfg.train
        work = self._work(traj, plan, pair_mask)
        mbs = self._micro_batches(traj.batch_size)
        shares = [torch.cat([mbs[i] for i in ix]) for ix in
                  torch.arange(len(mbs)).tensor_split(t.optimizer_steps_per_epoch)]
        local_pairs = torch.stack([pair_mask[rows].sum() for rows in shares]).double()
        global_pairs = dist.all_reduce_sum(local_pairs).tolist()
        sizes = [len(ix) for ix in torch.arange(len(mbs)).tensor_split(t.optimizer_steps_per_epoch)]
        return [_OptimizerStep(w, n, m) for w, n, m in zip(work, global_pairs, sizes, strict=True)]

    def _train_pack(self, traj: Trajectory, pack: list[tuple[torch.Tensor, int]], plan: ChunkPlan,
                    step: _OptimizerStep, batch: dict[str, torch.Tensor], acc: _Accum, *, sync: bool) -> None:
        """Forward (one transformer call) and backward of a pack of (rows, chunk index) items; gradients are
        all-reduced only when ``sync``. The policy loss sees the pack's items of one chunk length at once."""
        cfg = self.cfg
        # one process has nothing to all-reduce (accelerate's no_sync would only look that up per call)
        ctx = (contextlib.nullcontext() if sync or self.accelerator.num_processes == 1
               else self.accelerator.no_sync(self.model))
        with ctx:  # inside update_phase's attention scope: the backward uses the forward's kernels
            fwds = packed_forward(self.adapter, traj, [(rows, plan.chunks[k]) for rows, k in pack], self.settings,
                                  with_ref=cfg.algo.kl_beta > 0, kl_form=cfg.algo.kl_form,
                                  shared_inputs=[self._shared_inputs(traj, rows) for rows, _ in pack])
            loss_sum = None
            for length in dict.fromkeys(len(plan.chunks[k]) for _, k in pack):  # the chunk lengths, in order
                items = [i for i, (_, k) in enumerate(pack) if len(plan.chunks[k]) == length]
                terms = self.policy_loss(self._loss_input([fwds[i] for i in items], [pack[i] for i in items],
                                                          plan, batch), self.loss_settings)
                m = _cat([batch["pair_mask"][r, k] for r, k in (pack[i] for i in items)]).to(terms.loss.device)
                part = (terms.loss * m).sum()
                acc.add(terms, m, part)
                loss_sum = part if loss_sum is None else loss_sum + part
            self.accelerator.backward(loss_sum * (dist.world_size() / max(step.global_pairs, 1.0)))

    def _optimizer_step(self) -> float:
        """Clip, check and apply the accumulated gradient (the update's one host read per step); returns the
        gradient norm. Raises :class:`~flowgrpo.divergence.TrainingDiverged` (a ``FloatingPointError``) on a
        non-finite norm, before the weights change."""
        gn = float(self.accelerator.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm))
        if not math.isfinite(gn):  # never let one bad batch overwrite the weights
            raise TrainingDiverged(stop_line(self.epoch, self.cfg.train.num_epochs, f"the gradient norm is {gn} "
                                             "(the weights were not updated)", self.out / "checkpoints"))
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update()
        return gn

    def update_phase(self, traj: Trajectory, adv: Advantages, plan: ChunkPlan, old_log_probs: torch.Tensor,
                     steps: list[_OptimizerStep] | None = None):
        """Inner epochs × optimizer steps of the policy loss over the plan's chunks, in the packs of ``steps``
        (:meth:`_schedule` of the pairs the advantages keep; computed here when not given).

        Records (advantages, masks, old log-probs) stay on the host and each chunk's rows move to the device;
        statistics accumulate on the device and are read once, after the update."""
        cfg, t = self.cfg, self.cfg.train
        local = dist.local_slice(len(adv.values))
        batch = {"advantages": adv.values[local], "old_log_probs": old_log_probs,
                 "pair_mask": _pair_mask(plan, adv)}  # (B,), (B, T), (B, K) host
        steps = self._schedule(traj, plan, batch["pair_mask"]) if steps is None else steps
        first, later = _Accum(), _Accum()
        if not self.model.training:  # a walk over every module: only when evaluation switched it off
            self.model.train()
        bar = tqdm(total=t.inner_epochs * sum(s.micro_batches for s in steps), desc="update", leave=False,
                   disable=not (cfg.logging.progress and self.main))
        grad_norms = []
        # one attention-kernel scope for the whole update: every forward, its backward (and any checkpoint
        # recompute) use the same kernels; the transformer calls' own scopes are no-ops inside it
        with self.adapter.attention():
            for inner in range(t.inner_epochs):
                for u, step in enumerate(steps):
                    acc = first if inner == 0 and u == 0 else later
                    for i, pack in enumerate(step.work):
                        self._train_pack(traj, pack, plan, step, batch, acc, sync=i == len(step.work) - 1)
                    if step.work:
                        grad_norms.append(self._optimizer_step())
                    self.optimizer.zero_grad(set_to_none=True)
                    bar.update(step.micro_batches)
        bar.close()
        dev = self.adapter.device
        out = {**first.metrics("policy", dev), **later.metrics("policy_later", dev)}
        mismatch = first.mismatch_max(dev)  # a collective: every process takes part
        if "policy/pairs" in out:  # measured only when some pair was trained (nothing is logged otherwise)
            out["policy/logprob_mismatch_max"] = mismatch
        if grad_norms:
            out["policy/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["train/lr"] = self.lr_scheduler.get_last_lr()[0]
        return out

    # ------------------------------------------------------------------ evaluation
    def _eval_set(self) -> tuple[list[str], list[dict]]:
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
    def evaluate(self, tag: str) -> tuple[dict[str, float], torch.Tensor, list[str]]:
        """ODE images of the fixed evaluation set (:meth:`_eval_set`; image i seeded
        ``derive_seed(train.seed, "eval", i)``, never a training seed), scored by every reward and eval reward.

        Returns (metrics ``eval/<name>/mean`` and batch metrics, the images (N, 3, H, W) in [0, 1], captions).
        A reward with ``batch_metrics`` reports its whole-set figures under their own names (``eval/correctness``,
        ``eval/digit_3/diversity`` …) instead of its per-image mean."""
        ps, meta = self._eval_set()
        seeds = [derive_seed(self.cfg.train.seed, "eval", i) for i in range(len(ps))]
        self.model.eval()
        with self._eval_weights():
            images = generate_images(
                self.adapter, ps, seeds, num_steps=self.cfg.eval_sampling.num_steps,
                guidance_scale=self.cfg.eval_sampling.guidance_scale, batch_size=self.cfg.train.rollout_batch_size,
                progress=self.cfg.logging.progress and self.main, metadata=meta,
            )
        out: dict[str, float] = {}
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
        captions = [p[:40] for p in ps]
        if self.main:  # every process evaluates the same images; one reports them
            logger.info("eval (%s): %s", tag, ", ".join(f"{k}={v:.4f}" for k, v in out.items()
                                                           if not k.startswith("eval/digit_")))
        return out, images, captions

    # ------------------------------------------------------------------ the loop
    #: what a run writes into its output_dir; ``logging.overwrite=true`` removes these of the old run
    RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "rewards.json", "eval_before.json",
                 "eval_images_before.pt", "eval_images_after.pt", "lora", "transformer", "rollouts",
                 "samples_latest.png", "reward_curve.png", "before_after.png")

    def _claim_output_dir(self) -> None:
        """Refuse a folder that holds another run; when resuming into it, drop the records of epochs after the
        checkpoint (a run killed mid-epoch left them), so ``metrics.jsonl`` holds each epoch once; with
        ``logging.overwrite`` remove every file of the old run (its checkpoints included)."""
        metrics = self.out / "metrics.jsonl"
        if self.cfg.train.resume_from and metrics.exists():
            kept = [r for r in read_metrics(metrics) if r["epoch"] < self.epoch]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif (self.out / "config.yaml").exists() and not self.cfg.logging.overwrite:
            raise FileExistsError(occupied_message(self.out))
        elif self.cfg.logging.overwrite:
            old = [self.out / n for n in self.RUN_FILES if (self.out / n).exists()]
            old += sorted(self.out.glob("config_resumed_at_epoch_*.yaml"))
            for path in old:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            if old:
                logger.warning("logging.overwrite=true: removed the old run's %s from %s",
                               ", ".join(p.name for p in old), self.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def _write_config(self) -> None:
        """``config.yaml`` is the run's original config and is never overwritten: a resume warns with the keys that
        differ from the run's last config (:func:`~flowgrpo.preflight.latest_run_config`), and separately when the
        evaluation differs from the original one (the "before" figures were measured with that), and writes its
        own config beside it (``config_resumed_at_epoch_<E>.yaml``)."""
        path = self.out / "config.yaml"
        if not path.exists():
            save_config(self.cfg, path)
            return
        last = latest_run_config(self.out)
        changed = _changed_settings(last, self.cfg)
        if changed:
            logger.warning("resuming with settings that differ from %s: %s", last, "; ".join(changed.values()))
        eval_changed = [v for k, v in _changed_settings(path, self.cfg).items() if k.startswith(_EVAL_SETTINGS)]
        if eval_changed:
            logger.warning("the evaluation differs from the one the run's 'before' figures were measured with (%s): "
                           "%s; the before/after figures of this run compare different evaluations",
                           path, "; ".join(eval_changed))
        save_config(self.cfg, self.out / f"config_resumed_at_epoch_{self.epoch}.yaml")

    def _before(self) -> tuple[dict[str, float], torch.Tensor, list[str]]:
        """The base model's evaluation: measured at the start of a fresh run and kept in ``eval_before.json``;
        a resumed run reads it from the run it resumes (its checkpoint's run folder), never re-measures it."""
        if not self.cfg.train.resume_from:
            before, images, captions = self.evaluate("before")
            if self.main:
                (self.out / "eval_before.json").write_text(json.dumps({"metrics": before, "captions": captions}))
                torch.save(images, self.out / "eval_images_before.pt")
            return before, images, captions
        origin = resolve_checkpoint(self.cfg.train.resume_from).parent.parent
        for folder in (origin, self.out):
            if (folder / "eval_before.json").is_file():
                rec = json.loads((folder / "eval_before.json").read_text())
                images = folder / "eval_images_before.pt"
                img = torch.load(images, weights_only=True) if images.is_file() else torch.empty(0)
                if self.main and folder != self.out:
                    (self.out / "eval_before.json").write_text(json.dumps(rec))
                    torch.save(img, self.out / "eval_images_before.pt")
                return rec["metrics"], img, rec["captions"]
        logger.warning("no eval_before.json in %s: the base model's 'before' evaluation is not known to this "
                       "resumed run; summary.json reports no 'before' figures", origin)
        return {}, torch.empty(0), []

    def _finished(self) -> bool:
        """Whether the resumed checkpoint already ends the run and its final products are all there (then nothing
        is trained or rewritten). A run that trained every epoch but lacks ``summary.json`` or the model card
        (interrupted during its final evaluation and save) is not finished: the resume evaluates and writes them."""
        if self.epoch < self.cfg.train.num_epochs:
            return False
        final = {"summary.json": self.out / "summary.json", "model card": self.weights_dir / "README.md"}
        missing = [name for name, path in final.items() if not path.is_file()]
        if missing:
            logger.warning("the run in %s trained all %d epochs but its final outputs are incomplete (no %s): it was "
                           "stopped during its final evaluation and save; finishing them now", self.out,
                           self.cfg.train.num_epochs, " and no ".join(missing))
            return False
        logger.warning("the run of %s already finished all %d epochs (its checkpoint is after epoch %d): nothing "
                       "to do, nothing rewritten. To train further, resume with a larger train.num_epochs.",
                       self.cfg.train.resume_from, self.cfg.train.num_epochs, self.epoch - 1)
        return True

    def fit(self) -> dict:
        """Train for ``train.num_epochs`` epochs; returns the summary also written to ``summary.json``.

        Logs one line per epoch (:func:`~flowgrpo.metrics.epoch_line`: progress, elapsed time and ETA, reward,
        trained fraction, the off-policy updates' clip fraction and KL). A resumed run that is already finished
        returns the run's existing summary (or ``{}``) untouched."""
        cfg = self.cfg
        if self._finished():
            self.scorer.close()
            summary = self.out / "summary.json"
            # the files of this output_dir (a copied run folder's summary names the folder it was copied from)
            return {**json.loads(summary.read_text()), "outputs": self._outputs()} if summary.is_file() else {}
        if self.main:
            self._claim_output_dir()
            self._write_config()
            (self.out / "rewards.json").write_text(json.dumps([o.__dict__ for o in self.reward_origins], indent=1))
        t0 = time.perf_counter()  # the evaluations and the final save are timed here, outside the epochs' records
        before, img_before, captions = self._before()
        eval_seconds = time.perf_counter() - t0
        last, first = cfg.train.num_epochs - 1, self.epoch
        start = time.perf_counter()
        for epoch in range(self.epoch, cfg.train.num_epochs):
            self.epoch = epoch
            every = cfg.logging.eval_every
            record = self.train_epoch(epoch, evaluate=bool(every) and (epoch + 1) % every == 0 and epoch < last)
            self.watch.check(record, epoch, cfg.train.num_epochs, self.out / "checkpoints")  # before any save
            if cfg.logging.save_every and (epoch + 1) % cfg.logging.save_every == 0 and epoch < last:
                self.save_checkpoint(epoch)
            if self.main:
                elapsed = time.perf_counter() - start
                eta = elapsed / (epoch + 1 - first) * (last - epoch)
                logger.info("%s", epoch_line(record, epoch, cfg.train.num_epochs, elapsed, eta))
        self.stage = "final"  # the final evaluation and save (what an interruption report names)
        t0 = time.perf_counter()
        after, img_after, captions_after = self.evaluate("after")
        eval_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.save_checkpoint(last)
        with self._eval_weights():
            self.save_weights()
        save_seconds = time.perf_counter() - t0
        summary = self.write_summary(before, after, img_before, img_after, captions or captions_after,
                                     extra_seconds={"eval": eval_seconds, "save": save_seconds})
        if self.main:
            from flowgrpo.model_card import pipeline_call, write_model_card

            write_model_card(self.cfg, summary, self.weights_dir, self.out,
                             pipeline_class=type(self.adapter.pipe).__name__, prompt=self.prompts.prompts[0],
                             call=pipeline_call(self.cfg, self.adapter.height, self.adapter.width))
        self.scorer.close()
        return summary

    def train_epoch(self, epoch: int, evaluate: bool = False) -> dict:
        """One epoch's phases; with ``evaluate`` the held-out evaluation joins the epoch's record."""
        cfg = self.cfg
        m = self.metrics
        calls0, rows0 = self.forward_count
        truncation = getattr(self.adapter, "truncation", None)
        cut0 = truncation.total if truncation is not None else 0
        with m.timed("rollout"):
            traj, handles = self.rollout_phase()
        m.log({"rollout/transformer_calls": self.forward_count[0] - calls0,
               "rollout/transformer_rows": self.forward_count[1] - rows0, "rollout/trajectories": traj.batch_size})
        if truncation is not None:  # prompt encodings cut at a text encoder's limit, over all processes
            cut = dist.all_reduce_sum(torch.tensor([float(truncation.total - cut0)], dtype=torch.float64))
            m.log({"rollout/truncated_prompts": float(cut[0])})
        with m.timed("reward"):  # only the wait for scores not finished during the rollout
            rewards, group_ids = self.reward_phase(traj, handles)
        with m.timed("filter"):
            kept = self.group_filter(rewards, group_ids, cfg.algo.group_filter)
        with m.timed("advantage"):
            adv = self.advantage_phase(rewards, group_ids, kept.keep)
        with m.timed("plan"):
            plan = self.chunker.plan(traj, epoch, make_generator(cfg.train.seed, epoch, dist.rank(), "plan"))
        if not bool(kept.keep.all()):  # filtered-out samples are not forwarded in training at all
            plan = ChunkPlan(plan.chunks, plan.selected & kept.keep[dist.local_slice(len(kept.keep))].unsqueeze(1))
        m.log(kept.metrics)
        with m.timed("plan"):  # one schedule: the recompute scores old log-probs in the update's very packs
            steps = self._schedule(traj, plan, _pair_mask(plan, adv))
        old = traj.log_probs
        if self.recompute:
            with m.timed("recompute"):
                old = self.recompute_old_log_probs(traj, plan, steps)
        calls0, rows0 = self.forward_count
        with m.timed("update"):
            upd = self.update_phase(traj, adv, plan, old, steps)
        m.log({"update/transformer_calls": self.forward_count[0] - calls0,
               "update/transformer_rows": self.forward_count[1] - rows0})
        if cfg.logging.save_rollout_stats:
            self.save_rollout_stats(epoch, traj, rewards, group_ids, adv)
        m.log(_reward_metrics(rewards))
        self._warn_low_signal(epoch, adv)
        m.log({"adv/zero_spread_frac": adv.zero_spread_frac, "adv/nan_frac": adv.nan_frac,
               "adv/learning_frac": adv.learning_frac,
               "adv/kept_frac": float(adv.train_mask.double().mean()), "adv/abs_mean": float(adv.values.abs().mean()),
               "plan/chunks": plan.num_chunks, "plan/trained_frac": float(plan.selected.double().mean())})
        m.log(upd)
        if evaluate:
            with m.timed("eval"):
                m.log(self.evaluate(f"epoch {epoch + 1}")[0])  # 1-based, as the epoch lines
        every = cfg.logging.plot_every
        if self.main and (epoch == cfg.train.num_epochs - 1 or (every and (epoch + 1) % every == 0)):
            with m.timed("plots"):
                self._plot(epoch, traj, rewards)
        return m.commit(epoch)

    def _plot(self, epoch: int, traj: Trajectory, rewards: Rewards) -> None:
        """``reward_curve.png`` (every epoch so far, this one included) and ``samples_latest.png`` (the first 16
        samples of this epoch's rollout with their rewards)."""
        from flowgrpo.plots import reward_curve, sample_grid

        reward_curve(read_metrics(self.out / "metrics.jsonl") + [self.metrics.pending(epoch)],
                     self.out / "reward_curve.png")
        k = min(16, traj.batch_size)
        caps = [f"{p[:28]}\n{r:.3g}" for p, r in zip(traj.prompts[:k], rewards.total[:k].tolist(), strict=True)]
        sample_grid(traj.images[:k], caps, self.out / "samples_latest.png", title=f"epoch {epoch + 1}")

    def _warn_low_signal(self, epoch: int, adv: Advantages) -> None:
        """Metric ``adv/low_signal`` (1.0 or 0.0) each epoch; a console warning, with what to change, the first
        epoch the fraction of samples with a learning signal falls below ``algo.min_learning_frac``."""
        low = adv.learning_frac < self.cfg.algo.min_learning_frac
        self.metrics.log({"adv/low_signal": float(low)})
        if not low or self._low_signal_warned or not self.main:
            return
        self._low_signal_warned = True
        logger.warning(
            "epoch %d: only %.1f%% of the samples carry a learning signal (%.1f%% of the groups have equal rewards, "
            "%.1f%% of the samples a NaN reward; algo.min_learning_frac=%g): the update moves the policy little or "
            "not at all. Make the rewards differ within a group: a denser reward (a probability, not a 0/1 "
            "verdict), a larger train.group_size, more sampling.num_steps or a higher sampling.noise_level. "
            "Metric adv/low_signal marks each such epoch; this warning is shown once.",
            epoch, 100 * adv.learning_frac, 100 * adv.zero_spread_frac, 100 * adv.nan_frac,
            self.cfg.algo.min_learning_frac)

    def save_rollout_stats(self, epoch: int, traj: Trajectory, rewards: Rewards, group_ids: torch.Tensor,
                           adv: Advantages) -> None:
        """Gathered per-sample statistics of the epoch (global sample order) as safetensors."""
        from safetensors.torch import save_file

        init = dist.gather_cat(traj.latents[:, 0].float().contiguous())
        if not self.main:
            return
        folder = self.out / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"reward_total": rewards.total.contiguous(), "advantages": adv.values.contiguous(),
                   "group_ids": group_ids.contiguous(), "train_mask": adv.train_mask.contiguous(),
                   "initial_latents": init.cpu().contiguous(),
                   **{f"reward/{k}": v.contiguous() for k, v in rewards.components.items()}},
                  folder / f"epoch_{epoch}.safetensors")

    @property
    def weights_dir(self) -> Path:
        """Where the final weights go: ``output_dir/lora`` (LoRA) or ``output_dir/transformer`` (full)."""
        return self.out / ("lora" if self.cfg.model.finetune == "lora" else "transformer")

    def save_weights(self) -> None:
        """The trained LoRA (diffusers ``load_lora_weights`` format) or full transformer (``from_pretrained``)."""
        if not self.main:
            return
        from flowgrpo.models.lora import save_lora

        tr = self.accelerator.unwrap_model(self.model)
        if self.cfg.model.finetune == "lora":
            save_lora(self.adapter, self.weights_dir)
        else:
            tr.save_pretrained(self.weights_dir)

    def write_summary(self, before, after, img_before, img_after, captions,
                      extra_seconds: dict[str, float] | None = None) -> dict:
        """``summary.json``: every evaluation figure before and after (``<name>_before`` / ``_after``; reference
        figures such as ``diversity_real`` once), ``epochs``, ``train_seconds`` (the epochs' phases),
        ``phase_seconds`` (wall seconds per phase over the run, evaluation and the final save included) and
        ``outputs`` (where each product of the run was written); plus ``before_after.png``."""
        summary: dict = {}
        for key in sorted(set(before) | set(after)):
            short = key.removeprefix("eval/").replace("/", "_")
            if short.endswith("_real"):  # a reference figure of real data: the same before and after
                summary[short] = after.get(key, before.get(key))
                continue
            if key in before:
                summary[f"{short}_before"] = before[key]
            if key in after:
                summary[f"{short}_after"] = after[key]
        records = read_metrics(self.out / "metrics.jsonl") if self.main else []
        summary["epochs"] = self.cfg.train.num_epochs
        phases: dict[str, float] = {}
        for r in records:
            for k, v in r.items():
                if k.startswith("timing/") and v is not None:
                    phases[k.removeprefix("timing/")] = phases.get(k.removeprefix("timing/"), 0.0) + v
        summary["train_seconds"] = sum(v for k, v in phases.items() if k != "eval")
        for k, v in (extra_seconds or {}).items():
            phases[k] = phases.get(k, 0.0) + v
        rank = {p: i for i, p in enumerate(("rollout", "reward", "filter", "advantage", "plan", "recompute", "update",
                                            "plots", "eval", "save"))}  # the order the phases run in
        summary["phase_seconds"] = dict(sorted(phases.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))
        summary["outputs"] = self._outputs()
        if self.main:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
            (self.out / "summary.json").write_text(json.dumps(clean, indent=1))
            if img_after.numel():  # what `flowgrpo sample --run` reproduces
                torch.save(img_after, self.out / "eval_images_after.pt")
            if img_before.numel():
                self._write_before_after(img_before, img_after, captions, summary)
        return summary

    def _write_before_after(self, img_before, img_after, captions, summary) -> None:
        """``before_after.png``; for an editing model (evaluation records with ``images``) one column per prompt
        with its source image on top of its before and after images."""
        from flowgrpo.plots import before_after, edits_before_after
        from flowgrpo.sampling.rollout import load_condition_images

        _, meta = self._eval_set()
        if not all(m.get("images") for m in meta):
            before_after(img_before, img_after, captions, self.out / "before_after.png",
                         per_digit=per_digit_rows(summary))
            return
        sources = [torch.from_numpy(np.asarray(load_condition_images(m["images"][:1])[0]).copy()) for m in meta[:10]]
        edits_before_after(sources, img_before, img_after, captions, self.out / "before_after.png")

    def _outputs(self) -> dict[str, str]:
        """The run's products by name: path (as strings)."""
        names = {"run folder": "", "weights": self.weights_dir.name, "model card": f"{self.weights_dir.name}/README.md",
                 "checkpoints": "checkpoints", "config": "config.yaml", "metrics": "metrics.jsonl",
                 "summary": "summary.json", "reward curve": "reward_curve.png", "before/after": "before_after.png",
                 "last rollout": "samples_latest.png"}
        return {k: str(self.out / v) if v else str(self.out) for k, v in names.items()}


#: the settings that decide what an evaluation measures (the RL seed also picks the evaluation's seeds)
_EVAL_SETTINGS = ("data.eval_prompts", "data.eval_num_prompts", "eval_sampling.", "eval_rewards", "rewards",
                  "train.seed")


def _changed_settings(saved: Path, cfg: Config) -> dict[str, str]:
    """{key: "key: old -> new"} for every setting of ``cfg`` that differs from the saved config file ``saved``
    (``train.resume_from`` left out; a key one of them lacks shows as ``(absent)``)."""
    old = flat_dict(yaml.safe_load(saved.read_text()) or {})
    new = flat_dict(cfg.model_dump(mode="json"))
    absent = object()

    def shown(v) -> str:
        return "(absent)" if v is absent else repr(v)

    return {k: f"{k}: {shown(old.get(k, absent))} -> {shown(new.get(k, absent))}" for k in sorted(set(old) | set(new))
            if old.get(k, absent) != new.get(k, absent) and k != "train.resume_from"}


COLLAPSE_RATIO = 0.6  # a digit less varied than this fraction of the same digit's real digits is flagged


def per_digit_rows(summary: dict) -> list[dict[str, float | None]]:
    """Per-digit figures of a digits summary, one dict per digit 0–9 found (``digit``, ``correctness_before``,
    ``correctness_after``, ``diversity_before``, ``diversity_after``, ``diversity_real``, ``ratio_after`` =
    diversity_after / diversity_real, ``collapsed`` = ratio_after < :data:`COLLAPSE_RATIO`); empty for other
    tasks."""
    rows = []
    for d in range(10):
        real = summary.get(f"digit_{d}_diversity_real")
        if real is None:
            continue
        div_after = summary.get(f"digit_{d}_diversity_after")
        rows.append({
            "digit": d, "correctness_before": summary.get(f"digit_{d}_correctness_before"),
            "correctness_after": summary.get(f"digit_{d}_correctness_after"),
            "diversity_before": summary.get(f"digit_{d}_diversity_before"), "diversity_after": div_after,
            "diversity_real": real, "ratio_after": None if div_after is None or not real else div_after / real,
        })
        rows[-1]["collapsed"] = rows[-1]["ratio_after"] is not None and rows[-1]["ratio_after"] < COLLAPSE_RATIO
    return rows


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
