"""Everything a training run needs, checked before any model loads (a mistake must not cost a model load).

:func:`preflight` is the one place that decides what a run checks, and its docstring gives the order; the one
check that needs the model (the objective on the model's σ grid) is :func:`check_on_grid`, run by
:func:`flowgrpo.runner.run` right after the model loads. :func:`resolve_auto_resume` turns
``train.resume_from=auto`` into a concrete config first.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from flowgrpo.algo.objectives import Objective, build_objective
from flowgrpo.checkpoints.health import resolve_checkpoint
from flowgrpo.config import ConfigError, build_config, parse_override, read_yaml
from flowgrpo.data.image_sets import check_dataset_images
from flowgrpo.data.prompts import PromptSet, load_prompts
from flowgrpo.rewards.compose import ComposedReward
from flowgrpo.rewards.registry import check_reward_kwargs, load_reward
from flowgrpo.sampling.sde import noise_level_warning
from flowgrpo.training.run_folder import (
    checkpoint_run_config,
    latest_run_config,
    occupied_message,
    refuse_changed_evaluation,
    refuse_changed_model,
    refuse_foreign_resume,
    refuse_foreign_run_files,
    refuse_linked_run_files,
    refuse_nothing_to_train,
    refuse_older_resume,
    refuse_overwrite_with_resume,
    refuse_parts_without_config,
)
from flowgrpo.writing.metrics import read_metrics
from flowgrpo.writing.outputs import OutputRefused, check_folder
from flowgrpo.writing.run_lock import check_folder_path

logger = logging.getLogger(__name__)


def auto_resume_config_file(default: str | os.PathLike, overrides: list[str] = ()) -> Path | None:
    """The config file a command that names none should start from when its overrides say
    ``train.resume_from=auto``: the run's own last config (:func:`latest_run_config`) in the ``output_dir`` the
    overrides (else ``default``) name, so that the overrides are checked against the run's settings and not the
    embedded default's. None when the overrides do not resume or the folder holds no run."""
    try:
        keys = {".".join(k): v for k, v in map(parse_override, overrides)}
    except ConfigError:  # a malformed override: the config's own loading reports it
        return None
    if keys.get("train.resume_from") != "auto":
        return None
    out = Path(str(keys.get("output_dir") or read_yaml(default).get("output_dir", "")))
    saved = latest_run_config(out)
    return saved if str(out) and saved.is_file() else None


def resolve_auto_resume(config, overrides: list[str] = (), config_file: str | None = None):
    """``train.resume_from=auto``: continue the run in ``config.output_dir``. When that folder holds a
    checkpoint (``checkpoints/latest``), the run's last config (:func:`latest_run_config`: the newest resumed
    config, else ``config.yaml``) is used, with ``overrides`` applied on top and ``train.resume_from`` pointing
    at ``output_dir/checkpoints``; when it holds a run that stopped before its first checkpoint, that run starts
    again with the same config (its partial records removed); when it holds no run, a new run starts
    (``resume_from`` cleared). Any other ``resume_from`` is returned unchanged. A ``config_file`` the command also
    named is then not used (a warning says so): the run continues with its own settings.

    Raises:
        ConfigError: ``logging.overwrite=true`` with ``auto`` (they contradict each other; said first, quoting
            ``auto``); a checkpoint exists but no ``config.yaml`` beside it; or the folder holds a finished run's
            results (``summary.json``, the final weights) but no checkpoint to continue from: nothing is removed.
    """
    if config.train.resume_from != "auto":
        return config
    refuse_overwrite_with_resume(config)  # before anything is said or read: `auto` as typed
    out = Path(config.output_dir)
    has_checkpoint = (out / "checkpoints" / "latest").exists()
    if not has_checkpoint and not (out / "config.yaml").exists():
        logger.info("train.resume_from=auto: no checkpoint in %s; starting a new run", out)
        return config.model_copy(update={"train": config.train.model_copy(update={"resume_from": None})})
    if not (out / "config.yaml").exists():
        raise ConfigError(f"train.resume_from=auto: {out / 'checkpoints'} exists but {out / 'config.yaml'} "
                          "does not; give train.resume_from=<checkpoint folder> and the run's config instead")
    saved = latest_run_config(out)
    if config_file:
        logger.warning("train.resume_from=auto continues the run in %s with its own %s; the config file %s is not "
                       "used (only the command line's overrides apply)", out, saved.name, config_file)
    if has_checkpoint:
        resumed = build_config(read_yaml(saved), [f"output_dir={out}", "logging.overwrite=false", *overrides,
                                                  f"train.resume_from={out / 'checkpoints'}"])
        logger.info("train.resume_from=auto: continuing %s with its saved %s", out, saved.name)
        return resumed
    results = [n for n in ("summary.json", "transformer", "lora") if (out / n).exists()]
    if results:
        raise ConfigError(f"train.resume_from=auto: {out} holds a finished run's results ({', '.join(results)}) but "
                          f"no checkpoint to continue from ({out / 'checkpoints'} is empty or gone); nothing was "
                          "removed. Choose another output_dir, or start a new run over them with "
                          "logging.overwrite=true (without train.resume_from)")
    logger.warning("train.resume_from=auto: the run in %s stopped before its first checkpoint; starting it again "
                   "with its saved %s", out, saved.name)
    return build_config(read_yaml(saved), [f"output_dir={out}", *overrides, "train.resume_from=null",
                                           "logging.overwrite=true"])


def check_strategies(config) -> Objective:
    """Build the objective (its chunker and policy loss) and let it check its settings against the sampling
    settings, before any model or data is loaded (registered names and each strategy's own settings are checked
    by the schema itself). Returns the objective."""
    objective = build_objective(config)
    objective.validate()
    return objective


def check_rewards(specs) -> None:
    """Resolve every reward name and check its kwargs against the constructor's signature, without constructing
    it (no weights load; :func:`~flowgrpo.rewards.registry.check_reward_kwargs`, which the reward server shares).
    Raises :class:`~flowgrpo.rewards.registry.RewardLoadError` with a suggestion."""
    for spec in specs:
        check_reward_kwargs(spec.name, spec.kwargs, "rewards[].kwargs")


def check_batch(config, world_size: int, per_sample: int | None = None, objective: Objective | None = None) -> None:
    """The batch layout, per data rank: each of ``world_size`` / ``parallel.context_degree`` data ranks (C
    processes of a context group hold the same samples) samples B/W trajectories in micro-batches
    of ``rollout_batch_size`` and trains them in micro-batches of ``train_batch_size``, cut into
    ``optimizer_steps_per_epoch`` consecutive shares (unequal shares are warned about). Raises ``ValueError``.

    ``per_sample``: trajectories a sample becomes (the chunker's ``trajectories_per_sample`` on the model's σ
    grid). A chunker whose count only the grid decides (E-GRPO, ``multiplies_batch``) is checked again once the
    model is loaded, with it: its micro-batches (B/W·k / train_batch_size) must be at least the optimizer steps
    and split equally into them. ``objective``: one whose update cuts something else into micro-batches (DPO's
    pairs: its ``training_units``) is checked on those, ⌈units / train_batch_size⌉ micro-batches."""
    t, b = config.train, config.batch_size
    context = config.parallel.context_degree
    if world_size % context:
        raise ValueError(f"parallel.context_degree={context} must divide the world size {world_size} (the "
                         "processes of each context group split its transformer calls)")
    world_size //= context  # the data ranks: a context group's processes hold the same samples
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
    units = getattr(objective, "training_units", lambda _: None)(local)
    if units is not None:  # DPO: micro-batches of pairs, the last one possibly smaller
        count, what = units
        micro = -(-count // tb)
        if micro < steps:
            raise ValueError(f"train.optimizer_steps_per_epoch={steps} exceeds the {micro} training micro-batches "
                             f"of objective {config.objective.name!r} on each of the {world_size} processes: "
                             f"{count} {what} of its {local} samples / train.train_batch_size={tb}; lower "
                             "train.optimizer_steps_per_epoch or train.train_batch_size, or raise "
                             "train.prompts_per_epoch")
        return
    chunker = getattr(config.objective, "chunker", None)
    if chunker is not None and chunker.multiplies_batch:  # E-GRPO: only the σ grid decides the micro-batch count
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
             f"{per_sample} branch steps of chunker {config.objective.chunker.name!r}) / train.train_batch_size={tb}")
    if micro < steps or micro % steps:
        raise ValueError(f"train.optimizer_steps_per_epoch={steps} must divide {where}; choose a divisor of "
                         f"{micro}, or change train.train_batch_size")


#: pipelines whose image tokens :func:`check_context_tokens` counts from the folder's configs: a latent of the
#: VAE's spatial factor, cut into 2×2 patches (FLUX.1 and Qwen-Image pack them; Wan's transformer has patch (1, 2, 2))
CONTEXT_TOKEN_FAMILIES = ("FluxPipeline", "QwenImagePipeline", "WanPipeline")


def _model_folder(pretrained: str) -> Path | None:
    """The local folder of ``model.pretrained`` (a folder, an embedded model already built into the cache, or a
    hub id already in the local cache), without building or downloading anything; None otherwise."""
    if Path(pretrained).is_dir():
        return Path(pretrained)
    built = _embedded_folder(pretrained)
    if built is not None:
        return built
    try:
        from huggingface_hub import try_to_load_from_cache

        index = try_to_load_from_cache(pretrained, "model_index.json")
    except Exception:  # noqa: BLE001 - not a hub id: the model's own loading reports it
        return None
    return Path(index).parent if isinstance(index, str) else None


def _embedded_folder(name: str) -> Path | None:
    """The cache folder of an embedded model (``tiny``, ``digits``) when it is built there already, else None."""
    if name == "tiny":
        from flowgrpo.builds.cache_folder import cache_dir

        folder = cache_dir() / "tiny-flux-v1"
    elif name == "digits":
        from flowgrpo.tasks.digits.model import default_model_dir

        folder = default_model_dir()
    else:
        return None
    return folder if (folder / "model_index.json").is_file() else None


def _read_json(path: Path) -> dict:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


#: pipeline class prefix -> (the family's name in messages, where its transformer's patch side comes from:
#: an int, or the key of ``transformer/config.json`` (Wan: ``patch_size`` (t, h, w), its h)); the same rule
#: each adapter's ``__init__`` applies (``check_image_size``) with the loaded pipeline, its last guard
SIZE_FAMILIES = (("Flux3", "FLUX.3", 2), ("Flux2", "FLUX.2", 2), ("Flux", "FLUX", 2),
                 ("StableDiffusion3", "SD3", "patch_size"), ("QwenImage", "Qwen-Image", 2), ("ZImage", "Z-Image", 2),
                 ("Wan", "Wan", "patch_size"), ("LTX2", "LTX-2", 1))


def _vae_spatial_factor(vae: dict) -> int | None:
    """The VAE's spatial down-sampling factor from its ``config.json``: ``scale_factor_spatial`` (Wan 2.2),
    ``spatial_compression_ratio`` (LTX-2), 2^len(``temperal_downsample``) (Qwen-Image, Wan 2.1), else
    2^(len(``block_out_channels``) − 1) (FLUX, SD3, Z-Image), as the pipelines compute ``vae_scale_factor``."""
    down = vae.get("temperal_downsample")
    for value in (vae.get("scale_factor_spatial"), vae.get("spatial_compression_ratio"),
                  2 ** len(down) if isinstance(down, list) else None,
                  2 ** (len(vae["block_out_channels"]) - 1) if vae.get("block_out_channels") else None):
        if isinstance(value, int) and value > 0:
            return value
    return None


def size_rule(pretrained: str) -> tuple[str, int] | None:
    """(family name, pixel step) of ``model.pretrained``: height and width must be positive multiples of the step
    (the VAE's spatial factor times the transformer's patch side), read from the model folder's
    ``model_index.json``, ``vae/config.json`` and ``transformer/config.json`` without loading any weights. None
    for a family without a rule here or a folder not on this machine (the adapter's own check then refuses)."""
    folder = _model_folder(pretrained)
    if folder is None:
        return None
    cls = str(_read_json(folder / "model_index.json").get("_class_name")
              or _read_json(folder / "modular_model_index.json").get("_class_name") or "")
    family = next((f for f in SIZE_FAMILIES if cls.startswith(f[0])), None)
    factor = _vae_spatial_factor(_read_json(folder / "vae" / "config.json"))
    if family is None or factor is None:
        return None
    patch = family[2]
    if isinstance(patch, str):
        patch = _read_json(folder / "transformer" / "config.json").get(patch)
        patch = patch[1] if isinstance(patch, list) and len(patch) == 3 else patch
    return (family[1], factor * patch) if isinstance(patch, int) and patch > 0 else None


def check_size(pretrained: str, sizes: dict[str, int | None]) -> None:
    """Refuse, before the model loads, a size the family of ``pretrained`` cannot make (:func:`size_rule`);
    ``sizes``: the setting's name as the user gives it (``"model.height"``, ``"--height"``) -> its value (None:
    the pipeline's default, not checked). Raises ``ValueError``: "model.height=13: FLUX needs a positive
    multiple of 16"."""
    given = {k: v for k, v in sizes.items() if v is not None}
    rule = size_rule(pretrained) if given else None
    if rule is None:
        return
    family, step = rule
    for name, value in given.items():
        if value <= 0 or value % step:
            raise ValueError(f"{name}={value}: {family} needs a positive multiple of {step} (e.g. "
                             f"{max(step, round(value / step) * step)}; the VAE's factor times the transformer's "
                             f"patch, {pretrained!r})")


def context_image_tokens(config) -> tuple[int, str] | None:
    """(image tokens of one sample, how they were counted) for the run's model, read from its folder's
    ``model_index.json`` and ``vae/config.json`` without loading any weights: ⌊H / f / 2⌋ · ⌊W / f / 2⌋ (· the
    latent frames of a Wan video, ⌊(F − 1) / t⌋ + 1); f the VAE's spatial factor (its ``scale_factor_spatial``,
    else FLUX.1: 2^(len(block_out_channels) − 1), Qwen-Image, Wan: 2^len(temperal_downsample)); H × W
    ``model.height`` × ``model.width`` (FLUX.1: the VAE's ``sample_size`` when unset). None for another family, a
    folder not on this machine, or a size the configs do not give: the check at the first transformer call
    (:mod:`flowgrpo.distributed.context_parallel`) stays."""
    folder = _model_folder(config.model.pretrained)
    if folder is None:
        return None
    family = _read_json(folder / "model_index.json").get("_class_name")
    vae = _read_json(folder / "vae" / "config.json")
    if family not in CONTEXT_TOKEN_FAMILIES or not vae:
        return None
    down = vae.get("temperal_downsample")
    factor = int(vae.get("scale_factor_spatial") or (2 ** len(down) if isinstance(down, list) else
                                                     2 ** (len(vae.get("block_out_channels") or [0]) - 1)))
    m = config.model
    default = vae.get("sample_size") if family == "FluxPipeline" else None
    h, w = m.height or default, m.width or default
    if not h or not w:
        return None
    tokens, how = (h // factor // 2) * (w // factor // 2), f"{h}x{w} pixels / VAE factor {factor} / 2x2 patches"
    if family == "WanPipeline":
        frames = m.num_frames or 81
        latent_frames = (frames - 1) // int(vae.get("scale_factor_temporal", 4)) + 1
        tokens, how = tokens * latent_frames, f"{how} x {latent_frames} latent frames of {frames}"
    return tokens, how


def check_context_tokens(config) -> None:
    """With ``parallel.context_degree`` C > 1: the attention heads Ulysses splits and every transformer call's
    image tokens split evenly over the C processes of a context group, counted from the config and the model
    folder before any weights load (:func:`context_image_tokens`, the heads from ``transformer/config.json``);
    the check is :func:`flowgrpo.distributed.context_parallel.check_split`, the plan's and the loaded model's too.
    Raises
    ``ValueError`` naming the count and the settings that make it."""
    from flowgrpo.distributed.context_parallel import check_split

    p = config.parallel
    if p.context_degree == 1:
        return
    folder = _model_folder(config.model.pretrained)
    transformer = _read_json(folder / "transformer" / "config.json") if folder is not None else {}
    family = f"{transformer.get('_class_name', 'the transformer')} ({config.model.pretrained})"
    check_split(p.context_degree, p.context_attention, family, heads=transformer.get("num_attention_heads"),
                tokens=context_image_tokens(config))


def check_trackers(trackers) -> None:
    """Every tracker asked for is installed (else a run would go on without it)."""
    missing = [t for t in trackers if importlib.util.find_spec(t) is None]
    if missing:
        raise ConfigError(f"logging.trackers={list(trackers)}: {missing} not installed (pip install "
                          f"{' '.join(missing)}), or remove it from logging.trackers")


def check_output_dir(config) -> None:
    """A checkpoint to resume must exist, a resume into its run folder keeps the run's evaluation
    (:func:`~flowgrpo.training.run_folder.refuse_changed_evaluation`), and a folder holding another run is refused
    (unless resumed or ``logging.overwrite``), and so is an ``output_dir`` that is a file or under one, and one
    that the write rule refuses (:func:`flowgrpo.writing.outputs.check_folder`: a folder holding files flowgrpo did not
    write, one inside another run's weights or checkpoints, or the model's folder or a prompt file; the same for
    ``model.prompt_embeddings_dir``), before any model loads; a resume's trained parameters must be the
    checkpoint's (:func:`~flowgrpo.training.run_folder.refuse_changed_model`); a resume reads the run's
    ``metrics.jsonl`` (the checkpoint's run's when ``output_dir`` has none: the history
    :func:`~flowgrpo.watch.divergence.run_history` reads, quietly, once the model loads;
    :func:`~flowgrpo.writing.metrics.read_metrics`: a cut-off last line is dropped with a warning,
    any other bad line refused naming the file and line). Raises CheckpointError / ConfigError /
    FileExistsError / OutputRefused / ValueError."""
    out = Path(config.output_dir)
    check_folder_path(out)
    check_folder(out, "output_dir", "run", inputs=(config.model.pretrained, config.data.train_prompts,
                                                    config.data.eval_prompts))
    refuse_linked_run_files(out)
    if config.model.prompt_embeddings_dir:  # the run's other output folder: the prompt embeddings' cache
        from flowgrpo.sampling.prompt_cache import OWN_NAMES

        cache = Path(config.model.prompt_embeddings_dir).resolve()
        if cache == out.resolve() or cache in out.resolve().parents:
            raise OutputRefused(f"model.prompt_embeddings_dir {config.model.prompt_embeddings_dir!r} is or holds the "
                                f"run's output_dir {str(out)!r}, and a folder holds one kind of flowgrpo output (the "
                                "write rule; another run's folder is refused the same way): nothing was written; give "
                                "the cache a folder of its own, e.g. model.prompt_embeddings_dir="
                                f"{out / 'prompt_embeddings'}")
        check_folder(config.model.prompt_embeddings_dir, "model.prompt_embeddings_dir", "prompt embeddings",
                     inputs=(config.model.pretrained,), own_names=OWN_NAMES)
    if config.train.resume_from:
        checkpoint = resolve_checkpoint(config.train.resume_from)
        refuse_foreign_resume(config, checkpoint)
        refuse_older_resume(config, checkpoint)
        refuse_changed_model(config)
        refuse_changed_evaluation(config)
        refuse_nothing_to_train(config, checkpoint)
        if not read_metrics(out / "metrics.jsonl"):  # a new folder: the run's history is the checkpoint's run's
            read_metrics(checkpoint.parent.parent / "metrics.jsonl")
    elif (out / "config.yaml").exists() and not config.logging.overwrite:
        raise FileExistsError(occupied_message(out))
    else:
        refuse_parts_without_config(out)
        if config.logging.overwrite:
            refuse_foreign_run_files(out)


def load_prompt_field(config, field: str):
    """The :class:`~flowgrpo.data.prompts.PromptSet` of ``data.<field>`` (None when unset); a file that cannot
    be read is a ``ValueError`` naming the field."""
    value = getattr(config.data, field)
    try:
        return load_prompts(value) if value else None
    except ValueError as err:
        raise ValueError(f"data.{field}: {err}") from None


def build_rewards(specs) -> tuple[ComposedReward | None, list]:
    """(ComposedReward, origins) for a list of RewardSpec (constructed: no weights load yet); None for an empty
    list."""
    if not specs:
        return None, []
    rewards, weights, origins = {}, {}, []
    for spec in specs:
        reward, origin = load_reward(spec.name, **spec.kwargs)
        key = spec.name.split(":")[-1]
        rewards[key] = reward
        weights[key] = spec.weight
        origins.append(origin)
    return ComposedReward(rewards, weights), origins


def _rewards_for(config, prompts: PromptSet, eval_prompts: PromptSet | None):
    """The optimised and the evaluation-only rewards, constructed (no weights yet) and shown the prompt sets they
    will score; returns (rewards, eval_rewards or None, origins of both)."""
    rewards, origins = build_rewards(config.rewards)
    for name, reward in rewards.rewards.items():
        if getattr(reward, "eval_only", False):
            raise ValueError(f"reward {name!r} is for evaluation only (an independent judge): list it under "
                             "eval_rewards, not rewards")
    eval_rewards, eval_origins = build_rewards(config.eval_rewards)
    rewards.check_prompts(prompts, "training")
    for r in (rewards, eval_rewards):
        if r is not None:
            r.check_training_prompts(prompts)
            r.check_prompts(eval_prompts or prompts, "evaluation")
    return rewards, eval_rewards, origins + eval_origins


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` checked and built: the objective, the prompt sets (eval_prompts None: no held-out
    set), the constructed rewards (eval_rewards None: none) and every reward plugin's origin."""

    objective: Objective
    prompts: PromptSet
    eval_prompts: PromptSet | None
    rewards: ComposedReward
    eval_rewards: ComposedReward | None
    origins: list
    dataset_image: tuple[tuple[int, int], str] | None = None


def check_resumed_sampler(config, prompts: PromptSet) -> None:
    """A resume draws its prompts on from the checkpoint's sampler: its ``train.prompts_per_epoch``,
    ``train.seed`` and training prompt count must be the checkpoint's, checked before the model loads by the very
    check the checkpoint load runs (:meth:`flowgrpo.data.prompts.GroupSampler.load_state_dict`, on the
    checkpoint's ``state.json``). Raises ``ValueError`` naming what changed."""
    if not config.train.resume_from:
        return
    from flowgrpo.checkpoints.save_load import read_checkpoint_state
    from flowgrpo.data.prompts import GroupSampler

    sampler = GroupSampler(len(prompts), config.train.prompts_per_epoch, config.train.seed)
    sampler.load_state_dict(read_checkpoint_state(config.train.resume_from)["sampler"])


def check_dataset(config, objective: Objective) -> tuple[tuple[int, int], str] | None:
    """A dataset objective's images (``sft``: each record's ``target``; ``dpo_offline``: its ``chosen`` and
    ``rejected``: the keys its ``image_key`` gives the G samples of a record), every one opened and its size read
    (:func:`~flowgrpo.data.image_sets.check_dataset_images`; ``model.width`` × ``model.height`` when both are set,
    else the first image's). Returns the first image's (size, where) for :func:`check_dataset_size`; None for an
    objective that samples. Raises ``ValueError`` naming the file and line."""
    key = getattr(objective, "image_key", None)
    if key is None:
        return None
    m = config.model
    size = (m.width, m.height) if m.width and m.height else None
    keys = dict.fromkeys(key(j) for j in range(config.train.group_size))
    try:
        return check_dataset_images(config.data.train_prompts, keys, size)
    except ValueError as err:
        raise ValueError(f"data.train_prompts (objective {config.objective.name!r}): {err}") from None


def check_dataset_size(first: tuple[tuple[int, int], str] | None, adapter) -> None:
    """The dataset's images (all of one size, :func:`check_dataset`) at the loaded model's ``width`` × ``height``,
    before any evaluation. Raises ``ValueError`` naming the first image's file and line."""
    if first is None:
        return
    (w, h), where = first
    if (w, h) != (adapter.width, adapter.height):
        raise ValueError(f"data.train_prompts: {where} is {w}x{h} (width x height), the model makes "
                         f"{adapter.width}x{adapter.height} (model.width x model.height); resize the set (python -m "
                         "flowgrpo.data.image_sets ... --size H W) or set model.height and model.width")


def refuse_other_model(config) -> None:
    """A resume from a checkpoint of another model (``model.pretrained`` of the checkpoint's run, its folder's
    :func:`~flowgrpo.training.run_folder.latest_run_config`, differs: ``tiny`` against ``digits``) is refused
    first, naming both models: every other setting it would compare (evaluation, prompts, trained parameters)
    differs because the model does. The same folder under another path passes, and so does a checkpoint's model
    folder that no longer exists where it was (moved: it cannot be compared). Nothing is checked without a resume
    or a saved config. Raises :class:`~flowgrpo.strategies.settings.ConfigError`."""
    found = checkpoint_run_config(config)
    if found is None:
        return
    ckpt, saved = found
    old = ((read_yaml(saved) or {}).get("model") or {}).get("pretrained")
    new = config.model.pretrained
    if old is None or str(old) == str(new):
        return
    was, now = Path(str(old)), Path(str(new))
    if was.exists() and now.exists() and was.resolve() == now.resolve():
        return
    if not was.exists() and (was.is_absolute() or str(old).startswith(".")):  # moved: cannot be compared
        return
    raise ConfigError(f"train.resume_from={str(ckpt)!r} is a checkpoint of another model: its run trained "
                      f"model.pretrained={old}, this run gives model.pretrained={new}; set "
                      f"model.pretrained={old} to resume it, or start a new run without train.resume_from")


def preflight(config, world_size: int | None = None) -> Preflight:
    """Everything the run will need, checked before any model loads, in this order:

    0. the schema, when the config was built: types and ranges, registered names, each strategy section
       against its strategy's settings (objective, chunker, policy loss, group filter) and each strategy's
       checks against the other sections, the batch sizes dividing B;
    1. the objective's checks of its settings against the sampling settings (:func:`check_strategies`: the
       chunker on T and the SDE kind, some noise to train), and a warning for a ``sampling.noise_level`` far
       above the releases' for its SDE kind, and OPD's ``objective.noise_level``
       (:func:`~flowgrpo.sampling.sde.noise_level_warning`);
    2. the per-process batch layout for ``world_size`` processes (:func:`check_batch`; default: the launcher's
       ``WORLD_SIZE``, else 1; DPO's pairs counted), and the image tokens and attention heads (Ulysses) a
       context group splits (:func:`check_context_tokens`, from the model folder's configs), and
       ``model.height`` / ``model.width`` against the family's size rule (:func:`check_size`);
    3. reward names and their kwargs, without constructing them (:func:`check_rewards`);
    4. the trackers installed (:func:`check_trackers`);
    5. a resume's checkpoint of this model (:func:`refuse_other_model`); the output folder free, or the checkpoint
       to resume there, its run's trained-parameter settings
       (:func:`~flowgrpo.training.run_folder.refuse_changed_model`) (:func:`check_output_dir`);
    6. the prompt files read (:func:`load_prompt_field`), a resume's prompt sampler against the checkpoint's
       (:func:`check_resumed_sampler`), and a dataset objective's images, each opened and its size read
       (:func:`check_dataset`);
    7. the rewards constructed and shown the prompt sets they will score (their ``check_prompts``, an
       evaluation-only reward refused under ``rewards``), and the objective's optional ``check_rewards(rewards)``
       of the constructed optimised rewards (ReFL: its margin against their declared ranges).

    Once the model is loaded, :func:`check_on_grid` checks the objective on its σ grid. Returns
    :class:`Preflight`; raises ``ValueError`` (or a subclass: ``ConfigError``, ``RewardLoadError``,
    ``CheckpointError``) or ``FileExistsError`` naming the setting."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    objective = check_strategies(config)
    notes = [noise_level_warning(config.sampling.sde_kind, config.sampling.noise_level)]
    # the noise the objective's own settings give its rollout (OPD's flow_sde noise a, objective.noise_level)
    notes += [noise_level_warning(kind, level, key) for kind, level, key in config.objective.own_noise()]
    for note in filter(None, notes):
        logger.warning("%s", note)
    check_batch(config, world, objective=objective)
    check_size(config.model.pretrained, {"model.height": config.model.height, "model.width": config.model.width})
    check_context_tokens(config)
    check_rewards(config.rewards + config.eval_rewards)
    check_trackers(config.logging.trackers)
    refuse_other_model(config)  # a checkpoint of another model: said before any setting that differs with it
    check_output_dir(config)
    prompts, eval_prompts = load_prompt_field(config, "train_prompts"), load_prompt_field(config, "eval_prompts")
    check_resumed_sampler(config, prompts)
    dataset_image = check_dataset(config, objective)
    rewards, eval_rewards, origins = _rewards_for(config, prompts, eval_prompts)
    check = getattr(objective, "check_rewards", None)  # optional: an objective's checks of the rewards it optimises
    if check is not None and rewards is not None:  # (ReFL's margin against their declared ranges)
        check(rewards)
    return Preflight(objective, prompts, eval_prompts, rewards, eval_rewards, origins, dataset_image)


def check_on_grid(config, objective: Objective, sigmas: torch.Tensor, settings, world_size: int) -> None:
    """The check that needs the model: the objective's settings on the model's σ grid ``sigmas`` (T+1,) with the
    run's :class:`~flowgrpo.config.SamplingConfig`, and the batch layout with the trajectories a
    sample becomes there (:func:`check_batch`), before any evaluation or sampling. Raises ``ValueError``."""
    check_batch(config, world_size, objective.trajectories_per_sample(sigmas, settings), objective)
