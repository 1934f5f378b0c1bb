"""The slowly updated "old" copy of the trained weights that the forward-process releases keep.

DiffusionNFT samples with it and uses its velocity as v_old; AWM uses it as a second KL anchor ("ema" adapter);
DGPO as its clipping anchor and, past ``switch_ema_ref`` steps, as the sampler. All three start from a copy of the
trained weights and move it toward them with

    old ← d·old + (1 − d)·θ,    d = decay(k)

where the decay is a piecewise-linear ramp of the optimizer-step count k:

    decay(k) = 0                              for k < flat
             = min((k − flat)·ramp, cap)      otherwise

(DiffusionNFT ``return_decay`` in scripts/train_nft_sd3.py, lines 169–189; AWM ``kl_ema_decay_type='linear'``,
train_sd3_awm.py lines 1409–1419; DGPO ``min(0.3, 0.001·global_step)``, train_sd3_dgpo.py line 1176), or a
constant (AWM ``'constant'``). ``d = 0`` makes the old copy the current weights (on-policy). *When* a release
applies the update, and which k it passes, differs (docs/fidelity_forward.md): DiffusionNFT and AWM once per
epoch after its updates, with k = the optimizer steps taken so far; DGPO after every optimizer step, with k = the
steps taken before it. The caller decides; :func:`decay_at` is only the schedule, and :class:`OldCopy` the copy
the training loop keeps (a float32 shadow of the trained parameters, swapped in for its forwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from flowgrpo.checkpoints.state_dicts import shard_like
from flowgrpo.parallel import reshard

__all__ = ["NFT_DECAY_TYPES", "decay_at", "update_old_copy_", "copy_into_", "OldCopy"]


# DiffusionNFT's ``decay_type`` (config/nft.py: 1 by default, 2 for sd3_ocr) → the settings of ``objective:`` that
# give its schedule (``decay_flat``, ``decay_ramp``, ``decay_cap``), return_decay().
NFT_DECAY_TYPES: dict[int, dict[str, float]] = {
    0: {"decay_flat": 0, "decay_ramp": 0.0, "decay_cap": 0.0},
    1: {"decay_flat": 0, "decay_ramp": 0.001, "decay_cap": 0.5},
    2: {"decay_flat": 75, "decay_ramp": 0.0075, "decay_cap": 0.999},
}


def decay_at(step: int, schedule) -> float:
    """The decay d ∈ [0, 1) of the old-copy update at optimizer-step count ``step`` (≥ 0): ``decay(k) = 0`` for
    k < flat, else min((k − flat)·ramp, cap); with a constant set, that constant.

    Args:
        step: the optimizer-step count k.
        schedule: the objective's validated settings (a :class:`~flowgrpo.algo.objectives.ForwardConfig`):
            ``decay_flat``, ``decay_ramp``, ``decay_cap`` and, where it has one, ``decay_constant`` (AWM
            ``kl_ema_decay_type='constant'``; None: the ramp).

    Raises:
        ValueError: a negative ``step``.
    """
    if step < 0:
        raise ValueError(f"old-copy decay needs a step count >= 0, got {step}")
    constant = getattr(schedule, "decay_constant", None)
    if constant is not None:
        return float(constant)
    if step < schedule.decay_flat:
        return 0.0
    return min((step - schedule.decay_flat) * schedule.decay_ramp, schedule.decay_cap)


@torch.no_grad()
def update_old_copy_(old: Iterable[torch.Tensor], current: Iterable[torch.Tensor], decay: float) -> None:
    """In place, ``old ← decay·old + (1 − decay)·current`` for each pair (the releases' update; decay 0 copies
    ``current`` exactly). Arithmetic in the old copy's dtype.

    Raises:
        ValueError: ``decay`` outside [0, 1], or the two lists differ in length or in a tensor's shape.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"old-copy decay must be in [0, 1], got {decay}")
    old, current = list(old), list(current)
    if len(old) != len(current):
        raise ValueError(f"the old copy holds {len(old)} tensors, the trained weights {len(current)}")
    for o, c in zip(old, current, strict=True):
        if o.shape != c.shape:
            raise ValueError(f"old-copy tensor of shape {tuple(o.shape)} paired with a weight of {tuple(c.shape)}")
        src = c.detach().to(device=o.device, dtype=o.dtype)
        if decay == 0.0:
            o.copy_(src)
        else:
            o.mul_(decay).add_(src * (1.0 - decay))


@torch.no_grad()
def copy_into_(old: Iterable[torch.Tensor], current: Iterable[torch.Tensor]) -> None:
    """Start the old copy as the current weights (every release does this before its first epoch)."""
    update_old_copy_(old, current, 0.0)


class OldCopy:
    """The old copy of the trained parameters the training loop keeps: a float32 shadow of each, started as the
    weights themselves, moved by :meth:`update` and swapped into the model for the forwards that use it
    (:meth:`swapped`), as :class:`flowgrpo.training.ema.EMA` is for evaluation.

    Of sharded (FSDP2) parameters it keeps one shadow shard per parameter shard (the same layout, so an update
    and a swap are local); its checkpoint state is those shards (:meth:`state_dict`), which torch's distributed
    checkpoint reshards, so a run resumes with another process count.

    Args:
        params: the trained parameters of the prepared module (the optimizer's, DTensors under FSDP2).
        schedule: the objective's settings that give the decay of :func:`decay_at` (``objective.decay_*``).
        model: the prepared module (its FSDP2 units are resharded around a swap, so that no forward reuses
            weights gathered before it), or None.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], schedule,
                 model: torch.nn.Module | None = None) -> None:
        self.params = list(params)
        self.schedule = schedule
        self.model = model
        self.shadow = [p.detach().float().clone() for p in self.params]
        self._backup: list[torch.Tensor] | None = None
        self.decay = 0.0  # the decay of the last update (a metric)

    def update(self, step: int) -> float:
        """``old ← d·old + (1 − d)·θ`` with d = :func:`decay_at` (``step``, the schedule); returns d."""
        self.decay = decay_at(step, self.schedule)
        update_old_copy_(self.shadow, self.params, self.decay)
        return self.decay

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Run with the old copy's values in the model's parameters, the trained values restored after (for
        no-gradient forwards only: the swap writes the parameters in place)."""
        if self._backup is None:
            self._backup = [torch.empty_like(p.detach()) for p in self.params]
        with torch.no_grad():
            for b, s, p in zip(self._backup, self.shadow, self.params, strict=True):
                b.copy_(p.detach())
                p.copy_(s.to(p.dtype))
        reshard(self.model)
        try:
            yield
        finally:
            reshard(self.model)
            with torch.no_grad():
                for b, p in zip(self._backup, self.params, strict=True):
                    p.copy_(b)

    def state_dict(self, prefix: str = "old_copy") -> dict[str, torch.Tensor]:
        """{``<prefix>.<i>``: float32 old copy of the i-th trained parameter as this process holds it}: the
        shadow itself (no copy; a DTensor shard of a sharded parameter, written by each process into its own
        checkpoint file and loaded in place, :mod:`flowgrpo.checkpoints.save_load`), nothing gathered."""
        return {f"{prefix}.{i}": s for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "old_copy") -> None:
        """Load whole tensors (each process keeps its shard) or tensors laid out as the shadows (:meth:`state_dict`).
        Raises ``ValueError`` for a state of another number of tensors or shapes."""
        keys = [f"{prefix}.{i}" for i in range(len(self.shadow))]
        if sorted(state) != sorted(keys):
            raise ValueError(f"the old-copy state holds {len(state)} tensors {sorted(state)[:3]}, the model trains "
                             f"{len(self.shadow)} ({keys[:3]} …)")
        with torch.no_grad():
            for k, s in zip(keys, self.shadow, strict=True):
                if tuple(state[k].shape) != tuple(s.shape):
                    raise ValueError(f"old-copy tensor {k} has shape {tuple(state[k].shape)}, its parameter "
                                     f"{tuple(s.shape)}")
                if state[k] is not s:  # a sharded checkpoint loads into the shadow itself
                    s.copy_(shard_like(state[k].float(), s))
