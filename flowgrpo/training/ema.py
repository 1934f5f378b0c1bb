"""An exponential moving average of the trained parameters, used for evaluation and saving.

``ema ← decay·ema + (1 − decay)·θ`` after every optimizer step (Polyak averaging, as Flow-GRPO's ``ema`` option),
kept in float32 whatever the model's dtype. Of sharded (FSDP2) parameters it keeps one shadow shard per
parameter shard (the parameter's local tensor), updated in place, so it costs each process 4 bytes per parameter
it holds: on the parameter's device (``parallel.ema=device``) or in host memory (``parallel.ema=cpu``: each update
copies the process's parameter shards to the host, each swap copies the shadow shards to the device).

Its checkpoint state (:meth:`EMA.state_dict`) is the shadow as each process holds it: a DTensor shard of the
parameter's layout under FSDP2 (written by each process into its own file, :mod:`flowgrpo.checkpoints.save_load`), the
whole tensor otherwise. Nothing is gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from flowgrpo.checkpoints.state_dicts import local

#: where the shadow lives (``parallel.ema``)
PLACES = ("device", "cpu")


class EMA:
    """EMA of ``params`` with ``decay`` in [0, 1), its shadow on the parameters' device or in host memory
    (``place``: ``device`` or ``cpu``). Raises ``ValueError`` for a decay outside it or another place.

    Attributes:
        shadow: one float32 tensor per parameter, this process's part of it (the local shard of a DTensor
            parameter, the whole tensor otherwise), on the parameter's device or the host.
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, *, place: str = "device") -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if place not in PLACES:
            raise ValueError(f"EMA place must be one of {PLACES}, got {place!r}")
        self.params = list(params)
        self.decay = decay
        self.place = place
        self.shadow = [self._home(local(p).detach().float()).clone() for p in self.params]

    def _home(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu") if self.place == "cpu" else t

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            s.mul_(self.decay).add_(local(p).detach().float().to(s.device), alpha=1.0 - self.decay)

    @contextlib.contextmanager
    def swapped(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Run with the EMA weights in the model, restoring the trained weights after.

        ``model``: the prepared module that owns the parameters; when it is FSDP2-sharded its gathered weights are
        freed (:func:`flowgrpo.parallel.reshard`) after the swap in and after the swap back, so that whatever
        ``reshard_after_forward`` is, the forwards inside see the EMA values and those after the trained ones."""
        from flowgrpo.parallel import reshard

        backup = [local(p).detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params, strict=True):
                local(p).copy_(s.to(p.dtype))
        reshard(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params, strict=True):
                    local(p).copy_(b)
            reshard(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{``ema.<i>``: float32 shadow of the i-th trained parameter as this process holds it}: a DTensor of the
        parameter's layout (this process's shard, no copy) for a sharded parameter, the whole tensor otherwise.
        Writing a returned tensor in place writes the shadow (a sharded checkpoint loads into it)."""
        from flowgrpo.checkpoints.state_dicts import dtensor_like

        return {f"ema.{i}": dtensor_like(s, p) for i, (s, p) in enumerate(zip(self.shadow, self.params,
                                                                              strict=True))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load shadows: DTensors of the parameters' layouts (each process's shard, a sharded checkpoint), or
        whole tensors (each process keeps its shard of them). Raises ``ValueError`` for another number of tensors
        or another shape."""
        from torch.distributed.tensor import DTensor

        from flowgrpo.checkpoints.state_dicts import shard_like

        if len(state) != len(self.shadow):
            raise ValueError(f"EMA state holds {len(state)} tensors, the model trains {len(self.shadow)}")
        with torch.no_grad():
            for i, (s, p) in enumerate(zip(self.shadow, self.params, strict=True)):
                t = state[f"ema.{i}"]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"EMA tensor ema.{i} has shape {tuple(t.shape)}, its parameter {tuple(p.shape)}")
                part = t.to_local() if isinstance(t, DTensor) else local(shard_like(t, p.detach()))
                if part.data_ptr() != s.data_ptr():  # a sharded checkpoint loads into the shadow itself
                    s.copy_(part)
