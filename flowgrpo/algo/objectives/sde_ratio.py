"""``sde_ratio``: the GRPO family (Flow-GRPO, DanceGRPO, MixGRPO, GCPO, E-GRPO and their losses).

The rollout samples SDE trajectories recording every transition's log-probability (the chunker decides which
transitions are stochastic); the chunker's plan picks the trained transitions and groups them into chunks that share
one importance ratio; the update minimises the registered policy loss (``objective.policy_loss``) of each chunk's ratio
over the trained (sample, chunk) pairs: the update's optimizer steps are the schedule's packs of micro-batches
(:mod:`flowgrpo.algo.microbatches`), run by the update loop (:mod:`flowgrpo.training.update`). Every log-prob, in
rollout and training, comes from the adapter's ``velocity`` and :func:`~flowgrpo.sampling.sde.sde_step`, so the
first ratio of an on-policy update is exactly 1 when the training batch layout equals the rollout's
(``policy/logprob_mismatch_max`` reports it); a chunker that changes the layout (``needs_recompute``),
``objective.recompute_old_log_probs`` or a loss that reads the transition moments rescore the old log-probs under the
training layout first (the ``recompute`` phase).

Only the first optimizer step of the first pass is on-policy; the ratio statistics of the later ones are logged
under ``policy_later/``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, ClassVar, Literal

import torch
from annotated_types import Gt
from pydantic import Field, SerializeAsAny, field_validator, model_validator

from flowgrpo.algo.chunkers import CHUNKERS, ChunkerConfig, build_chunker
from flowgrpo.algo.microbatches import StepWork, pair_mask, schedule
from flowgrpo.algo.objectives.base import (
    CLIP_RANGE,
    KL_BETA,
    OBJECTIVES,
    TIMESTEP_FRACTION,
    BaseObjective,
    MicroBatchAt,
    ObjectiveConfig,
    UpdateStep,
    shared_field,
)
from flowgrpo.algo.policy_losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossInput, needs_moments
from flowgrpo.compile import training_graph
from flowgrpo.distributed import dist
from flowgrpo.records import Advantages, ChunkPlan, Trajectory
from flowgrpo.rng import make_generator
from flowgrpo.sampling.packed_forward import ChunkForward, packed_forward
from flowgrpo.sampling.sde import KL_FORMS, SDE_KINDS
from flowgrpo.strategies.settings import registered_name, strategy_settings

KlFormName = registered_name(KL_FORMS, "objective.kl_form")


class SdeRatioConfig(ObjectiveConfig):
    """Settings of ``sde_ratio`` (``objective: {name: sde_ratio, ...}``), each read by this objective alone: the
    trust region and KL of the policy loss, the recompute switch, the policy loss's own section and the chunker's.
    The policy loss reads this section itself (:mod:`flowgrpo.algo.policy_losses`: ``clip_low``, ``clip_high``,
    ``kl_beta``, ``policy_loss``)."""

    name: Literal["sde_ratio"] = "sde_ratio"
    rollout_by_chunker: ClassVar[bool] = True
    clip_range: Annotated[float, Gt(0)] = shared_field(CLIP_RANGE, 1e-4)
    clip_range_low: float | None = Field(None, gt=0, description="sde_ratio: epsilon_low (default clip_range)")
    clip_range_high: float | None = Field(None, gt=0, description="sde_ratio: epsilon_high (default clip_range)")
    kl_beta: float = shared_field(KL_BETA, 0.0)
    timestep_fraction: float = shared_field(TIMESTEP_FRACTION, 1.0)
    kl_form: KlFormName = Field(
        "flow_grpo", description="sde_ratio: registered KL form of its KL on transition means: flow_grpo "
        "(Flow-GRPO's scripts: (mu-mu_ref)^2 / (2*std_dev_t^2), std_dev_t = a*sqrt(sigma/(1-sigma)), no dt) or "
        "gaussian (exact Gaussian KL with the transition std; 1/(sigma-sigma_next) times larger for flow_sde and "
        "dance_sde)"
    )
    recompute_old_log_probs: bool = Field(
        False, description="sde_ratio: recompute old log-probs with the training batch layout before the first update"
    )
    policy_loss: SerializeAsAny[PolicyLossConfig] = Field(
        default_factory=lambda: _strategy("objective.policy_loss", {}),
        description="sde_ratio: the policy loss and its own settings (one section per loss, "
        "flowgrpo.algo.policy_losses; a plain name is shorthand for {name: ...})"
    )
    chunker: SerializeAsAny[ChunkerConfig] = Field(
        default_factory=lambda: _strategy("objective.chunker", {}),
        description="sde_ratio: the chunker strategy and its own settings (one section per strategy, "
        "flowgrpo.algo.chunkers; a plain name is shorthand for {name: ...})"
    )

    @field_validator("policy_loss", "chunker", mode="before")
    @classmethod
    def _strategy_sections(cls, value, info):
        return _strategy(f"objective.{info.field_name}", value)

    @model_validator(mode="after")
    def _fraction_read(self) -> SdeRatioConfig:
        """``timestep_fraction`` moved from its default with a chunker that does not read it (one without
        ``reads_timestep_fraction``): ``ValueError`` naming the chunkers that do."""
        readers = [n for n in CHUNKERS if getattr(CHUNKERS.get(n), "reads_timestep_fraction", False)]
        if self.timestep_fraction != 1.0 and self.chunker.name not in readers:
            raise ValueError(f"objective.timestep_fraction={self.timestep_fraction} is read only with "
                             f"objective.chunker.name={' / '.join(readers)}, but the chunker is "
                             f"{self.chunker.name!r}: remove the setting (its default is 1.0) or choose "
                             f"{' / '.join(readers)}")
        return self

    @property
    def clip_low(self) -> float:
        """ε_low: ``clip_range_low``, else ``clip_range``."""
        return self.clip_range if self.clip_range_low is None else self.clip_range_low

    @property
    def clip_high(self) -> float:
        """ε_high: ``clip_range_high``, else ``clip_range``."""
        return self.clip_range if self.clip_range_high is None else self.clip_range_high

    def problems(self, config) -> list[str]:
        """:class:`ObjectiveConfig`'s problems, then the policy loss's ``check`` against the run (a ``ValueError``'s
        message)."""
        out = super().problems(config)
        try:
            self.policy_loss.check(config)
        except ValueError as err:
            out.append(str(err))
        return out


#: the strategy sections inside ``objective:`` (dotted key → the registry its ``name`` selects from, the settings
#: every strategy of the kind has)
NESTED_SECTIONS = {"objective.policy_loss": (POLICY_LOSSES, PolicyLossConfig),
                   "objective.chunker": (CHUNKERS, ChunkerConfig)}


def _strategy(key: str, value):
    """The nested strategy section ``key`` (of :data:`NESTED_SECTIONS`) validated from ``value`` (a name or a
    mapping) against the settings model of the strategy it names
    (:func:`flowgrpo.strategies.settings.strategy_settings`)."""
    registry, base = NESTED_SECTIONS[key]
    return strategy_settings(value, prefix=key, registry=registry, base=base)


@dataclass(frozen=True)
class SdeRatioWork:
    """An epoch's update, planned.

    Attributes:
        traj: the rollout; adv: its advantages (B,) over all processes.
        plan: the chunks and which local samples train them (filtered-out samples deselected).
        steps: each optimizer step's packed forwards (:func:`~flowgrpo.algo.microbatches.schedule`).
        old_log_probs: (B_local, T) float32 host, the rollout policy's (rescored by :meth:`SdeRatio.recompute`).
        old_means: (B_local, T, …) rollout-policy transition means, for a loss that reads moments (after the
            recompute), else None.
        epoch: the epoch (0-based); recompute: whether the ``recompute`` phase runs before the update.
    """

    traj: Trajectory
    adv: Advantages
    plan: ChunkPlan
    steps: list[StepWork]
    old_log_probs: torch.Tensor
    old_means: torch.Tensor | None
    epoch: int
    recompute: bool

    @property
    def metrics(self) -> dict[str, float]:
        """``plan/chunks`` (K) and ``plan/trained_frac`` (the share of the trajectory's transitions a trained
        sample trains: :meth:`~flowgrpo.records.ChunkPlan.trained_transition_frac`)."""
        return {"plan/chunks": self.plan.num_chunks,
                "plan/trained_frac": self.plan.trained_transition_frac(self.traj.jump)}


_STATS = ("pairs", "ratio", "clipped", "approx_kl", "kl_ref", "loss")


class _Accum:
    """Sums over trained pairs of one group of optimizer steps (on-policy first step, or the later ones).

    Each chunk's detached statistics are kept as they are, on the model's device (a few (N,) tensors), so
    adding a chunk launches no work and never waits for the device; :meth:`metrics` reduces them in one pass
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


@dataclass(frozen=True)
class _UpdateState:
    """An update's shared records (host) and its two accumulators (on-policy first step, the later ones)."""

    batch: dict[str, torch.Tensor]
    first: _Accum
    later: _Accum


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@OBJECTIVES.register("sde_ratio")
class SdeRatio(BaseObjective):
    """The GRPO family's objective (module docstring): the chunker's rollout and plan, an optional recompute, the
    registered policy loss over chunks."""
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None

    Config = SdeRatioConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        self.o: SdeRatioConfig = config.objective
        self.chunker = build_chunker(self.o.chunker, self.o.timestep_fraction)
        self.settings = config.sampling
        self.policy_loss = POLICY_LOSSES.get(self.o.policy_loss.name)
        # a loss that reads the rollout policy's transition means gets them from the recompute pass
        self.needs_recompute = (self.o.recompute_old_log_probs or self.chunker.needs_recompute
                                or needs_moments(self.policy_loss))

    @property
    def needs_reference(self) -> bool:
        """A KL to the reference (``objective.kl_beta`` > 0)."""
        return self.o.kl_beta > 0

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """The policy loss's and the chunker's checks against the sampling settings, and some noise to train."""
        cfg = self.cfg
        self.o.policy_loss.check(cfg)
        self.chunker.validate(cfg.sampling.num_steps, cfg.sampling.sde_kind)
        self._check_noise()

    def _check_noise(self) -> None:
        """Refuse settings under which no transition the chunker makes stochastic has any noise (nothing to
        train): the SDE kind's std on a uniform σ grid of ``num_steps`` steps, at the chunker's SDE steps."""
        s = self.cfg.sampling
        sigma = torch.linspace(1.0, 0.0, s.num_steps + 1)
        try:
            steps = self.chunker.sde_steps(s.num_steps, 0)
        except ValueError:  # a chunker whose steps follow from the model's σ grid: every step may be stochastic
            steps = torch.ones(s.num_steps, dtype=torch.bool)
        x = torch.zeros(s.num_steps, 1)
        _, std = SDE_KINDS.get(s.sde_kind)(x, x, sigma[:-1, None], sigma[1:, None], float(s.noise_level))
        std = torch.as_tensor(std, dtype=torch.float32).expand(s.num_steps, 1)[:, 0]
        if not bool((std[steps] > 0).any()):
            raise ValueError(
                f"sampling.sde_kind={s.sde_kind!r} with sampling.noise_level={s.noise_level} leaves no stochastic "
                f"transition among the chunker's {int(steps.sum())} SDE steps: there is nothing to train. Use an "
                "SDE kind with noise (flow_sde, dance_sde, cps) and a noise_level that gives it some (e.g. 0.7)"
            )

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """The chunker's checks on the model's σ grid, then its trajectories per sample."""
        self.chunker.validate_grid(sigmas, settings)
        return self.chunker.trajectories_per_sample(sigmas, settings)

    # ------------------------------------------------------------------ phases
    def rollout(self, adapter, request) -> Trajectory:
        """The chunker's rollout (SDE at its stochastic steps, log-probs of every transition); ``sampling.cache``,
        allowed only with a chunker that has ODE steps, is on over those steps only
        (:func:`~flowgrpo.sampling.feature_cache.ode_step_cache`)."""
        cache = self.cfg.sampling.cache
        return self.chunker.rollout(adapter, replace(request, ode_cache=None if cache.name == "none" else cache))

    def plan(self, traj: Trajectory, adv: Advantages, keep: torch.Tensor, epoch: int) -> SdeRatioWork:
        """The chunker's plan (filtered-out samples, ``keep`` (B,) False, are not forwarded at all) and its work
        (:meth:`work`)."""
        plan = self.chunker.plan(traj, epoch, make_generator(self.cfg.train.seed, epoch, dist.data_rank(), "plan"))
        if not bool(keep.all()):
            plan = ChunkPlan(plan.chunks, plan.selected & keep[dist.local_slice(len(keep))].unsqueeze(1))
        return self.work(traj, adv, plan, epoch)

    def work(self, traj: Trajectory, adv: Advantages, plan: ChunkPlan, epoch: int) -> SdeRatioWork:
        """The update of ``plan``: the schedule of the pairs the advantages keep (one schedule: a recompute scores
        old log-probs in the update's very packs) and the rollout's log-probs as the old ones."""
        steps = schedule(traj, plan, pair_mask(plan, adv), batch_size=self.cfg.train_batch_size,
                         steps=self.cfg.train.optimizer_steps_per_epoch,
                         shared_inputs=lambda rows: self._shared_inputs(traj, rows))
        return SdeRatioWork(traj, adv, plan, steps, traj.log_probs, None, epoch, self.needs_recompute)

    def _shared_inputs(self, traj: Trajectory, rows: torch.Tensor) -> torch.Tensor | None:
        """Keys of rows whose training inputs are identical (a chunker with ``shares_inputs``: the rows of one
        group start their trained transition from one shared latent), else None."""
        return traj.group_ids[rows] if getattr(self.chunker, "shares_inputs", False) else None

    def recompute(self, adapter, work: SdeRatioWork) -> SdeRatioWork:
        """``work`` with old log-probs (B, T) float32 on the host recomputed in the training layout (the packs of
        the update's schedule), so the first ratio is exactly 1; for a loss that reads moments, with the rollout
        policy's transition means (B, T, …). Pairs no pack forwards keep the rollout's log-probs (the update never
        reads them). A compiled transformer recomputes through its training graph
        (:func:`~flowgrpo.compile.training_graph`), the update's own."""
        with training_graph(adapter):
            return self._recompute(adapter, work)

    def _recompute(self, adapter, work: SdeRatioWork) -> SdeRatioWork:
        traj, plan = work.traj, work.plan
        old = traj.log_probs.clone()
        keep_means = needs_moments(self.policy_loss)
        old_means = torch.zeros_like(traj.latents[:, :-1]) if keep_means else None
        for step, i, pack in ((s, i, pack) for s in work.steps for i, pack in enumerate(s.work)):
            outs = packed_forward(adapter, traj, [(rows, plan.chunks[k]) for rows, k in pack], self.settings,
                                  with_ref=False, shared_inputs=[self._shared_inputs(traj, rows) for rows, _ in pack])
            if step.is_filler(i):  # the same transformer calls on every process; its values are not kept
                continue
            for (rows, k), out in zip(pack, outs, strict=True):
                idx = (rows.unsqueeze(1), torch.tensor(plan.chunks[k]).unsqueeze(0))
                old[idx] = out.log_probs.detach().cpu()
                if keep_means:
                    old_means[idx[0].to(old_means.device), idx[1].to(old_means.device)] = \
                        out.means.detach().to(old_means)
        return replace(work, old_log_probs=old, old_means=old_means)

    # ------------------------------------------------------------------ the update (run by training.update)
    def update_steps(self, work: SdeRatioWork) -> list[UpdateStep]:
        """The schedule's optimizer steps: each its packs (``work.steps``), its trained pairs over all processes,
        its micro-batches (progress) and its filler packs."""
        return [UpdateStep(s, s.global_pairs, s.micro_batches, s.padding) for s in work.steps]

    def update_state(self, work: SdeRatioWork) -> _UpdateState:
        """The host records the packs read (advantages (B_local,), old log-probs (B, T), pair mask (B, K)) and the
        statistics of the on-policy first step and of the later ones."""
        local = dist.local_slice(len(work.adv.values))
        return _UpdateState({"advantages": work.adv.values[local], "old_log_probs": work.old_log_probs,
                             "pair_mask": pair_mask(work.plan, work.adv)}, _Accum(), _Accum())

    def micro_batches(self, work: SdeRatioWork, step: UpdateStep, inner: int) -> list[list[tuple[torch.Tensor, int]]]:
        """The step's packs of (rows, chunk index) items, one transformer call each (the same every pass)."""
        return step.plan.work

    def loss(self, adapter, work: SdeRatioWork, pack: list[tuple[torch.Tensor, int]], state: _UpdateState,
             at: MicroBatchAt) -> torch.Tensor | None:
        """Forward (one transformer call) of a pack of (rows, chunk index) items: the policy loss summed over its
        trained pairs. The policy loss sees the pack's items of one chunk length at once. Records (advantages,
        masks, old log-probs) stay on the host and the pack's rows move to the device; statistics accumulate on the
        device (the first pass's first step apart: the on-policy one). None when every transition is on a frozen
        module (Wan2.2's untrained expert): the chunk plan, the same on every process, skips it everywhere."""
        o, plan, batch = self.o, work.plan, state.batch
        acc = state.first if at.inner == 0 and at.step == 0 else state.later
        fwds = packed_forward(adapter, work.traj, [(rows, plan.chunks[k]) for rows, k in pack], self.settings,
                              with_ref=o.kl_beta > 0, kl_form=o.kl_form,
                              shared_inputs=[self._shared_inputs(work.traj, rows) for rows, _ in pack])
        loss_sum = None
        for length in dict.fromkeys(len(plan.chunks[k]) for _, k in pack):  # the chunk lengths, in order
            items = [i for i, (_, k) in enumerate(pack) if len(plan.chunks[k]) == length]
            terms = self.policy_loss(self._loss_input([fwds[i] for i in items], [pack[i] for i in items], work,
                                                      batch), o)
            m = _cat([batch["pair_mask"][r, k] for r, k in (pack[i] for i in items)]).to(terms.loss.device)
            part = (terms.loss * m).sum()
            if not at.filler:
                acc.add(terms, m, part)
            loss_sum = part if loss_sum is None else loss_sum + part
        return loss_sum if loss_sum.requires_grad else None

    def update_metrics(self, adapter, work: SdeRatioWork, state: _UpdateState) -> dict[str, float]:
        """``policy/…`` (the first step's pairs) and ``policy_later/…`` means, and ``policy/logprob_mismatch_max``
        when some pair was trained (collectives: every process calls it)."""
        dev = adapter.device
        out = {**state.first.metrics("policy", dev), **state.later.metrics("policy_later", dev)}
        mismatch = state.first.mismatch_max(dev)  # a collective: every process takes part
        if "policy/pairs" in out:  # measured only when some pair was trained (nothing is logged otherwise)
            out["policy/logprob_mismatch_max"] = mismatch
        return out

    def _loss_input(self, fwds: list[ChunkForward], items: list[tuple[torch.Tensor, int]], work: SdeRatioWork,
                    batch: dict[str, torch.Tensor]) -> PolicyLossInput:
        """The policy loss's view of the forwards of items (rows, chunk index) of one chunk length, concatenated
        over the items (moments only for a loss that declares it reads them)."""
        plan = work.plan
        dev = fwds[0].log_probs.device
        rows = _cat([r for r, _ in items])
        old = _cat([batch["old_log_probs"][r][:, list(plan.chunks[k])] for r, k in items]).to(dev)
        new, adv = _cat([f.log_probs for f in fwds]), batch["advantages"][rows].to(dev)
        kl = None if fwds[0].kl is None else _cat([f.kl for f in fwds])
        if not needs_moments(self.policy_loss):
            return PolicyLossInput(new, old, adv, kl_ref=kl)
        at = work.old_means.device
        old_means = _cat([work.old_means[r.to(at)][:, list(plan.chunks[k])] for r, k in items]).to(dev)  # (n, k, …)
        drift = ((_cat([f.means for f in fwds]) - old_means) ** 2).flatten(2).mean(dim=2)
        trained = _cat([batch["pair_mask"][r, k] for r, k in items]).to(dev)  # (n,) the pairs the loss counts
        groups = torch.cat([torch.full((len(r),), i) for i, (r, _) in enumerate(items)]).to(dev)  # one an item
        return PolicyLossInput(new, old, adv, kl_ref=kl, std=_cat([f.stds for f in fwds]),
                               dt=_cat([f.dts for f in fwds]), mean_drift_sq=drift, trained=trained, groups=groups)


#: the common names of the GRPO family's objective (Flow-GRPO's and the papers' own), accepted as objective.name
for _alias in ("grpo", "flow_grpo", "flowgrpo"):
    OBJECTIVES.alias(_alias, "sde_ratio")
