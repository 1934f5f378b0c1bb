"""Group-relative advantage estimators (registered; chosen by ``advantage.name``).

All estimators see the rewards of the whole batch (gathered across processes) and the group id of each sample.
Shared conventions (docs/design.md, "Advantages and loss"):

* ``A = (r − mean) / (std + eps)`` with the population std and eps = 1e-4 by default (Flow-GRPO, arXiv
  2505.05470, eq. 6; its ``np.std``), or the unbiased std (``ddof=1``) and eps = 1e-8 as the DanceGRPO family
  (DanceGRPO, MixGRPO, GCPO, E-GRPO: ``torch.std()`` + 1e-8) — ``advantage.std_ddof`` and ``advantage.std_eps``;
* a group whose valid rewards are all equal (max == min, an exact test: float means of equal values are not
  exact) gets advantage exactly 0;
* a NaN reward is left out of its group's statistics and its sample gets advantage 0 (and no training);
* advantages are clipped to ±``clip``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from flowgrpo.records import Advantages, Rewards
from flowgrpo.strategies.registry import Registry

logger = logging.getLogger(__name__)

STD_EPS = 1e-4

# An estimator maps (rewards (B,) float64 with NaN, group_ids (B,), global_std, *, ddof, eps) -> advantages (B,)
# float64, meaningful only on valid samples of groups with spread. Its ``reads`` attribute names the ``advantage.*``
# knobs it reads (``std_ddof`` / ``std_eps`` too, when it divides by a std); the config refuses the others moved
# from their default, except the std settings under ``multi_reward: gdpo``, whose batch renormalisation reads them
# (a plugin that declares no ``reads`` may read any).
Estimator = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def estimator(name: str, reads: tuple[str, ...] = ()) -> Callable[[Estimator], Estimator]:
    """Register an estimator as ``name``, reading the ``advantage.*`` knobs ``reads``."""

    def deco(fn: Estimator) -> Estimator:
        fn.reads = reads
        return ESTIMATORS.register(name)(fn)

    return deco


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, len(uniq)


def _group_stats(r: torch.Tensor, inv: torch.Tensor, n: int, ddof: int = 0):
    """Per-sample (count, mean, std with ``ddof``, max, min) of its group over valid (non-NaN) rewards."""
    valid = ~torch.isnan(r)
    rz = torch.where(valid, r, torch.zeros_like(r))
    cnt = torch.zeros(n, dtype=r.dtype).index_add_(0, inv, valid.to(r.dtype))
    s = torch.zeros(n, dtype=r.dtype).index_add_(0, inv, rz)
    mean = s / cnt.clamp(min=1)
    dev = torch.where(valid, (r - mean[inv]) ** 2, torch.zeros_like(r))
    var = torch.zeros(n, dtype=r.dtype).index_add_(0, inv, dev) / (cnt - ddof).clamp(min=1)
    big = torch.finfo(r.dtype).max
    mx = torch.full((n,), -big, dtype=r.dtype).scatter_reduce(0, inv, torch.where(valid, r, -big), "amax")
    mn = torch.full((n,), big, dtype=r.dtype).scatter_reduce(0, inv, torch.where(valid, r, big), "amin")
    return cnt[inv], mean[inv], var.sqrt()[inv], mx[inv], mn[inv]


def _batch_std(r: torch.Tensor, ddof: int = 0) -> torch.Tensor:
    v = r[~torch.isnan(r)]
    return v.std(correction=ddof) if v.numel() > ddof else torch.zeros((), dtype=r.dtype)


@estimator("grpo", reads=("global_std", "std_ddof", "std_eps"))
def grpo(r: torch.Tensor, group_ids: torch.Tensor, global_std: bool = False, *, ddof: int = 0,
         eps: float = STD_EPS) -> torch.Tensor:
    """GRPO (Shao et al., arXiv 2402.03300, Sec. 4.1.2; Flow-GRPO eq. 6): ``(r − mean_g) / (std + eps)``,
    std (with ``ddof``) of the group or, with ``global_std``, of the whole batch."""
    inv, n = _group_index(group_ids)
    _, mean, std, _, _ = _group_stats(r, inv, n, ddof)
    if global_std:
        std = _batch_std(r, ddof).expand_as(r)
    return (r - mean) / (std + eps)


@estimator("dr_grpo")
def dr_grpo(r: torch.Tensor, group_ids: torch.Tensor, global_std: bool = False, **_std) -> torch.Tensor:
    """Dr. GRPO (Liu et al., arXiv 2503.20783, Sec. 3.2): ``r − mean_g``, no division by the std."""
    inv, n = _group_index(group_ids)
    _, mean, _, _, _ = _group_stats(r, inv, n)
    return r - mean


@estimator("rloo")
def rloo(r: torch.Tensor, group_ids: torch.Tensor, global_std: bool = False, **_std) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740, eq. 9): ``r_i − mean_{j≠i} r_j``
    over the group's valid samples, i.e. ``n/(n−1)·(r_i − mean_g)``."""
    inv, n = _group_index(group_ids)
    cnt, mean, _, _, _ = _group_stats(r, inv, n)
    return (r - mean) * cnt / (cnt - 1).clamp(min=1)


def _check_groups(group_ids: torch.Tensor) -> None:
    _, counts = torch.unique(group_ids, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError(
            f"every group needs G >= 2 samples for group-relative advantages; group sizes found: "
            f"{sorted(set(counts.tolist()))} (raise train.group_size)"
        )


def _flat_groups(r: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the sample's group has no spread in ``r`` (max == min over valid rewards, or none valid)."""
    inv, n = _group_index(group_ids)
    _, _, _, mx, mn = _group_stats(r, inv, n)
    return mx <= mn


def solved_group_frac(r: torch.Tensor, group_ids: torch.Tensor) -> float | None:
    """Of the groups whose valid (non-NaN) rewards in ``r`` (B,) are all equal (groups by ``group_ids`` (B,)), the
    fraction whose shared reward is the highest valid reward of the batch: solved groups, as a capped reward makes
    them. None when no group is equal or every valid reward is the same (a constant reward solves nothing)."""
    valid = ~torch.isnan(r)
    if not valid.any() or bool((r[valid] == r[valid].max()).all()):
        return None
    inv, n = _group_index(group_ids)
    cnt, _, _, mx, mn = _group_stats(r, inv, n)
    equal = (mx <= mn) & (cnt > 0)
    groups = torch.unique(inv[equal]).numel()
    at_top = torch.unique(inv[equal & (mx == r[valid].max())]).numel()
    return at_top / groups if groups else None


def _normalize(r: torch.Tensor, group_ids: torch.Tensor, estimator: str, global_std: bool, ddof: int,
               eps: float) -> torch.Tensor:
    a = ESTIMATORS.get(estimator)(r, group_ids, global_std, ddof=ddof, eps=eps)
    flat = _flat_groups(r, group_ids) | torch.isnan(r)
    return torch.where(flat, torch.zeros_like(a), a)


def _per_component(rewards: Rewards, group_ids: torch.Tensor, estimator: str, global_std: bool, ddof: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each component normalised within its groups, then summed with the weights (MixGRPO's
    ``advantage_aggr``). Returns (advantages (B,) float64, zero-spread (B,) bool: the group is flat in every
    weighted component, so a flat total whose components vary still trains; a weight-0 component, a metric, adds
    nothing and does not count)."""
    adv = torch.zeros_like(rewards.total, dtype=torch.float64)
    flat = torch.ones_like(rewards.total, dtype=torch.bool)
    for name, comp in rewards.components.items():
        if rewards.weights[name] == 0:
            continue
        c = comp.double()
        adv = adv + rewards.weights[name] * _normalize(c, group_ids, estimator, global_std, ddof, eps)
        flat &= _flat_groups(c, group_ids)
    return adv, flat


def _gdpo(rewards: Rewards, group_ids: torch.Tensor, valid: torch.Tensor, estimator: str, global_std: bool,
          ddof: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (Liu et al., arXiv 2601.05242, eq. 4–5; NVlabs/GDPO ``grpo_trainer.py``): :func:`_per_component`,
    then ``(A − mean_batch) / (std_batch + eps)``. Returns (advantages (B,), zero-spread (B,) bool)."""
    adv, flat = _per_component(rewards, group_ids, estimator, global_std, ddof, eps)
    masked = torch.where(valid, adv, torch.full_like(adv, float("nan")))
    mean = adv[valid].mean() if bool(valid.any()) else torch.zeros((), dtype=adv.dtype)
    adv = (adv - mean) / (_batch_std(masked, ddof) + eps)
    return torch.where(flat | ~valid, torch.zeros_like(adv), adv), flat


def _combine(rewards: Rewards, group_ids: torch.Tensor, valid: torch.Tensor, multi_reward: str, estimator: str,
             global_std: bool, ddof: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (B,) float64 before clipping, zero-spread mask (B,) bool) for the ``multi_reward`` mode of
    :func:`compute_advantages`. Raises ``ValueError`` for an unknown mode."""
    if multi_reward == "sum_then_normalize":
        total = rewards.total.double()
        zero_spread = _flat_groups(total, group_ids)  # includes a group with no valid reward at all
        return _normalize(total, group_ids, estimator, global_std, ddof, eps), zero_spread
    if multi_reward == "gdpo":
        return _gdpo(rewards, group_ids, valid, estimator, global_std, ddof, eps)
    if multi_reward == "normalize_then_sum":
        adv, zero_spread = _per_component(rewards, group_ids, estimator, global_std, ddof, eps)
        return torch.where(zero_spread | ~valid, torch.zeros_like(adv), adv), zero_spread
    raise ValueError(f"multi_reward must be 'sum_then_normalize', 'gdpo' or 'normalize_then_sum', got "
                     f"{multi_reward!r}")


def compute_advantages(
    rewards: Rewards,
    group_ids: torch.Tensor,
    *,
    estimator: str = "grpo",
    global_std: bool = False,
    multi_reward: str = "sum_then_normalize",
    clip: float = 5.0,
    drop_zero_spread: bool = False,
    std_ddof: int = 0,
    std_eps: float = STD_EPS,
) -> Advantages:
    """Advantages (B,) for the batch's rewards.

    Args:
        rewards: the composed rewards; ``rewards.total`` (B,) is used by ``sum_then_normalize``; ``gdpo`` uses
            the components.
        group_ids: (B,) long group of each sample.
        estimator: a registered estimator (``grpo``, ``dr_grpo``, ``rloo``).
        multi_reward: ``sum_then_normalize`` (weighted composition, then group statistics) or ``gdpo`` (each
            component normalised within its groups, weighted sum, renormalised over the batch: Liu et al.,
            arXiv 2601.05242, eq. 4–5) or ``normalize_then_sum`` (GDPO without the batch renormalisation:
            MixGRPO's ``advantage_aggr``).
        clip: advantages are clipped to ±clip.
        drop_zero_spread: zero-spread groups get ``train_mask`` False (DAPO's dynamic sampling, arXiv 2503.14476).
            Under ``gdpo`` a group is zero-spread only when every component is flat in it.
        std_ddof, std_eps: the std's delta degrees of freedom (0 population, 1 unbiased) and the eps added to it,
            in the group statistics and in GDPO's batch renormalisation.

    Raises:
        ValueError: a group with fewer than 2 samples, an unknown ``multi_reward``, or ``std_ddof`` not 0 or 1.
    """
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 (population std) or 1 (unbiased std), got {std_ddof!r}")
    _check_groups(group_ids)
    total = rewards.total.double()
    inv, n = _group_index(group_ids)
    valid = ~torch.isnan(total)
    adv, zero_spread = _combine(rewards, group_ids, valid, multi_reward, estimator, global_std, std_ddof, std_eps)
    adv = adv.clamp(-clip, clip).float()
    train_mask = valid.clone()
    if drop_zero_spread:
        train_mask &= ~zero_spread
    group_zero = torch.zeros(n, dtype=torch.bool).index_fill_(0, inv[zero_spread], True)
    nan_frac = float((~valid).double().mean())
    if nan_frac > 0:
        logger.warning("%.1f%% of samples have a NaN reward: advantage 0, left out of the update", 100 * nan_frac)
    learning = train_mask & ~zero_spread
    return Advantages(
        values=adv, train_mask=train_mask, zero_spread_frac=float(group_zero.double().mean()), nan_frac=nan_frac,
        learning_frac=float(learning.double().mean()),
    )
