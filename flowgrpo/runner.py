"""The training command as a library: :func:`run` builds every part from a config and trains; :func:`main` is the
command line that ``flowgrpo/train.py`` and ``flowgrpo train`` run (its description: :data:`DESCRIPTION`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path

from flowgrpo.preflight import check_batch, preflight, resolve_auto_resume

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "digits.yaml"
DESCRIPTION = """Train a flow-matching text-to-image model with the GRPO family.

    accelerate launch flowgrpo/train.py [CONFIG.yaml] [dotted.key=value ...]
    python flowgrpo/train.py [CONFIG.yaml] --help   # every config field with the value this run would use

With no config the embedded default runs: the digits task (a small FLUX-architecture model that draws
handwritten digits, pretrained and cached on first use) with the digit-correctness reward.
"""
_SETUP_DONE = False  # set once the run is built: errors after it are bugs and keep their traceback
_TRAINER = None  # the running trainer, for the one-line report of an interrupted run


CONFIG_HELP = """config files:
  A config is YAML holding any of the fields listed above; unknown keys fail with the closest valid one.
  A top-level `base: OTHER.yaml` (a path relative to the file) reads that file first and merges this one over
  it: sections merge key by key, lists and plain values replace (configs/digits_chunk.yaml extends digits.yaml).
  dotted.key=value overrides apply last (values are YAML: train.lr=1e-4, 'rewards=[{name: jpeg_compressibility}]').

resume:
  train.resume_from=runs/x/checkpoints     continue from the newest checkpoint there (or give epoch_N)
  train.resume_from=auto                   continue the run in output_dir with its saved config.yaml (the
                                           command's other overrides apply on top, e.g. train.num_epochs=120);
                                           a fresh start when output_dir holds no checkpoint yet"""


def help_text(config_path: str | None, overrides: list[str]) -> str:
    """Every config field with the value this command line would use: the given config's (with its bases and
    the overrides), or the embedded digits default's without one; the schema's value when the config cannot be
    read. Then the config-file and resume notes and the installed reward plugins."""
    from flowgrpo.config import describe_fields, flat_dict, load_config

    source = config_path or f"{DEFAULT_CONFIG} (the embedded default)"
    try:
        values = flat_dict(load_config(config_path or DEFAULT_CONFIG, [o for o in overrides if "=" in o])
                       .model_dump(mode="json"))
    except Exception as err:  # noqa: BLE001 - help must print whatever is wrong with the config
        values, source = {}, f"schema defaults ({source} could not be read: {err})"
    rows = describe_fields()
    width = max(len(r[0]) for r in rows)
    lines = [f"  {k:<{width}}  {d}  [{values[k] if k in values else v}]" for k, v, d in rows]
    return (f"config fields (set in YAML or as dotted.key=value), [values this command uses: {source}]:\n"
            + "\n".join(lines) + "\n\n" + CONFIG_HELP + "\n\n" + _rewards_help())


def _rewards_help() -> str:
    try:
        from flowgrpo.rewards.registry import registered_rewards

        names = sorted(registered_rewards())
    except Exception as err:  # noqa: BLE001 - a broken plugin must not hide the help
        return f"registered rewards: could not be listed ({err})"
    return ("registered rewards (entry-point group flowgrpo.rewards; any 'module:attr' works too):\n  "
            + "\n  ".join(textwrap.wrap(", ".join(names), 110)))


def build_rewards(specs):
    """(ComposedReward, origins) for a list of RewardSpec; None for an empty list."""
    from flowgrpo.rewards.compose import ComposedReward
    from flowgrpo.rewards.registry import load_reward

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


def _rewards_for(config, prompts, eval_prompts):
    """The optimised and the evaluation-only rewards, constructed (no weights yet) and shown the prompt sets they
    will score, before any model loads; returns (rewards, eval_rewards or None, origins of both)."""
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


def run(config) -> dict:
    """Build every part from ``config`` and train; returns the summary. The main process holds the run folder's
    lock (:func:`~flowgrpo.run_lock.hold_run_folder`) from before ``train.resume_from=auto`` reads it to the end.

    Raises:
        RunFolderBusy: another live run holds ``output_dir`` (a ``FileExistsError``).
    """
    with _hold(config.output_dir):
        config = resolve_auto_resume(config)
        with _hold(config.output_dir):  # the folder the resolved config trains in (the same one, unless moved)
            return _run(config)


def _hold(output_dir):
    """The run folder's lock, held by the main process only (rank 0; the others are part of its run)."""
    import contextlib

    from flowgrpo.run_lock import hold_run_folder

    return hold_run_folder(output_dir) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()


def _run(config) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from flowgrpo.models import load_model_from_config
    from flowgrpo.models.lora import setup_trainable
    from flowgrpo.sampling.rollout import SamplerSettings
    from flowgrpo.trainer import Trainer

    quiet_libraries()
    chunker, prompts, eval_prompts = preflight(config)
    rewards, eval_rewards, origins = _rewards_for(config, prompts, eval_prompts)
    accelerator = Accelerator(log_with=config.logging.trackers or None, project_dir=config.output_dir)
    set_seed(config.train.seed)
    m = config.model
    adapter = load_model_from_config(m)
    sampling = SamplerSettings.from_config(config.sampling)
    sigmas = adapter.sigmas(sampling.num_steps)
    chunker.validate_grid(sigmas, sampling)  # before any evaluation or sampling
    check_batch(config, accelerator.num_processes, chunker.trajectories_per_sample(sigmas, sampling))
    adapter.pipe.to(accelerator.device)
    params = setup_trainable(
        adapter, finetune=m.finetune, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.lora_target_modules,
        need_reference=config.algo.kl_beta > 0, gradient_checkpointing=m.gradient_checkpointing,
    )
    if m.finetune == "lora":  # LoRA weights train in float32 whatever the model's dtype
        for p in params:
            p.data = p.data.float()
    for r in (rewards, eval_rewards):
        if r is not None:
            r.setup(accelerator.device)
    if accelerator.trackers is not None and config.logging.trackers:
        accelerator.init_trackers("flowgrpo", config=_tracker_config(config))
    trainer = Trainer(config, adapter=adapter, params=params, rewards=rewards, eval_rewards=eval_rewards,
                      chunker=chunker, prompts=prompts, eval_prompts=eval_prompts,
                      accelerator=accelerator, reward_origins=origins)
    torch.set_grad_enabled(True)
    global _SETUP_DONE, _TRAINER
    _SETUP_DONE, _TRAINER = True, trainer
    summary = trainer.fit()
    accelerator.end_training()
    return summary


def _tracker_config(config) -> dict:
    """The config as the trackers take it: dotted keys, plain values (lists and None as text)."""
    from flowgrpo.config import flat_dict

    return {k: v if isinstance(v, int | float | str | bool) else str(v)
            for k, v in flat_dict(config.model_dump(mode="json")).items()}


LIBRARY_PROGRESS_ENV = "FLOWGRPO_LIBRARY_PROGRESS"


def quiet_libraries() -> None:
    """Keep the console for our metrics: silence the libraries' per-call notices (truncated prompts,
    deprecations), their progress bars (weight loading, downloads; shown again with ``FLOWGRPO_LIBRARY_PROGRESS=1``)
    and httpx's line per HTTP request of a remote reward (shown when the root logger is at DEBUG), not their
    errors."""
    import os
    import warnings

    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    if os.environ.get(LIBRARY_PROGRESS_ENV, "0") != "1":
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        try:
            from huggingface_hub.utils import disable_progress_bars
        except ImportError:  # pragma: no cover - huggingface_hub comes with diffusers
            pass
        else:
            disable_progress_bars()
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")


def _cell(v, fmt: str = ">10.4f") -> str:
    return format(v, fmt) if isinstance(v, float | int) else format("-", fmt[0] + fmt[1:].split(".")[0])


def format_report(summary: dict) -> str:
    """The end-of-run report: where everything was written, the before/after table of the evaluation figures
    (reference figures such as real-data diversity in both columns), the digits task's per-digit table, and the
    wall time of each phase. ``summary`` is what :meth:`~flowgrpo.trainer.Trainer.write_summary` returns."""
    from flowgrpo.trainer import per_digit_rows

    blocks = []
    outputs = summary.get("outputs", {})
    if outputs:
        width = max(map(len, outputs))
        blocks.append("written:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in outputs.items()))
    metrics = sorted({k.rsplit("_", 1)[0] for k in summary if k.endswith(("_before", "_after"))
                      and not k.startswith("digit_")})
    if metrics:
        refs = [k for k in summary if k.endswith("_real") and not k.startswith("digit_")]
        width = max(len(m) for m in metrics + refs)
        lines = [f"{'metric':<{width}}  {'before':>10}  {'after':>10}"]
        lines += [f"{m:<{width}}  {_cell(summary.get(f'{m}_before'))}  {_cell(summary.get(f'{m}_after'))}"
                  for m in metrics]
        lines += [f"{r:<{width}}  {_cell(summary[r])}  {_cell(summary[r])}" for r in refs]
        blocks.append("\n".join(lines))
    rows = per_digit_rows(summary)
    if rows:
        lines = ["digit  correct before  after  diversity before  after   real  after/real"]
        for r in rows:
            flag = "  <- collapsed" if r["collapsed"] else ""
            lines.append(f"{r['digit']:>5}  {_cell(r['correctness_before'], '>14.3f')}  "
                         f"{_cell(r['correctness_after'], '>5.3f')}  {_cell(r['diversity_before'], '>16.1f')}  "
                         f"{_cell(r['diversity_after'], '>5.1f')}  {_cell(r['diversity_real'], '>5.1f')}  "
                         f"{_cell(r['ratio_after'], '>10.3f')}{flag}")
        blocks.append("\n".join(lines))
    phases = summary.get("phase_seconds", {})
    if phases:
        total = sum(phases.values())
        lines = ["phase       seconds   share"]
        lines += [f"{k:<10}  {v:>7.1f}  {v / total if total else 0:>6.1%}" for k, v in phases.items()]
        lines.append(f"{'all':<10}  {total:>7.1f}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def print_summary(summary: dict) -> None:
    """Print :func:`format_report` (the script's result, on stdout)."""
    print(format_report(summary))  # noqa: T201 - the script's result table


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """The training command; ``prog`` names it in usage lines (``flowgrpo train`` from the CLI)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    positional = [a for a in argv if not a.startswith("-")]
    config_path = positional[0] if positional and "=" not in positional[0] else None
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, epilog=help_text(config_path, positional) if _wants_help(argv) else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="YAML config (omit for the embedded digits default)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config and not Path(args.config).is_file():  # key=value, even output_dir=x.yaml
        args.overrides.insert(0, args.config)
        args.config = None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    quiet_libraries()
    from flowgrpo.checkpoint import CheckpointError
    from flowgrpo.config import ConfigError, load_config
    from flowgrpo.divergence import TrainingDiverged
    from flowgrpo.rewards.base import MissingWeightsError
    from flowgrpo.rewards.compose import RewardError
    from flowgrpo.rewards.registry import RewardLoadError
    from flowgrpo.rewards.remote import RemoteRewardError

    main_process = os.environ.get("RANK", "0") == "0"
    global _SETUP_DONE, _TRAINER
    _SETUP_DONE, _TRAINER = False, None  # a fresh command (main may run twice in one process)
    try:
        config = load_config(args.config or DEFAULT_CONFIG, args.overrides)
        with _hold(config.output_dir):  # before anything in the folder is read
            summary = run(resolve_auto_resume(config, args.overrides, config_file=args.config))
    except (ConfigError, RewardLoadError, CheckpointError, FileExistsError, MissingWeightsError,
            RemoteRewardError) as err:  # RemoteRewardError: the reward server is unreachable at setup
        parser.exit(2, f"error: {err}\n")
    except RewardError as err:
        if err.__cause__ is not None and not isinstance(err.__cause__, ValueError | RemoteRewardError):
            raise  # the plugin itself failed: its traceback is what its author needs
        # an impossible score (±inf, wrong shape), the plugin's ValueError, which by the reward contract names
        # bad input (a missing metadata field, a bad image), or a lost reward server: the message says it all
        parser.exit(2, f"error: {err}\n")
    except (KeyError, ValueError) as err:
        if not _SETUP_DONE:  # bad input found while setting up (names, prompt files, models): no traceback
            parser.exit(2, f"error: {err.args[0] if isinstance(err, KeyError) else err}\n")
        raise
    except TrainingDiverged as err:  # the rule of flowgrpo.divergence: one line, the last checkpoint kept
        parser.exit(1, f"error: {err}\n")
    except KeyboardInterrupt:
        parser.exit(130, _interrupted_line(args, prog) if main_process else "")
    if main_process:
        print_summary(summary)


def _interrupted_line(args, prog: str | None = None) -> str:
    """One line for Ctrl-C: the epoch reached, the checkpoint left, and the command that resumes the run (the
    command as it was started: ``flowgrpo train`` from the CLI, else the training script by its absolute path,
    which works from any folder)."""
    import shlex

    if _TRAINER is None:
        return "\ninterrupted while setting up; nothing was trained\n"
    ckpt = _TRAINER.out / "checkpoints"
    script = Path(__file__).resolve().parent / "train.py"
    command = prog.split() if prog else [sys.executable, str(script)]
    words = [*command, *([args.config] if args.config else [])]
    words += [o for o in args.overrides if not o.startswith("train.resume_from=")]
    n = _TRAINER.cfg.train.num_epochs
    where = ("during the final evaluation and save" if _TRAINER.stage == "final"
             else f"in epoch {_TRAINER.epoch + 1}/{n}")  # 1-based, as the epoch lines
    if (ckpt / "latest").is_file():
        latest = (ckpt / "latest").read_text().strip()
        resume = shlex.join([*words, f"train.resume_from={ckpt}"])
        return f"\ninterrupted {where}; last checkpoint {ckpt / latest} is intact; resume: {resume}\n"
    return (f"\ninterrupted {where}; no checkpoint written yet (logging.save_every="
            f"{_TRAINER.cfg.logging.save_every}); start again with: {shlex.join([*words, 'logging.overwrite=true'])}\n")


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)
