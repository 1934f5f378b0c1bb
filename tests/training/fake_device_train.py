"""``torchrun … tests/training/fake_device_train.py CONFIG``: ``flowgrpo/train.py`` on a fake accelerator with an
NCCL-like process group, on CPU (gloo underneath).

The model lives on the fake accelerator of :mod:`fake_device` during training; the process group reports the
``nccl`` backend, so :func:`flowgrpo.dist.backend_device` decides for CUDA (which the fake accelerator stands in
for); each collective refuses any tensor that is not on the accelerator, as NCCL refuses CPU tensors ("No backend
type associated with device type cpu"). The data are CPU memory, so gloo does the real reduction and the run's
results can be compared with a one-process run.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as td

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fake_device import FakeAccelerator  # noqa: E402 - after the path set-up

from flowgrpo import runner  # noqa: E402
from flowgrpo.training.loop import Trainer  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce", "gather", "scatter")


def _requiring_accelerator(fn, mode: FakeAccelerator):
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
        for t in tensors:
            if not mode.is_on(t):
                raise RuntimeError(f"No backend type associated with device type cpu (a host tensor of shape "
                                   f"{tuple(t.shape)} reached NCCL's {fn.__name__})")
        return fn(*args, **kwargs)

    return collective


def _fit_on_accelerator(fit):
    @functools.wraps(fit)
    def run(self):
        mode = FakeAccelerator(*[c for c in self.adapter.pipe.components.values() if isinstance(c, torch.nn.Module)])
        if self.optim.ema is not None:
            mode.place(self.optim.ema.shadow)
        saved = {name: getattr(td, name) for name in COLLECTIVES}
        saved_backend, saved_current = td.get_backend, torch.cuda.current_device
        for name, fn in saved.items():
            setattr(td, name, _requiring_accelerator(fn, mode))
        td.get_backend = lambda group=None: "nccl"
        torch.cuda.current_device = lambda: 0
        try:
            with mode:
                return fit(self)
        finally:
            for name, fn in saved.items():
                setattr(td, name, fn)
            td.get_backend, torch.cuda.current_device = saved_backend, saved_current

    return run


if __name__ == "__main__":
    Trainer.fit = _fit_on_accelerator(Trainer.fit)
    runner.main()
