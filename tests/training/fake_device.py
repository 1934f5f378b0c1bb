"""A second, fake device on a CPU-only machine, to catch tensors of two devices meeting in one operation.

:class:`FakeAccelerator` is a ``TorchFunctionMode``. Inside it, tensors carry a *place*: the accelerator or the
host. The model's parameters and buffers start on the accelerator; every tensor computed from an accelerator
tensor is on the accelerator; ``.to(device)`` / ``.cpu()`` / ``device=`` move between places (a copy, as on a
real GPU). The accelerator's device reads as ``torch.device("meta")`` (``x.device``, ``adapter.device``), so code
that moves tensors with ``.to(model_device)`` moves them here; the data itself always stays in CPU memory, so
the arithmetic is real.

Each operation is checked with CUDA's rules: all tensor operands on one place, except host 0-dim tensors (CPU
scalars are allowed beside CUDA tensors), ``copy_`` (copies across devices), and host index tensors used to
index an accelerator tensor. A breach raises ``RuntimeError("Expected all tensors to be on the same device …")``
as CUDA would. Reading an accelerator tensor's value on the host (``float``, ``item``, ``tolist``, ``bool``,
``.cpu()``) is counted in :attr:`FakeAccelerator.syncs` (host synchronisations of a real GPU); :meth:`reads`
counts the value reads alone (PyTorch's own C++ code sees the real CPU device and may "move" a tensor to it).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from tests.training.device_ledger import _tensors  # the operation's tensors, found cheaply

FAKE = torch.device("meta")
_SYNCS = {"__float__", "__int__", "__bool__", "item", "tolist", "numpy", "__index__"}
_MOVES = {"to", "cpu", "cuda", "type"}


def _is_fake(device) -> bool:
    """``meta`` is the fake accelerator; so is ``cuda`` on this CUDA-less machine (code that picks CUDA, such as
    :func:`flowgrpo.distributed.dist.backend_device` under NCCL, lands there)."""
    return device is not None and torch.device(device).type in (FAKE.type, "cuda")


class FakeAccelerator(TorchFunctionMode):
    """Run code as if ``modules`` lived on an accelerator. ``syncs`` counts host reads of accelerator values."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        self.on_acc = WeakIdKeyDictionary()
        self.syncs: Counter = Counter()
        self.trace: list[str] | None = None  # set to [] to keep the stack of every host read (debugging)
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                self.on_acc[t] = True

    def reads(self) -> int:
        """Host reads of accelerator values so far (``float``, ``item``, ``tolist``, ``bool`` …), moves excluded."""
        return sum(v for k, v in self.syncs.items() if k != "cpu")

    def is_on(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on the accelerator."""
        return self._acc(t)

    def place(self, tensors: list[torch.Tensor]) -> None:
        """Put existing tensors (e.g. optimizer state) on the accelerator."""
        for t in tensors:
            self.on_acc[t] = True

    def recomputing(self, checkpoint):
        """``checkpoint`` (:func:`torch.utils.checkpoint.checkpoint`) whose function runs inside this mode when the
        backward recomputes it: a backward is dispatched through the mode's handler, where the mode is off, so
        without this a recomputation would run unchecked and its factories (``device=x.device``) would make real
        ``meta`` tensors."""
        from torch.overrides import _get_current_function_mode_stack

        def wrapped(function, *args, **kwargs):
            def run(*a, **k):
                if self in _get_current_function_mode_stack():
                    return function(*a, **k)
                with self:
                    return function(*a, **k)

            return checkpoint(run, *args, **kwargs)

        return wrapped

    def _acc(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.on_acc

    def _put(self, out) -> None:
        """Every tensor in ``out`` (an operation's result) on the accelerator."""
        for t in _tensors(out, []):
            self.on_acc[t] = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        tensors = _tensors(kwargs, _tensors(args, []))
        acc = [t for t in tensors if self._acc(t)]
        if name == "__get__" and args and self._acc(args[0]):
            out = func(*args, **kwargs)
            if isinstance(out, torch.device):  # x.device
                return FAKE
            if isinstance(out, torch.Tensor):  # x.grad, x.data, x.T …
                self.on_acc[out] = True
            return out
        if name in _SYNCS:
            if acc:
                self.syncs[name] += 1
                if self.trace is not None:
                    import traceback

                    self.trace.append("".join(traceback.format_stack(limit=12)[:-1]))
            return func(*args, **kwargs)
        if name in _MOVES and args and isinstance(args[0], torch.Tensor):
            return self._move(func, name, args, kwargs)
        target = kwargs.get("device")
        if _is_fake(target):  # a factory (zeros, arange, randn …) on the accelerator
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            if any(out is t for t in tensors):  # as_tensor(host_tensor, device=…) copies to a real device
                out = out.clone()
            self._put(out)
            return out
        self._check(name, args, tensors, acc)
        out = func(*args, **kwargs)
        to_host = target is not None and not _is_fake(target)
        if acc and not to_host and name != "copy_":
            self._put(out)
        return out

    def _check(self, name: str, args, tensors: list[torch.Tensor], acc: list[torch.Tensor]) -> None:
        if not acc or name in ("copy_", "__set__"):
            return
        if name in ("__getitem__", "__setitem__") and self._acc(args[0]):
            # an accelerator tensor indexed by host indices is fine; a host value written into it is not
            if name == "__setitem__" and isinstance(args[2], torch.Tensor) and args[2].dim() > 0:
                host_value = not self._acc(args[2])
            else:
                host_value = False
            if not host_value:
                return
        host = [t for t in tensors if not self._acc(t) and t.dim() > 0]
        if host:
            shapes = [tuple(t.shape) for t in host][:3]
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"accelerator and cpu! (op {name}; host tensors of shape {shapes})"
            )

    def _move(self, func, name: str, args, kwargs):
        src = args[0]
        if name == "cpu":
            dest_fake = False
        elif name == "cuda":
            dest_fake = True
        else:
            dest = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, torch.device | str) and not _is_dtype_name(a):
                    dest = a
                elif isinstance(a, torch.Tensor):
                    dest = FAKE if self._acc(a) else a.device
            dest_fake = self._acc(src) if dest is None else _is_fake(dest)
            if _is_fake(kwargs.get("device")):
                kwargs["device"] = "cpu"
            args = tuple("cpu" if (isinstance(a, torch.device | str) and _is_fake(a)) else a for a in args)
            args = tuple(a.detach().cpu() if isinstance(a, torch.Tensor) and i else a for i, a in enumerate(args))
        if name == "cuda":
            out = src.clone()
        elif name == "cpu":
            out = src.clone() if self._acc(src) else src
        else:
            out = func(*args, **kwargs)
            if out is src and self._acc(src) != dest_fake:  # a real device change copies
                out = src.clone()
        if self._acc(src) and not dest_fake:
            self.syncs["cpu"] += 1
            if self.trace is not None:
                import traceback

                self.trace.append("".join(traceback.format_stack(limit=12)[:-1]))
        if dest_fake:
            self.on_acc[out] = True
        elif out is not src:
            self.on_acc.pop(out, None)
        return out


def _is_dtype_name(a) -> bool:
    return isinstance(a, str) and a not in ("cpu", "cuda", "meta") and not a.startswith(("cuda:", "cpu:"))
