"""What flowgrpo writes and where: the one rule every writer of the toolkit checks before any slow work.

A writer (a run's ``output_dir``, ``flowgrpo sample --out``, ``flowgrpo prompts --out``, the dataset and model
builders, ``eval/geneval.py --outdir``; the list is in docs/run_folder.md, "What flowgrpo writes and where")

- writes a **folder** only when it is absent, empty, or **owned** by flowgrpo output of the same kind: it holds
  :data:`MARKER_FILE`, which the writer puts there when it claims the folder (:func:`claim_folder`), or it is the
  run folder of an older version (a flowgrpo ``config.yaml``: :func:`owner`). The files flowgrpo itself leaves in
  a folder it claimed (:data:`OWN_FILES`) do not make it non-empty;
- writes a **file** only when it is absent, or when the writer's explicit overwrite option was given
  (``--overwrite``, named so in every command that has one, as ``logging.overwrite`` is for a run);
- never writes **onto its own input**: the output is not one of the command's inputs and does not lie inside
  one;
- never writes **into a part of another flowgrpo output** (a run's ``transformer/``, ``lora/``, ``checkpoints/``
  …: :data:`RUN_FILES`), which ``flowgrpo push`` uploads or a resume reads.

A writer that writes its folder again (``flowgrpo sample``) records the files it wrote in the marker
(:func:`record_written`) and removes the earlier call's before writing (:func:`remove_written`), so the folder
holds one call's outputs; a file named as its files are that no call recorded is refused (:func:`check_written`).

Anything else is :class:`OutputRefused` (a ``ValueError``) with one line naming the path, a file found there and
the remedy. Writers that build into a temporary folder and rename it into place (the cache,
:func:`flowgrpo.builds.cache_folder.build_once`) never replace an existing folder and need no check.

This module is the home of the rule because it is the one thing every writer shares; it imports nothing heavy
(the CLI checks an ``--out`` before torch is imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

#: the file flowgrpo writes into a folder it claims; it names the kind of output the folder holds
MARKER_FILE = ".flowgrpo-output"
#: the run lock's file (:mod:`flowgrpo.writing.run_lock`)
LOCK_FILE = ".flowgrpo.lock"
#: files flowgrpo leaves in a folder it claimed: they do not make the folder non-empty
OWN_FILES = (MARKER_FILE, LOCK_FILE)
#: what a run writes into its output_dir; ``logging.overwrite`` removes these of the old run and keeps the rest
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "rewards.json", "eval_before.json",
             "eval_images_before.pt", "eval_images_after.pt", "lora", "transformer", "rollouts",
             "samples_latest.png", "reward_curve.png", "before_after.png")
#: the top-level sections of every resolved config a run has written into its ``config.yaml`` (the config's
#: ``model_dump``; a hand-written config sets a few and may name a ``base``)
#: (the sections every version has written: ``algo`` and ``chunker`` of earlier ones are now ``objective``'s,
#: ``advantage`` and ``group_filter``)
RESOLVED_SECTIONS = frozenset({"output_dir", "model", "sampling", "eval_sampling", "train", "objective", "rewards",
                               "eval_rewards", "data", "logging", "parallel"})
#: the parts of each kind of output another writer may not write into
OWNED_PARTS = {"run": RUN_FILES}


class OutputRefused(ValueError):
    """A path a writer may not write (module docstring); the message is one line with the remedy."""


def owner(folder: str | os.PathLike) -> str | None:
    """The kind of flowgrpo output that owns ``folder`` (``"run"``, ``"sample"``, …): its :data:`MARKER_FILE`'s
    ``kind``, else ``"run"`` for a folder holding the resolved ``config.yaml`` a run writes
    (:data:`RESOLVED_SECTIONS`: run folders written before the marker), else None (not flowgrpo's, or absent)."""
    folder = Path(folder)
    try:
        return json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        saved = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    # a run folder of a version without the marker: its config.yaml is the resolved config, every section written
    # out and no base; another tool's config (output_dir and a train section are common) or a user's own flowgrpo
    # config file placed there is not (a run into such a folder replaced or removed it)
    return "run" if isinstance(saved, dict) and "base" not in saved and RESOLVED_SECTIONS <= saved.keys() else None


def foreign_files(folder: str | os.PathLike) -> list[str]:
    """The names in ``folder`` (sorted) other than :data:`OWN_FILES`; empty for an absent folder."""
    try:
        return sorted(n for n in os.listdir(folder) if n not in OWN_FILES)
    except (FileNotFoundError, NotADirectoryError):
        return []


def check_folder(folder: str | os.PathLike, what: str, kind: str, inputs: Iterable = (),
                 own_names: str | None = None) -> None:
    """Refuse to write the output folder ``folder`` of ``kind`` unless it is absent, empty or owned by output of
    ``kind`` (:func:`owner`), and unless it stays clear of the command's ``inputs`` (paths; None entries skipped)
    and of the parts of other flowgrpo outputs. ``what`` names the option in the message (``"--out"``,
    ``"output_dir"``). ``own_names``: a regular expression of the names the writer gives its files; a folder
    holding only such names counts as owned (a cache written before the marker). Reads only names and marker
    files (no slow work). Raises :class:`OutputRefused`."""
    folder = Path(folder)
    shown = f"{what} {str(folder)!r}"
    if folder.exists() and not folder.is_dir():
        raise OutputRefused(f"{shown} is a file, not a folder; give a folder to write into")
    _check_inputs(folder, shown, inputs)
    _check_parts(folder, shown)
    found = foreign_files(folder)
    if not found:
        return
    mine = owner(folder)
    if mine == kind or (mine is None and own_names and all(re.fullmatch(own_names, n) for n in found)):
        return
    if mine is not None:
        raise OutputRefused(f"{shown} holds flowgrpo's {mine} output, not {kind} output; choose another folder")
    raise OutputRefused(f"{shown} is not empty and was not made by flowgrpo (it holds {found[0]!r}"
                        f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}): nothing was written; choose "
                        "another folder, or empty this one")


def claim_folder(folder: str | os.PathLike, kind: str, what: str = "output folder") -> bool:
    """Make ``folder`` (and the folders above it) and mark it as flowgrpo output of ``kind`` (:data:`MARKER_FILE`,
    kept when there). Call after :func:`check_folder`. Returns whether this call made the folder.
    Raises :class:`OutputRefused` naming ``what`` (the option), the folder and the OS's reason when it cannot be
    made or written (no permission, a read-only or virtual file system such as ``/proc``)."""
    folder = Path(folder)
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / MARKER_FILE).is_file():
            write_text_file(folder / MARKER_FILE, json.dumps({"kind": kind}) + "\n")
    except OSError as err:
        raise OutputRefused(f"{what} {str(folder)!r} cannot be made: {err.strerror or err} "
                            f"({err.filename or folder}); choose a folder you can write to") from None
    return made


def unclaim_folder(folder: str | os.PathLike) -> None:
    """Remove ``folder`` when it holds nothing but :data:`OWN_FILES` (a writer that failed before writing
    anything leaves no folder it made); anything else is left as it is."""
    folder = Path(folder)
    if not folder.is_dir() or foreign_files(folder):
        return
    try:
        for name in OWN_FILES:
            (folder / name).unlink(missing_ok=True)
        folder.rmdir()
    except OSError:  # another process wrote there meanwhile: leave it
        pass


def written_files(folder: str | os.PathLike) -> list[str]:
    """The names of the files the last call of the writer of ``folder`` wrote there, as it recorded them in the
    folder's :data:`MARKER_FILE` (``files``; :func:`record_written`); empty when none are recorded (a folder of an
    older version, or of a writer that records none)."""
    try:
        names = json.loads((Path(folder) / MARKER_FILE).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str) and n and "/" not in n and n not in OWN_FILES and n != ".."]


def record_written(folder: str | os.PathLike, kind: str, names: Iterable[str], unsettled: Iterable[str] = ()) -> None:
    """Record ``names`` (files directly in ``folder``) as what the writer of ``kind`` wrote there, in the folder's
    :data:`MARKER_FILE` (``files``), with each present file's size and SHA-256 (``content``: name to ``[bytes,
    hex digest]``; :func:`changed_written` finds a file edited since), but the ``unsettled`` names (about to be
    written: recorded by name only, so a call that fails half-way leaves them its own). Replaced atomically
    (written beside it, then renamed over it)."""
    folder, unsettled = Path(folder), set(unsettled)
    names = sorted(set(names))
    content = {n: _fingerprint(folder / n) for n in names if n not in unsettled}
    record = {"kind": kind, "files": names, "content": {n: v for n, v in content.items() if v is not None}}
    tmp = folder / f"{MARKER_FILE}.tmp"
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MARKER_FILE)


def _fingerprint(path: Path) -> list | None:
    """``[size in bytes, SHA-256 hex digest]`` of the plain file ``path``; None for a link or a missing file."""
    if path.is_symlink() or not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return [path.stat().st_size, digest.hexdigest()]


def changed_written(folder: str | os.PathLike) -> list[str]:
    """The recorded files of ``folder`` (:func:`record_written`) whose size or SHA-256 differs from the recorded
    one, or that are a link now: edited (or replaced) since flowgrpo wrote them, so no longer flowgrpo's to
    remove or replace. Sorted names; empty for a marker without ``content`` (an older version's)."""
    folder = Path(folder)
    try:
        content = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8")).get("content", {})
    except (OSError, ValueError, AttributeError):
        return []
    changed = []
    for name in written_files(folder):
        path, recorded = folder / name, content.get(name) if isinstance(content, dict) else None
        if recorded is None or not (path.exists() or path.is_symlink()):
            continue
        if path.is_symlink() or path.stat().st_size != recorded[0] or _fingerprint(path) != recorded:
            changed.append(name)
    return changed


def check_written(folder: str | os.PathLike, what: str, own_names: str) -> None:
    """Refuse to write into ``folder`` (owned by the writer, :func:`check_folder`) when it holds a file named as
    the writer names its files (the regular expression ``own_names``) that no earlier call recorded writing
    (:func:`written_files`): the writer could neither replace it (not its own) nor leave it (the folder would mix
    two calls' outputs); or a recorded file changed since (:func:`changed_written`: a user's edit, which removing
    the earlier call's files would lose; a recorded file replaced by a symbolic link is named as one). Reads
    names, and the recorded files' sizes and contents. Raises :class:`OutputRefused`."""
    changed = changed_written(folder)
    if changed:
        path = Path(folder) / changed[0]
        now = (f"which is a symbolic link now (to {os.readlink(path)!r}), not the file it wrote"
               if path.is_symlink() else "which was changed since, so it is yours now")
        raise OutputRefused(f"{what} {str(folder)!r} holds {changed[0]!r}, which an earlier flowgrpo call wrote but "
                            f"{now}: nothing was written; move it out of this folder, or choose another folder")
    recorded = set(written_files(folder))
    for name in foreign_files(folder):
        if name not in recorded and re.fullmatch(own_names, name):
            raise OutputRefused(f"{what} {str(folder)!r} holds {name!r}, which no earlier flowgrpo call recorded "
                                "writing: nothing was written; choose another folder, or move it out of this one")


def remove_written(folder: str | os.PathLike, keep: Iterable[str] = ()) -> list[str]:
    """Remove the files an earlier call recorded writing in ``folder`` (:func:`written_files`), but ``keep``
    (names the new call writes over); a recorded name that is not a plain file now is left. Returns the names
    removed."""
    folder, keep = Path(folder), set(keep)
    gone = []
    for name in written_files(folder):
        path = folder / name
        if name not in keep and path.is_file() and not path.is_symlink():
            path.unlink()
            gone.append(name)
    return gone


def normal_mode(path: str | os.PathLike) -> None:
    """Give the file ``path`` the permissions a plain ``open`` would have given it (``0o666`` less the process's
    umask): a file written through a temporary file (``tempfile.mkstemp``, ``safetensors``' ``save_file``) is made
    ``0o600``, readable by its owner only, unlike every other file of the output. Call on the written file (before
    or after its rename into place)."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where the kernel says it (Linux >= 4.7: ``Umask:`` in
    /proc/self/status), so no file another thread creates meanwhile gets the wrong mode; else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_tensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)`` (``tensors``: names to contiguous CPU tensors) as a
    new file (:func:`replace_file`: the mode a plain open gives, a hard link to an earlier file keeps its content):
    every safetensors file flowgrpo writes goes through here."""
    from safetensors.torch import save_file

    replace_file(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def replace_file(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Write the file ``path`` as a new file: ``write(tmp)`` writes a temporary file beside it, which gets the mode
    a plain open gives (:func:`normal_mode`) and is renamed over ``path``. An existing ``path`` is replaced, never
    changed in place: a hard link to it (a user's backup, ``st_nlink`` > 1) keeps its content, and a crash leaves
    the old file whole. ``path`` must not be a symbolic link (the run's files: checked before the run,
    :func:`flowgrpo.training.run_folder.refuse_linked_run_files`); the temporary is removed when ``write`` fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        normal_mode(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_file(path: str | os.PathLike, text: str) -> None:
    """``text`` (UTF-8) as the new content of ``path``, through :func:`replace_file`."""
    replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` (UTF-8) to ``path`` (made when absent): in place when the file has one link, else (a hard
    link shares it, ``st_nlink`` > 1) as a new file holding the old content and ``text``
    (:func:`replace_file`), so the other link keeps the old content."""
    path = Path(path)
    try:
        shared = path.stat().st_nlink > 1
    except FileNotFoundError:
        shared = False
    if not shared:
        with path.open("a", encoding="utf-8") as f:
            f.write(text)
        return
    old = path.read_bytes()
    replace_file(path, lambda tmp: tmp.write_bytes(old + text.encode("utf-8")))


def check_file(path: str | os.PathLike, what: str, inputs: Iterable = (), overwrite: bool = False) -> None:
    """Refuse to write the output file ``path`` when it is one of the command's ``inputs`` (whatever
    ``overwrite`` says), lies inside an input folder or another output's part, is a folder, or exists and
    ``overwrite`` (the command's ``--overwrite``) is not given, or is a symbolic link (a link's target is not the
    command's to replace). The writer then replaces the file whole (:func:`write_text_file`): a hard link to the
    old file keeps the old content. Raises :class:`OutputRefused`."""
    path = Path(path)
    shown = f"{what} {str(path)!r}"
    _check_inputs(path, shown, inputs)
    _check_parts(path, shown)
    if path.is_dir():
        raise OutputRefused(f"{shown} is a folder; give the file to write")
    if path.is_symlink():  # --overwrite replaces a file, never what a link points at (another file, elsewhere)
        raise OutputRefused(f"{shown} is a symbolic link (to {os.readlink(path)!r}): flowgrpo never writes through "
                            "a link: nothing was written; remove the link or choose another path")
    if path.exists() and not overwrite:
        raise OutputRefused(f"{shown} exists and flowgrpo does not replace a file unasked: nothing was written; "
                            "choose another path, or give --overwrite to replace it")


def _check_inputs(out: Path, shown: str, inputs: Iterable) -> None:
    """Refuse an output that is one of ``inputs`` (the same path, a link to it, or a hard link: the same file) or
    lies inside one (an output folder that holds an input is non-empty: refused unless flowgrpo's own, whose
    writer writes only its own names)."""
    target = out.resolve()
    for given in inputs:
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        if target == source or (target.is_file() and source.is_file() and os.path.samefile(target, source)):
            raise OutputRefused(f"{shown} is also an input of this command ({str(given)!r}): writing would replace "
                                "it; choose another path")
        if source in target.parents:
            raise OutputRefused(f"{shown} lies inside {str(given)!r}, an input of this command; choose a path "
                                "outside it")


def _check_parts(out: Path, shown: str) -> None:
    """Refuse an output inside a part of another flowgrpo output (:data:`OWNED_PARTS`: a run's weights,
    checkpoints … folder), or that is such a part."""
    target = out.resolve()
    for above in target.parents:
        parts = OWNED_PARTS.get(owner(above) or "", ())
        name = target.relative_to(above).parts[0]
        if name in parts:
            raise OutputRefused(f"{shown} would write into {str(above / name)!r}, part of the flowgrpo "
                                f"{owner(above)} in {str(above)!r}: choose a folder outside it")


def claim_for_command(parser, folder: str | os.PathLike, kind: str, what: str = "out_dir",
                      inputs: Iterable = (), own_names: str | None = None) -> bool:
    """A command line's output folder: :func:`check_folder` (``inputs``, ``own_names`` as there), then
    :func:`claim_folder`; a refusal ends the command with its one line (``PROG: error: …``, exit status 2) through
    the ``argparse`` ``parser``. Returns whether the folder was made."""
    try:
        check_folder(folder, what, kind, inputs, own_names)
        return claim_folder(folder, kind, what)
    except OutputRefused as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
