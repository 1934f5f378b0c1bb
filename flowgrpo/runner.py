"""The training command as a library: :func:`run` builds every part from a config and trains; :func:`main` is the
command line that ``flowgrpo/train.py`` and ``flowgrpo train`` run (its description: :data:`DESCRIPTION`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import sys
import textwrap
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from flowgrpo import parallel
from flowgrpo.argtypes import OneLineParser
from flowgrpo.checkpoints.save_load import CheckpointError
from flowgrpo.config import ConfigError, describe_fields, flat_dict, load_config
from flowgrpo.config.help import help_config, not_read, refused
from flowgrpo.distributed import dist, launch
from flowgrpo.distributed.launch import (
    launch_environment,
    launcher_words,
    restore_signals,
    stop_on_signals,
    stopping_signal,
    wait_for_launcher,
)
from flowgrpo.models import fetch_first, load_model_from_config
from flowgrpo.models.lora import make_trainable
from flowgrpo.models.quiet import quiet_libraries
from flowgrpo.preflight import (
    auto_resume_config_file,
    check_dataset_size,
    check_on_grid,
    preflight,
    resolve_auto_resume,
)
from flowgrpo.rewards.base import MissingWeightsError
from flowgrpo.rewards.compose import OOM_HINT, RewardError
from flowgrpo.rewards.registry import RewardLoadError, registered_rewards
from flowgrpo.rewards.remote import RemoteRewardError
from flowgrpo.runtime import ray_engine
from flowgrpo.sampling.prompt_cache import attach_prompt_cache
from flowgrpo.sampling.rollout import check_condition_images
from flowgrpo.training.loop import Trainer
from flowgrpo.training.report import format_report
from flowgrpo.watch.divergence import TrainingDiverged
from flowgrpo.writing.outputs import OutputRefused
from flowgrpo.writing.run_lock import hold_run_folder

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = Path(__file__).resolve().parent / "tasks" / "digits" / "default.yaml"
DESCRIPTION = """Train a flow-matching text-to-image or text/image-to-video model with the GRPO family and its kin.

    accelerate launch -q flowgrpo/train.py [CONFIG.yaml] [dotted.key=value ...]
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
    the overrides), or the embedded digits default's without one, and "not read by ..." for a strategy setting
    the chosen strategy does not read (:func:`~flowgrpo.config.help.not_read`); when a strategy refuses settings
    of the command (``objective=nft`` over a config with SDE-ratio settings), the refusals first and those rows
    marked ``REFUSED`` with the value it accepts (:func:`~flowgrpo.config.help.refused`); the schema's value when
    the config cannot be read for another fault. Then the config-file and resume notes and the installed reward
    plugins."""
    source = config_path or f"{DEFAULT_CONFIG} (the embedded default)"
    rows = describe_fields()
    keys = [r[0] for r in rows]
    problems = []
    try:
        config, problems = help_config(config_path or DEFAULT_CONFIG, [o for o in overrides if "=" in o])
        values = {**flat_dict(config.model_dump(mode="json")), **not_read(config, keys),
                  **refused(config, problems, keys)}
    except Exception as err:  # noqa: BLE001 - help must print whatever is wrong with the config
        bad = _bad_override(config_path or DEFAULT_CONFIG, [o for o in overrides if "=" in o])
        values, source = {}, (f"schema defaults (the override {bad!r} could not be applied to {source}: {err})"
                              if bad is not None else f"schema defaults ({source} could not be read: {err})")
    width = max(len(r[0]) for r in rows)
    lines = [f"  {k:<{width}}  {d}  [{values[k] if k in values else v}]" for k, v, d in rows]
    refusals = "".join(f"  this command is refused: {what}; the rows marked REFUSED:\n"
                       + "".join(f"    - {p}\n" for p in ps) for what, ps in problems)
    return (f"config fields (set in YAML or as dotted.key=value), [values this command uses: {source}]:\n"
            + refusals + "\n".join(lines) + "\n\n" + CONFIG_HELP + "\n\n" + _rewards_help())


def _bad_override(path, overrides: list[str]) -> str | None:
    """The first override that makes the config at ``path`` fail to load (the file alone loading), or None when
    the file itself cannot be read: what ``--help`` blames."""
    try:
        load_config(path, [], strategy_checks=False)
    except Exception:  # noqa: BLE001 - the file's own fault
        return None
    for i in range(len(overrides)):
        try:
            load_config(path, overrides[: i + 1], strategy_checks=False)
        except Exception:  # noqa: BLE001 - any fault of this override
            return overrides[i]
    return None


def _rewards_help() -> str:
    try:
        names = sorted(registered_rewards())
    except Exception as err:  # noqa: BLE001 - a broken plugin must not hide the help
        return f"registered rewards: could not be listed ({err})"
    return ("registered rewards (entry-point group flowgrpo.rewards; any 'module:attr' works too):\n  "
            + "\n  ".join(textwrap.wrap(", ".join(names), 110)))


def run(config) -> dict:
    """Build every part from ``config`` and train; returns the summary. The main process holds the run folder's
    lock (:func:`~flowgrpo.writing.run_lock.hold_run_folder`) from before ``train.resume_from=auto`` reads it to the
    end.

    Raises:
        RunFolderBusy: another live run holds ``output_dir`` (a ``FileExistsError``).
    """
    with _hold(config.output_dir):
        config = resolve_auto_resume(config)
        with _hold(config.output_dir):  # the folder the resolved config trains in (the same one, unless moved)
            return _run(config)


def _hold(output_dir):
    """The run folder's lock, held by the main process only (rank 0; the others are part of its run)."""
    return hold_run_folder(output_dir) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()


def _run(config) -> dict:
    """:func:`run` inside the lock. Every check that needs no model runs first
    (:func:`~flowgrpo.preflight.preflight`), the one that needs it right after it loads
    (:func:`~flowgrpo.preflight.check_on_grid`)."""
    quiet_libraries()
    launch.check_launch()  # the processes asked for were started
    launch.cpu_without_accelerator()  # torchrun on a machine without a GPU: the CPU and gloo, said in the log
    ready = preflight(config)
    if config.runtime.engine == "ray":
        ray_engine.check_installed()
    accelerator = Accelerator(log_with=config.logging.trackers or None, project_dir=config.output_dir,
                              kwargs_handlers=parallel.process_group_kwargs(config.parallel))
    # every process has checked the run folder (preflight) before the main one writes into it: else a process
    # slower to start sees the main process's config.yaml as another run's
    dist.barrier()
    parallel.check_engine(accelerator, config.parallel)
    # the rewards' weights before the model's (a build or a download of minutes): a missing one stops the run at
    # once (MissingWeightsError); before the seed is set, so the model's initialisation draws what it always drew
    for r in (ready.rewards, ready.eval_rewards):
        if r is not None:
            r.setup(accelerator.device)
            parallel.place_rewards(r, accelerator.device, config.parallel)  # reward models: device or host memory
    set_seed(config.train.seed)
    m = config.model
    fetch_first(m.pretrained, accelerator.is_local_main_process)  # a hub id: one download per machine, then all
    several = accelerator.num_processes > 1  # an expert sharded over several processes: each reads its shards
    adapter = load_model_from_config(m, empty_transformer=_built_empty(config, accelerator),
                                     empty_other_expert=several and config.parallel.experts == "shard",
                                     progress=config.logging.progress and accelerator.is_main_process)
    for prompts, setting in ((ready.prompts, "data.train_prompts"), (ready.eval_prompts, "data.eval_prompts")):
        check_condition_images(adapter, prompts, setting)  # an image-to-video or editing model: every image given
    check_dataset_size(ready.dataset_image, adapter)  # a dataset objective's images at the model's size
    sampling = config.sampling
    check_on_grid(config, ready.objective, adapter.sigmas(sampling.num_steps), sampling, accelerator.num_processes)
    parallel.place_pipeline(adapter, accelerator.device, config.parallel)  # what sits on each device
    if m.cache_prompt_embeddings:  # each distinct prompt encoded once (flowgrpo.sampling.prompt_cache)
        attach_prompt_cache(adapter, m.pretrained, config.parallel.text_encoders, m.prompt_embeddings_dir)
    make_trainable(adapter, config, ready.objective)
    if accelerator.trackers is not None and config.logging.trackers:
        accelerator.init_trackers("flowgrpo", config=_tracker_config(config))
    trainer = Trainer(config, adapter=adapter, rewards=ready.rewards, eval_rewards=ready.eval_rewards,
                      objective=ready.objective, prompts=ready.prompts, eval_prompts=ready.eval_prompts,
                      accelerator=accelerator, reward_origins=ready.origins)
    torch.set_grad_enabled(True)
    global _SETUP_DONE, _TRAINER
    _SETUP_DONE, _TRAINER = True, trainer
    with ray_engine.ray_rollouts(config, trainer):  # the rollout workers (runtime.engine=ray), ended on every exit
        summary = trainer.fit()
    accelerator.end_training()
    parallel.release()
    return summary


def _built_empty(config, accelerator) -> bool:
    """Whether this process builds the trained transformer on the meta device instead of loading it: on every
    process of a sharded (FSDP2) run of several processes in full fine-tuning (each then reads only its own shards
    from the weight files: :func:`flowgrpo.parallel.prepare_model`), and on all but the main process for LoRA (the
    main process loads the base and initialises the adapter, and sends each process its shards)."""
    sharded = config.parallel.sharding == "fsdp2" and accelerator.num_processes > 1
    return sharded and (config.model.finetune == "full" or accelerator.process_index != 0)


def _tracker_config(config) -> dict:
    """The config as the trackers take it: dotted keys, plain values (lists and None as text)."""
    return {k: v if isinstance(v, int | float | str | bool) else str(v)
            for k, v in flat_dict(config.model_dump(mode="json")).items()}


def print_summary(summary: dict, tables=(), *, written: bool = True) -> None:
    """Print :func:`~flowgrpo.training.report.format_report` (the script's result, on stdout); ``written=False``
    for a run that had already finished (nothing written by this command)."""
    print(format_report(summary, tables, written=written))  # noqa: T201 - the script's result table


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def one_rank_speaks() -> None:
    """On a process other than global rank 0: the log handlers pass errors only, so the run's information and
    warnings (a resume, changed settings, truncated prompts, the collapse guard) are printed once, by rank 0,
    whatever module logs them. Every process computes the same things; rank 0 speaks for the run."""
    logging.captureWarnings(True)  # Python warnings too (logged as WARNING by "py.warnings")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _ErrorsOnly) for f in handler.filters):
            handler.addFilter(_ErrorsOnly())


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """The training command; ``prog`` names it in usage lines (``flowgrpo train`` from the CLI)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    positional = [a for a in argv if not a.startswith("-")]
    config_path = positional[0] if positional and "=" not in positional[0] else None
    parser = OneLineParser(
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
    main_process = os.environ.get("RANK", "0") == "0"
    if not main_process:
        one_rank_speaks()
    global _SETUP_DONE, _TRAINER
    _SETUP_DONE, _TRAINER = False, None  # a fresh command (main may run twice in one process)
    replaced = stop_on_signals()  # a launcher's SIGTERM after Ctrl-C ends the run with its line too
    try:
        summary = _main(args, parser, prog, main_process)
    finally:
        restore_signals(replaced)
    if main_process:
        trainer = _TRAINER
        print_summary(summary, trainer.tables if trainer is not None else (),
                      written=not (trainer is not None and trainer.finished_before))


def _main(args, parser: argparse.ArgumentParser, prog: str | None, main_process: bool) -> dict:
    """The run of :func:`main`, each known failure one line (``parser.exit``); returns the run's summary."""
    try:
        config = load_config(args.config or auto_resume_config_file(DEFAULT_CONFIG, args.overrides) or DEFAULT_CONFIG,
                             args.overrides)
        with _hold(config.output_dir):  # before anything in the folder is read
            summary = run(resolve_auto_resume(config, args.overrides, config_file=args.config))
    except launch.LaunchRefused as err:  # one process where several were asked for: the line, no launcher's trace
        sys.stderr.write(f"error: {err}\n")
        sys.stderr.flush()
        _end_accelerate_launcher(2)
        sys.exit(2)
    except (ConfigError, RewardLoadError, CheckpointError, FileExistsError, MissingWeightsError,
            RemoteRewardError, OutputRefused) as err:  # RemoteRewardError: the reward server is unreachable at setup
        _refuse(parser, 2, f"error: {err}\n", main_process)
    except RewardError as err:
        if err.__cause__ is not None and not isinstance(err.__cause__, ValueError | RemoteRewardError
                                                        | torch.OutOfMemoryError):
            raise  # the plugin itself failed: its traceback is what its author needs
        # an impossible score (±inf, wrong shape), the plugin's ValueError, which by the reward contract names
        # bad input (a missing metadata field, a bad image), or a lost reward server: the message says it all
        _refuse(parser, 2, f"error: {err}\n", main_process)
    except (KeyError, ValueError) as err:
        if not _SETUP_DONE:  # bad input found while setting up (names, prompt files, models): no traceback
            _refuse(parser, 2, f"error: {err.args[0] if isinstance(err, KeyError) else err}\n", main_process)
        raise
    except TrainingDiverged as err:  # the rule of flowgrpo.watch.divergence: one line, the last checkpoint kept
        parser.exit(1, f"error: {err}\n" if main_process else "")  # every process stops together; one says it
    except torch.OutOfMemoryError as err:  # the rollout, the update, the evaluation: what to change, not a trace
        where = f" ({_TRAINER.stage}, epoch {_TRAINER.epoch + 1})" if _TRAINER is not None else " (setting up)"
        first = str(err).splitlines()[0] if str(err) else "OutOfMemoryError"
        parser.exit(1, f"error: out of device memory{where}: {first}; {OOM_HINT}\n")
    except KeyboardInterrupt:
        if main_process and launch.launched_by_accelerate():
            wait_for_launcher()  # its copy of our output drops what it read at its own Ctrl-C (launch's docstring)
        parser.exit(128 + stopping_signal(), _interrupted_line(args, prog) if main_process else "")
    return summary


#: how long a process other than the main one waits before it says a refusal of its own (module :func:`_refuse`)
OTHER_RANK_WAIT_S = 30.0


def _refuse(parser: argparse.ArgumentParser, code: int, line: str, main_process: bool) -> None:
    """End the process with ``line`` said once for the run. The checks of the set-up find the same fault on every
    process: under torchrun every process ends with ``code`` together, the main process saying the line and the
    others ending quietly (:func:`flowgrpo.distributed.dist.share_refusal`, through the launcher's store, waiting at
    most :data:`OTHER_RANK_WAIT_S`); another process still speaks, naming its rank, when the main process did not
    refuse within that time (the fault was its own: a file its machine lacks). Where there is no launcher's store
    another process waits :data:`OTHER_RANK_WAIT_S` before it speaks (the launcher ends it meanwhile when the main
    process refused). A stop signal while another process waits (the launcher ending it) ends it quietly, with
    ``code``. Under ``accelerate launch`` (one child) the launcher is ended after the line
    (:func:`~flowgrpo.distributed.launch.end_launcher`), else it follows the line with a traceback; it exits 143, not
    ``code``: accelerate 1.16 exits 1 for any failed child and 128 + the signal when ended."""
    try:
        dist.share_refusal(main_process, OTHER_RANK_WAIT_S, code, line)  # ends the process under torchrun
    except KeyboardInterrupt:  # the launcher's SIGTERM (launch.stop_on_signals): the run is refused, not stopped
        if not main_process:
            dist.end_worker(code)
    if main_process:
        sys.stderr.write(line)
        sys.stderr.flush()
        _end_accelerate_launcher(code)
        parser.exit(code)
    parser.exit(code, f"(rank {os.environ.get('RANK', '?')}) {line}")


def _end_accelerate_launcher(code: int) -> None:
    """Under ``accelerate launch``, end the launcher after a refusal's line (its ``CalledProcessError`` traceback
    would follow it: :func:`~flowgrpo.distributed.launch.end_launcher`); its SIGTERM back to this process (ending
    its tree) then ends this process quietly with ``code``, not through ``KeyboardInterrupt``
    (:func:`flowgrpo.distributed.launch.stop_on_signals`). Nothing elsewhere."""
    if not launch.launched_by_accelerate():
        return
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: dist.end_worker(code))
    launch.end_launcher()


def _interrupted_line(args, prog: str | None = None) -> str:
    """One line for Ctrl-C: the epoch reached, the checkpoint left, and the command that resumes the run (the
    command as it was started: under ``torchrun`` or ``accelerate launch`` the same launch
    (:func:`flowgrpo.distributed.launch.launcher_words`), else ``flowgrpo train`` from the CLI, else the training
    script by its absolute path, which works from any folder), a launch after the variables it needed
    (``ACCELERATE_USE_CPU=true``, ``CUDA_VISIBLE_DEVICES=…``:
    :func:`~flowgrpo.distributed.launch.launch_environment`))."""
    if _TRAINER is None:
        return "\ninterrupted while setting up; nothing was trained\n"
    ckpt = _TRAINER.out / "checkpoints"
    script = Path(__file__).resolve().parent / "train.py"
    launcher = launcher_words(sys.argv[0]) if sys.argv and sys.argv[0] else []
    # torchrun / accelerate launch: the same launch (flowgrpo.distributed.launch), the CLI's subcommand after it
    if launcher:
        command = [*launcher, *(prog.split()[1:] if prog else [])]
    else:
        command = prog.split() if prog else [sys.executable, str(script)]
    env = launch_environment() if launcher else []  # a launch's variables (ACCELERATE_USE_CPU=true torchrun …)
    words = [*env, *command, *([args.config] if args.config else [])]
    words += [o for o in args.overrides if not o.startswith("train.resume_from=")]
    n = _TRAINER.cfg.train.num_epochs
    e = _TRAINER.epoch  # 0-based: shown 1-based, as the epoch lines
    where = {"final": "during the final evaluation and save",
             "before": (f"before {'the first epoch' if e == 0 else f'epoch {e + 1}/{n}'} (setting up or evaluating "
                        "before training)")}.get(_TRAINER.stage, f"in epoch {e + 1}/{n}")
    if (ckpt / "latest").is_file():
        latest = (ckpt / "latest").read_text().strip()
        resume = shlex.join([*words, f"train.resume_from={ckpt}"])
        return f"\ninterrupted {where}; last checkpoint {ckpt / latest} is intact; resume: {resume}\n"
    return (f"\ninterrupted {where}; no checkpoint written yet (logging.save_every="
            f"{_TRAINER.cfg.logging.save_every}); start again with: {shlex.join([*words, 'logging.overwrite=true'])}\n")


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)
