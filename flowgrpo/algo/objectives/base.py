"""What every objective shares: the protocol the training loop uses, the settings base, and the shared phases.

An *objective* is a registered strategy (:data:`OBJECTIVES`) deciding what the update optimises given an epoch's
rollout and its group advantages: which trajectories the rollout records, what the update forwards, which loss
it minimises. The loop (:class:`~flowgrpo.training.loop.Trainer`) is the same for every objective; it calls, in
this order, each phase timed under its name:

=============  =====================================================================================================
``rollout``    :meth:`Objective.rollout` ``(adapter, request)`` → the epoch's rollout record
``reward``     (the loop: rewards scored on the record's ``images``, ``prompts``, ``metadata``, ``group_ids``)
``filter``     :meth:`Objective.filter_groups` ``(rewards, group_ids)`` → :class:`~flowgrpo.algo.filters.FilterResult`
``advantage``  :meth:`Objective.advantages` ``(rewards, group_ids, keep)`` → :class:`~flowgrpo.records.Advantages`
``plan``       :meth:`Objective.plan` ``(record, adv, keep, epoch)`` → the objective's work record (frozen), with
               ``recompute`` (bool) and ``metrics`` (``plan/…`` figures)
``recompute``  :meth:`Objective.recompute` ``(adapter, work)`` → work, only when ``work.recompute``
``update``     the update loop (:func:`~flowgrpo.training.update.run_update`) runs the objective's optimizer steps
               (:meth:`Objective.update_steps`), each a list of micro-batches (:meth:`Objective.micro_batches`), with
               the loss of each (:meth:`Objective.loss`) → ``policy/…`` metrics (:meth:`Objective.update_metrics`)
=============  =====================================================================================================

The rollout record is a :class:`~flowgrpo.records.Trajectory` or any record with ``batch_size``, ``images``
(B, 3, H, W), ``prompts``, ``metadata``, ``group_ids`` (B,) and ``initial_noise`` (B, …): the loop's reward,
plots and rollout statistics read only these. Each objective declares its settings as a model (its ``Config``,
a subclass of :class:`ObjectiveConfig`); the run config's ``objective:`` section is validated against the model
of the objective its ``name`` selects, and its :meth:`ObjectiveConfig.check` refuses the other sections' settings
it does not read. Before any model loads the run calls :meth:`Objective.validate`, and on the model's σ grid
:meth:`Objective.trajectories_per_sample`.

The update loop owns the inner epochs, the gradient accumulation, the back-propagation, the optimizer step and
the gradient scaling (a micro-batch's loss is a sum over its trained rows; the loop scales it by world size / the
step's trained rows on all processes, :attr:`UpdateStep.rows`); an objective hands it, per optimizer step, its
micro-batches and a loss per micro-batch, and never touches a gradient.

Around the phases: :attr:`Objective.needs_reference` decides whether full fine-tuning keeps a frozen reference
copy; once the optimizer is built the loop calls :meth:`Objective.prepare` with it (an objective that keeps a
copy of the weights makes it there, from the prepared parameters); and every checkpoint saves
:meth:`Objective.state_dict` (``objective.safetensors``) and a resume loads it back
(:meth:`Objective.load_state_dict`), so a resumed run continues bit for bit. An objective whose update needs the
model adapter or the optimised rewards themselves (ReFL / DRaFT's differentiable rewards, a distillation teacher)
defines the optional ``attach(adapter, rewards)``, which the loop calls once after :meth:`Objective.prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from pydantic import Field
from pydantic.fields import FieldInfo

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.algo.filters import GROUP_FILTERS, FilterResult, advantages_of_kept
from flowgrpo.records import Advantages, Rewards
from flowgrpo.strategies.registry import Registry
from flowgrpo.strategies.settings import Section, refuse

OBJECTIVES: Registry = Registry("objective")


class ObjectiveConfig(Section):
    """Settings every objective has (``objective:``). Subclasses fix ``name`` to their registered name and add
    their own fields."""

    name: str = Field(
        "sde_ratio", description="registered objective (flowgrpo.algo.objectives.OBJECTIVES): sde_ratio (the GRPO "
        "family, also accepted as grpo, flow_grpo or flowgrpo: SDE rollout with per-step log-probs, the "
        "chunker's plan, a clipped-ratio policy loss over chunks), "
        "or one a plugin registers; a plain name is shorthand for {name: ...}"
    )

    #: the objective's rollout records no log-prob (only its final latent is trained on, with fresh noise and the
    #: real velocity), so a feature cache (``sampling.cache``) may run on every step of it
    #: (:func:`~flowgrpo.config.schema.check_cache_allowed` asks)
    caches_rollout: ClassVar[bool] = False
    #: the objective's rollout is its chunker's (the ``chunker:`` section): a feature cache may then run on the
    #: chunker's ODE steps when the chunker says it has some (``ChunkerConfig.caches_ode_steps``)
    rollout_by_chunker: ClassVar[bool] = False

    #: fields of this settings model that the objective never reads: field -> why (what it reads instead); one
    #: moved from its default is refused (:meth:`problems`), and ``--help`` shows them as not read
    unread: ClassVar[dict[str, str]] = {}

    def problems(self, config) -> list[str]:
        """Every run setting (``config``, the whole :class:`~flowgrpo.config.Config`) this objective does not read
        or cannot run with, one line each naming the setting, why and what to do (empty: none). Here: a field of
        :attr:`unread` moved from its default, and ``advantage.min_learning_frac`` moved for an objective that does not
        train on the advantages (it is the low-signal warning's threshold, :attr:`Objective.trains_on_advantages`)."""
        out = [f"objective.{key}={getattr(self, key)!r} is not read by objective {self.name!r} ({why}): remove the "
               f"setting (default {type(self).model_fields[key].default!r})"
               for key, why in self.unread.items() if _moved(self, key)]
        if not getattr(OBJECTIVES.get(self.name), "trains_on_advantages", True) and _moved(config.advantage,
                                                                                           "min_learning_frac"):
            out.append(f"advantage.min_learning_frac={config.advantage.min_learning_frac!r} is read only by "
                       f"objectives that train on the group advantages, but objective {self.name!r} does not (its "
                       "signal is not the differences within a group): remove the setting (default "
                       f"{type(config.advantage).model_fields['min_learning_frac'].default!r})")
        return out

    def own_noise(self) -> list[tuple[str, float, str]]:
        """The SDE noise this objective's own settings give its rollout, beyond ``sampling``'s: (SDE kind, noise
        level, the setting's dotted key) each, warned about by the preflight like ``sampling.noise_level``
        (:func:`~flowgrpo.sampling.sde.noise_level_warning`). Here: none."""
        return []

    def check(self, config) -> None:
        """Reject, before any model loads, every problem :meth:`problems` finds, all in one ``ValueError`` (one
        line each)."""
        refuse(self.problems(config), f"objective {self.name!r} cannot run with this config")


#: the weight β of a KL to the reference, declared once for every objective that has one (each sets its default
#: with :func:`shared_field`): the SDE-ratio objective's on transition means, the others' in velocity space
KL_BETA = Field(0.0, ge=0, description="weight beta of the KL to the reference (the base model): sde_ratio's on "
                "transition means (objective.kl_form); nft, awm, dgpo and sft the velocity-space KL "
                "mean_dims(v - v_ref)^2 (DiffusionNFT 1e-4, AWM 0.001, DGPO 0.02)")

#: the clip ε of an objective's ratio, declared once for every objective that clips one (each sets its release's
#: default with :func:`shared_field`)
CLIP_RANGE = Field(
    1e-4, ge=0, description="the clip epsilon of the objective's ratio: sde_ratio's clipped surrogate of each chunk's "
    "importance ratio, both sides (objective.clip_range_low / high set one side; > 0; 1e-4); awm's of its ratio (1; "
    "on-policy the ratio is 1); dgpo's of exp(e_old - e) against the old copy (1e-2); tdm_r1's of its surrogate's "
    "exp(e_old - e) against the slow surrogate (1e-3)")

#: the fraction f of a trajectory's steps that train, int(T*f) as the releases count, declared once for every
#: objective that reads one (each sets its release's default with :func:`shared_field`)
TIMESTEP_FRACTION = Field(
    1.0, gt=0, le=1, description="the fraction f of the steps that train, int(K*f) as the releases count: "
    "sde_ratio with chunker per_step, of its K trainable transitions per sample (Flow-GRPO "
    "config.train.timestep_fraction over all T steps, 0.99 of 10 trains 9; DanceGRPO --timestep_fraction over T-1: "
    "set objective.chunker.drop_last_step); nft: a random int(T*f) of the grid's T sigmas per sample (0.99); awm: "
    "its strata from the first int(T*f) grid steps (0.9); opd: the first int(T*f) steps of the student's T (0.99)")

#: the teacher of a distillation objective, declared once for every objective that reads one
TEACHER = Field(None, description="the teacher a distillation objective reads: a run's output_dir (its transformer/ "
                "or lora/), a transformer folder, a LoRA folder, or a diffusers pipeline folder; opd: required; dmd2: "
                "the real score, default the run's base model (model.pretrained)")


def shared_field(field: FieldInfo, default) -> FieldInfo:
    """The shared field ``field`` (:data:`KL_BETA`, :data:`CLIP_RANGE`, :data:`TIMESTEP_FRACTION`,
    :data:`TEACHER`) with another default (an objective's release value): the same constraints and description (an
    objective that needs a tighter one adds it to the annotation: ``Annotated[float, Gt(0)]``)."""
    return FieldInfo.merge_field_infos(field, default=default)


def _moved(section, key: str) -> bool:
    """Whether ``section.key`` differs from its field's default."""
    return getattr(section, key) != type(section).model_fields[key].default


@dataclass(frozen=True)
class UpdateStep:
    """One optimizer step of an update, as the update loop (:func:`~flowgrpo.training.update.run_update`) runs it.

    Attributes:
        plan: the objective's own record of the step, handed back to :meth:`Objective.micro_batches`.
        rows: what the step trains (rows, (sample, chunk) pairs …) summed over all processes: each micro-batch's
            loss, a sum over its trained rows, is scaled by ``world_size / max(rows, 1)``, so the step minimises
            the mean over them (DDP's and FSDP2's gradient average over the processes turns the world-size factor
            back into that mean).
        progress: progress-bar units of the step (its micro-batches).
        fillers: the last ``fillers`` micro-batches are fillers: forwarded and back-propagated with weight 0 so
            that every process makes the same transformer calls, never recorded.
        optimizer: None: the run's optimizer applies the step (the trained model's); else a second optimizer
            the objective keeps for parameters it trains itself
            (:class:`~flowgrpo.training.optim.SecondOptimizer`: DMD2's fake score). Such a step's gradient
            norm is not in ``policy/grad_norm`` and :meth:`Objective.after_step` is not called after it.
    """

    plan: Any
    rows: float
    progress: int = 1
    fillers: int = 0
    optimizer: Any = None


@dataclass(frozen=True)
class MicroBatchAt:
    """Where a micro-batch stands in the update: pass ``inner`` (0-based) of ``train.inner_epochs``, optimizer step
    ``step`` (0-based) of the pass; ``filler``: its loss is weighted 0 and nothing of it is recorded."""

    inner: int
    step: int
    filler: bool = False


@runtime_checkable
class Objective(Protocol):
    """What the training loop uses of an objective (see the module docstring for the order)."""

    needs_reference: bool
    """Whether the update forwards the frozen reference (full fine-tuning then keeps a frozen copy)."""

    trains_on_advantages: bool
    """Whether the update's signal is the group advantages (a group of equal rewards then trains nothing): the loop
    measures the share of samples with a learning signal against ``advantage.min_learning_frac`` (metric
    ``adv/low_signal``, a console warning) only for such an objective (one that does not say: True)."""

    def validate(self) -> None:
        """Reject settings this objective cannot run with, before any model loads (``ValueError`` naming the
        setting and what is allowed)."""

    def prepare(self, optim) -> None:
        """Called once the optimizer (:class:`~flowgrpo.training.optim.Optimization`) is built, before any
        resume: make what the objective keeps of the trained parameters (``optim.params``)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must hold to resume the objective exactly: {name: tensor as this process holds it}
        (empty when nothing): a DTensor shard of a sharded model's parameter (nothing gathered; the checkpoint
        writes each process's shards and loads them back in place), the whole tensor otherwise."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s tensors, or whole tensors (every process; ``ValueError`` when they do not
        fit)."""

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """Check the settings on the model's σ grid ``sigmas`` (T+1,) with the run's
        :class:`~flowgrpo.config.SamplingConfig` (``ValueError``), before any sampling; returns how
        many trajectories one requested sample becomes (1 but for E-GRPO's branching)."""

    def training_units(self, local: int) -> tuple[int, str] | None:
        """Optional (an objective without it: None). What one process's update cuts into micro-batches of
        ``train_batch_size`` when it is not the process's ``local`` samples: (their count, what they are, for the
        preflight's message; DPO: its pair slots), known from the config alone. None: the samples (or, for a
        chunker that multiplies them, its trajectories). Read by :func:`flowgrpo.preflight.check_batch`."""

    def rollout(self, adapter, request):
        """The epoch's rollout record for the :class:`~flowgrpo.sampling.rollout.RolloutRequest`."""

    def filter_groups(self, rewards: Rewards, group_ids: torch.Tensor) -> FilterResult:
        """Which samples of each group enter the advantages."""

    def advantages(self, rewards: Rewards, group_ids: torch.Tensor, keep: torch.Tensor) -> Advantages:
        """(B,) advantages of the gathered batch from the ``keep`` (B,) bool samples."""

    def plan(self, record, adv: Advantages, keep: torch.Tensor, epoch: int):
        """The update's work record: what is trained, in which micro-batches and optimizer steps."""

    def recompute(self, adapter, work):
        """``work`` with what must be rescored under the training layout before the update (old log-probs)."""

    def update_steps(self, work) -> list[UpdateStep]:
        """The optimizer steps of one pass over ``work``, in order (every pass runs them all)."""

    def update_state(self, work) -> Any:
        """What the update's losses share, made once an update: the metric accumulators and the host records the
        losses read (handed to :meth:`loss` and :meth:`update_metrics`)."""

    def micro_batches(self, work, step: UpdateStep, inner: int) -> list:
        """The micro-batches of ``step`` in pass ``inner``, in order: each is forwarded and back-propagated once,
        inside one accumulation context (:meth:`loss` receives it)."""

    def loss(self, adapter, work, item, state, at: MicroBatchAt) -> torch.Tensor | None:
        """The 0-dim loss of micro-batch ``item``: the sum over its trained rows, with gradient, unscaled (the loop
        scales it, :attr:`UpdateStep.rows`); its statistics are added to ``state`` unless ``at.filler``. None: it
        has nothing to back-propagate (every parameter it reaches is frozen) on every process alike."""

    def after_step(self, steps_before: int) -> None:
        """After each optimizer step (``steps_before`` steps were taken before it)."""

    def after_epoch(self, steps: int) -> None:
        """After the epoch's update (``steps`` optimizer steps taken so far), before :meth:`update_metrics`."""

    def update_metrics(self, adapter, work, state) -> dict[str, float]:
        """The update's own metrics (``policy/…``, ``objective/…``) from ``state``; every process calls it (the
        reductions over the processes happen here). The loop adds ``policy/grad_norm`` and ``train/lr``."""


class BaseObjective:
    """The phases every objective shares: the group filter (``group_filter``) and the advantages
    (``advantage``: the estimator and its settings) from the kept samples; one trajectory a sample; nothing to check; no
    update state, hooks or metrics of its own. A subclass implements ``rollout``, ``plan``, ``recompute``,
    ``update_steps``, ``micro_batches`` and ``loss`` (:class:`Objective`).

    Args:
        config: the validated :class:`~flowgrpo.config.Config` (no model: constructed before any loads).
    """

    Config: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    #: the update trains on the group advantages (:attr:`Objective.trains_on_advantages`); False for an objective
    #: whose signal is a dataset, the reward's gradient or a teacher
    trains_on_advantages: ClassVar[bool] = True
    #: the objective keeps an old copy of the trained weights (a float32 shadow made in :meth:`prepare`, sharded
    #: like them); the memory plan (:mod:`flowgrpo.memory_plan.estimate`) counts it
    uses_old_copy: ClassVar[bool] = False
    #: the objective loads a whole frozen teacher transformer (in ``model.dtype``, on the device); the memory plan
    #: counts it
    frozen_teacher: ClassVar[bool] = False
    #: the objective trains a whole copy of the teacher with its own AdamW (DMD2's fake score, in ``model.dtype`` on
    #: the device); the memory plan counts it, its gradients and its optimizer's moments
    trains_teacher_copy: ClassVar[bool] = False
    #: the objective trains another copy of the teacher with its AdamW and keeps a float32 slow copy of it (TDM-R1's
    #: surrogate reward); the memory plan counts them
    surrogate_copies: ClassVar[bool] = False
    #: under ``model.finetune: lora`` the objective's trained copies of the teacher are LoRA adapters on the teacher's
    #: own weights (TDM-R1), not whole copies (DMD2); the memory plan counts their LoRA weights
    lora_copies: ClassVar[bool] = False
    #: why the objective cannot take its rollouts from rollout workers (``runtime.engine: ray``,
    #: checked with the config), or None where it can: its update reads only the rollout
    #: record, its behaviour log-probs included, and a Ray run of it is tested to equal the torchrun run. An
    #: objective not verified so (a plugin's) is refused with this default
    rollout_workers_refusal: ClassVar[str | None] = "it is not among the objectives verified with rollout workers"

    def __init__(self, config) -> None:
        self.cfg = config
        self.group_filter = GROUP_FILTERS.get(config.group_filter.name)

    @property
    def needs_reference(self) -> bool:
        """No KL to the reference (an objective with one says so)."""
        return False

    def validate(self) -> None:
        """Nothing beyond the schema."""

    def prepare(self, optim) -> None:
        """Nothing to keep."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """No state beyond the weights and the optimizer's."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to load; ``ValueError`` for a non-empty state (written by another objective)."""
        if state:
            raise ValueError(f"objective {self.cfg.objective.name!r} keeps no state, but the checkpoint holds "
                             f"{sorted(state)[:3]} …")

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """One trajectory a sample."""
        return 1

    def training_units(self, local: int) -> tuple[int, str] | None:
        """The samples themselves (:meth:`Objective.training_units`)."""
        return None

    def update_state(self, work) -> Any:
        """Nothing shared."""
        return None

    def after_step(self, steps_before: int) -> None:
        """After each optimizer step (``steps_before`` steps were taken before it); nothing by default."""

    def after_epoch(self, steps: int) -> None:
        """After the epoch's update (``steps`` optimizer steps taken so far); nothing by default."""

    def update_metrics(self, adapter, work, state) -> dict[str, float]:
        """No metrics of its own."""
        return {}

    def filter_groups(self, rewards: Rewards, group_ids: torch.Tensor) -> FilterResult:
        """The configured group filter (``none``: keep all)."""
        return self.group_filter(rewards, group_ids, self.cfg.group_filter)

    def advantages(self, rewards: Rewards, group_ids: torch.Tensor, keep: torch.Tensor) -> Advantages:
        """Advantages from the samples the group filter kept (all of them without a filter)."""
        a = self.cfg.advantage

        def compute(r: Rewards, g: torch.Tensor) -> Advantages:
            return compute_advantages(r, g, estimator=a.name, global_std=a.global_std,
                                      multi_reward=a.multi_reward, clip=a.clip,
                                      drop_zero_spread=a.drop_zero_spread_groups, std_ddof=a.std_ddof,
                                      std_eps=a.std_eps)

        return advantages_of_kept(compute, rewards, group_ids, keep)


def objective_config_class(name: str) -> type[ObjectiveConfig]:
    """The settings model of the objective registered as ``name`` (``KeyError`` listing the valid names)."""
    return getattr(OBJECTIVES.get(name), "Config", ObjectiveConfig)


def build_objective(config) -> Objective:
    """The objective ``config.objective.name`` names, constructed with the run's config."""
    return OBJECTIVES.get(config.objective.name)(config)
