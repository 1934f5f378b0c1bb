"""An exponential moving average of the trained parameters, used for evaluation and saving.

``ema ← decay·ema + (1 − decay)·θ`` after every optimizer step (Polyak averaging, as Flow-GRPO's ``ema`` option),
kept in float32 whatever the model's dtype. Of sharded (FSDP2) parameters it keeps one shadow shard per
parameter shard, updated in place, so it costs each process 4 bytes per parameter it holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class EMA:
    """EMA of ``params`` with ``decay`` in [0, 1). Raises ``ValueError`` for a decay outside it."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.params = list(params)
        self.decay = decay
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            s.mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

    @contextlib.contextmanager
    def swapped(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Run with the EMA weights in the model, restoring the trained weights after.

        ``model``: the prepared module that owns the parameters; when it is FSDP2-sharded its gathered weights are
        freed (:func:`flowgrpo.parallel.reshard`) after the swap in and after the swap back, so that whatever
        ``reshard_after_forward`` is, the forwards inside see the EMA values and those after the trained ones."""
        from flowgrpo.parallel import reshard

        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params, strict=True):
                p.copy_(s.to(p.dtype))
        reshard(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params, strict=True):
                    p.copy_(b)
            reshard(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{``ema.<i>``: whole float32 shadow of the i-th trained parameter}, in host memory. With sharded
        parameters each shadow is a shard: every process calls this (it gathers them), and every process gets
        the whole tensors."""
        from flowgrpo.state_dicts import full_tensor

        return {f"ema.{i}": full_tensor(s).detach().cpu() for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole shadows (:meth:`state_dict`); each process keeps its shard. Raises ``ValueError`` for
        another number of tensors."""
        from flowgrpo.state_dicts import shard_like

        if len(state) != len(self.shadow):
            raise ValueError(f"EMA state holds {len(state)} tensors, the model trains {len(self.shadow)}")
        with torch.no_grad():
            for i, s in enumerate(self.shadow):
                s.copy_(shard_like(state[f"ema.{i}"], s))
