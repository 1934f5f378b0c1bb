"""What every chunker shares: the protocol the trainer uses, the base class, the config base, and helpers.

A chunker is a registered strategy (:data:`CHUNKERS`) that answers three questions:

* which transitions the rollout samples with the SDE (the others are ODE steps; only SDE transitions have a
  log-probability and can be trained) — :meth:`Chunker.rollout`;
* which transitions are trained and which share one importance ratio
  ``r = exp(mean over the chunk of (log p_new − log p_old))`` — :meth:`Chunker.plan`, a
  :class:`~flowgrpo.records.ChunkPlan`;
* whether the training forward batches transitions differently from the rollout, so the old log-probs must be
  recomputed with the training layout for the first ratio to be exactly 1 — :attr:`Chunker.needs_recompute`
  (see ``docs/design.md``, "Exactness").

Each strategy declares its settings as a pydantic model (its ``Config`` attribute, a subclass of
:class:`ChunkerConfig`); the run config's ``objective.chunker`` section is validated against the model of the strategy
its ``name`` selects (:func:`~flowgrpo.strategies.settings.strategy_settings`), so a knob of another strategy is an
error, not
silently ignored. The chunker is a part of the ``sde_ratio`` objective (:mod:`flowgrpo.algo.objectives`).
"""

from __future__ import annotations

import math
from typing import ClassVar, Protocol, runtime_checkable

import torch
from pydantic import Field

from flowgrpo.records import ChunkPlan, Trajectory
from flowgrpo.sampling.rollout import RolloutRequest, rollout
from flowgrpo.sampling.sde import NOISELESS_LAST_STEP
from flowgrpo.strategies.registry import Registry
from flowgrpo.strategies.settings import Section, settings_class

CHUNKERS: Registry = Registry("chunker")


class ChunkerConfig(Section):
    """Settings every chunker has. Subclasses add their own and fix ``name`` to their registered name."""

    name: str = Field("per_step", description="the chunker (flowgrpo.algo.chunkers.CHUNKERS: a built-in or one a "
                      "plugin registers); a plain name is shorthand for {name: ...}")
    #: the rollout draws more than P·G trajectories an epoch, a number only the model's σ grid decides (E-GRPO:
    #: G per prompt and branch step), so the batch checks on B = P·G check only what holds for any multiple of it
    multiplies_batch: ClassVar[bool] = False
    #: the rollout has runs of ODE steps (velocities that enter no log-prob), on which a feature cache may run
    #: (:func:`~flowgrpo.sampling.feature_cache.ode_step_cache`; asked by
    #: :func:`~flowgrpo.config.schema.check_cache_allowed`)
    caches_ode_steps: ClassVar[bool] = False


class DropLastConfig(ChunkerConfig):
    """Settings of the chunkers that train a subset of a full SDE trajectory."""

    drop_last_step: bool = Field(
        False, description="never train the last transition (GCPO's 17-step setting, arXiv 2510.21583, Sec. 5.1)"
    )


@runtime_checkable
class Chunker(Protocol):
    """What the trainer uses of a chunker."""

    needs_recompute: bool
    #: the rows of one group share their transformer input at every trained transition, so training forwards
    #: one row per group (E-GRPO's shared anchors); the velocity is shared and its gradient sums over the rows
    shares_inputs: bool

    def validate(self, num_steps: int, sde_kind: str) -> None:
        """Reject settings this chunker cannot run with T = ``num_steps`` and ``sde_kind``, before any model loads.

        Raises:
            ValueError: naming the setting and what is allowed.
        """

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """How many trajectories one requested sample becomes on the σ grid ``sigmas`` (T+1,) with the run's
        settings: 1 for the standard rollout (E-GRPO: one per branch step). The trainer's micro-batches cut the
        B·k trajectories."""

    def validate_grid(self, sigmas: torch.Tensor, settings) -> None:
        """Reject settings that fail on the model's σ grid ``sigmas`` (T+1,) with the run's
        :class:`~flowgrpo.config.SamplingConfig`: called once the model is loaded, before any
        evaluation or sampling (the grid depends on the model's scheduler, e.g. its shift).

        Raises:
            ValueError: naming the setting and what is allowed.
        """

    def rollout(self, adapter, request: RolloutRequest) -> Trajectory:
        """Sample the epoch's trajectories for ``request``."""

    def plan(self, traj: Trajectory, epoch: int, generator: torch.Generator) -> ChunkPlan:
        """The chunks of ``traj`` and which samples train which chunk."""


def trainable_steps(traj: Trajectory, drop_last_step: bool = False) -> list[int]:
    """Transitions stochastic for every sample (the grid positions a shared chunk plan can use)."""
    steps = [t for t in range(traj.num_steps) if bool(traj.stochastic[:, t].all())]
    if drop_last_step and steps and steps[-1] == traj.num_steps - 1:
        steps = steps[:-1]
    return steps


def check_trainable(cfg: ChunkerConfig, num_steps: int, sde_kind: str) -> int:
    """T minus the last transition when it is never trained (``drop_last_step``, or an SDE kind whose last
    transition is deterministic, :data:`~flowgrpo.sampling.sde.NOISELESS_LAST_STEP`: cps): the transitions a plan
    can use.

    Raises:
        ValueError: none is left, naming ``sampling.num_steps`` and the setting that removes the last one.
    """
    drop = bool(getattr(cfg, "drop_last_step", False))
    trainable = num_steps - int(drop or sde_kind in NOISELESS_LAST_STEP)
    if trainable < 1:
        why = ("objective.chunker.drop_last_step=true leaves it out" if drop
               else f"sde_kind {sde_kind!r} makes it deterministic")
        raise ValueError(f"sampling.num_steps={num_steps} leaves no transition to train: the last transition is "
                         f"never trained ({why}); use sampling.num_steps >= 2")
    return trainable


def fraction_count(fraction: float, k: int) -> int:
    """⌈fraction·k⌉, at least 1, computed so that float noise (0.28·25 = 7.000000000000001) does not add one."""
    return max(1, math.ceil(round(fraction * k, 9)))


def release_count(fraction: float, k: int, key: str) -> int:
    """``int(k·fraction)``: how the releases count the transitions or chunks they train, float product included
    (int(0.29·100) = 28): Flow-GRPO ``int(num_steps * timestep_fraction)`` over all T steps (its 0.99 leaves
    the last step out), DanceGRPO ``int(len(timesteps) * timestep_fraction)`` over its T − 1 trainable steps,
    GCPO ``int(num_chunks * timestep_fraction)``. ``k`` is the number of trainable transitions (chunks).

    Raises:
        ValueError: the count is 0 while k > 0 (naming ``key``): nothing would be trained.
    """
    n = int(k * fraction)
    if n < 1 and k > 0:
        raise ValueError(f"{key}={fraction} trains int({k} * {fraction}) = 0 of the {k} trainable "
                         f"{'chunks' if 'chunk' in key else 'transitions'}; raise it to at least {1 / k:.4g}")
    return n


def make_plan(chunks: list[tuple[int, ...]], selected: torch.Tensor) -> ChunkPlan:
    """A :class:`ChunkPlan`; raises ``ValueError`` when there is nothing to train."""
    if not chunks:
        raise ValueError("the chunker found no stochastic transition to train (check sde_kind and noise_level)")
    return ChunkPlan(chunks=tuple(chunks), selected=selected)


class BaseChunker:
    """Shared defaults: SDE at every step, the standard P×G rollout, the training layout equal to the rollout's.

    Subclasses set ``Config`` (their settings model) and override :meth:`sde_steps` / :meth:`plan`."""

    Config: ClassVar[type[ChunkerConfig]] = ChunkerConfig
    needs_recompute = False
    shares_inputs = False

    def __init__(self, cfg: ChunkerConfig) -> None:
        self.cfg = cfg

    def sde_steps(self, num_steps: int, epoch: int) -> torch.Tensor:
        """(T,) bool: which transitions the rollout samples with the SDE."""
        return torch.ones(num_steps, dtype=torch.bool)

    def validate(self, num_steps: int, sde_kind: str) -> None:
        self.sde_steps(num_steps, 0)
        check_trainable(self.cfg, num_steps, sde_kind)

    def validate_grid(self, sigmas: torch.Tensor, settings) -> None:
        """Nothing depends on the σ grid beyond :meth:`validate`."""

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """One trajectory a sample."""
        return 1

    def rollout(self, adapter, request: RolloutRequest) -> Trajectory:
        """The standard rollout (:func:`flowgrpo.sampling.rollout.rollout`) with this chunker's SDE steps."""
        return rollout(adapter, request, self.sde_steps(request.settings.num_steps, request.epoch))


def chunker_config_class(name: str) -> type[ChunkerConfig]:
    """The settings model of the chunker registered as ``name`` (``KeyError`` listing the valid names)."""
    return settings_class(CHUNKERS, name, ChunkerConfig)


def chunker_settings(name: str = "per_step", **settings) -> ChunkerConfig:
    """The validated settings of chunker ``name`` (``ValueError`` for a key or value the strategy refuses)."""
    return chunker_config_class(name).model_validate({"name": name, **settings})


def build_chunker(cfg: ChunkerConfig, timestep_fraction: float = 1.0) -> Chunker:
    """The chunker named by ``cfg.name``, constructed with its settings, and with the objective's
    ``timestep_fraction`` (in (0, 1]) where it reads it (its class's ``reads_timestep_fraction``)."""
    cls = CHUNKERS.get(cfg.name)
    return cls(cfg, timestep_fraction) if getattr(cls, "reads_timestep_fraction", False) else cls(cfg)
