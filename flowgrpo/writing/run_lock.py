"""A run owns its ``output_dir`` while it runs: an advisory lock on ``output_dir/.flowgrpo.lock``.

The main process takes the lock (``fcntl.flock``, exclusive, non-blocking) before it reads anything in the folder
to decide how to use it (resume, overwrite, refuse) and holds it until the run ends. The operating system releases
it when the process ends, however it ends (a crash, ``kill -9``, a lost node), so a lock is never stale and there
is no PID file to clean up. A second run on the folder — a fresh start, ``logging.overwrite=true`` or
``train.resume_from=auto`` — is refused with :class:`RunFolderBusy`, naming the live run's PID, start time, host
and command (written into the lock file by its holder) and never suggesting anything that would remove its files.

Reading a run folder (``flowgrpo sample --run``, plotting ``metrics.jsonl``) takes no lock. Where ``fcntl`` is
missing (Windows) no lock is taken and a warning says so once. File systems without ``flock`` support refuse the
lock with an ``OSError`` that is reported as such.

On a shared file system (:data:`SHARED_FILE_SYSTEMS`: NFS, Lustre, GPFS, BeeGFS, CIFS, ..., the type of the
folder's mount read from ``/proc/mounts``) ``flock`` is not reliable across machines (NFS emulates it with
byte-range locks, or not at all with ``local_lock``; Lustre only with its ``flock`` mount option), so the lock is
the lock file itself, created with ``O_CREAT | O_EXCL`` (atomic on NFSv3+ and the parallel file systems) and
removed when the run ends. A run killed without cleanup (``kill -9``, a lost node) leaves it behind: it is stale,
and replaced, when it names this machine and a process that is gone (or a later one with its PID); one naming
another machine is reported with the remedy (delete the file once that run is known to be gone).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from flowgrpo.writing.outputs import LOCK_FILE, MARKER_FILE, OutputRefused, check_folder, claim_folder, foreign_files

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)

#: file system types (``/proc/mounts``' third field) whose ``flock`` is not reliable across machines
SHARED_FILE_SYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs",
                       "fuse.glusterfs", "fuse.sshfs", "panfs", "wekafs", "afs")
MOUNTS = "/proc/mounts"
#: folder -> [open lock file, nesting depth, whether the hold created the folder] of the locks this process holds
_HELD: dict[Path, list] = {}


class RunFolderBusy(FileExistsError):
    """``output_dir`` is held by a live run (another process)."""


class RunFolderUnusable(ValueError):
    """``output_dir`` cannot be made, or its lock file cannot be written (no permission, a read-only or virtual
    file system such as ``/sys`` or ``/proc``): a ``ValueError``, bad input reported in one line."""


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
    except ValueError:
        return "details not written yet"
    parts = [f"PID {info.get('pid')}"]
    if info.get("host"):
        parts[0] += f" on {info['host']}"
    if info.get("started"):
        parts.append(f"started {info['started']}")
    if info.get("command"):
        parts.append(f"command: {info['command']}")
    return ", ".join(parts)


def _holder(text: str) -> tuple[str, bool]:
    """Who holds a lock whose file reads ``text``, for a "busy" line, and whether that is the recorded run: its
    description (:func:`_describe`), or, when the recorded run's process has ended (:func:`_live`: another program
    holds the lock, or a run that ended before writing its own record), the record named as a past run's."""
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    if isinstance(info, dict) and not _live(info):
        return f"held by another process; the last run recorded in its lock file, {_describe(text)}, has ended", False
    return _describe(text), True


def check_folder_path(output_dir: str | os.PathLike) -> None:
    """``output_dir`` can be a run folder: it is a folder or can be made one. Raises ``FileExistsError`` when it
    or one of the folders above it is a file."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"output_dir {str(output_dir)!r} is a file, not a folder; choose a folder for the run")
    above = next((p for p in folder.absolute().parents if p.exists() and not p.is_dir()), None)
    if above is not None:
        raise FileExistsError(f"output_dir {str(output_dir)!r} cannot be made: {str(above)!r} above it is a file, "
                              "not a folder; choose a folder for the run")


def file_system_type(path: Path, mounts: str | os.PathLike | None = None) -> str | None:
    """The type of the file system holding ``path`` (an existing path): the ``/proc/mounts`` entry with the
    longest mount point above it; None where the table cannot be read (not Linux)."""
    try:
        lines = Path(mounts or MOUNTS).read_text().splitlines()
    except OSError:
        return None
    path, best = Path(path).resolve(), (-1, None)
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if (point == path or point in path.parents) and len(point.parts) > best[0]:
            best = (len(point.parts), fields[2])
    return best[1]


def _live(info: dict) -> bool:
    """Whether the lock file's holder may still run: not on this machine (unknowable here), or a process of its
    PID here that started no later than the lock (a later one reuses a dead run's PID)."""
    import psutil

    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return True
    try:
        created = psutil.Process(info["pid"]).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    try:
        started = datetime.datetime.fromisoformat(info["started"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return True
    return created <= started + 1.0


def _acquire_exclusive(folder: Path, record: str) -> object:
    """The lock of a folder on a shared file system: ``folder/LOCK_FILE`` created with ``O_EXCL`` (a stale one
    replaced once, :func:`_live`); returns the open file (removed at release).

    Raises:
        RunFolderBusy: the file exists and its holder may be alive.
    """
    path = folder / LOCK_FILE
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except PermissionError as err:
            raise RunFolderUnusable(f"output_dir {str(folder)!r} cannot be used as a run folder: {err.strerror} "
                                    f"({path}); choose a folder you can write to") from None
        except FileExistsError:
            text = path.read_text(encoding="utf-8", errors="replace")
            try:
                info = json.loads(text)
            except ValueError:
                info = {}
            if info and not _live(info):
                logger.warning("replacing the stale lock of %s (%s: that process is gone)", folder, _describe(text))
                path.unlink(missing_ok=True)
                continue
            raise RunFolderBusy(
                f"output_dir {str(folder)!r} is in use by a run that is still running ({_describe(text)}); a second "
                f"run cannot share its folder. Wait for it to finish (or stop it), or give this run another "
                f"output_dir; on this shared file system the lock is the file {str(path)!r}: if that run is gone "
                "(a lost node), delete it") from None
        fh = os.fdopen(fd, "w", encoding="utf-8")
        fh.write(record)
        fh.flush()
        fh.exclusive = True
        return fh
    raise RunFolderBusy(f"output_dir {str(folder)!r}: its lock file {str(path)!r} keeps reappearing; another run "
                        "is starting there")


def _acquire(folder: Path, command: str) -> object:
    """Open and lock ``folder/LOCK_FILE`` (created with the folder, which is marked as a run's:
    :func:`flowgrpo.writing.outputs.claim_folder`); returns the open file holding the lock and whether this call created
    ``folder``.

    Raises:
        RunFolderBusy: another process holds it.
        FileExistsError: ``folder`` or a folder above it is a file (:func:`check_folder_path`).
        OutputRefused: ``folder`` holds files flowgrpo did not write, or another kind of flowgrpo output
            (:func:`flowgrpo.writing.outputs.check_folder`; checked before anything is written there).
        RunFolderUnusable: ``folder`` cannot be made or its lock file cannot be written (the OS's reason).
    """
    check_folder_path(folder)
    check_folder(folder, "output_dir", "run")
    made = not folder.exists()
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                         "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shared = file_system_type(folder) in SHARED_FILE_SYSTEMS
        fh, created = (None, False) if shared else _open_lock(folder)
    except OSError as err:
        raise RunFolderUnusable(f"output_dir {str(folder)!r} cannot be used as a run folder: "
                                f"{err.strerror or err} ({err.filename or folder}); choose a folder you can write to"
                                ) from None
    if shared:
        fh = _acquire_exclusive(folder, record)
        try:
            claim_folder(folder, "run")
        except BaseException:
            _release(folder, fh, made)
            raise
        return fh, made
    marked = (folder / MARKER_FILE).is_file()
    _flock(folder, fh)
    try:
        if not created:
            fh.seek(0)
            _check_own_lock(folder, fh.read())
        claim_folder(folder, "run")
    except BaseException:
        fh.created = created
        _release(folder, fh, made)
        raise
    fh.created, fh.marked = created, not marked  # what this hold wrote: removed again if the run leaves nothing
    fh.seek(0)
    fh.truncate()
    fh.write(record)
    fh.flush()
    return fh, made


def _flock(folder: Path, fh) -> None:
    """Take the advisory lock on the open lock file ``fh`` without waiting; closes ``fh`` when it cannot.

    Raises:
        RunFolderBusy: another process holds it (its record named).
    """
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder, recorded = _holder(fh.read())
        fh.close()
        busy = "is in use by a run that is still running" if recorded else "is in use"
        raise RunFolderBusy(
            f"output_dir {str(folder)!r} {busy} ({holder}); a second run "
            "cannot share its folder. Wait for it to finish (or stop it), or give this run another output_dir"
        ) from None
    except BaseException:
        fh.close()
        raise


def _open_lock(folder: Path) -> tuple[object, bool]:
    """Open ``folder/LOCK_FILE`` for reading and writing, made when absent (then ``True``): never through a
    symbolic link, never a file with another link (a hard link: writing the lock would change the other name's
    content too). Raises :class:`~flowgrpo.writing.outputs.OutputRefused` for those, before anything is written."""
    import stat

    path = folder / LOCK_FILE
    flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    created = True
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        created = False
        try:
            fd = os.open(path, flags)
        except OSError as err:
            if path.is_symlink():
                raise OutputRefused(f"output_dir {str(folder)!r}: its lock file {LOCK_FILE!r} is a symbolic link (to "
                                    f"{os.readlink(path)!r}); flowgrpo writes its lock only into a file of its own: "
                                    "nothing was changed; remove the link") from err
            raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        what = f"a hard link ({info.st_nlink} names share it)" if stat.S_ISREG(info.st_mode) else "not a plain file"
        raise OutputRefused(f"output_dir {str(folder)!r}: its lock file {LOCK_FILE!r} is {what}; writing the lock "
                            "would change another file: nothing was changed; remove it")
    return os.fdopen(fd, "r+", encoding="utf-8"), created


def _check_own_lock(folder: Path, text: str) -> None:
    """An existing lock file (not held) is flowgrpo's: empty, or the JSON record a run writes (a ``pid``); else a
    file of the user's that only shares the name, refused with :class:`~flowgrpo.writing.outputs.OutputRefused`."""
    try:
        ours = not text.strip() or "pid" in json.loads(text)
    except (ValueError, TypeError):
        ours = False
    if not ours:
        raise OutputRefused(f"output_dir {str(folder)!r} holds a file {LOCK_FILE!r} that is not flowgrpo's lock (it "
                            "holds other text): nothing was changed; move it out of this folder, or choose another")


def _release(folder: Path, fh, made: bool) -> None:
    """Close the lock file (which releases the lock); a folder this hold created and nothing but flowgrpo's own
    files (the lock's, the marker: :data:`flowgrpo.writing.outputs.OWN_FILES`) came to live in (a run that stopped at a
    setup error) is removed again, and so are the lock file and the marker this hold wrote into a folder that was
    there when no run was written into it (no ``config.yaml``: a refused run), so a refused run leaves nothing."""
    try:
        if getattr(fh, "exclusive", False):  # a shared file system's lock: the file itself
            fh.close()
            (folder / LOCK_FILE).unlink(missing_ok=True)
        if not made and not (folder / "config.yaml").exists():  # no run was written: a refused one
            wrote = {LOCK_FILE: getattr(fh, "created", False), MARKER_FILE: getattr(fh, "marked", False)}
            for name in [n for n, mine in wrote.items() if mine]:
                (folder / name).unlink(missing_ok=True)
        if made and not foreign_files(folder):
            for p in folder.iterdir():
                p.unlink()
            folder.rmdir()
    except OSError:  # another process made something there meanwhile: leave it
        pass
    finally:
        fh.close()


def lock_holder(output_dir: str | os.PathLike) -> str | None:
    """Who holds the lock of ``output_dir`` now, without taking it: the live run's description (PID, host, start,
    command) or None when no run holds it (no lock file, a stale one, no ``fcntl``). Reading only: a shared
    (``LOCK_SH``) non-blocking ``flock`` that fails means a run holds the folder; on a shared file system the lock
    file's existence with a live holder (:func:`_live`) does."""
    path = Path(output_dir) / LOCK_FILE
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        if file_system_type(path.parent.resolve()) in SHARED_FILE_SYSTEMS:
            return _describe(text) if _live(json.loads(text) if text.startswith("{") else {}) else None
        if fcntl is None:  # pragma: no cover - Windows
            return None
        with open(path, encoding="utf-8") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _holder(text)[0]
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except (OSError, ValueError):
        return None
    return None


@contextlib.contextmanager
def hold_run_folder(output_dir: str | os.PathLike, command: str | None = None) -> Iterator[None]:
    """Hold the lock of ``output_dir`` for the ``with`` block (re-entrant within one process: a nested hold of
    the same folder shares the outer one, which releases it).

    Args:
        output_dir: the run folder (created if missing; removed again at the end if the run left nothing in it).
        command: what to show a refused second run (default: this process's command line).

    Raises:
        RunFolderBusy: another live process holds the folder (a ``FileExistsError``).
        FileExistsError: ``output_dir`` or a folder above it is a file.
        OutputRefused: ``output_dir`` holds files flowgrpo did not write (a ``ValueError``).
        RunFolderUnusable: ``output_dir`` cannot be made or written (a ``ValueError``).
    """
    if fcntl is None:  # pragma: no cover - Windows
        logger.warning("no fcntl on this platform: %s is not locked against a second run", output_dir)
        yield
        return
    folder = Path(output_dir).resolve()
    if folder in _HELD:
        _HELD[folder][1] += 1
    else:
        fh, made = _acquire(folder, command or shlex.join([sys.executable, *sys.argv]))
        _HELD[folder] = [fh, 1, made]
    try:
        yield
    finally:
        _HELD[folder][1] -= 1
        if _HELD[folder][1] == 0:
            fh, _, made = _HELD.pop(folder)
            _release(folder, fh, made)
