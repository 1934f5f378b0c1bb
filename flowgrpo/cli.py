"""The ``flowgrpo`` command: ``flowgrpo train …``, ``flowgrpo sample …``, ``flowgrpo prompts …``,
``flowgrpo push …``, ``flowgrpo plan …``.

``flowgrpo plan CONFIG --gpus N`` prints a config's memory per GPU and per rank's host memory by part, and whether
it fits, under the config's ``parallel`` layout (:mod:`flowgrpo.memory_plan.estimate`; nothing is loaded or allocated).

``flowgrpo sample`` draws ODE images from a base model plus (optionally) a trained LoRA or full transformer, for
given prompts and seeds, to compare before and after training. With the run's evaluation settings and seeds it
reproduces the run's evaluation images: image i uses seed ``derive_seed(train.seed, "eval", i)``
(``--run RUN_DIR`` reads them from the run's ``config.yaml``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from flowgrpo.argtypes import OneLineParser, float_at_least, int_in

logger = logging.getLogger("flowgrpo.cli")
# Each subcommand imports its own modules when it runs (deliberately lazy): ``flowgrpo --help`` and ``flowgrpo
# push`` load no torch, ``flowgrpo sample`` no trainer; ``flowgrpo train`` hands over to flowgrpo.runner.


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and appends ``(default: X)`` to every option whose default is a value
    (not None, not False, not already in the help text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default == argparse.SUPPRESS \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


#: ``flowgrpo sample`` options and their values without ``--run`` (None in the parser: "not given")
SAMPLE_DEFAULTS = {"seed": 0, "num_steps": 40, "guidance_scale": 3.5, "dtype": "float32", "height": None,
                   "width": None, "max_sequence_length": 512, "num_frames": None}
#: options that override a run's setting with ``--run``: option → the run config's key
RUN_OVERRIDES = {"seed": "train.seed", "num_steps": "eval_sampling.num_steps",
                 "guidance_scale": "eval_sampling.guidance_scale", "dtype": "model.dtype", "height": "model.height",
                 "width": "model.width", "max_sequence_length": "model.max_sequence_length",
                 "num_frames": "model.num_frames"}


def _given(args: argparse.Namespace, name: str):
    return getattr(args, name) is not None


def _sample_settings(args: argparse.Namespace) -> dict:
    """What ``flowgrpo sample`` draws: ``build`` (a function loading the model), ``steps``, ``guidance``, ``seed``,
    ``weights`` (a folder or None), ``prompt_file``, ``count`` (0: one image per prompt) and ``cache`` (the run's
    ``eval_sampling.cache``, so its evaluation images are reproduced; None without ``--run``).

    With ``--run`` everything comes from the run folder's config, and each option of :data:`RUN_OVERRIDES` that is
    given replaces its setting (``--num-steps 1`` samples with one step, ``--seed 5`` draws the evaluation seeds of
    seed 5, ``--dtype`` … rebuild the run's model so); ``--model`` and ``--lora`` cannot apply to a run (it names
    its own model and weights) and are refused. Without ``--run``: ``--model`` and the defaults of
    :data:`SAMPLE_DEFAULTS`. Every refusal is a ``ValueError`` naming the option."""
    from flowgrpo.config import load_config
    from flowgrpo.models import load_model, load_model_from_config

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a file; give a folder (the PNGs, grid.png and images.pt go in it)")
    if args.no_weights and args.lora:
        raise ValueError("--no-weights samples the base model alone, --lora adds weights: give one of them")
    if args.run:
        for name, why in (("model", "the run's config names its model (model.pretrained)"),
                          ("lora", "the run's own weights are used (--no-weights: none)")):
            if getattr(args, name):
                raise ValueError(f"--{name} cannot be used with --run: {why}; to sample another base model or "
                                 "other weights, give --model (and --lora) without --run")
        cfg_path = Path(args.run) / "config.yaml"
        if not cfg_path.is_file():
            raise ValueError(f"{args.run!r} is not a run folder (no config.yaml in it)")
        if not _is_run_folder(Path(args.run)):
            raise ValueError(f"--run {args.run!r} is not a flowgrpo run folder (its config.yaml was not written by "
                             "flowgrpo train); give the output_dir of a training run, or --model to sample a base "
                             "model")
        cfg = load_config(cfg_path, [f"{RUN_OVERRIDES[k]}={getattr(args, k)}" for k in RUN_OVERRIDES
                                     if _given(args, k)])
        _check_sample_size(args, cfg.model.pretrained, {"height": cfg.model.height, "width": cfg.model.width})
        default_count = cfg.data.eval_num_prompts if cfg.data.eval_prompts else min(cfg.data.eval_num_prompts,
                                                                                     cfg.batch_size)
        return {"build": lambda: load_model_from_config(cfg.model),  # as training built it (+ the overrides)
                "steps": cfg.eval_sampling.num_steps, "guidance": cfg.eval_sampling.guidance_scale,
                "seed": cfg.train.seed,
                "weights": Path(args.run) / ("lora" if cfg.model.finetune == "lora" else "transformer"),
                "prompt_file": args.prompts or cfg.data.eval_prompts or cfg.data.train_prompts,
                "count": args.num_images or default_count, "cache": cfg.eval_sampling.cache}
    if not args.model:
        raise ValueError("give --run RUN_DIR or --model")
    v = {k: getattr(args, k) if _given(args, k) else d for k, d in SAMPLE_DEFAULTS.items()}
    _check_sample_size(args, args.model, {"height": v["height"], "width": v["width"]})
    return {"build": lambda: load_model(args.model, dtype=v["dtype"], height=v["height"], width=v["width"],
                                        max_sequence_length=v["max_sequence_length"], num_frames=v["num_frames"]),
            "steps": v["num_steps"], "guidance": v["guidance_scale"], "seed": v["seed"],
            "weights": Path(args.lora) if args.lora else None, "prompt_file": args.prompts,
            "count": args.num_images, "cache": None}


def _check_sample_size(args: argparse.Namespace, pretrained: str, sizes: dict) -> None:
    """The family's size rule (:func:`flowgrpo.preflight.check_size`) on the frame size, before the model
    loads; a size is named as given: ``--height`` when given, else the run's ``model.height``."""
    from flowgrpo.preflight import check_size

    check_size(pretrained, {(f"--{k}" if _given(args, k) else f"model.{k}"): v for k, v in sizes.items()})


def _load_weights(adapter, weights: Path) -> None:
    """A trained LoRA (``pytorch_lora_weights.safetensors``) or full transformer (``config.json``) from ``weights``."""
    if (weights / "pytorch_lora_weights.safetensors").exists():
        from flowgrpo.models.lora import load_lora_into

        load_lora_into(adapter.pipe, weights)
    elif (weights / "config.json").exists():
        from flowgrpo.models.base import config_difference

        cls = type(adapter.transformer)
        try:
            theirs = cls.load_config(str(weights))
        except (OSError, ValueError) as err:
            raise ValueError(f"the transformer folder {str(weights)!r} has no readable config.json ({err})") from None
        named = theirs.get("_class_name")
        differ = config_difference(adapter.transformer.config, theirs)
        if (named and named != cls.__name__) or differ:
            why = (f"it is a {named}, the model's transformer a {cls.__name__}" if named and named != cls.__name__
                   else "its {} is {!r}, the model's {!r}".format(*differ))
            raise ValueError(f"the weights {str(weights)!r} are another model's transformer ({why}): give the "
                             "weights of a run on this model (--model)")
        adapter.transformer.load_state_dict(cls.from_pretrained(weights).state_dict())
    else:
        raise ValueError(f"no LoRA or transformer weights in {str(weights)!r}"
                         + _unfinished_run_hint(weights.parent))


def _is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` is a flowgrpo training run's output_dir, by the test ``flowgrpo train`` itself uses to
    recognise its run folders (:func:`flowgrpo.writing.outputs.owner`: its marker, or a resolved config.yaml)."""
    from flowgrpo.writing.outputs import owner

    return owner(folder) == "run"


def _unfinished_run_hint(run: Path, then: str = "sample it") -> str:
    """For a run folder without final weights: a run still training there (it holds the folder's lock,
    :func:`flowgrpo.writing.run_lock.lock_holder`) is said to be running, with its checkpoints so far; else the
    checkpoints a resume could finish it from (newest first, the one ``train.resume_from=auto`` picks named) and
    the command; ``then`` is what to do after (``"sample it"``, ``"push it"``); empty for a folder that is not a
    run (:func:`_is_run_folder`). Shared by ``flowgrpo sample`` and ``flowgrpo push``."""
    if not _is_run_folder(run):
        return ""
    from flowgrpo.checkpoints.health import checkpoint_folders, newest_healthy
    from flowgrpo.writing.run_lock import lock_holder

    done = [p.name for p in reversed(checkpoint_folders(run / "checkpoints"))]
    holder = lock_holder(run)
    if holder is not None:  # a live run holds the folder: it has not stopped, it is training
        return (f": the run is still training (it holds the run folder's lock: {holder}); its final weights are "
                f"written when it ends: wait for it to finish, then {then} (checkpoints so far: "
                f"{', '.join(done) or 'none'})")
    finish = f"finish it with `flowgrpo train output_dir={run} train.resume_from=auto`, then {then}"
    if not done:
        return f": the run stopped before its first checkpoint and its final weights; {finish}"
    pick = newest_healthy(run / "checkpoints")
    return (f": the run stopped before writing its final weights; its checkpoints: {', '.join(done)} (a resume "
            f"continues from {pick.name if pick else 'none: each is marked unhealthy'}); {finish}")


def _sample_inputs(args: argparse.Namespace, s: dict, weights: Path | None) -> list:
    """What ``flowgrpo sample`` reads (the run's config, the weights, the model folder, the prompt file): its
    ``--out`` may not be or lie inside any of them (:func:`flowgrpo.writing.outputs.check_folder`; the run folder itself
    and its checkpoints are a run's, refused as such, and a new folder beside them, ``RUN/samples``, is fine)."""
    return [Path(args.run) / "config.yaml" if args.run else None, weights, args.model, s["prompt_file"]]


#: the names ``flowgrpo sample`` gives its files in ``--out`` (a call that finds one it did not record refuses)
SAMPLE_NAMES = r"images\.pt|grid\.png|\d{5,}\.(png|gif)"


def _sample(args: argparse.Namespace) -> None:
    from flowgrpo.writing.outputs import check_folder, check_written, claim_folder, unclaim_folder

    s = _sample_settings(args)
    weights = None if args.no_weights else s["weights"]
    if s["prompt_file"] is None:
        raise ValueError("no prompts (give --prompts FILE)")
    out = Path(args.out)
    # before the model is built: a folder that holds other files, lies in the run, or cannot be made fails at once
    check_folder(out, "--out", "sample", inputs=_sample_inputs(args, s, weights))
    check_written(out, "--out", SAMPLE_NAMES)
    if weights is not None and (weights / "pytorch_lora_weights.safetensors").is_file():
        from flowgrpo.models.lora import lora_shapes

        lora_shapes(weights / "pytorch_lora_weights.safetensors")  # an unreadable file, before the model builds
    made = claim_folder(out, "sample", "--out")
    try:
        _sample_into(out, args, s, weights)
    except BaseException:  # a failed sample leaves no empty folder it made
        if made:
            unclaim_folder(out)
        raise


def _sample_into(out: Path, args: argparse.Namespace, s: dict, weights: Path | None) -> None:
    """Build the model of the settings ``s``, sample and write images.pt, grid.png and one PNG (GIF) each into
    ``out``, recorded in its marker (:func:`flowgrpo.writing.outputs.record_written`) and the files an earlier call
    recorded there removed first: the folder holds one call's images; files flowgrpo did not write are kept."""
    import torch
    from PIL import Image

    from flowgrpo.data.prompts import load_prompts
    from flowgrpo.images import to_uint8
    from flowgrpo.plots import sample_grid
    from flowgrpo.rng import derive_seed
    from flowgrpo.sampling.rollout import generate_images
    from flowgrpo.writing.outputs import record_written, replace_file

    ps = load_prompts(s["prompt_file"])
    adapter = s["build"]()
    if weights is not None:
        _load_weights(adapter, weights)
    count = s["count"] or len(ps)
    prompts = [ps.prompts[i % len(ps)] for i in range(count)]
    seeds = [derive_seed(s["seed"], "eval", i) for i in range(count)]
    # an image-conditioned model (editing, image-to-video) reads each record's conditioning images
    metadata = [ps.metadata[i % len(ps)] for i in range(count)]
    images = generate_images(adapter, prompts, seeds, num_steps=s["steps"], guidance_scale=s["guidance"],
                             batch_size=args.batch_size, cache=s["cache"], metadata=metadata)
    names = ["images.pt", "grid.png", *(f"{i:05d}.{'gif' if img.ndim == 4 else 'png'}" for i, img in enumerate(images))]
    _replace_written(out, names)
    # every file a new one (replace_file): a hard link to an earlier call's file keeps its content
    replace_file(out / "images.pt", lambda tmp: torch.save(images, tmp))
    sample_grid(images[:40], [p[:30] for p in prompts[:40]], out / "grid.png", ncols=10)
    for i, img in enumerate(images):
        if img.ndim == 4:  # a video (F, 3, H, W): an animated GIF to look at (images.pt keeps the exact frames)
            frames = [Image.fromarray(a) for a in to_uint8(img)]
            replace_file(out / f"{i:05d}.gif", lambda tmp, f=frames: f[0].save(
                tmp, format="GIF", save_all=True, append_images=f[1:], duration=62, loop=0))
        else:
            picture = Image.fromarray(to_uint8(img))
            replace_file(out / f"{i:05d}.png", lambda tmp, p=picture: p.save(tmp, format="PNG"))
    record_written(out, "sample", names)
    logger.info("wrote %d %s to %s", len(images), "videos" if images.ndim == 5 else "images", out)


def _replace_written(out: Path, names: list[str]) -> None:
    """Before ``names`` are written into ``out``: record them with the earlier call's files (so a failure leaves
    every file flowgrpo wrote recorded), then remove the earlier call's files the new call does not write over."""
    from flowgrpo.writing.outputs import record_written, remove_written, written_files

    record_written(out, "sample", [*written_files(out), *names], unsettled=names)
    gone = remove_written(out, keep=names)
    if gone:
        logger.info("removed %d files of an earlier flowgrpo sample call from %s", len(gone), out)


def _check_prompts_args(args: argparse.Namespace) -> None:
    """Refuse what ``flowgrpo prompts`` would not honour: ``--per-task`` and ``--seed`` for a set read from files
    (only the geneval generator takes them), sources for geneval, and an ``--out`` whose suffix the prompt loader
    would read in another format than the one written (geneval writes JSONL records, every other set one prompt a
    line), and an ``--out`` the write rule refuses (:func:`flowgrpo.writing.outputs.check_file`: one of the sources, or
    an existing file without ``--overwrite``). Each refusal is a ``ValueError``, raised before any source is read."""
    from flowgrpo.writing.outputs import check_file

    out = Path(args.out)
    if not out.is_dir():  # a folder: named by the prompt set's writer (it wants a file)
        check_file(out, "--out", inputs=args.sources, overwrite=args.overwrite)
    if args.set == "geneval":
        if args.sources:
            raise ValueError("geneval: the generator reads no source files")
        if out.suffix != ".jsonl":
            raise ValueError(f"geneval: --out {str(out)!r} must end in .jsonl (each line a GenEval "
                             "record with its metadata, which the prompt loader reads only from a .jsonl file)")
        return
    given = [f"--{k.replace('_', '-')}" for k in ("per_task", "seed") if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{args.set}: {' and '.join(given)} "
                         f"{'applies' if len(given) == 1 else 'apply'} only to the geneval generator; "
                         f"the {args.set} prompts are read from the source files as they are")
    if out.suffix == ".jsonl":
        raise ValueError(f"{args.set}: --out {str(out)!r} would be read as JSONL, but the file holds "
                         "one prompt a line: give a .txt file")


def _refuse_unwritable(err: OSError, out: Path) -> None:
    """Raise ``ValueError`` naming ``--out`` and the OS's reason when ``err`` is about writing ``out`` or making a
    folder above it; any other ``OSError`` is raised again as it is."""
    if err.filename is None or Path(err.filename) not in (out, *out.parents):
        raise err
    raise ValueError(f"--out {str(out)!r} cannot be written: {err.strerror or err} ({err.filename}); "
                     "choose a file in a folder you can write to") from None


def _prompts(args: argparse.Namespace) -> None:
    _check_prompts_args(args)
    if args.set == "geneval":
        try:
            from flowgrpo_rewards.geneval.prompts import main as geneval_main
        except ImportError:
            raise ValueError("geneval: needs the flowgrpo-rewards distribution "
                             "(pip install -e ./rewards)") from None
        per_task, seed = args.per_task or 1000, args.seed or 0
        try:
            geneval_main([str(args.out), "--per-task", str(per_task), "--seed", str(seed), "--allow-fewer",
                          *(["--overwrite"] if args.overwrite else [])])
        except OSError as err:
            _refuse_unwritable(err, Path(args.out))
        return
    from flowgrpo.data.public_prompts import build_prompt_file

    try:
        build_prompt_file(args.set, args.sources, args.out)
    except KeyError as err:
        raise ValueError(err.args[0]) from None


class PushRefused(ValueError):
    """Why :func:`push_run` uploaded nothing, in one line."""


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the Hub cannot be used (offline mode, a refusal, no network), whichever HTTP
    library this huggingface_hub uses."""
    import importlib

    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    kinds: list[type[BaseException]] = [OfflineModeIsEnabled, HfHubHTTPError, LocalTokenNotFoundError,
                                        ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests.exceptions", "RequestException")):
        try:
            kinds.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(kinds)


def _hub_failure(err: BaseException, repo_id: str, endpoint: str | None) -> str:
    """One line on why a Hub call failed, and what to do."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, OfflineModeIsEnabled):
        return "the Hugging Face Hub cannot be reached: offline mode is on (HF_HUB_OFFLINE=1); unset it to push"
    if isinstance(err, LocalTokenNotFoundError):
        return "no Hub token: give --token, set HF_TOKEN, or run `hf auth login`"
    if isinstance(err, HfHubHTTPError):
        return f"the Hub refused the upload to {repo_id!r}: {first} (check --token and the repository's owner)"
    where = endpoint or "the Hugging Face Hub (HF_ENDPOINT)"
    return f"{where} cannot be reached ({type(err).__name__}: {first}); check the network or --endpoint"


def push_run(run: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
             endpoint: str | None = None, commit_message: str | None = None) -> str:
    """Upload a run's weights folder (``lora/`` or ``transformer/``, with its model card ``README.md`` and
    figures) to the Hugging Face Hub repository ``repo_id`` (created when missing; ``private`` creates it
    private, and refuses an existing public one rather than publish into it). ``endpoint`` selects another Hub API
    server (default: huggingface_hub's, i.e. ``HF_ENDPOINT``). Returns the commit URL.
    Raises :class:`PushRefused` (one line; ``flowgrpo push`` prints it as ``flowgrpo push: error: …``, exit
    status 2) when huggingface_hub is missing, the run has no weights, the Hub cannot be
    used (offline mode, no network, a refusal, no token), ``private`` cannot be honoured, or ``repo_id`` is not a
    Hub repository id (checked before anything is read or sent)."""
    try:
        from huggingface_hub import CommitOperationAdd, HfApi
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise PushRefused('huggingface_hub is not installed (pip install "huggingface_hub>=0.20")') from None
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise PushRefused(f"{repo_id!r} is not a Hub repository id ({str(err).splitlines()[0]}); "
                         "write owner/name, e.g. my-user/flux-digits-lora") from None
    run = Path(run)
    if not run.is_dir():
        raise PushRefused(f"{str(run)!r} {'is a file, not' if run.exists() else 'does not exist; give'} a run "
                          "folder (the output_dir of a finished run, holding lora/ or transformer/)")
    weights = next((run / d for d in ("lora", "transformer") if (run / d).is_dir()), None)
    if weights is None:
        hint = _unfinished_run_hint(run, then="push it")
        raise PushRefused(f"{str(run)!r} holds no lora/ or transformer/ folder" + (hint or " and is not a flowgrpo "
                          "run folder; give the output_dir of a finished training run"))
    linked = weights if weights.is_symlink() else next((f for f in sorted(weights.rglob("*")) if f.is_symlink()), None)
    if linked is not None:  # flowgrpo makes no links: one is a user's, and would upload what it points at
        raise PushRefused(f"{str(linked)!r} is a symbolic link (to {str(linked.readlink())!r}); flowgrpo pushes only a "
                          "run's own weights: nothing was sent; put the files themselves there, or push another run")
    if not (weights / "README.md").exists():
        logger.warning("%s has no model card README.md (runs of older versions): pushing the weights alone", weights)
    api = HfApi(endpoint=endpoint, token=token)
    ops = [CommitOperationAdd(path_in_repo=f.relative_to(weights).as_posix(), path_or_fileobj=str(f))
           for f in sorted(weights.rglob("*")) if f.is_file()]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if private and not api.repo_info(repo_id).private:
            raise PushRefused(f"--private, but the Hub repository {repo_id!r} exists and is public; "
                             "nothing was uploaded (make it private on the Hub first, or push without --private)")
        info = api.create_commit(repo_id, operations=ops,
                                 commit_message=commit_message or f"flowgrpo run {run.name}")
    except _hub_errors() as err:
        raise PushRefused(_hub_failure(err, repo_id, endpoint)) from None
    logger.info("pushed %d files of %s to %s", len(ops), weights, info.commit_url)
    return info.commit_url


def _plan_arguments(pl: argparse.ArgumentParser) -> argparse.ArgumentParser:
    pl.add_argument("config", help="training config (YAML)")
    pl.add_argument("overrides", nargs="*", help="key=value config overrides (as flowgrpo train takes them)")
    pl.add_argument("--gpus", type=int_in(1), required=True, help="processes, one GPU each")
    pl.add_argument("--gpu-memory-gib", type=float_at_least(0.001, "GiB"), default=80.0,
                    help="memory of one GPU in GiB")
    pl.add_argument("--gpus-per-node", type=int_in(1), default=None,
                    help="processes on one node, for the per-node host memory (default: min(--gpus, 8))")
    pl.add_argument("--host-gib", type=float_at_least(0.001, "GiB"), default=1800.0,
                    help="host memory of one node in GiB: a note when a stage needs more (assumed default)")
    return pl


def _sample_arguments(s: argparse.ArgumentParser) -> None:
    """The options of ``flowgrpo sample`` (defaults from :data:`SAMPLE_DEFAULTS`, or the run's with ``--run``)."""
    s.add_argument("--run", help="a run folder: model, weights, evaluation settings and seeds from its config.yaml "
                   "(the options below marked 'with --run' replace the run's setting when given)")
    s.add_argument("--model", help="diffusers folder, hub id, 'digits' or 'tiny' (not with --run)")
    s.add_argument("--lora", help="folder with pytorch_lora_weights.safetensors (or a full transformer folder; not "
                   "with --run, which uses its own)")
    s.add_argument("--no-weights", action="store_true", help="the base model only (ignore the run's weights)")
    s.add_argument("--prompts", help="prompt file (.txt or .jsonl) or embedded set name (with --run: instead of "
                   "the run's evaluation prompts)")
    s.add_argument("--num-images", type=int_in(0, meaning="0: one per prompt"), default=0,
                   help="images (prompts cycled); 0: one per prompt (with --run: the run's evaluation count)")
    d = SAMPLE_DEFAULTS
    s.add_argument("--seed", type=int, help=f"image i uses seed derive_seed(SEED, 'eval', i) (default {d['seed']}; "
                   "with --run: train.seed)")
    s.add_argument("--num-steps", type=int_in(1), help=f"ODE steps (default {d['num_steps']}; with --run: "
                   "eval_sampling.num_steps)")
    s.add_argument("--guidance-scale", type=float_at_least(0.0, "as sampling.guidance_scale"),
                   help=f"guidance (default {d['guidance_scale']}; with --run: "
                   "eval_sampling.guidance_scale)")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help=f"model dtype (default {d['dtype']}; with --run: model.dtype)")
    s.add_argument("--height", type=int_in(1), help="pixels (default: the pipeline's; with --run: model.height)")
    s.add_argument("--width", type=int_in(1), help="pixels (default: the pipeline's; with --run: model.width)")
    s.add_argument("--num-frames", type=int_in(1), help="video models: frames per video (default: the model's; "
                   "with --run: model.num_frames)")
    s.add_argument("--max-sequence-length", type=int_in(1), help=f"text tokens (default "
                   f"{d['max_sequence_length']}; with --run: model.max_sequence_length)")
    s.add_argument("--batch-size", type=int_in(1), default=8, help="images a pipeline call")
    s.add_argument("--out", required=True, help="output folder (PNGs, grid.png, images.pt): absent, empty or an "
                   "earlier sample's (whose images this call replaces; other files are kept); never in a run's "
                   "weights or checkpoints")


def _parser() -> argparse.ArgumentParser:
    """The ``flowgrpo`` command's parser (``train`` is only listed: its own parser is :func:`flowgrpo.runner.main`)."""
    parser = OneLineParser(prog="flowgrpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train (same as flowgrpo/train.py; flowgrpo train --help lists the config)",
                   add_help=False)
    s = sub.add_parser("sample", help="ODE images (or videos) from a base model plus a trained LoRA",
                       formatter_class=DefaultsHelpFormatter)
    _sample_arguments(s)
    pr = sub.add_parser("prompts", help="build a config's prompt file from a local copy of a public prompt set",
                        formatter_class=DefaultsHelpFormatter,
                        description="sets: hpd (HPDv2 train.json/test.json), pickapic (Pick-a-Pic parquet/JSONL/CSV "
                                    "'caption'), ocr (quoted-text prompts), geneval (generated, no source)")
    from flowgrpo.data.public_prompts import prompt_set_names

    pr.add_argument("set", choices=prompt_set_names())
    pr.add_argument("sources", nargs="*", help="the dataset's files (local copies)")
    pr.add_argument("--out", required=True, type=Path, help="prompt file to write (.txt; geneval: .jsonl); an "
                    "existing one only with --overwrite")
    pr.add_argument("--per-task", type=int_in(1), help="geneval only: prompts per task (default 1000)")
    pr.add_argument("--seed", type=int_in(0), help="geneval only: generator seed (default 0)")
    pr.add_argument("--overwrite", action="store_true", help="replace --out when it exists (never one of the "
                    "sources)")
    _plan_arguments(sub.add_parser("plan", help="per-GPU and host memory of a config on N GPUs, by part, and "
                                   "whether it fits", formatter_class=DefaultsHelpFormatter))
    pu = sub.add_parser("push", help="upload a run's weights and model card to the Hugging Face Hub",
                        formatter_class=DefaultsHelpFormatter)
    pu.add_argument("run", help="the run folder (its lora/ or transformer/ folder is uploaded)")
    pu.add_argument("repo_id", help="Hub repository, user/name (created when missing)")
    pu.add_argument("--private", action="store_true", help="create the repository private")
    pu.add_argument("--token", help="Hub token (default: HF_TOKEN or the `hf auth login` token)")
    pu.add_argument("--endpoint", help="Hub API server (default: huggingface_hub's, HF_ENDPOINT)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train":
        from flowgrpo.runner import main as train_main

        train_main(argv[1:], prog="flowgrpo train")
        return
    if argv and argv[0] == "plan":  # overrides may follow the options: parsed intermixed, by its own parser
        args = _plan_arguments(OneLineParser(prog="flowgrpo plan", formatter_class=DefaultsHelpFormatter,
                                                       description="per-GPU and host memory of a config on N GPUs, "
                                                       "by part, and whether it fits")).parse_intermixed_args(argv[1:])
        args.command = "plan"
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from flowgrpo.models.quiet import quiet_libraries

    quiet_libraries()
    from flowgrpo.config import ConfigError

    if args.command == "sample":
        try:
            _sample(args)
        except (ConfigError, ValueError) as err:  # bad input (config, prompts, model folder): one line
            parser.exit(2, f"flowgrpo sample: error: {err}\n")
    elif args.command == "prompts":
        try:
            _prompts(args)
        except ValueError as err:  # bad input (sources, an --out that cannot be written): one line
            parser.exit(2, f"flowgrpo prompts: error: {err}\n")
    elif args.command == "plan":
        from flowgrpo.memory_plan.estimate import plan_config, render

        try:
            p = plan_config(args.config, args.gpus, args.gpu_memory_gib, args.overrides,
                            gpus_per_node=args.gpus_per_node, host_gib=args.host_gib)
        except (ConfigError, ValueError, OSError) as err:  # bad input (config, layout, model): one line
            parser.exit(2, f"flowgrpo plan: error: {err}\n")
        print(render(p, f"{Path(args.config).name} on {args.gpus} GPU{'s' * (args.gpus > 1)}"))  # noqa: T201
    else:
        try:
            url = push_run(args.run, args.repo_id, private=args.private, token=args.token, endpoint=args.endpoint)
        except PushRefused as err:  # no weights, a bad repository id, the Hub unreachable or refusing: one line
            parser.exit(2, f"flowgrpo push: error: {err}\n")
        print(url)  # noqa: T201 - the result


if __name__ == "__main__":
    main()
