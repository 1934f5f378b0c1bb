"""The update loop of every objective: inner epochs × optimizer steps × micro-batches, gradient accumulation, the
backward, the gradient scaling, the optimizer step, and the update's shared metrics.

An objective (:class:`~flowgrpo.algo.objectives.base.Objective`) hands the loop what to train and never touches a
gradient:

* :meth:`~flowgrpo.algo.objectives.base.Objective.update_steps` ``(work)``: the optimizer steps of one pass
  (:class:`~flowgrpo.algo.objectives.base.UpdateStep`: the objective's record of the step, its trained rows over all
  processes, its progress units and fillers);
* :meth:`~flowgrpo.algo.objectives.base.Objective.micro_batches` ``(work, step, inner)``: the step's micro-batches in
  pass ``inner``;
* :meth:`~flowgrpo.algo.objectives.base.Objective.loss` ``(adapter, work, item, state, at)``: one micro-batch's loss,
  the sum over its trained rows (or None: nothing to back-propagate), its statistics added to ``state``
  (:meth:`~flowgrpo.algo.objectives.base.Objective.update_state`, made once an update);
* the hooks :meth:`~flowgrpo.algo.objectives.base.Objective.after_step` (after every optimizer step) and
  :meth:`~flowgrpo.algo.objectives.base.Objective.after_epoch` (after the update), and
  :meth:`~flowgrpo.algo.objectives.base.Objective.update_metrics` (its metrics from ``state``).

Per optimizer step the loop runs every micro-batch in its own accumulation context
(:meth:`~flowgrpo.training.optim.Optimization.accumulating`: gradients are reduced over the processes in the
step's last backward, or after each with ``parallel.gradient_sync=micro_batch``), back-propagates its loss scaled by
``world_size / max(step.rows, 1)`` (0 for a filler), so the step minimises the mean over its rows on all
processes, then clips and applies the gradient (:meth:`~flowgrpo.training.optim.Optimization.step`; a step with no
micro-batch on this process, the same on every process, is skipped) and zeroes it. One attention-kernel scope
(the adapter's ``attention()``) covers the whole update: every forward, its backward and any checkpoint recompute
use the same kernels. A step whose :attr:`~flowgrpo.algo.objectives.base.UpdateStep.optimizer` is a second optimizer
(:class:`~flowgrpo.training.optim.SecondOptimizer`: parameters the objective trains itself) goes through it instead
of ``optim`` (accumulation, backward, step, zeroing). Metrics: the objective's, ``policy/grad_norm`` (the mean
over the model's steps taken) and ``train/lr`` (the learning rate of the next step).
"""

from __future__ import annotations

from tqdm.auto import tqdm

from flowgrpo.algo.objectives.base import MicroBatchAt
from flowgrpo.distributed import dist

__all__ = ["run_update"]


def run_update(objective, adapter, optim, work, *, inner_epochs: int, progress: bool) -> dict[str, float]:
    """Train ``objective`` on its planned ``work`` for ``inner_epochs`` passes (module docstring).

    Args:
        objective: the run's objective (:class:`~flowgrpo.algo.objectives.base.Objective`).
        adapter: the model adapter (its ``attention()`` scope and ``device``).
        optim: the run's :class:`~flowgrpo.training.optim.Optimization`; every gradient goes through it.
        work: the objective's work record (``plan``/``recompute`` phases); ``work.epoch`` names the epoch (0-based)
            in a stop on a non-finite gradient.
        inner_epochs: passes over the work (``train.inner_epochs``, >= 1).
        progress: show a progress bar (micro-batches).

    Returns:
        The objective's :meth:`~flowgrpo.algo.objectives.base.Objective.update_metrics`, ``policy/grad_norm`` (when a
        step was taken) and ``train/lr``.

    Raises:
        ValueError: ``inner_epochs`` < 1.
        TrainingDiverged: a non-finite gradient norm (the weights were not updated).
        RuntimeError: with several processes and ``parallel.gradient_sync=step``, a step whose last micro-batch has
            no loss (None) after an earlier one back-propagated: the reduction that micro-batch's backward would
            have made never happens (DDP's ``no_sync`` and FSDP2's deferred reduce-scatter wait for it), so the
            step stops before the optimizer applies unaveraged gradients.
    """
    if inner_epochs < 1:
        raise ValueError(f"inner_epochs must be >= 1, got {inner_epochs}")
    steps = objective.update_steps(work)
    state = objective.update_state(work)
    norms: list[float] = []
    optim.train_mode()
    bar = tqdm(total=inner_epochs * sum(s.progress for s in steps), desc="update", leave=False, disable=not progress)
    with adapter.attention():
        for inner in range(inner_epochs):
            for u, step in enumerate(steps):
                opt = optim if step.optimizer is None else step.optimizer  # a second optimizer: its own step
                items = objective.micro_batches(work, step, inner)
                _backward_step(objective, adapter, opt, work, state, step, items, inner=inner, u=u)
                norm = opt.step(work.epoch) if items else None
                opt.zero_grad()
                if norm is not None and opt is optim:
                    norms.append(norm)
                    objective.after_step(optim.steps - 1)
                bar.update(step.progress)
    bar.close()
    objective.after_epoch(optim.steps)
    out = objective.update_metrics(adapter, work, state)
    if norms:
        out["policy/grad_norm"] = sum(norms) / len(norms)
    out["train/lr"] = optim.lr
    return out


def _backward_step(objective, adapter, optim, work, state, step, items: list, *, inner: int, u: int) -> None:
    """Back-propagate the losses of one optimizer step's micro-batches ``items``, each in its own accumulation
    context, scaled by ``world_size / max(step.rows, 1)`` (0 for the step's fillers, its last ``step.fillers``
    items); ``inner`` and ``u`` (0-based) name the pass and the step.

    Raises:
        RuntimeError: with several processes, the step's last micro-batch had no loss after an earlier one
            left its gradient reduction to it (:func:`run_update`).
    """
    deferred = False  # a backward ran whose gradient reduction waits for the step's last one
    for i, item in enumerate(items):
        filler = i >= len(items) - step.fillers
        sync = i == len(items) - 1
        with optim.accumulating(sync=sync):
            loss = objective.loss(adapter, work, item, state, MicroBatchAt(inner, u, filler))
            if loss is not None:
                optim.backward(loss * (0.0 if filler else dist.world_size() / max(step.rows, 1.0)))
                deferred = not (sync or optim.sync_every_micro_batch)
    if deferred and dist.world_size() > 1:
        raise RuntimeError(
            f"update pass {inner + 1}, optimizer step {u + 1}: the step's last micro-batch has no gradient "
            "(every transition on a frozen module, e.g. Wan2.2's untrained expert), and the earlier "
            "ones left their gradient reduction to it (parallel.gradient_sync=step): the processes would "
            "step on gradients never averaged; set parallel.gradient_sync=micro_batch, or train only "
            "the trained module's steps (chunker)")
