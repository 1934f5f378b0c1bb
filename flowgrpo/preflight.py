"""Everything a training run needs, checked before any model loads (a mistake must not cost a model load).

:func:`preflight` runs every check: strategy names and settings (:func:`check_strategies`), the per-process batch
layout (:func:`check_batch`), reward names and kwargs (:func:`check_rewards`), trackers (:func:`check_trackers`),
the output folder and the checkpoint to resume (:func:`check_output_dir`), and the prompt files.
:func:`resolve_auto_resume` turns ``train.resume_from=auto`` into a concrete config first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def latest_run_config(out: str | os.PathLike) -> Path:
    """The config the run in ``out`` last ran with: its newest ``config_resumed_at_epoch_<E>.yaml`` (largest E;
    a resume that extended or changed the run wrote it), else its original ``config.yaml``."""
    out = Path(out)
    resumed = [(int(p.stem.rsplit("_", 1)[1]), p) for p in out.glob("config_resumed_at_epoch_*.yaml")
               if p.stem.rsplit("_", 1)[1].isdigit()]
    return max(resumed)[1] if resumed else out / "config.yaml"


def resolve_auto_resume(config, overrides: list[str] = (), config_file: str | None = None):
    """``train.resume_from=auto``: continue the run in ``config.output_dir``. When that folder holds a
    checkpoint (``checkpoints/latest``), the run's last config (:func:`latest_run_config`: the newest resumed
    config, else ``config.yaml``) is used, with ``overrides`` applied on top and ``train.resume_from`` pointing
    at ``output_dir/checkpoints``; when it holds none, the run starts afresh (``resume_from`` cleared). Any other
    ``resume_from`` is returned unchanged. A ``config_file`` the command also named is then not used (a warning
    says so): the run continues with its own settings.
    Raises :class:`~flowgrpo.config.ConfigError` when a checkpoint exists but no ``config.yaml`` beside it."""
    from flowgrpo.config import ConfigError, build_config, read_yaml

    if config.train.resume_from != "auto":
        return config
    out = Path(config.output_dir)
    if not (out / "checkpoints" / "latest").exists():
        fresh = {"train": config.train.model_copy(update={"resume_from": None})}
        if (out / "config.yaml").exists():  # a run that stopped before its first save: nothing to continue
            logger.warning("train.resume_from=auto: the run in %s stopped before its first checkpoint; starting "
                           "it again", out)
            fresh["logging"] = config.logging.model_copy(update={"overwrite": True})
        else:
            logger.info("train.resume_from=auto: no checkpoint in %s; starting a new run", out)
        return config.model_copy(update=fresh)
    if not (out / "config.yaml").exists():
        raise ConfigError(f"train.resume_from=auto: {out / 'checkpoints'} exists but {out / 'config.yaml'} "
                          "does not; give train.resume_from=<checkpoint folder> and the run's config instead")
    saved = latest_run_config(out)
    if config_file:
        logger.warning("train.resume_from=auto continues the run in %s with its own %s; the config file %s is not "
                       "used (only the command line's overrides apply)", out, saved.name, config_file)
    resumed = build_config(read_yaml(saved), [*overrides, f"train.resume_from={out / 'checkpoints'}"])
    logger.info("train.resume_from=auto: continuing %s with its saved %s", out, saved.name)
    return resumed


def check_strategies(config):
    """Let the chunker check its settings against the sampling settings, before any model or data is loaded (a
    mistake must not cost a model load and an evaluation; registered names are checked by the schema itself).
    Returns the chunker."""
    from flowgrpo.algo.chunkers import build_chunker
    from flowgrpo.algo.losses import POLICY_LOSSES, check_config

    check_config(POLICY_LOSSES.get(config.algo.policy_loss), config)
    chunker = build_chunker(config.chunker)
    chunker.validate(config.sampling.num_steps, config.sampling.sde_kind)
    _check_noise(config, chunker)
    return chunker


def _check_noise(config, chunker) -> None:
    """Refuse settings under which no transition the chunker makes stochastic has any noise (nothing to train):
    the SDE kind's std on a uniform σ grid of ``num_steps`` steps, at the chunker's SDE steps."""
    import torch

    from flowgrpo.sampling.sde import SDE_KINDS

    s = config.sampling
    sigma = torch.linspace(1.0, 0.0, s.num_steps + 1)
    try:
        steps = chunker.sde_steps(s.num_steps, 0)
    except ValueError:  # a chunker whose steps follow from the model's σ grid: every step may be stochastic
        steps = torch.ones(s.num_steps, dtype=torch.bool)
    x = torch.zeros(s.num_steps, 1)
    _, std = SDE_KINDS.get(s.sde_kind)(x, x, sigma[:-1, None], sigma[1:, None], float(s.noise_level))
    std = torch.as_tensor(std, dtype=torch.float32).expand(s.num_steps, 1)[:, 0]
    if not bool((std[steps] > 0).any()):
        raise ValueError(
            f"sampling.sde_kind={s.sde_kind!r} with sampling.noise_level={s.noise_level} leaves no stochastic "
            f"transition among the chunker's {int(steps.sum())} SDE steps: there is nothing to train. Use an SDE "
            "kind with noise (flow_sde, dance_sde, cps) and a noise_level that gives it some (e.g. 0.7)"
        )


def check_rewards(specs) -> None:
    """Resolve every reward name and check its kwargs against the constructor's signature, without constructing
    it (no weights load). Raises :class:`~flowgrpo.rewards.registry.RewardLoadError` with a suggestion."""
    import inspect

    from flowgrpo.registry import did_you_mean
    from flowgrpo.rewards.registry import RewardLoadError, resolve_reward_factory

    for spec in specs:
        factory, _ = resolve_reward_factory(spec.name)
        try:
            sig = inspect.signature(factory)
        except (TypeError, ValueError):  # a builtin or C factory: its own call checks the kwargs
            continue
        params = sig.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        allowed = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in spec.kwargs:
            if key not in allowed:
                raise RewardLoadError(f"reward {spec.name!r} has no keyword argument {key!r} (rewards[].kwargs); "
                                      f"it accepts {allowed}{did_you_mean(key, allowed)}")
        try:
            sig.bind(**spec.kwargs)
        except TypeError as err:
            raise RewardLoadError(f"reward {spec.name!r}: {err} (rewards[].kwargs); it accepts {allowed}") from None


def check_batch(config, world_size: int, per_sample: int | None = None) -> None:
    """The batch layout, per process: each of ``world_size`` processes samples B/W trajectories in micro-batches
    of ``rollout_batch_size`` and trains them in micro-batches of ``train_batch_size``, cut into
    ``optimizer_steps_per_epoch`` consecutive shares (unequal shares are warned about). Raises ``ValueError``.

    ``per_sample``: trajectories a sample becomes (the chunker's ``trajectories_per_sample`` on the model's σ
    grid). A chunker whose count only the grid decides (E-GRPO, ``multiplies_batch``) is checked again once the
    model is loaded, with it: its micro-batches (B/W·k / train_batch_size) must be at least the optimizer steps
    and split equally into them."""
    t, b = config.train, config.batch_size
    if b % world_size:
        raise ValueError(f"the batch B = prompts_per_epoch*group_size = {b} cannot be split evenly over "
                         f"{world_size} processes; make B a multiple of {world_size}")
    local, tb = b // world_size, config.train_batch_size
    where = f"the {local} trajectories each of the {world_size} processes samples (B = {b})"
    if local % t.rollout_batch_size:
        raise ValueError(f"train.rollout_batch_size={t.rollout_batch_size} must divide {where}")
    if local % tb:
        raise ValueError(f"train.train_batch_size={tb} must divide {where}")
    steps = t.optimizer_steps_per_epoch
    if config.chunker.multiplies_batch:  # E-GRPO: the micro-batch count is a multiple only the σ grid decides
        if per_sample is not None:
            _check_grid_batch(config, local, per_sample)
        return
    if local // tb < steps:
        raise ValueError(f"train.optimizer_steps_per_epoch={steps} exceeds the {local // tb} training "
                         f"micro-batches of {where}; lower train.rollout_batch_size (or train.train_batch_size) "
                         "or optimizer_steps_per_epoch")
    if (local // tb) % steps:
        logger.warning("with %d processes the %d training micro-batches of each process split unequally into "
                       "train.optimizer_steps_per_epoch=%d optimizer steps", world_size, local // tb, steps)


def _check_grid_batch(config, local: int, per_sample: int) -> None:
    """E-GRPO's micro-batches on the σ grid: ``local``·``per_sample`` trajectories a process, cut by
    ``train_batch_size``, into ``optimizer_steps_per_epoch`` equal shares."""
    t, tb = config.train, config.train_batch_size
    micro, steps = local * per_sample // tb, t.optimizer_steps_per_epoch
    where = (f"the {micro} training micro-batches of {local * per_sample} trajectories a process ({local} samples × "
             f"{per_sample} branch steps of chunker {config.chunker.name!r}) / train.train_batch_size={tb}")
    if micro < steps or micro % steps:
        raise ValueError(f"train.optimizer_steps_per_epoch={steps} must divide {where}; choose a divisor of "
                         f"{micro}, or change train.train_batch_size")


def check_trackers(trackers) -> None:
    """Every tracker asked for is installed (else a run would go on without it)."""
    import importlib.util

    from flowgrpo.config import ConfigError

    missing = [t for t in trackers if importlib.util.find_spec(t) is None]
    if missing:
        raise ConfigError(f"logging.trackers={list(trackers)}: {missing} not installed (pip install "
                          f"{' '.join(missing)}), or remove it from logging.trackers")


def check_output_dir(config) -> None:
    """A checkpoint to resume must exist, and a folder holding another run is refused (unless resumed or
    ``logging.overwrite``), and so is an ``output_dir`` that is a file, before any model loads. Raises
    CheckpointError / FileExistsError."""
    from flowgrpo.checkpoint import resolve_checkpoint

    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output_dir {str(out)!r} is a file, not a folder; choose a folder for the run")
    if config.train.resume_from:
        resolve_checkpoint(config.train.resume_from)
    elif (out / "config.yaml").exists() and not config.logging.overwrite:
        raise FileExistsError(occupied_message(out))


def occupied_message(out: Path) -> str:
    """Why ``out`` cannot take a new run, and the ways on: resume (only when a checkpoint is there), overwrite or
    another folder."""
    if (out / "checkpoints" / "latest").exists():
        return (f"output_dir {str(out)!r} already holds a run; choose another output_dir, resume it with "
                f"train.resume_from={out / 'checkpoints'} (or train.resume_from=auto), or set logging.overwrite=true")
    return (f"output_dir {str(out)!r} already holds a run that stopped before its first checkpoint; start it again "
            "with logging.overwrite=true (or train.resume_from=auto), or choose another output_dir")


def load_prompt_field(config, field: str):
    """The :class:`~flowgrpo.data.prompts.PromptSet` of ``data.<field>`` (None when unset); a file that cannot
    be read is a ``ValueError`` naming the field."""
    from flowgrpo.data.prompts import load_prompts

    value = getattr(config.data, field)
    try:
        return load_prompts(value) if value else None
    except ValueError as err:
        raise ValueError(f"data.{field}: {err}") from None


def preflight(config, world_size: int | None = None):
    """Everything the run will need, checked before any model loads: strategy names and settings, reward names
    and kwargs, prompt files, trackers and the per-process batch layout. Returns (chunker, prompts,
    eval_prompts). ``world_size``: the process count (default: the launcher's ``WORLD_SIZE``, else 1)."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    chunker = check_strategies(config)
    check_batch(config, world)
    check_rewards(config.rewards + config.eval_rewards)
    check_trackers(config.logging.trackers)
    check_output_dir(config)
    return chunker, load_prompt_field(config, "train_prompts"), load_prompt_field(config, "eval_prompts")
