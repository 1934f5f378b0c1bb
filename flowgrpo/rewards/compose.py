"""Weighted composition of several rewards into one :class:`~flowgrpo.records.Rewards` record, and the one
scoring path every caller (training, evaluation, the background scorer) goes through.

The composed reward is the **weighted sum** ``R = Σ_i w_i·r_i``, as the Flow-GRPO release (arXiv 2505.05470)
composes its multi-score rewards: each score multiplied by its weight and summed. Weights may be negative:
``{quality: 1.0, penalty: -1.0}`` is ``quality − penalty``. A weighted *mean* ``Σ w_i r_i / Σ w_i`` is not used:
with a negative weight its denominator can be 0 (every total NaN) or negative (every total's sign flipped).

NaN semantics (docs/design.md, "Advantages and loss"): a NaN component means "not applicable to this sample" and
contributes nothing, i.e. the sum runs over the components present, ``R = Σ_{i present} w_i·r_i``. A sample with no
component present has a NaN composed reward, which the advantage estimator leaves out of its group's statistics. A
component of weight 0 (a metric logged beside the reward, or read by a group filter) never makes a sample's reward
present: a sample whose every weighted component is NaN has a NaN composed reward, not 0. A
reward that returns ``None`` for a sample declares it not applicable: it is read as NaN (and counted in
``reward/<name>/nan_frac``). An infinite score is an error naming the reward (:class:`RewardError`), raised when the
batch is scored, before any advantage is computed. With one reward of weight w the composed reward is w·r.
"""

from __future__ import annotations

import logging
import math
import reprlib

import torch

from flowgrpo.records import Rewards
from flowgrpo.rewards.base import is_group_wise, score_groups

logger = logging.getLogger(__name__)


#: what to try when the device runs out of memory (a reward's scoring, the rollout or the update)
OOM_HINT = ("to fit: parallel.reward_models=offload (reward models on the device only while they score), "
            "parallel.text_encoders=offload, a smaller train.rollout_batch_size or train.train_batch_size, "
            "model.gradient_checkpointing=true, or parallel.sharding=fsdp2 over several GPUs (docs/gpus.md)")


class RewardError(RuntimeError):
    """A reward failed while scoring a batch. ``reward_name`` is the name it has in the config's composition.

    The original exception, when there is one, is chained as ``__cause__``.
    """

    def __init__(self, reward_name: str, message: str) -> None:
        super().__init__(message)
        self.reward_name = reward_name


def compose_rewards(components: dict[str, torch.Tensor], weights: dict[str, float]) -> Rewards:
    """Weighted sum of (B,) component scores over the components present (NaN: absent).

    Returns:
        :class:`~flowgrpo.records.Rewards` with ``total`` (B,) float32 CPU, NaN where no component of nonzero
        weight is present.

    Raises:
        ValueError: mismatched names or shapes, or a non-finite weight.
    """
    if set(components) != set(weights):
        raise ValueError(f"reward components {sorted(components)} and weights {sorted(weights)} differ")
    bad = {k: w for k, w in weights.items() if not math.isfinite(float(w))}
    if bad:
        raise ValueError(f"reward weights must be finite numbers, got {bad}")
    shapes = {k: tuple(v.shape) for k, v in components.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"every reward must return a (B,) tensor, got shapes {shapes}")
    comps = {k: v.detach().float().cpu() for k, v in components.items()}
    total = None
    any_present = None
    for name, r in comps.items():
        present = ~torch.isnan(r)
        term = torch.where(present, float(weights[name]) * r, torch.zeros_like(r))
        total = term if total is None else total + term
        counts = present if float(weights[name]) != 0.0 else torch.zeros_like(present)  # a weight-0 metric does not
        any_present = counts if any_present is None else any_present | counts
    total = torch.where(any_present, total, torch.full_like(total, float("nan")))
    return Rewards(components=comps, weights=dict(weights), total=total)


#: rewards already warned about returning half-precision scores (once per reward name and process)
_WARNED_HALF: set[str] = set()


def _as_scores(name: str, raw) -> torch.Tensor:
    """A reward's output as float32 CPU; ``None`` entries of a list or tuple become NaN (not applicable). A float16
    or bfloat16 tensor is cast with a warning, once per reward: the contract is float32, and half precision keeps
    3 significant digits (bfloat16: 2–3), which can tie the scores of a group.

    Raises:
        RewardError: the output is not numbers (strings, objects, ragged lists), naming the reward and a sample
            of what it returned.
    """
    if isinstance(raw, list | tuple):
        raw = [float("nan") if s is None else s for s in raw]
    if isinstance(raw, torch.Tensor) and raw.dtype in (torch.float16, torch.bfloat16) and name not in _WARNED_HALF:
        _WARNED_HALF.add(name)
        logger.warning("reward %r returned %s scores; they are cast to float32, but half precision keeps only 2-3 "
                       "significant digits, which can tie the scores of a group: return float32 (the reward "
                       "contract)", name, str(raw.dtype).removeprefix("torch."))
    try:
        return torch.as_tensor(raw, dtype=torch.float32).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as err:
        shown = reprlib.repr(raw)
        raise RewardError(name, f"reward {name!r} returned {type(raw).__name__} {shown}, which is not numbers "
                          f"({err}); a reward returns B scores: a (B,) float tensor, or a list of floats with "
                          "None (or NaN) for 'not applicable'") from None


def score_components_named(composed: ComposedReward, images: torch.Tensor, prompts: list[str],
                           metadata: list[dict], group_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Score the components of ``composed``: the only scoring path (training, evaluation, background scorer).

    Point-wise rewards are always scored. Group-wise ones (:func:`~flowgrpo.rewards.base.is_group_wise`) are
    scored group by group when ``group_ids`` (B,) is given, and left out otherwise (a micro-batch of the rollout
    may hold part of a group; evaluation images have no groups).

    Args:
        images: (B, 3, H, W) float in [0, 1]. prompts: B strings. metadata: B dicts.

    Returns:
        name → (B,) float32 CPU scores, in the composition's order; ``None`` scores are NaN.

    Raises:
        RewardError: a reward raised, returned something that is not B scores, or returned ±inf (the message
            names the reward and the samples).
    """
    b = images.shape[0]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # grad mode is thread-local; rewards never need gradients here
        for name, reward in composed.rewards.items():
            group_wise = is_group_wise(reward)
            if group_wise and group_ids is None:
                continue
            try:
                raw = score_groups(reward, images, prompts, metadata, group_ids) if group_wise else \
                    reward(images, prompts, metadata)
            except torch.OutOfMemoryError as err:
                raise RewardError(name, f"reward {name!r} ran out of device memory on a batch of {b} "
                                        f"({str(err).splitlines()[0] if str(err) else 'OutOfMemoryError'}); "
                                        f"{OOM_HINT}") from err
            except Exception as err:
                raise RewardError(name, f"reward {name!r} failed on a batch of {b}: {type(err).__name__}: {err}") \
                    from err
            scores = _as_scores(name, raw)
            if scores.shape != (b,):
                raise RewardError(name, f"reward {name!r} returned shape {tuple(scores.shape)}, expected ({b},)")
            inf = torch.isinf(scores).nonzero().flatten().tolist()
            if inf:
                raise RewardError(
                    name, f"reward {name!r} returned an infinite score for sample(s) {inf[:5]} of the batch "
                    f"(prompt {prompts[inf[0]]!r}: {float(scores[inf[0]])}); a reward must be finite, or NaN/None "
                    "for 'not applicable'. Fix or clip the reward.")
            out[name] = scores
    return out


class ComposedReward:
    """Several rewards with weights; calls each (through :func:`score_components_named`) and composes.

    Args:
        rewards: name → reward object (the :class:`~flowgrpo.rewards.base.Reward` protocol).
        weights: name → weight (any finite number; negative for a penalty).
    """

    def __init__(self, rewards: dict, weights: dict[str, float]) -> None:
        self.rewards = rewards
        self.weights = weights

    def setup(self, device: torch.device) -> None:
        for r in self.rewards.values():
            r.setup(device)

    def check_training_prompts(self, prompts) -> None:
        """Show the training prompts to every component that implements the optional hook
        ``check_training_prompts`` (see :mod:`flowgrpo.rewards.base`); the trainer calls this once, before
        :meth:`setup`."""
        for r in self.rewards.values():
            hook = getattr(r, "check_training_prompts", None)
            if hook is not None:
                hook(prompts)

    def check_prompts(self, prompts, role: str) -> None:
        """Show a prompt set this composition will score (``role``: "training" or "evaluation") to every component
        that implements the optional hook ``check_prompts`` (see :mod:`flowgrpo.rewards.base`).

        Raises:
            ValueError: a component refuses the set; the message names the reward, the set and its source.
        """
        for name, r in self.rewards.items():
            hook = getattr(r, "check_prompts", None)
            if hook is None:
                continue
            try:
                hook(prompts)
            except ValueError as err:
                raise ValueError(f"reward {name!r} cannot score the {role} prompts ({prompts.source}): {err}") from None

    @property
    def group_wise(self) -> list[str]:
        """Names of the components that score whole groups."""
        return [k for k, r in self.rewards.items() if is_group_wise(r)]

    def score_components(self, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                         group_ids: torch.Tensor | None = None):
        """name → (B,) float32 CPU scores of every component, through :func:`score_components_named` (same path,
        same errors); ``group_ids`` (B,) is needed when a component is group-wise (else ValueError)."""
        if self.group_wise and group_ids is None:
            raise ValueError(f"rewards {self.group_wise} score whole groups: pass group_ids")
        return score_components_named(self, images, prompts, metadata, group_ids)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                 group_ids: torch.Tensor | None = None) -> Rewards:
        return compose_rewards(self.score_components(images, prompts, metadata, group_ids), self.weights)
