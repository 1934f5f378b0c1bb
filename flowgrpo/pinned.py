"""Bit-reproducible CPU builds: run a build step in a child process whose numerical environment is pinned.

The bytes of a float32 computation on the CPU depend on more than its inputs and seeds (measured on the digits
pretraining, torch 2.14 with MKL 2024.2 and oneDNN 3.12, 30 + 30 optimizer steps, sha256 of the saved weights):

* the **thread count**: one thread and two give different weights (a sum split between threads is added in
  another order). ``accelerate launch`` sets ``OMP_NUM_THREADS=1`` for the process it starts unless the variable
  is set already (accelerate 1.15, ``commands/launch.py``: ``num_cpu_threads_per_process`` defaults to the
  variable, else 1), while ``python`` alone uses one thread a core: the same command gave different models under
  the two launchers, and on machines with different core counts;
* the **instruction set** each library dispatches to: capping torch's own kernels at AVX2
  (``ATEN_CPU_CAPABILITY``), MKL's (``MKL_ENABLE_INSTRUCTIONS``) or oneDNN's (``ONEDNN_MAX_CPU_ISA``) on an
  AVX-512 machine each changes the weights, so machines with other CPUs build other models.

Load on the machine did not change them (two 2-thread builds on 2 busy cores were identical). These settings are
read when each library initialises, so they cannot be changed inside a process that has already computed: the
build runs in a fresh child process with :data:`PINNED_ENV`. Its bytes then depend only on the seed, the library
versions (torch, diffusers) and the CPU family: any x86-64 CPU with AVX2 (Intel since 2013, AMD since 2015) runs
the same kernels; other CPUs (ARM) build their own, equally good, model.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

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


def run_pinned(argv: list[str], what: str) -> None:
    """Run ``python argv…`` in a child process with :data:`PINNED_ENV` over this process's environment; its
    output goes to this process's.

    Raises:
        RuntimeError: the child failed (its exit code; its own error is above in the output).
    """
    proc = subprocess.run([sys.executable, *argv], env={**os.environ, **PINNED_ENV}, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed in its child process (exit code {proc.returncode}); its error is above")


def numerics() -> dict[str, object]:
    """The numerical environment of this process, for a build's record: library versions, thread count, the
    instruction set torch dispatches to and the machine."""
    import torch

    info: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "machine": platform.machine()}
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:  # pragma: no cover - a dependency of every build that records this
        pass
    info["pinned"] = all(os.environ.get(k) == v for k, v in PINNED_ENV.items())
    return info
