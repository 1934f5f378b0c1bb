"""How this process was launched, for the command a stopped run prints to resume it, and the stop signals that
end a run with that line.

A run started by ``torchrun`` or ``accelerate launch`` is resumed by the same launch: the launcher's own words are
read from its command line (the parent process's, ``/proc/<ppid>/cmdline`` on Linux), up to this process's script;
where that cannot be read, a ``torchrun`` launch is rebuilt from the variables torchrun sets (``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``: the nodes).

``accelerate launch`` (1.16, ``accelerate/commands/launch.py``, ``_terminate_process_tree``) answers Ctrl-C by
sending its child SIGTERM, then SIGKILL after 5 s; torchrun's agent likewise sends its workers SIGTERM. Python's
default SIGTERM ends the process at once, so a run under a launcher died before saying where it stopped:
:func:`stop_on_signals` makes the first SIGINT or SIGTERM a ``KeyboardInterrupt`` and ignores the ones after it, so
the run prints its "interrupted …; resume: …" line within the launcher's grace period.

accelerate's launcher also copies its child's error output through a pipe, and a chunk its main thread has read
when its own ``KeyboardInterrupt`` is raised is dropped: on a loaded machine, where the launcher runs after its child
has handled the same Ctrl-C, that chunk was the resume line. Under accelerate a run stopped by SIGINT therefore says
the line once the launcher's SIGTERM has come (:func:`wait_for_launcher`): the launcher sends it after it started
the thread that copies what follows.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["LaunchRefused", "check_launch", "cpu_without_accelerator", "end_launcher", "launch_environment",
           "launched_by_accelerate", "launcher_words", "restore_signals", "stop_on_signals", "stopping_signal",
           "wait_for_launcher"]

#: the launchers' executables whose name is shown rather than the interpreter running them
_LAUNCHERS = ("torchrun", "accelerate")
#: the longest a stopped run waits for accelerate's SIGTERM before its line (:func:`wait_for_launcher`); accelerate
#: kills the child 5 s after that SIGTERM, so the wait takes nothing from that grace period
LAUNCHER_WAIT_S = 4.0

_STOPPED_BY: list[int] = []  # the stop signals received since stop_on_signals, in order (the first one stopped)
#: the environment variables that decide a launch (which devices, accelerate's settings such as
#: ``ACCELERATE_USE_CPU``): a resume command repeats them (:func:`launch_environment`)
_LAUNCH_PREFIXES = ("ACCELERATE_",)
_LAUNCH_SUFFIXES = ("_VISIBLE_DEVICES",)
_LAUNCH_NAMES = ("ZE_AFFINITY_MASK",)


def _interrupt_once(signum: int, frame) -> None:
    """The first stop signal raises ``KeyboardInterrupt``; the launcher's SIGTERM that follows a Ctrl-C (or a
    second Ctrl-C) is ignored, so it cannot cut the interrupted line short."""
    _STOPPED_BY.append(signum)
    if len(_STOPPED_BY) == 1:
        raise KeyboardInterrupt


def stop_on_signals() -> dict:
    """SIGINT and SIGTERM both stop the run through ``KeyboardInterrupt``, once (:func:`_interrupt_once`); returns
    the handlers it replaced (for :func:`restore_signals`). Only from the main thread (``signal.signal`` refuses
    others: nothing is changed); a signal set to be ignored (a job started in the background has SIGINT ignored)
    stays ignored."""
    import threading

    _STOPPED_BY.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}
    replaced = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            replaced[sig] = signal.signal(sig, _interrupt_once)
    return replaced


def restore_signals(replaced: dict) -> None:
    """Put back the handlers :func:`stop_on_signals` replaced (a command run inside another program)."""
    for sig, handler in replaced.items():
        signal.signal(sig, handler)


def wait_for_launcher(seconds: float = LAUNCHER_WAIT_S) -> bool:
    """After a run stopped by SIGINT, wait until a SIGTERM has come too (accelerate's launcher answers Ctrl-C with
    one, after it started copying its child's output again: the module docstring), at most ``seconds``; returns
    whether it came. At once where the stop was not SIGINT or a SIGTERM already came."""
    import time

    deadline = time.monotonic() + seconds
    while signal.SIGTERM not in _STOPPED_BY and stopping_signal() == signal.SIGINT:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def stopping_signal() -> int:
    """The number of the signal that stopped the run (SIGINT = 2 when none was recorded: a ``KeyboardInterrupt``
    raised another way)."""
    return _STOPPED_BY[0] if _STOPPED_BY else int(signal.SIGINT)


def _parent_command(pid: int) -> tuple[list[str], Path] | None:
    """The command line and working folder of process ``pid`` (Linux ``/proc``), or None where unreadable."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None
    return [w.decode(errors="replace") for w in words if w], cwd


def launcher_words(script: str, *, parent: tuple[list[str], Path] | None = None,
                   env: dict[str, str] | None = None) -> list[str]:
    """The launcher's words before ``script`` (this process's ``sys.argv[0]``), ending with the script as the
    launcher was given it, e.g. ``["torchrun", "--nproc_per_node", "2", "flowgrpo/train.py"]``; empty when this
    process was not started by ``torchrun`` or ``accelerate launch`` (``env``: torchrun's ``TORCHELASTIC_RUN_ID``
    or accelerate's ``ACCELERATE_*`` variables) or its launch cannot be told.

    Args:
        script: this process's script path (as in ``sys.argv[0]``).
        parent: the launcher's (command words, working folder); default: the parent process's.
        env: the environment; default ``os.environ``.
    """
    env = os.environ if env is None else env
    torchrun = "TORCHELASTIC_RUN_ID" in env
    if not torchrun and not any(k.startswith("ACCELERATE_") for k in env):
        return []
    parent = _parent_command(os.getppid()) if parent is None else parent
    mine = Path(script).resolve()
    if parent is not None:
        words, cwd = parent
        for i, word in enumerate(words):
            if (cwd / word).resolve() == mine:
                head = words[:i + 1]
                if len(head) > 1 and Path(head[1]).name in _LAUNCHERS and "python" in Path(head[0]).name:
                    head = [Path(head[1]).name, *head[2:]]  # the launcher's script, as it was typed
                elif head and Path(head[0]).name in _LAUNCHERS:
                    head = [Path(head[0]).name, *head[1:]]
                return head
    if torchrun:  # the launcher's words cannot be read: torchrun's own settings, from its variables
        nodes, per_node = env.get("GROUP_WORLD_SIZE", "1"), env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))
        return ["torchrun", *(["--nnodes", nodes] if nodes != "1" else []), "--nproc_per_node", per_node, script]
    return []


def _parent_environment(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (Linux ``/proc``), or None where unreadable."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if b"=" in item)
    return {k: v for k, _, v in pairs}


def launch_environment(env: dict[str, str] | None = None, parent_env: dict[str, str] | None = None) -> list[str]:
    """The ``NAME=value`` words that start the command resuming this run: the variables that decide a launch
    (``ACCELERATE_*`` such as ``ACCELERATE_USE_CPU=true``, ``CUDA_VISIBLE_DEVICES`` and the other
    ``*_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``), sorted by name, as the user gave them. Under ``accelerate
    launch`` they are read from the launcher's own environment (``/proc/<ppid>/environ``; default
    ``parent_env``), since accelerate sets ``ACCELERATE_*`` variables of its own for its processes (its flags,
    already in the launch words); none when that cannot be read. Elsewhere (``torchrun``, which adds no such
    variable, or one process) from this process's ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env and any(k.startswith("ACCELERATE_") for k in env):
        env = _parent_environment(os.getppid()) if parent_env is None else parent_env
        if env is None:
            return []
    return [f"{k}={v}" for k, v in sorted(env.items())
            if k.startswith(_LAUNCH_PREFIXES) or k.endswith(_LAUNCH_SUFFIXES) or k in _LAUNCH_NAMES]


_MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


class LaunchRefused(ValueError):
    """A launch that started fewer processes than it asked for (:func:`check_launch`)."""


def cpu_without_accelerator(env: dict | None = None) -> bool:
    """Several processes (``WORLD_SIZE`` > 1: torchrun) on a machine with no accelerator and no
    ``ACCELERATE_USE_CPU`` set: accelerate would pick no process-group backend (``'undefined'``, found only after
    the model loaded). Sets ``ACCELERATE_USE_CPU=true`` in ``env`` (default ``os.environ``; read by accelerate's
    ``Accelerator``), so the processes run on the CPU with gloo as ``accelerate launch --cpu`` would, and says so
    in the log. Returns whether it did."""
    import torch

    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1")) < 2 or "ACCELERATE_USE_CPU" in env:
        return False
    accelerator = getattr(torch, "accelerator", None)
    if (accelerator.is_available() if accelerator is not None else torch.cuda.is_available()):
        return False
    env["ACCELERATE_USE_CPU"] = "true"
    logger.info("no accelerator (GPU) on this machine: the %s processes run on the CPU with gloo "
                "(ACCELERATE_USE_CPU=true)", env["WORLD_SIZE"])
    return True


def check_launch(env: Mapping[str, str] | None = None) -> None:
    """Refuse a launch that asked for several processes and started one, with one line naming the way that works.

    ``accelerate launch --cpu --num_processes N`` (N > 1) starts a single Python process (accelerate's simple
    launcher: on the CPU its other processes are MPI's to start, ``--mpirun_hostfile`` or ``mpirun``); that
    process sees ``MASTER_ADDR`` (set by accelerate only when N > 1 or several machines were asked for) and
    ``ACCELERATE_USE_CPU`` but no ``WORLD_SIZE``, and would train alone. (A ``MASTER_ADDR`` the shell exported
    for a one-process CPU launch reads the same; the line says to unset it.)

    Args:
        env: the environment (default ``os.environ``).
    Raises:
        LaunchRefused: (a ``ValueError``) that launch (``ACCELERATE_USE_CPU`` true, ``ACCELERATE_MIXED_PRECISION``
            and ``MASTER_ADDR`` set by accelerate launch, neither ``WORLD_SIZE`` nor an MPI size); the command
            says it and ends accelerate's launcher with :func:`end_launcher`.
    """
    env = os.environ if env is None else env
    launched = "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env  # accelerate launch, N > 1
    on_cpu = env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if on_cpu and launched and "WORLD_SIZE" not in env and not any(k in env for k in _MPI_SIZES):
        raise LaunchRefused(
            "accelerate launch --cpu with several processes started only this one (accelerate leaves the CPU's "
            "other processes to MPI); launch with ACCELERATE_USE_CPU=true torchrun --nproc_per_node N "
            "flowgrpo/train.py CONFIG (docs/many_gpus.md), or for one process unset MASTER_ADDR")


def launched_by_accelerate(pid: int | None = None) -> bool:
    """Whether process ``pid`` (default: the parent) is accelerate's launcher (its command line holds
    ``accelerate`` and ``launch``)."""
    import psutil

    try:
        command = " ".join(psutil.Process(os.getppid() if pid is None else pid).cmdline())
    except (psutil.Error, OSError):
        return False
    return "accelerate" in command and "launch" in command


def end_launcher(pid: int | None = None) -> bool:
    """End accelerate's launcher that started this process, so that a refusal already said stays the last line.

    accelerate's simple launcher (``accelerate launch`` without ``-q``: the CPU launch of :func:`check_launch`)
    raises ``CalledProcessError`` with its own traceback, which repeats the child's stderr, when its child exits
    non-zero; on SIGTERM it ends its child and exits 143 without one (``accelerate.commands.launch``'s
    ``_run_subprocess``). The parent is signalled only when its command line is accelerate's launch.

    Args:
        pid: the parent process (default ``os.getppid()``).
    Returns:
        Whether a launcher was signalled.
    """
    pid = os.getppid() if pid is None else pid
    if not launched_by_accelerate(pid):
        return False
    _wait_read(sys.stderr)
    os.kill(pid, signal.SIGTERM)
    return True


def _wait_read(stream, limit_s: float = 30.0) -> None:
    """Wait until the launcher has read what this process wrote to ``stream`` (a pipe it copies to its own stderr:
    the bytes still in the pipe, ``FIONREAD``, reach 0), and a moment more for it to write them out, so that the
    signal that ends it does not cut the line (its handler raises in the copying thread); at most ``limit_s``
    seconds, and not at all when ``stream`` is not a pipe."""
    import fcntl
    import stat
    import struct
    import termios
    import time

    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] == 0:
                break
            time.sleep(0.01)
        time.sleep(0.2)
    except (OSError, ValueError, AttributeError):
        return
