"""The life of a run folder (``output_dir``): claimed for one run, its config written once, a resume's changed
settings reported, the base model's "before" evaluation kept, and a finished run recognised.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from flowgrpo.checkpoints.health import newest_healthy, resolve_checkpoint
from flowgrpo.strategies.settings import ConfigError, flat_dict, save_config
from flowgrpo.writing.metrics import read_metrics
from flowgrpo.writing.outputs import (
    OWN_FILES,
    RUN_FILES,
    OutputRefused,
    claim_folder,
    foreign_files,
    replace_file,
    write_text_file,
)

logger = logging.getLogger(__name__)


#: the settings that decide what an evaluation measures (the RL seed also picks the evaluation's seeds)
EVAL_SETTINGS = ("data.eval_prompts", "data.eval_num_prompts", "eval_sampling.", "eval_rewards", "rewards",
                 "train.seed")
#: of them, the ones that decide which images an evaluation scores (its prompts, their count, its sampler): a
#: resume into the run's folder cannot change them (:func:`refuse_changed_evaluation`)
EVAL_IMAGES = ("data.eval_prompts", "data.eval_num_prompts", "eval_sampling.")

_CHECKPOINT_FILE = (r"(trainable|ema|objective)\.safetensors|optimizer\.pt|rng\.pt|state\.json|health\.json|"
                    r"\.health\.json\.tmp|optimizer_groups\.json|sharded/(__\d+_\d+\.distcp|\.metadata)")
#: the model card and its figures (flowgrpo.training.model_card)
_CARD = r"README\.md|reward_curve\.png|before_after\.png"
#: the paths a run writes inside its folders (the :data:`~flowgrpo.writing.outputs.RUN_FILES` that are folders), as
#: regular expressions of a file's path relative to that folder: ``checkpoints/`` (``latest``, each
#: ``epoch_<N>`` and its temporary, aside and removing forms, flowgrpo.checkpoints.save_load), the final weights
#: (``transformer/``: diffusers' ``config.json`` and safetensors files; ``lora/``: ``pytorch_lora_weights``),
#: each with the model card, and ``rollouts/``. ``logging.overwrite`` removes a part only when every file in it is
#: one of these (:func:`foreign_run_file`)
RUN_PART_NAMES = {
    "checkpoints": rf"latest|\.latest\.tmp|\.?epoch_\d+(\.tmp|\.old|\.removing)?/({_CHECKPOINT_FILE})",
    "transformer": rf"{_CARD}|config\.json|diffusion_pytorch_model(-\d+-of-\d+)?\.safetensors(\.index\.json)?",
    "lora": rf"{_CARD}|pytorch_lora_weights\.safetensors",
    "rollouts": r"epoch_\d+\.safetensors",
}


def foreign_run_file(out: str | os.PathLike) -> Path | None:
    """The first file (sorted) inside a folder of the run in ``out`` (:data:`RUN_PART_NAMES`) that a run does not
    write there: a user's own file, which ``logging.overwrite`` must not remove; None when there is none. Reads
    only names."""
    out = Path(out)
    for part, names in sorted(RUN_PART_NAMES.items()):
        folder = out / part
        if not folder.is_dir():
            continue
        for path in sorted(f for f in folder.rglob("*") if not f.is_dir()):
            if not re.fullmatch(names, path.relative_to(folder).as_posix()):
                return path
    return None


def linked_run_file(out: str | os.PathLike) -> Path | None:
    """The first symbolic link (sorted) where the run in ``out`` writes, reads to resume or removes: one of
    :data:`~flowgrpo.writing.outputs.RUN_FILES`, ``config_resumed_at_epoch_*.yaml``, the marker or lock
    (:data:`~flowgrpo.writing.outputs.OWN_FILES`), or anything inside the run's folders (:data:`RUN_PART_NAMES`);
    None when there is none. flowgrpo makes no links, so a link is a user's: writing through it would change
    its target outside the run folder, removing the run's files would fail on it half-way. Reads only names."""
    out = Path(out)
    top = [out / n for n in (*RUN_FILES, *OWN_FILES)] + sorted(out.glob("config_resumed_at_epoch_*.yaml"))
    for path in top:
        if path.is_symlink():
            return path
    for part in sorted(RUN_PART_NAMES):
        if (out / part).is_dir():
            inner = sorted(f for f in (out / part).rglob("*") if f.is_symlink())
            if inner:
                return inner[0]
    return None


def refuse_linked_run_files(out: str | os.PathLike) -> None:
    """Refuse a run (fresh, resumed or ``logging.overwrite``) in ``out`` when a path it writes or removes is a
    symbolic link (:func:`linked_run_file`): the link's target is never written nor removed, and neither is the
    link. Raises :class:`~flowgrpo.writing.outputs.OutputRefused` naming the link and its target."""
    found = linked_run_file(out)
    if found is not None:
        raise OutputRefused(f"output_dir {str(out)!r}: {str(found)!r} is a symbolic link (to "
                            f"{os.readlink(found)!r}); flowgrpo writes and removes a run's files only inside its run "
                            "folder: nothing was changed; put the files themselves there instead of the link, or "
                            "choose another output_dir")


def refuse_foreign_run_files(out: str | os.PathLike) -> None:
    """Refuse ``logging.overwrite=true`` on the run in ``out`` when a folder of the run holds a file flowgrpo did
    not write there (:func:`foreign_run_file`; the files beside the run's own at the top of ``out`` are kept, as
    always), or a symbolic link (:func:`refuse_linked_run_files`). Raises
    :class:`~flowgrpo.writing.outputs.OutputRefused` naming the file."""
    refuse_linked_run_files(out)
    found = foreign_run_file(out)
    if found is not None:
        raise OutputRefused(f"logging.overwrite=true would remove {str(found)!r} with the old run's "
                            f"{found.relative_to(out).parts[0]}/, but flowgrpo did not write it: nothing was removed; "
                            "move it out of the run folder, or choose another output_dir")


def refuse_parts_without_config(out: str | os.PathLike) -> None:
    """Refuse a fresh run or ``logging.overwrite=true`` in ``out`` when a folder of a run there
    (:data:`RUN_PART_NAMES`: ``checkpoints/``, ``transformer/``, ``lora/``, ``rollouts/``) holds files but ``out``
    has no ``config.yaml``: a run writes its config before any of them, so they are not a run's (the folder's marker
    written by hand: fresh-user trial 6), and neither writing nor removing them is flowgrpo's to do. Raises
    :class:`~flowgrpo.writing.outputs.OutputRefused` naming the first file."""
    out = Path(out)
    if (out / "config.yaml").exists():
        return
    for part in sorted(RUN_PART_NAMES):
        found = sorted(f for f in (out / part).rglob("*") if not f.is_dir()) if (out / part).is_dir() else []
        if found:
            raise OutputRefused(f"output_dir {str(out)!r} holds {str(found[0])!r} in a run's {part}/ but no "
                                "config.yaml, which a run writes before any of them: they are not a run's, nothing "
                                "was written or removed; move them out of the folder, or choose another output_dir")


def refuse_overwrite_with_resume(config) -> None:
    """Refuse ``logging.overwrite=true`` with any ``train.resume_from`` (a resume keeps the run; overwrite removes
    it), quoting ``resume_from`` as given (``auto`` before it is resolved: call this first). Reads nothing.
    Raises :class:`~flowgrpo.strategies.settings.ConfigError`."""
    if config.logging.overwrite and config.train.resume_from is not None:
        raise ConfigError(f"logging.overwrite=true and train.resume_from={config.train.resume_from} contradict each "
                          "other (overwrite removes the run a resume continues); drop one of them")


def refuse_foreign_resume(config, resumed: Path) -> None:
    """Refuse a resume from checkpoint ``resumed`` into an ``output_dir`` that holds another run: a resume writes
    into its checkpoint's own run folder (the folder above its ``checkpoints``, compared as resolved paths, so a run
    folder moved or reached through a link is the same run) or into a new or empty folder. A copy of a run folder
    (``cp -a A B``) is a run of its own: resume it from its own checkpoints (``B/checkpoints``, ``auto``). Also
    refuses ``logging.overwrite=true`` with ``train.resume_from`` (a resume keeps the run; overwrite removes it).
    Reads only names. Raises :class:`~flowgrpo.strategies.settings.ConfigError` naming both folders and the
    remedy."""
    refuse_overwrite_with_resume(config)
    out, origin = Path(config.output_dir), Path(resumed).parent.parent
    if not foreign_files(out) or out.resolve() == origin.resolve():
        return
    raise ConfigError(f"train.resume_from={config.train.resume_from} is a checkpoint of the run in {str(origin)!r}, "
                      f"but output_dir {str(out)!r} holds another run, whose results the resume would replace: "
                      f"nothing was changed; resume into the checkpoint's run (output_dir={origin}) or into a new "
                      "folder")


def refuse_older_resume(config, resumed: Path) -> None:
    """Refuse a resume from checkpoint ``resumed`` (resolved from ``train.resume_from``) that would replace newer
    work in ``output_dir``: its ``checkpoints`` hold a checkpoint a resume would take
    (:func:`~flowgrpo.checkpoints.health.newest_healthy`) of a later epoch, or, for a checkpoint folder named
    itself, its ``summary.json`` says its final weights are of more epochs (training from the older one would
    replace them, the later checkpoints and the records of the epochs after it). A resume from the newest healthy
    checkpoint (the root ``checkpoints``, ``auto``) passes, extending a finished run included, and so does one
    that passes over a damaged or unhealthy newest checkpoint; so does a resume into another, new ``output_dir``.
    Reads only ``state.json`` and ``summary.json``. Raises :class:`~flowgrpo.strategies.settings.ConfigError`
    naming what is newer and the remedy."""
    root = Path(config.output_dir) / "checkpoints"
    newest = newest_healthy(root) if (root / "latest").is_file() else None
    named = not (Path(config.train.resume_from) / "latest").is_file()  # a checkpoint folder, not a root
    done = _summary_epochs(root.parent) if named else 0
    if newest is None and not done:
        return
    epoch = _epoch_of(resumed)
    final = [f"the final {n}" for n in ("lora", "transformer", "summary.json") if (root.parent / n).exists()]
    if newest is not None and _epoch_of(newest) > epoch:
        newer = [repr(str(newest)), *final]
    elif done > epoch + 1:
        newer = final
    else:
        return
    raise ConfigError(f"train.resume_from={config.train.resume_from} (epoch_{epoch}) is older than what output_dir "
                      f"holds: {', '.join(newer)}; the resume would replace them, nothing was changed. Resume from the "
                      f"newest (train.resume_from={root}), or from this one into another output_dir")


def _summary_epochs(out: Path) -> int:
    """The epochs of the finished run in ``out`` (its ``summary.json``'s ``epochs``), 0 when unknown."""
    try:
        epochs = json.loads((out / "summary.json").read_text(encoding="utf-8")).get("epochs")
    except (OSError, ValueError, AttributeError):
        return 0
    return epochs if type(epochs) is int else 0


def _epoch_of(checkpoint: Path) -> int:
    """The epoch of a checkpoint folder (its ``state.json``'s; a resolved checkpoint has one), else of its name
    ``epoch_<N>``, else -1 (the load reports a checkpoint it cannot read)."""
    try:
        return int(json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        name = Path(checkpoint).name
        return int(name[6:]) if name.startswith("epoch_") and name[6:].isdigit() else -1


def latest_run_config(out: str | os.PathLike) -> Path:
    """The config the run in ``out`` last ran with: its newest ``config_resumed_at_epoch_<E>.yaml`` (largest E;
    a resume that extended or changed the run wrote it), else its original ``config.yaml``."""
    out = Path(out)
    resumed = [(int(p.stem.rsplit("_", 1)[1]), p) for p in out.glob("config_resumed_at_epoch_*.yaml")
               if p.stem.rsplit("_", 1)[1].isdigit()]
    return max(resumed)[1] if resumed else out / "config.yaml"


def occupied_message(out: Path) -> str:
    """Why ``out`` cannot take a new run, and the ways on: resume (only when a checkpoint is there), overwrite or
    another folder."""
    if (out / "checkpoints" / "latest").exists():
        return (f"output_dir {str(out)!r} already holds a run; choose another output_dir, resume it with "
                f"train.resume_from={out / 'checkpoints'} (or train.resume_from=auto), or set logging.overwrite=true")
    return (f"output_dir {str(out)!r} already holds a run that stopped before its first checkpoint; start it again "
            "with logging.overwrite=true (or train.resume_from=auto), or choose another output_dir")


def changed_settings(saved: Path, cfg) -> dict[str, str]:
    """{key: "key: old -> new"} for every setting of ``cfg`` that differs from the saved config file ``saved``
    (``train.resume_from`` left out; a key one of them lacks shows as ``(absent)``). A strategy section whose
    strategy changed (``objective.name: 'dpo' -> 'sde_ratio'``; :data:`~flowgrpo.config.schema.STRATEGY_SECTIONS`)
    comes first, as one entry under its ``name`` key that counts the settings of the old strategy dropped and of
    the new one added instead of listing each ``-> (absent)``; its settings that both have are listed as usual. A
    saved config of the earlier layout (``algo``, ``chunker``) is read with its keys at their new homes
    (:func:`~flowgrpo.config.loading.upgraded`); a home it did not list (``objective.timestep_fraction`` of a run
    whose chunker had none) is no change."""
    from flowgrpo.algo.objectives.sde_ratio import NESTED_SECTIONS
    from flowgrpo.config.loading import MOVES, upgraded
    from flowgrpo.config.schema import STRATEGY_SECTIONS

    raw = yaml.safe_load(saved.read_text()) or {}
    old = flat_dict(upgraded(raw))  # an earlier version's keys at their homes
    new = flat_dict(cfg.model_dump(mode="json"))
    unlisted = set(MOVES.values()) - set(old) if {"algo", "chunker"} & set(raw) else set()
    absent = object()

    def shown(v) -> str:
        return "(absent)" if v is absent else repr(v)

    changed = {k: f"{k}: {shown(old.get(k, absent))} -> {shown(new.get(k, absent))}"
               for k in sorted(set(old) | set(new))
               if old.get(k, absent) != new.get(k, absent) and k != "train.resume_from" and k not in unlisted}
    switched = {}
    for section in [*STRATEGY_SECTIONS, *NESTED_SECTIONS]:
        name = f"{section}.name"
        if name not in changed:
            continue
        mine = [k for k in changed if k.startswith(f"{section}.") and k != name]
        gone = [k for k in mine if k not in new]
        added = [k for k in mine if k not in old]
        for k in gone + added:
            del changed[k]
        switched[name] = (f"{changed.pop(name)} (the section's settings follow its {section.rsplit('.', 1)[-1]}: "
                          f"{len(gone)} of the old one's dropped, {len(added)} of the new one's at their values)")
    return switched | changed


def schedule_shift_line(saved: dict, train, epoch: int) -> str | None:
    """A warning when a resume at ``epoch`` (0-based, the next to run) changes ``train.num_epochs`` or
    ``train.lr_min_ratio`` of a ``cosine`` schedule (``saved``: the run's last config as a dict; ``train``: the
    resumed run's ``train`` settings): the cosine's length is the run's, so the rate jumps at the resume and the
    epochs already run followed another curve. None when the rate of ``epoch`` is unchanged."""
    from flowgrpo.training.optim import epoch_lr_factor

    old = saved.get("train", {})
    if train.lr_schedule != "cosine" or old.get("lr_schedule") != "cosine":
        return None
    n_old, m_old = old.get("num_epochs", train.num_epochs), old.get("lr_min_ratio", train.lr_min_ratio)
    if (n_old, m_old) == (train.num_epochs, train.lr_min_ratio):
        return None
    before = epoch_lr_factor(min(epoch, n_old), n_old, "cosine", m_old)
    after = epoch_lr_factor(epoch, train.num_epochs, "cosine", train.lr_min_ratio)
    return (f"the cosine learning rate follows the run's length: resumed at epoch {epoch + 1} with "
            f"train.num_epochs {n_old} -> {train.num_epochs} (lr_min_ratio {m_old} -> {train.lr_min_ratio}), the rate "
            f"goes from {before:.3g} to {after:.3g} of train.lr at the resume; the epochs already run followed the "
            "old curve (to keep it, resume with the run's values)")


def refuse_changed_evaluation(config) -> None:
    """A resume with another evaluation than the run's first leg (:data:`EVAL_IMAGES`: other prompts, count or
    evaluation sampler; a prompt file under another name with the same records is the same, :func:`_same_prompts`)
    is refused, whether into the run's folder (``output_dir`` holding its ``config.yaml``: the run's
    ``metrics.jsonl`` would hold evaluations of different images, which its best checkpoint, collapse warning,
    reward curve and time to quality compare as one series; digits: the diversity of a digit from 20 images is off
    by ~0.03, configs/digits.yaml) or into a new folder (the "before" figures and images are the checkpoint's run's,
    ``eval_before.json``, so the before/after table would compare evaluations of different images). Raises
    :class:`~flowgrpo.strategies.settings.ConfigError` naming each changed key, the run's value and the command
    line's."""
    if not config.train.resume_from:
        return
    saved = Path(config.output_dir) / "config.yaml"
    if not saved.is_file():  # a new folder: the checkpoint's run measured the "before" evaluation
        saved = resolve_checkpoint(config.train.resume_from).parent.parent / "config.yaml"
        if not saved.is_file():
            return
    changed = [v for k, v in changed_settings(saved, config).items() if k.startswith(EVAL_IMAGES)
               and not (k == "data.eval_prompts" and _same_prompts(saved, config.data.eval_prompts))]
    if changed:
        raise ConfigError(f"resuming {str(saved.parent)!r} with another evaluation than its first leg "
                          f"({'; '.join(changed)}): one run's metrics.jsonl and its before/after table compare its "
                          "evaluations as one series (best checkpoint, curves, time to quality); keep the run's value "
                          "(the first of each pair), or evaluate the other way in a new run")


#: the settings that decide the trained parameters' names and shapes, which a checkpoint's tensors must match
#: (:func:`refuse_changed_model`)
TRAINED_SHAPE = ("model.finetune", "model.lora_rank", "model.lora_target_modules")


def checkpoint_run_config(config) -> tuple[Path, Path] | None:
    """(the checkpoint folder ``train.resume_from`` names, the saved config of its run: the run folder's
    :func:`latest_run_config`), or None without a resume or where that run saved no config."""
    if not config.train.resume_from:
        return None
    ckpt = resolve_checkpoint(config.train.resume_from)
    saved = latest_run_config(ckpt.parent.parent)
    return (ckpt, saved) if saved.is_file() else None


def refuse_changed_model(config) -> None:
    """A resume whose trained parameters the checkpoint cannot fill is refused before any model loads (it once
    loaded the model, then failed on the first unknown parameter, naming no fix), read from the config of the
    checkpoint's run (its folder's :func:`latest_run_config`; nothing checked where there is none):
    :data:`TRAINED_SHAPE` (LoRA or full fine-tuning, the LoRA's rank and targets), and ``train.ema_decay`` set
    where the checkpoint's run kept no EMA (its checkpoint holds no EMA weights). Raises
    :class:`~flowgrpo.strategies.settings.ConfigError` naming each key, the checkpoint's value and this run's, and the
    fix."""
    found = checkpoint_run_config(config)
    if found is None:
        return
    ckpt, saved = found
    old, changed = flat_dict(yaml.safe_load(saved.read_text()) or {}), changed_settings(saved, config)
    keys = ["model.finetune"] if "model.finetune" in changed else [k for k in TRAINED_SHAPE if k in changed]
    if keys:  # another kind of fine-tuning: its LoRA settings are beside the point
        fixes = " and ".join(f"{k}={_override(old.get(k))}" for k in keys)
        raise ConfigError(f"train.resume_from={str(ckpt)!r} holds the trained weights of another model setting "
                          f"({'; '.join(changed[k] for k in keys)}: the checkpoint's, then this run's); set {fixes}, "
                          "or start a new run without train.resume_from")
    if old.get("train.ema_decay") is None and config.train.ema_decay is not None:
        raise ConfigError(f"train.resume_from={str(ckpt)!r}: train.ema_decay={config.train.ema_decay} but the "
                          "checkpoint's run kept no EMA, so its checkpoint holds no EMA weights; set "
                          "train.ema_decay=null, or start a new run without train.resume_from")


def refuse_nothing_to_train(config, checkpoint: Path) -> None:
    """A resume into another folder than the checkpoint's run (``output_dir`` a new folder) from a checkpoint that
    already holds ``train.num_epochs`` epochs or more trains nothing and has no final outputs to finish there: it
    is refused before any model loads (it once wrote a checkpoint copy and a summary into the new folder, saying
    it was finishing an interrupted run's outputs). A resume in the run's own folder is :meth:`RunFolder.finished`'s
    to answer. Raises :class:`~flowgrpo.strategies.settings.ConfigError` naming the epochs and the fix."""
    match = re.fullmatch(r"epoch_(\d+)", checkpoint.name)
    if match is None:
        return
    done, n = int(match.group(1)) + 1, config.train.num_epochs
    run = checkpoint.parent.parent
    if done < n or run.resolve() == Path(config.output_dir).resolve():
        return
    raise ConfigError(f"train.resume_from={str(checkpoint)!r} is after epoch {done} of its run ({str(run)!r}), and "
                      f"train.num_epochs={n}: nothing is left to train into output_dir={config.output_dir!r}; set "
                      f"train.num_epochs above {done} to train on from it")


def _override(value) -> str:
    """``value`` as a ``key=value`` override writes it (a list as ``[a,b]``)."""
    return f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)


def _same_prompts(saved: Path, prompts: str | None) -> bool:
    """Whether ``prompts`` (a prompt file or embedded set) holds the records of the saved config's
    ``data.eval_prompts`` (the run folder or its prompt file moved, say), or that file can no longer be read (then
    only its name can be compared, which :meth:`RunFolder.write_config` warns about)."""
    from flowgrpo.data.prompts import load_prompts

    old = (yaml.safe_load(saved.read_text()) or {}).get("data", {}).get("eval_prompts")
    if old is None or prompts is None:
        return old == prompts
    try:
        before = load_prompts(old)
    except (OSError, ValueError):
        return True
    try:
        now = load_prompts(prompts)
    except (OSError, ValueError):
        return True  # the preflight's reading of the prompt files says what is wrong with it
    return (before.prompts, before.metadata) == (now.prompts, now.metadata)


class RunFolder:
    """The run folder ``config.output_dir`` of the run ``config`` (its :class:`~flowgrpo.config.Config`)."""

    def __init__(self, config) -> None:
        self.cfg = config
        self.out = Path(config.output_dir)

    @property
    def weights_dir(self) -> Path:
        """Where the final weights go: ``output_dir/lora`` (LoRA) or ``output_dir/transformer`` (full)."""
        return self.out / ("lora" if self.cfg.model.finetune == "lora" else "transformer")

    def claim(self, epoch: int) -> None:
        """Refuse a folder that holds another run; when resuming into it at ``epoch``, drop the records of epochs
        after the checkpoint (a run killed mid-epoch left them), so ``metrics.jsonl`` holds each epoch once; with
        ``logging.overwrite`` remove every file of the old run (its checkpoints included), refused when one of the
        run's folders holds a file it did not write (:func:`refuse_foreign_run_files`). Raises
        ``FileExistsError`` / :class:`~flowgrpo.writing.outputs.OutputRefused`."""
        metrics = self.out / "metrics.jsonl"
        refuse_linked_run_files(self.out)  # the preflight checked it; the folder is locked since
        if self.cfg.train.resume_from and metrics.exists():
            kept = [r for r in read_metrics(metrics, quiet=True) if r["epoch"] < epoch]  # preflight warned
            write_text_file(metrics, "".join(json.dumps(r) + "\n" for r in kept))
        elif (self.out / "config.yaml").exists() and not self.cfg.logging.overwrite:
            raise FileExistsError(occupied_message(self.out))
        elif self.cfg.logging.overwrite:
            refuse_parts_without_config(self.out)  # the preflight checked both; the folder is locked since
            refuse_foreign_run_files(self.out)
            old = [self.out / n for n in RUN_FILES if (self.out / n).exists()]
            old += sorted(self.out.glob("config_resumed_at_epoch_*.yaml"))
            for path in old:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            if old:
                logger.warning("logging.overwrite=true: removed the old run's %s from %s",
                               ", ".join(p.name for p in old), self.out)
        if not self.cfg.train.resume_from:
            refuse_parts_without_config(self.out)
        claim_folder(self.out, "run")  # the preflight checked the folder (flowgrpo.writing.outputs.check_folder)

    def write_config(self, epoch: int) -> None:
        """``config.yaml`` is the run's original config and is never overwritten: a resume at ``epoch`` warns with
        the keys that differ from the run's last config (:func:`latest_run_config`), and separately when the
        evaluation differs from the original one (the "before" figures were measured with that), and writes its
        own config beside it (``config_resumed_at_epoch_<E>.yaml``)."""
        path = self.out / "config.yaml"
        if not path.exists():
            save_config(self.cfg, path)
            return
        last = latest_run_config(self.out)
        changed = changed_settings(last, self.cfg)
        if changed:
            logger.warning("resuming with settings that differ from %s: %s", last, "; ".join(changed.values()))
        line = schedule_shift_line(yaml.safe_load(last.read_text()) or {}, self.cfg.train, epoch)
        if line:
            logger.warning("%s", line)
        eval_changed = [v for k, v in changed_settings(path, self.cfg).items() if k.startswith(EVAL_SETTINGS)]
        if eval_changed:
            logger.warning("the evaluation differs from the one the run's 'before' figures were measured with (%s): "
                           "%s; the before/after figures of this run compare different evaluations",
                           path, "; ".join(eval_changed))
        save_config(self.cfg, self.out / f"config_resumed_at_epoch_{epoch}.yaml")

    def before(self, evaluate: Callable[[str], tuple], main: bool) -> tuple[dict[str, float], torch.Tensor, list[str]]:
        """The base model's evaluation (metrics, images, captions): measured by ``evaluate("before")`` at the
        start of a fresh run and kept in ``eval_before.json``; a resumed run reads it from the run it resumes (its
        checkpoint's run folder), never re-measures it. Only the ``main`` process writes."""
        if not self.cfg.train.resume_from:
            before, images, captions = evaluate("before")
            if main:
                write_text_file(self.out / "eval_before.json", json.dumps({"metrics": before, "captions": captions}))
                replace_file(self.out / "eval_images_before.pt", lambda tmp: torch.save(images, tmp))
            return before, images, captions
        origin = resolve_checkpoint(self.cfg.train.resume_from).parent.parent
        for folder in (origin, self.out):
            if (folder / "eval_before.json").is_file():
                rec = json.loads((folder / "eval_before.json").read_text())
                images = folder / "eval_images_before.pt"
                img = torch.load(images, weights_only=True) if images.is_file() else torch.empty(0)
                if main and folder != self.out:
                    write_text_file(self.out / "eval_before.json", json.dumps(rec))
                    replace_file(self.out / "eval_images_before.pt", lambda tmp, img=img: torch.save(img, tmp))
                return rec["metrics"], img, rec["captions"]
        logger.warning("no eval_before.json in %s: the base model's 'before' evaluation is not known to this "
                       "resumed run; summary.json reports no 'before' figures", origin)
        return {}, torch.empty(0), []

    def finished(self, epoch: int) -> bool:
        """Whether the resumed checkpoint (next ``epoch``) already ends the run and its final products are all
        there (then nothing is trained or rewritten). A run that trained every epoch but lacks ``summary.json`` or
        the model card (interrupted during its final evaluation and save) is not finished: the resume evaluates
        and writes them."""
        if epoch < self.cfg.train.num_epochs:
            return False
        final = {"summary.json": self.out / "summary.json", "model card": self.weights_dir / "README.md"}
        missing = [name for name, path in final.items() if not path.is_file()]
        if missing:
            logger.warning("the run in %s trained all %d epochs but its final outputs are incomplete (no %s): it was "
                           "stopped during its final evaluation and save; finishing them now", self.out,
                           self.cfg.train.num_epochs, " and no ".join(missing))
            return False
        line = finished_line(self.cfg.train.resume_from, epoch, self.cfg.train.num_epochs)
        last = latest_run_config(self.out)
        unused = [v for k, v in changed_settings(last, self.cfg).items() if k != "train.num_epochs"] \
            if last.is_file() else []
        if unused:  # nothing trains, so nothing given is read: said, not silently dropped
            line += f" The settings given that differ from the run's were not used: {'; '.join(unused)}."
        logger.warning("%s", line)
        return True


def finished_line(resume_from, epoch: int, num_epochs: int) -> str:
    """The one line of resuming a finished run: its checkpoint is after ``epoch`` epochs (counted as the epoch
    lines; the checkpoint ``epoch_<epoch - 1>``), at least ``num_epochs``; saying so when it has more than
    ``train.num_epochs`` asks."""
    if epoch > num_epochs:
        return (f"the run of {resume_from} already trained {epoch} epochs (its checkpoint epoch_{epoch - 1} is after "
                f"epoch {epoch}, counted as the epoch lines), more than train.num_epochs={num_epochs} asks: nothing "
                f"to do, nothing rewritten. To train further, resume with train.num_epochs above {epoch}.")
    return (f"the run of {resume_from} already finished all {num_epochs} epochs (its checkpoint epoch_{epoch - 1} is "
            f"after epoch {epoch}/{num_epochs}, counted as the epoch lines): nothing to do, nothing rewritten. To "
            "train further, resume with a larger train.num_epochs.")
