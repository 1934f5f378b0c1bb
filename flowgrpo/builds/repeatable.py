"""Repeatable CPU builds: run a build step in a child process whose numerical environment is pinned; record what
the bytes still depend on.

The bytes of a float32 computation on the CPU depend on more than its inputs and seeds (measured on the digits
pretraining, torch 2.14 with MKL 2024.2 and oneDNN 3.12, 30 + 30 optimizer steps, sha256 of the saved weights):

* the **thread count**: one thread and two give different weights (a sum split between threads is added in
  another order). ``accelerate launch`` sets ``OMP_NUM_THREADS=1`` for the process it starts unless the variable
  is set already (accelerate 1.15, ``commands/launch.py``: ``num_cpu_threads_per_process`` defaults to the
  variable, else 1), while ``python`` alone uses one thread a core: the same command gave different models under
  the two launchers, and on machines with different core counts;
* the **instruction set** each library dispatches to: capping torch's own kernels at AVX2
  (``ATEN_CPU_CAPABILITY``), MKL's (``MKL_ENABLE_INSTRUCTIONS``) or oneDNN's (``ONEDNN_MAX_CPU_ISA``) on an
  AVX-512 machine each changes the weights, so machines with other CPUs build other models;
* the **CPU vendor and model**, even with all of the above pinned: the pinned build of ``digits-v2-seed0`` (torch
  2.14.1, diffusers 0.42.1) gave transformer sha256 ``b95f31c1…d250c01`` and VAE ``1306c5bb…4cba995d`` on an Intel
  Xeon with AVX-512 and AMX, but transformer ``39527b84…a51505`` and VAE ``12c7e805…467adbe`` on two AMD EPYCs,
  and the two bases are not equally good: the judge reads 0.609 of the Intel base's digits as the prompted one
  before RL, 0.586 of the AMD base's. The VAE, trained first, already differs. Under
  :data:`PINNED_ENV` the matrix products run in MKL with conditional numerical reproducibility (``MKL_VERBOSE``:
  ``SGEMM … CNR:AVX2``), but the VAE's convolutions run in oneDNN (``ONEDNN_VERBOSE``: ``convolution,jit:avx2``),
  which has no such mode and sizes its kernels' blocking for the CPU it finds. On the Intel machine (a 30 + 10
  step build of seed 0, 2026-12-02) oneDNN is in the path and its dispatch moves the bytes:
  ``torch.backends.mkldnn.enabled = False`` gives another VAE (``372990f9…`` against ``26f2064e…``), and with
  oneDNN on, capping it at SSE4.1 instead of AVX2 gives a third (``a35fb760…``); with oneDNN off the same cap
  changes nothing (the convolutions then run as MKL products, ``MKL_VERBOSE``: ``SGEMM … CNR:AVX2``);
  ``torch.backends.mkldnn.deterministic = True`` changes nothing (one thread). So oneDNN's CPU-dependent kernel choice
  is in the path, but turning oneDNN off does not make the vendors agree: on an AMD EPYC (2026-12-02) the short build
  gives other bytes than the Intel one's with oneDNN on, off, or capped. The cause found there: **MKL honours
  ``MKL_CBWR`` only on Intel processors**; on the AMD machine it reports ``SGEMM … CNR:AUTO`` under
  ``MKL_CBWR=AVX2`` (``mkl_serv_cbwr_get`` reads AUTO: ``numerics()['mkl_cbwr_branch']``) and honours only
  ``COMPATIBLE``. Two AMD machines (AVX2 only; AVX-512, family 26) built the same bytes. oneDNN off with
  ``MKL_CBWR=COMPATIBLE`` routes every product through MKL's compatible branch: the candidate for vendor-independent
  bytes, 1.85x slower, not yet compared with an Intel build (docs/digits.md, "What is reproducible").

Load on the machine did not change them (two 2-thread builds on 2 busy cores were identical). These settings are
read when each library initialises, so they cannot be changed inside a process that has already computed: the
build runs in a fresh child process with :data:`PINNED_ENV`. Its bytes are then the same for one seed, recipe,
torch and diffusers version **on one kind of machine** (one CPU model; tested: whatever the launcher, the parent's
thread count, the load); another CPU model, and certainly another vendor, may build other bytes: another draw of the
same recipe, which RL may take elsewhere (docs/results.md measures the default over three base seeds as a stand-in
for three machines). :func:`numerics` records what a build's bytes depend on (the CPU, the dispatched instruction
sets, the BLAS library) and :func:`weights_digest` the bytes themselves, so a run can say which base it started from.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

#: One thread; torch's kernels, MKL (with conditional numerical reproducibility on its AVX2 code path) and oneDNN
#: at AVX2. One thread is also the fastest on a busy machine (2 threads on 2 shared cores: 8x slower, measured).
PINNED_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


#: ``prctl`` option (linux/prctl.h): the signal the kernel sends a process when the thread that started it ends
PR_SET_PDEATHSIG = 1


def _end_with_parent(parent_pid: int) -> None:
    """The child's ``preexec_fn`` (between fork and exec): on Linux, ask the kernel to SIGKILL it when its parent
    ends (``prctl(PR_SET_PDEATHSIG)``; it survives the exec), however the parent ends (``kill``, ``timeout``, a
    scheduler's SIGTERM, ``kill -9``), so a killed run leaves no orphan build running; then, if the parent already
    ended before the request (its pid is no longer the child's parent), exit at once. Elsewhere nothing is asked:
    the parent still ends the child on an exception (:func:`run_pinned`)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
            return
        if os.getppid() != parent_pid:
            os._exit(1)


def run_pinned(argv: list[str], what: str) -> None:
    """Run ``python argv…`` in a child process with :data:`PINNED_ENV` over this process's environment; its
    output goes to this process's. The child ends with this process: killed by the kernel when this process ends
    (Linux, :func:`_end_with_parent`), and killed here when waiting for it is interrupted (Ctrl-C, an exception
    raised by a signal handler).

    Raises:
        RuntimeError: the child failed (its exit code; its own error is above in the output).
    """
    parent = os.getpid()
    proc = subprocess.Popen([sys.executable, *argv], env={**os.environ, **PINNED_ENV},
                            preexec_fn=lambda: _end_with_parent(parent))  # noqa: PLW1509 - prctl needs it
    try:
        returncode = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if returncode != 0:
        raise RuntimeError(f"{what} failed in its child process (exit code {returncode}); its error is above")


#: MKL's conditional-numerical-reproducibility branches (mkl_cbwr.h ``MKL_CBWR_*``) by value
CBWR_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
                 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
#: the /proc/cpuinfo flags a build record lists (the vector instruction sets the libraries choose between)
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")


def parse_cpuinfo(text: str) -> dict[str, object]:
    """The first processor of a ``/proc/cpuinfo`` text: ``vendor`` (``vendor_id``), ``model`` (``model name``),
    ``family``/``model_number`` (``cpu family``/``model``) and ``isa`` (which of :data:`ISA_FLAGS` its ``flags``
    have, in that order); a field missing from the text is left out."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    out: dict[str, object] = {}
    for key, name in (("vendor_id", "vendor"), ("model name", "model"), ("cpu family", "family"),
                      ("model", "model_number")):
        if key in fields:
            out[name] = fields[key]
    if "flags" in fields:
        have = set(fields["flags"].split())
        out["isa"] = [f for f in ISA_FLAGS if f in have]
    return out


def parse_torch_config(text: str) -> dict[str, str]:
    """The math libraries of a ``torch.__config__.show()`` text: ``mkl`` (its version line), ``onednn`` (its
    version), ``blas`` and ``lapack`` (``BLAS_INFO``/``LAPACK_INFO``), ``torch_capability_usage`` (the build's
    ``CPU capability usage``); a library the text does not name is left out."""
    out: dict[str, str] = {}
    patterns = {"mkl": r"Math Kernel Library Version ([^\n]+?) for", "onednn": r"MKL-DNN (v[\d.]+)",
                "blas": r"BLAS_INFO=([^,\s]+)", "lapack": r"LAPACK_INFO=([^,\s]+)",
                "torch_capability_usage": r"CPU capability usage: (\S+)"}
    for name, pattern in patterns.items():
        found = re.search(pattern, text)
        if found:
            out[name] = found.group(1)
    return out


def _mkl_branch() -> dict[str, str]:
    """MKL's current and automatic CBWR branches (what it dispatches to), read from the MKL service functions torch
    links statically (``mkl_serv_cbwr_get``, ``mkl_serv_cbwr_get_auto_branch``); empty where torch does not export
    them (another build, another platform)."""
    import torch

    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        current, auto = lib.mkl_serv_cbwr_get(1), lib.mkl_serv_cbwr_get_auto_branch()
    except (OSError, AttributeError):
        return {}
    return {"mkl_cbwr_branch": CBWR_BRANCHES.get(current, str(current)),
            "mkl_auto_branch": CBWR_BRANCHES.get(auto, str(auto))}


def numerics() -> dict[str, object]:
    """The numerical environment of this process, for a build's record and a run's report: library versions
    (torch, diffusers, MKL, oneDNN), the BLAS and LAPACK libraries, the thread count, the instruction set torch's
    kernels dispatch to (``cpu_capability``) and MKL's branches (:func:`_mkl_branch`, where readable), the machine and
    its CPU (:func:`parse_cpuinfo` of ``/proc/cpuinfo`` where it exists, else ``platform.processor()``), and
    ``pinned``: whether :data:`PINNED_ENV` is in force."""
    import torch

    info: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "machine": platform.machine()}
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:  # pragma: no cover - a dependency of every build that records this
        pass
    info.update(parse_torch_config(torch.__config__.show()))
    info.update(_mkl_branch())
    cpuinfo = Path("/proc/cpuinfo")
    info["cpu"] = parse_cpuinfo(cpuinfo.read_text()) if cpuinfo.is_file() else {"model": platform.processor()}
    info["pinned"] = all(os.environ.get(k) == v for k, v in PINNED_ENV.items())
    return info


#: the components whose weights :func:`weights_digest` hashes
DIGEST_COMPONENTS = ("transformer", "vae")


def weights_digest(folder: str | os.PathLike) -> dict[str, str]:
    """sha256 (hex) of each :data:`DIGEST_COMPONENTS` component's weights in a diffusers pipeline ``folder``: of
    its ``*.safetensors`` files' bytes in name order (one file: that file's sha256). A component without such files
    is left out."""
    out = {}
    for component in DIGEST_COMPONENTS:
        files = sorted((Path(folder) / component).glob("*.safetensors"))
        if not files:
            continue
        h = hashlib.sha256()
        for f in files:
            with f.open("rb") as stream:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    h.update(block)
        out[component] = h.hexdigest()
    return out
