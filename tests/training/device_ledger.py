"""A per-rank device-memory ledger on a CPU-only machine: the bytes of the live tensors that would sit on the
accelerator, now and at their peak, counted while the real training command runs.

On CPU every tensor is host memory, so what a GPU would hold must be told apart by *where the code puts it*. The
ledger marks a tensor as on the device when the run places it there, and :class:`LedgerMode` (a
``TorchFunctionMode``) marks every tensor computed from a marked one, as a real device would hold an operation's
output on the device of its inputs (activations, gradients read through ``.grad``, the optimizer's moments made by
``zeros_like``). A tensor leaves the ledger when Python frees it (a weak reference), so a stale reference that keeps
a whole model alive stays counted: the fault this ledger exists to catch (the original, unsharded parameters of a
sharded model kept by a list in the runner).

Placement points (wrapped by :func:`install`, in the order a run reaches them):

* ``parallel.place_pipeline``: every component moved to the device (not the encoders kept in host memory by
  ``text_encoders: offload``, not the transformer under ``sharding: fsdp2``, which FSDP2 places);
* ``torch.distributed.fsdp.fully_shard``: the module's parameters and buffers as FSDP2 moves them to the mesh's
  device before sharding (not with ``CPUOffloadPolicy``), and the sharded parameters it makes;
* ``parallel.prepare_model``: the prepared model's (re-made) shards, the reference's (not with ``reference:
  cpu_offload``);
* ``parallel.place_rewards``: reward models on the device (not with ``reward_models: offload``);
* ``Trainer.fit``: runs inside :class:`LedgerMode`; the EMA's shadow (not with ``ema: cpu``).

Bytes are counted once per storage (views share it); a DTensor counts its local shard. Tensors made inside C++
(autograd's saved tensors of a C++ function, FSDP2's all-gather buffers, created on the mesh's CPU device here) are
not seen: the ledger is a lower bound of what a GPU holds, identical in kind on every rank, which is what comparing
ranks needs.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard
    return local if isinstance(local, torch.Tensor) else t


class DeviceLedger:
    """Live bytes of the tensors marked as on the device, by storage; ``peak`` the most at once, ``peak_at`` the
    phase it was reached in (:meth:`phase`)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new count (the next run of the same process); tensors marked before are forgotten."""
        self.current = 0
        self.peak = 0
        self.peak_at = "start"
        self.stage = "start"
        self.stages: dict[str, int] = {}  # the most live bytes within each phase
        self._refs: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (its weak reference, storage key)
        self._storages: dict[int, list[int]] = {}  # storage key -> [bytes, live marked tensors on it]

    def phase(self, name: str) -> None:
        self.stage = name
        self.stages[name] = max(self.stages.get(name, 0), self.current)

    def mark(self, t) -> None:
        """Count ``t`` (a tensor; anything else is ignored) as on the device until it is freed."""
        if not isinstance(t, torch.Tensor) or id(t) in self._refs:
            return
        local = _local(t)
        if local.is_meta or local.device.type != "cpu":
            return
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own (an async
            return  # collective's result before it is waited on)
        if nbytes == 0:
            return
        try:
            ref = weakref.ref(t, functools.partial(self._freed, id(t)))
        except TypeError:
            return
        self._refs[id(t)] = (ref, key)
        entry = self._storages.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.current += nbytes
        entry[1] += 1
        if self.current > self.peak:
            self.peak, self.peak_at = self.current, self.stage
        self.stages[self.stage] = max(self.stages.get(self.stage, 0), self.current)

    def mark_module(self, module) -> None:
        if module is None:
            return
        module = getattr(module, "module", module)  # a wrapper (ComputeIn, DDP)
        for t in [*module.parameters(), *module.buffers()]:
            self.mark(t)

    def is_marked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._refs and self._refs[id(t)][0]() is t

    def _freed(self, tid: int, _ref) -> None:
        _, key = self._refs.pop(tid, (None, None))
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._storages[key]

    def report(self) -> dict:
        return {"peak": self.peak, "peak_at": self.peak_at, "end": self.current, "stages": self.stages}


def _tensors(tree, out: list) -> list:
    """``out`` with the tensors in ``tree`` appended, in order: ``tree`` a tensor or nested lists, tuples
    (named ones too) and dicts of them, what an operation takes and returns. The same tensors as
    ``torch.utils._pytree.tree_flatten`` finds there, at a fraction of its cost: it ran for every operation of
    a run and took over half of the ledger's runs' time."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _tensors(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors(x, out)
    return out


class LedgerMode(TorchFunctionMode):
    """Inside it, every output of an operation with a marked tensor operand is marked (a device op's output is on
    the device), and so is an attribute read of a marked tensor (``.grad``, ``.data``). Nothing else changes."""

    def __init__(self, ledger: DeviceLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("cpu", "numpy", "tolist", "item"):
            return out
        if any(self.ledger.is_marked(t) for t in _tensors(kwargs or {}, _tensors(args, []))):
            for t in _tensors(out, []):
                self.ledger.mark(t)
        return out


def host_peak_bytes() -> int:
    """This process's peak resident set (``VmHWM`` of ``/proc/self/status``), in bytes; 0 where not readable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def install(ledger: DeviceLedger, config_of) -> None:
    """Wrap the run's placement points (the module docstring) to mark what they put on the device.
    ``config_of()``: the running config (its ``parallel`` section decides what is offloaded)."""
    import torch.distributed.fsdp as fsdp

    from flowgrpo import parallel
    from flowgrpo.training.loop import Trainer

    place_pipeline, prepare_model, place_rewards = (parallel.place_pipeline, parallel.prepare_model,
                                                     parallel.place_rewards)
    fully_shard, fit = fsdp.fully_shard, Trainer.fit

    def placed_pipeline(adapter, device, settings):
        ledger.phase("load")
        place_pipeline(adapter, device, settings)
        offloaded = {id(m) for m in getattr(adapter.encoders_offload, "modules", [])}
        expert = parallel.other_expert(adapter)
        for m in adapter.pipe.components.values():
            if not isinstance(m, torch.nn.Module) or id(m) in offloaded:
                continue
            if m is adapter.transformer and settings.sharding == "fsdp2":
                continue
            if m is expert and settings.experts == "offload":
                continue
            ledger.mark_module(m)

    def sharding(module, *args, **kwargs):
        offload = isinstance(kwargs.get("offload_policy"), fsdp.CPUOffloadPolicy)
        if not offload:  # FSDP2 moves the module's states to the mesh's device first
            ledger.mark_module(module)
        out = fully_shard(module, *args, **kwargs)
        if not offload:
            ledger.mark_module(module)
        return out

    def prepared(adapter, accelerator, config):
        ledger.phase("shard")
        model = prepare_model(adapter, accelerator, config)
        p = config.parallel
        if p.offload != "cpu":
            ledger.mark_module(model)
        if p.reference != "cpu_offload":
            ledger.mark_module(adapter.frozen_reference)
        return model

    def rewards_placed(composed, device, settings):
        place_rewards(composed, device, settings)
        if settings.reward_models != "offload":
            for reward in composed.rewards.values():
                for m in parallel.reward_modules(reward):
                    ledger.mark_module(m)

    def fit_counted(self):
        ledger.phase("fit")
        if self.optim.ema is not None and config_of().parallel.ema != "cpu":
            for t in self.optim.ema.shadow:
                ledger.mark(t)
        with LedgerMode(ledger):
            return fit(self)

    parallel.place_pipeline, parallel.prepare_model, parallel.place_rewards = (placed_pipeline, prepared,
                                                                                rewards_placed)
    fsdp.fully_shard = sharding
    Trainer.fit = fit_counted


def write_report(ledger: DeviceLedger, out_dir: str | Path, extra: dict | None = None) -> Path:
    """``<out_dir>/ledger_<global rank>.json``: the ledger's report, this process's host peak, and ``extra``."""
    rank = int(os.environ.get("RANK", "0"))
    path = Path(out_dir) / f"ledger_{rank}.json"
    path.write_text(json.dumps({"rank": rank, **ledger.report(), "host_peak": host_peak_bytes(), **(extra or {})}))
    return path
