"""``torchrun … tests/training/fake_device_train.py CONFIG [CONFIG …]``: ``flowgrpo/train.py`` on a fake accelerator
with an NCCL-like process group, on CPU (gloo underneath); several configs run in turn in the same processes (one
start of the processes, several runs).

The model lives on the fake accelerator of :mod:`fake_device` during training; the process group reports the
``nccl`` backend, so :func:`flowgrpo.distributed.dist.backend_device` decides for CUDA (which the fake accelerator
stands in
for); each collective refuses any tensor that is not on the accelerator, as NCCL refuses CPU tensors ("No backend
type associated with device type cpu"). The data are CPU memory, so gloo does the real reduction and the run's
results can be compared with a one-process run. An objective's own model (a distillation teacher, built on the
model's device before training) is on the accelerator too; checkpointed functions (``torch.utils.checkpoint``) are
checked again when the backward recomputes them (:meth:`FakeAccelerator.recomputing`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as td
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fake_device import FakeAccelerator  # noqa: E402 - after the path set-up

from flowgrpo import runner  # noqa: E402
from flowgrpo.algo.objectives import reward_backprop  # noqa: E402
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
        teacher = getattr(self.objective, "teacher", None)
        mode = FakeAccelerator(*[c for c in self.adapter.pipe.components.values() if isinstance(c, torch.nn.Module)],
                               *([teacher] if teacher is not None else []))
        if self.optim.ema is not None:
            mode.place(self.optim.ema.shadow)
        saved = {name: getattr(td, name) for name in COLLECTIVES}
        saved_backend, saved_current = td.get_backend, torch.cuda.current_device
        checkpoint = torch.utils.checkpoint.checkpoint
        for name, fn in saved.items():
            setattr(td, name, _requiring_accelerator(fn, mode))
        td.get_backend = lambda group=None: "nccl"
        torch.cuda.current_device = lambda: 0
        torch.utils.checkpoint.checkpoint = reward_backprop.checkpoint = mode.recomputing(checkpoint)
        try:
            with mode:
                return fit(self)
        finally:
            for name, fn in saved.items():
                setattr(td, name, fn)
            td.get_backend, torch.cuda.current_device = saved_backend, saved_current
            torch.utils.checkpoint.checkpoint = reward_backprop.checkpoint = checkpoint

    return run


if __name__ == "__main__":
    from accelerate.state import PartialState

    Trainer.fit = _fit_on_accelerator(Trainer.fit)
    configs = sys.argv[1:]
    if len(configs) > 1:
        # accelerate's end_training destroys the process group, and a later run of the same process would train
        # alone: keep it for all runs, destroy it after the last (as tests/training/sharded_train.py)
        PartialState.destroy_process_group = lambda self, group=None: None
    for config in configs:
        runner.main([config])
    if len(configs) > 1 and td.is_initialized():
        td.destroy_process_group()
