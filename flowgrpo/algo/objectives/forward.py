"""What the forward-process objectives (``nft``, ``awm``, ``dgpo``) share: their settings base, the rollout, the
plan and the update's micro-batches and losses; each objective adds only its σ and noise draws and its per-row loss.

The epoch (the phases of :mod:`flowgrpo.algo.objectives.base`):

1. **rollout**: an ODE (or SA-Solver) sample per requested sample with ``objective.solver`` on the objective's
   grid (:meth:`ForwardObjective.grids`), at ``sampling.guidance_scale``, under the weights the objective rolls out
   with (:meth:`ForwardObjective.rollout_weights`: DiffusionNFT the old copy, AWM the trained ones, DGPO the trained
   ones until ``switch_ema_ref`` steps, then the old copy); only the final latents x₀ are kept
   (:class:`~flowgrpo.records.FinalSamples`).
2. **reward, filter, advantage**: as for every objective (every estimator and group filter).
3. **plan**: micro-batches of ``train_batch_size`` local samples (consecutive, or cut from a seeded permutation of
   each rollout batch: :meth:`ForwardObjective.micro_batch_order`, AWM's release layout),
   ``optimizer_steps_per_epoch`` equal consecutive shares of them, and each step's trained rows summed over the
   processes (one collective an epoch).
4. **update**: for each micro-batch the objective draws its training σ's and fresh noise ε
   (:meth:`ForwardObjective.draws`: DiffusionNFT per sample, AWM per micro-batch, DGPO per epoch and per group);
   for each of the K draws one forward of the micro-batch's rows at ``x_σ = (1 − σ)·x₀ + σ·ε`` (the no-gradient
   forwards first: old copy, reference; then the trained weights with gradient, at
   ``objective.train_guidance_scale``) and the per-row loss (:meth:`ForwardObjective.terms`, the wave's pure
   functions) summed over the trained rows: each draw is one micro-batch of the update loop
   (:mod:`flowgrpo.training.update`), which back-propagates it scaled so an optimizer step minimises the mean over
   all its rows on all processes (the releases' gradient accumulation over micro-batches and σ's). Samples the
   advantages leave out (NaN reward, a dropped group, a GFPO rejection) are forwarded and masked.
5. the **old copy** moves on the objective's schedule (:meth:`ForwardObjective.after_step`, after every optimizer
   step; :meth:`ForwardObjective.after_epoch`, after the epoch's update) and is part of every checkpoint.

Every draw comes from a generator seeded by (run seed, epoch, pass, what, and the sample, the global micro-batch
or nothing), so an epoch is the same on any number of processes and any batching that keeps the draws' scope.
The SDE-ratio objective's own settings (its chunker, policy loss, clip ranges and KL) are in its own section
(``objective: {name: sde_ratio, ...}``), so a forward-process objective cannot be given them; the rollout settings
of ``sampling`` that only the SDE-ratio objective reads (``sampling.sde_kind`` and its noise, …) are refused with a
forward-process objective, all of them in one error, one line each (:func:`sde_ratio_problems`,
:meth:`ForwardConfig.problems`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field
from pydantic.fields import FieldInfo

from flowgrpo.algo.microbatches import micro_batches, step_shares
from flowgrpo.algo.objectives.base import (
    KL_BETA,
    BaseObjective,
    MicroBatchAt,
    ObjectiveConfig,
    UpdateStep,
    _moved,
    shared_field,
)
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms
from flowgrpo.algo.objectives.old_copy import OldCopy
from flowgrpo.distributed import dist
from flowgrpo.records import Advantages, FinalSamples
from flowgrpo.sampling.final_rollout import solver_rollout
from flowgrpo.sampling.solvers import SOLVERS, awm_sa_grid, check_grid, flow_sigmas
from flowgrpo.strategies.settings import registered_name

SolverName = registered_name(SOLVERS, "objective.solver")

#: settings only the SDE-ratio objective reads: (section, key) -> what a forward-process objective uses instead (an
#: objective's :attr:`ForwardConfig.instead` replaces the entries that are not true of it)
SDE_RATIO_ONLY = {
    ("sampling", "sde_kind"): "its rollout solver is objective.solver",
    ("sampling", "noise_level"): "its solver's noise is objective.solver_noise_level",
    ("sampling", "logprob_reduction"): "it computes no log-probabilities",
    ("sampling", "cps_simplified_logprob"): "it computes no log-probabilities",
    ("sampling", "sigma_one_guard"): "its rollout is an ODE solver",
    ("sampling", "final_decode"): "it decodes the solver's final sample",
}

#: what a dataset objective (``sft``, ``dpo_offline``) reads in place of the rollout's settings
DATASET_INSTEAD = {("sampling", k): "it samples nothing: the dataset's images are its samples"
                   for k in ("sde_kind", "noise_level", "sigma_one_guard", "final_decode")}
#: the :class:`ForwardConfig` fields a dataset objective never reads (it samples nothing)
DATASET_UNREAD = {k: "it samples nothing: the dataset's images are its samples"
                  for k in ("solver", "solver_noise_level", "grid", "grid_shift")}
#: the old copy's fields, unread by an objective that keeps no old copy
NO_OLD_COPY_UNREAD = {k: "it keeps no old copy of the weights" for k in ("decay_flat", "decay_ramp", "decay_cap")}


def sde_ratio_problems(objective, config) -> list[str]:
    """One line for each ``sampling`` setting only the SDE-ratio objective reads (:data:`SDE_RATIO_ONLY`) moved
    from its default, for the objective settings ``objective`` (an
    :class:`~flowgrpo.algo.objectives.base.ObjectiveConfig` whose class declares ``trains_on`` and ``instead``, as
    :class:`ForwardConfig` does) in the run config ``config``: who reads it, what the objective trains on and
    reads instead."""
    out = []
    instead = {**SDE_RATIO_ONLY, **type(objective).instead}
    for (sec, key), why in instead.items():
        section = getattr(config, sec)
        if _moved(section, key):
            default = type(section).model_fields[key].default
            out.append(f"{sec}.{key}={getattr(section, key)!r} is read only by objective.name=sde_ratio, but "
                       f"objective.name is {objective.name!r}, which trains on {objective.trains_on} ({why}): remove "
                       f"the setting, or set it back on the command line: {sec}.{key}={default!r}")
    return out


class ForwardConfig(ObjectiveConfig):
    """Settings every forward-process objective has (``objective:``); each objective sets the release's defaults
    with :func:`shared` (the same constraints and description, its own default)."""

    #: what the objective trains on, for the refusals of the SDE-ratio settings (:func:`sde_ratio_problems`)
    trains_on: ClassVar[str] = "the rollout's final samples"
    #: what it reads in place of an SDE-ratio setting, where :data:`SDE_RATIO_ONLY`'s text is not true of it
    instead: ClassVar[dict[tuple[str, str], str]] = {}

    solver: SolverName = Field("euler", description="forward-process objectives: the rollout's solver "
                               "(flowgrpo.sampling.solvers: euler; dpmpp_2m, DiffusionNFT's dpm2 and DGPO's "
                               "DPM-Solver++(2M); sa_solver, AWM's SA-Solver, which rolls out on AWM's moved grid)")
    solver_noise_level: float = Field(0.0, ge=0, description="the rollout solver's noise: SA-Solver's tau for "
                                      "0.3 <= sigma <= 0.9 (AWM: 0.4); deterministic solvers read none")
    grid: Literal["model", "flow_shift"] = Field(
        "model", description="the rollout's and the training sigmas' grid: the model's scheduler grid (model; "
        "DiffusionNFT, AWM), or diffusers' use_flow_sigmas grid with shift grid_shift (flow_shift: DGPO's, "
        "starting below 1)")
    grid_shift: float = Field(3.0, gt=0, description="the shift of grid=flow_shift (DGPO: 3)")
    train_guidance_scale: float = Field(
        1.0, ge=0, description="guidance of the training forwards, independent of sampling.guidance_scale: 1.0 is "
        "no CFG (the releases' SD3.5 training; SD3's true CFG needs > 1); a guidance-embedding model (FLUX.1-dev) "
        "takes the embedding's value")
    kl_beta: float = shared_field(KL_BETA, 0.0)
    adv_clip_max: float = Field(5.0, gt=0, description="advantages clipped to +-c (every release: 5); DiffusionNFT "
                                "maps them to r = A/(2c) + 1/2 and scales its loss by c, AWM rescales them to "
                                "+-advantage_max")
    decay_flat: int = Field(0, ge=0, description="old copy: steps with decay 0 (old <- d*old + (1-d)*weights, "
                            "d = 0 for k < flat else min((k - flat)*ramp, cap))")
    decay_ramp: float = Field(0.001, ge=0, description="old copy: decay gained per optimizer step after flat")
    decay_cap: float = Field(0.5, ge=0, lt=1, description="old copy: the largest decay (DiffusionNFT decay_type 1: "
                             "0.5; type 2 (OCR): flat 75, ramp 0.0075, cap 0.999; AWM and DGPO: 0.3)")

    def problems(self, config) -> list[str]:
        """:class:`ObjectiveConfig`'s problems (its :attr:`unread` fields), then every setting only the SDE-ratio
        objective reads (:func:`sde_ratio_problems`), one line each."""
        return super().problems(config) + sde_ratio_problems(self, config)


def shared(name: str, default):
    """The :class:`ForwardConfig` field ``name`` with another default (an objective's release value)."""
    return FieldInfo.merge_field_infos(ForwardConfig.model_fields[name], default=default)


@dataclass(frozen=True)
class RowDraw:
    """One forward of a micro-batch: its rows and their training σ and noise.

    Attributes:
        rows: (n,) long host, local sample indices. sigma: (n,) float32 host. noise: (n, …) float32 host ε.
    """

    rows: torch.Tensor
    sigma: torch.Tensor
    noise: torch.Tensor


@dataclass(frozen=True)
class ForwardWork:
    """An epoch's forward-process update, planned.

    Attributes:
        samples: the rollout; adv: the batch's advantages (all processes).
        advantages: (B_local,) float32 host, this process's; trained: (B_local,) bool host, the samples trained.
        steps: per optimizer step, its micro-batches ((n,) long host local indices).
        step_rows: per optimizer step, its trained rows (sample, σ) over all processes.
        offset: the global index of this process's first sample.
        epoch: 0-based; extra: what the objective drew for the whole epoch (DGPO's σ indices, group numbering).
        recompute: always False (nothing to rescore).
    """

    samples: FinalSamples
    adv: Advantages
    advantages: torch.Tensor
    trained: torch.Tensor
    steps: list[list[torch.Tensor]]
    step_rows: list[float]
    offset: int
    epoch: int
    extra: dict = field(default_factory=dict)
    recompute: bool = False

    def micro_batch_index(self, rows: torch.Tensor) -> int:
        """The global index of micro-batch ``rows`` (one of :attr:`steps`' tensors): this process's first
        micro-batch's (``offset // len(rows)``) plus its position in the plan. Raises ``ValueError`` for rows that
        are not one of the plan's micro-batches."""
        flat = [mb for share in self.steps for mb in share]
        for i, mb in enumerate(flat):
            if mb is rows or (mb.shape == rows.shape and torch.equal(mb, rows)):
                return self.offset // len(rows) + i
        raise ValueError(f"rows {rows.tolist()} are not one of the plan's micro-batches")

    @property
    def metrics(self) -> dict[str, float]:
        """``plan/trained_samples_frac`` (the share of local samples trained; not ``plan/trained_frac``, the share
        of a trajectory's transitions, which the epoch line shows as "% of steps") and ``plan/rows`` (all
        processes)."""
        return {"plan/trained_samples_frac": float(self.trained.double().mean()),
                "plan/rows": float(sum(self.step_rows))}


class _Stats:
    """Sums of each per-row statistic over trained rows, kept on the model's device, read once (all processes)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[torch.Tensor]] = {}
        self.rows: list[torch.Tensor] = []

    def add(self, terms: ObjectiveTerms, mask: torch.Tensor) -> None:
        m = mask.to(terms.loss.dtype)
        self.rows.append(m.sum())
        for name, value in {"loss": terms.loss.detach(), **terms.stats}.items():
            self.sums.setdefault(name, []).append((value.float() * m).sum())

    def metrics(self) -> dict[str, float]:
        if not self.rows:
            return {}
        names = list(self.sums)
        local = torch.stack([torch.stack(self.rows).sum()] + [torch.stack(self.sums[n]).sum() for n in names])
        total = dist.all_reduce_sum(local.double()).tolist()
        if total[0] == 0:
            return {}
        return {"objective/rows": total[0], **{f"objective/{n}": v / total[0] for n, v in zip(names, total[1:],
                                                                                              strict=True)}}


class ForwardObjective(BaseObjective):
    """The forward-process family's phases (module docstring). Subclasses set ``Config`` and implement
    :meth:`sigmas_per_sample`, :meth:`draws` and :meth:`terms`, and override the weight
    hooks (:meth:`rollout_weights`, :meth:`after_step`, :meth:`after_epoch`) and checks as their release does."""

    Config: ClassVar[type[ForwardConfig]] = ForwardConfig
    #: whether the objective keeps an old copy of the weights (a checkpointed float32 shadow)
    uses_old_copy: ClassVar[bool] = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.o = config.objective
        self.optim = None
        self.old: OldCopy | None = None

    # ------------------------------------------------------------------ what a subclass provides
    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        """K, the training σ's (forwards) each sample gets per pass, on the training grid ``sigmas`` (T+1,)."""
        raise NotImplementedError

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[RowDraw]:
        """The K forwards of micro-batch ``rows`` in pass ``inner``."""
        raise NotImplementedError

    def terms(self, adapter, work: ForwardWork, draw: RowDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """The per-row loss of one forward (x0 (n, …) on the model's device)."""
        raise NotImplementedError

    def micro_batch_order(self, n: int, epoch: int, offset: int) -> torch.Tensor | None:
        """The order (n,) long of this process's ``n`` samples (the first of them global sample ``offset``) that
        the plan cuts its micro-batches from, in ``epoch``; None: consecutive (the default)."""
        return None

    def plan_extra(self, samples: FinalSamples, epoch: int) -> dict:
        """What the objective draws once an epoch (nothing by default)."""
        return {}

    def check_grid(self, sigmas: torch.Tensor) -> None:
        """The objective's checks on its training grid (T+1,) (``ValueError``); nothing by default."""

    def check_whole_groups(self, why: str) -> None:
        """Refuse a batch whose groups span data ranks (``ValueError`` in one line, saying ``why`` the objective
        needs every group on one process): each rank's share of ``batch_size`` must be whole groups."""
        local, g = self.cfg.batch_size // dist.data_world_size(), self.cfg.train.group_size
        if local % g:
            raise ValueError(f"objective {self.o.name!r} {why}: the {local} samples each of {dist.data_world_size()} "
                             f"data ranks holds must be whole groups of train.group_size={g}; choose "
                             "train.prompts_per_epoch divisible by the number of processes")

    # ------------------------------------------------------------------ checks
    @property
    def needs_reference(self) -> bool:
        """A KL to the reference (``objective.kl_beta`` > 0)."""
        return self.o.kl_beta > 0

    def grids(self, model_sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rollout grid, training grid), (T+1,) float32 host each: the model's grid or DGPO's flow-shift grid;
        SA-Solver rolls out on AWM's moved grid (:func:`~flowgrpo.sampling.solvers.awm_sa_grid`, σ₀ = 1 − 1e-3,
        the last non-zero σ set to half the σ before it) and trains on the unmoved one, as the release."""
        t = model_sigmas.numel() - 1
        base = model_sigmas.float().cpu() if self.o.grid == "model" else flow_sigmas(t, self.o.grid_shift)
        return (awm_sa_grid(base) if self.o.solver == "sa_solver" else base), base

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """Both grids checked on the model's σ grid (and the objective's own checks); one sample each."""
        roll, train = self.grids(sigmas)
        check_grid(roll)
        check_grid(train)
        if self.o.solver == "sa_solver" and roll.numel() < 3:
            raise ValueError(f"objective.solver=sa_solver needs sampling.num_steps >= 2, got {roll.numel() - 1}")
        if self.sigmas_per_sample(train) < 1:
            raise ValueError(f"objective {self.o.name!r} trains no sigma on a {train.numel() - 1}-step grid")
        self.check_grid(train)
        return 1

    # ------------------------------------------------------------------ the weights
    def prepare(self, optim) -> None:
        """Keep the optimizer (its step count) and start the old copy as the prepared weights."""
        self.optim = optim
        if self.uses_old_copy:
            self.old = OldCopy(optim.params, self.o, model=optim.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The old copy (float32, as this process holds it: :meth:`OldCopy.state_dict`), or nothing."""
        return self.old.state_dict() if self.old is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.old is None:
            super().load_state_dict(state)
        else:
            self.old.load_state_dict(state)

    def rollout_weights(self):
        """The weights the rollout samples with (a context); the trained ones by default."""
        return contextlib.nullcontext()

    def velocity(self, adapter, x, sigma, embeds, *, weights: str = "trained", guidance: float | None = None):
        """The velocity (n, …) at (x, σ) under ``weights``: ``trained`` (with gradient), ``old`` (the old copy,
        no gradient) or ``reference`` (the base model, no gradient), at ``train_guidance_scale`` by default."""
        g = self.o.train_guidance_scale if guidance is None else guidance
        if weights == "trained":
            return adapter.velocity(x, sigma, embeds, g)
        scope = self.old.swapped() if weights == "old" else adapter.reference()
        with torch.no_grad(), scope:
            return adapter.velocity(x, sigma, embeds, g)

    # ------------------------------------------------------------------ phases
    def rollout(self, adapter, request) -> FinalSamples:
        """The solver's final samples (module docstring, 1.), under :meth:`rollout_weights`."""
        roll, train = self.grids(adapter.sigmas(request.settings.num_steps))
        with self.rollout_weights():
            return solver_rollout(adapter, request, solver=self.o.solver, sigmas=roll, train_sigmas=train,
                                  noise_level=self.o.solver_noise_level, cache=self.cfg.sampling.cache)

    def plan(self, samples: FinalSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """Micro-batches, optimizer-step shares and each step's trained rows over all processes (one collective)."""
        t = self.cfg.train
        local = dist.local_slice(len(adv.values))
        trained = adv.train_mask[local] & keep[local]
        mbs = micro_batches(samples.batch_size, self.cfg.train_batch_size)
        order = self.micro_batch_order(samples.batch_size, epoch, local.start)
        if order is not None:
            mbs = [order[mb] for mb in mbs]
        shares = step_shares(mbs, t.optimizer_steps_per_epoch)
        k = self.sigmas_per_sample(samples.sigmas)
        counts = torch.tensor([sum(float(trained[mb].sum()) * k for mb in share) for share in shares],
                              dtype=torch.float64)
        return ForwardWork(samples, adv, adv.values[local].float(), trained, shares,
                           dist.all_reduce_sum(counts).tolist(), local.start, epoch, self.plan_extra(samples, epoch))

    def recompute(self, adapter, work: ForwardWork) -> ForwardWork:
        """Nothing to rescore (the plan never asks)."""
        return work

    # ------------------------------------------------------------------ the update (run by training.update)
    def update_steps(self, work: ForwardWork) -> list[UpdateStep]:
        """The plan's optimizer steps: each its micro-batches and its trained rows over all processes."""
        return [UpdateStep(share, rows, len(share)) for share, rows in zip(work.steps, work.step_rows, strict=True)]

    def update_state(self, work: ForwardWork) -> _Stats:
        """The sums of the per-row statistics over the trained rows."""
        return _Stats()

    def micro_batches(self, work: ForwardWork, step: UpdateStep, inner: int) -> list[RowDraw]:
        """The step's forwards in pass ``inner``: the K draws (:meth:`draws`) of each of its micro-batches."""
        return [d for mb in step.plan for d in self.draws(work, mb, inner)]

    def loss(self, adapter, work: ForwardWork, draw: RowDraw, stats: _Stats, at: MicroBatchAt) -> torch.Tensor:
        """One forward's loss (:meth:`terms`) summed over the draw's trained rows; its statistics recorded."""
        s, dev = work.samples, adapter.device
        x0 = s.x0[draw.rows.to(s.x0.device)].to(dev).float()
        embeds = s.embeds.index(draw.rows.to(s.embeds.device))
        terms = self.terms(adapter, work, draw, x0, embeds)
        mask = work.trained[draw.rows].to(terms.loss.device)
        if not at.filler:
            stats.add(terms, mask)
        return (terms.loss * mask.to(terms.loss.dtype)).sum()

    def update_metrics(self, adapter, work: ForwardWork, stats: _Stats) -> dict[str, float]:
        """The ``objective/<stat>`` means over the trained rows (all processes) and ``objective/old_decay``."""
        out = stats.metrics()
        if self.old is not None:
            out["objective/old_decay"] = self.old.decay
        return out
