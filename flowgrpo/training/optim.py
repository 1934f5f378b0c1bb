"""The one place a gradient is applied: the optimizer, its learning-rate schedule, gradient accumulation and
synchronisation, clipping, the non-finite check, the step and the EMA of the weights, and their checkpoint state.

Every objective's update calls only this interface (:class:`Optimization`): per optimizer step, for each pack of
its micro-batches ``with optim.accumulating(sync=last): ...forward...; optim.backward(loss)``, then
``optim.step(epoch)`` and ``optim.zero_grad()``. A sharded or otherwise distributed optimizer is a change here
alone: the transformer is wrapped (DDP) or sharded (FSDP2) by :func:`flowgrpo.parallel.prepare_model` before the
optimizer is built, so the optimizer, clipping, the EMA and checkpoints all hold the prepared module's parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from flowgrpo import parallel
from flowgrpo.checkpoints.health import resolve_checkpoint
from flowgrpo.checkpoints.save_load import load_checkpoint, save_checkpoint
from flowgrpo.training.ema import EMA
from flowgrpo.watch.divergence import TrainingDiverged, stop_line

logger = logging.getLogger(__name__)


class Optimization:
    """AdamW (``train.lr``, ``adam_betas``, ``adam_eps``, ``weight_decay``) with a linear warmup over
    ``train.warmup_steps`` optimizer steps, gradient-norm clipping (``train.max_grad_norm``) and an optional EMA
    of the trained weights (``train.ema_decay``), around the transformer prepared by
    :func:`flowgrpo.parallel.prepare_model` (DDP-wrapped, FSDP2-sharded, or as it is).

    Args:
        config: the run's :class:`~flowgrpo.config.Config` (``train`` and ``parallel`` are read).
        adapter: the model adapter, its transformer set up for training (LoRA or full); its ``forward_module``
            becomes the prepared transformer (gradient sync).
        accelerator: an ``accelerate.Accelerator``.

    Attributes:
        model: the wrapped transformer (forward through it); optimizer, lr_scheduler, ema (or None).
    """

    def __init__(self, config, *, adapter, accelerator) -> None:
        train = config.train
        self.train_cfg = train
        self.checkpoints = Path(config.output_dir) / "checkpoints"  # named by a stop on a non-finite gradient
        self.accelerator = accelerator
        self.sync_every_micro_batch = config.parallel.gradient_sync == "micro_batch"
        # wrap (DDP) or shard (FSDP2) first: after fully_shard the parameters are new DTensor objects, so a list
        # taken before would get no gradient
        self.model = parallel.prepare_model(adapter, accelerator, config)
        self.params = parallel.trainable_parameters(self.model)
        optimizer = torch.optim.AdamW(self.params, lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps,
                                      weight_decay=train.weight_decay)
        warm = train.warmup_steps
        self.epoch_factor = 1.0  # the schedule's factor of the epoch being trained (begin_epoch)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: (min(1.0, (step + 1) / warm) if warm else 1.0) * self.epoch_factor
        )
        self.optimizer = accelerator.prepare(optimizer)
        self.ema = (EMA(self.params, train.ema_decay, place=config.parallel.ema) if train.ema_decay is not None
                    else None)

    # ------------------------------------------------------------------ one optimizer step
    def second_optimizer(self, params: list[torch.nn.Parameter], *, lr: float,
                         betas: tuple[float, float] | None = None) -> SecondOptimizer:
        """A :class:`SecondOptimizer` over ``params`` (parameters an objective trains beside the model) with this
        run's ``train`` settings, learning rate ``lr`` and AdamW ``betas`` (None: ``train.adam_betas``): how an
        objective gets one without importing the loop's modules."""
        return SecondOptimizer(params, self.train_cfg, lr=lr, checkpoints=self.checkpoints, betas=betas)

    def begin_epoch(self, epoch: int) -> None:
        """Set the learning rate of epoch ``epoch`` (0-based): ``train.lr`` × the warmup's factor of the next step
        × :func:`epoch_lr_factor` (``train.lr_schedule``), for every step of the epoch."""
        t = self.train_cfg
        self.epoch_factor = epoch_lr_factor(epoch, t.num_epochs, t.lr_schedule, t.lr_min_ratio)
        for group, base in zip(self.optimizer.param_groups, self.lr_scheduler.base_lrs, strict=True):
            group["lr"] = base * self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)

    def accumulating(self, *, sync: bool):
        """The context of one pack's forward and backward (:func:`flowgrpo.parallel.gradient_sync`): with
        ``parallel.gradient_sync=step`` gradients are reduced over the processes only when ``sync`` (the step's
        last pack), with ``micro_batch`` after every pack (FSDP2's reduce-scatter keeps only gradient shards)."""
        return parallel.gradient_sync(self.model, sync=sync, every_micro_batch=self.sync_every_micro_batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of the 0-dim ``loss`` (already scaled to the step's mean)."""
        self.accelerator.backward(loss)

    def step(self, epoch: int) -> float:
        """Clip, check and apply the accumulated gradient (the update's one host read per step), advance the
        learning-rate schedule and the EMA; returns the gradient norm.

        Raises :class:`~flowgrpo.watch.divergence.TrainingDiverged` (a ``FloatingPointError``) on a non-finite norm,
        before the weights change, naming the epoch (``epoch`` 0-based, shown 1-based as the console counts) and
        the last checkpoint or its absence."""
        gn = parallel.clip_grad_norm(self.accelerator, self.params, self.train_cfg.max_grad_norm)
        if not math.isfinite(gn):  # never let one bad batch overwrite the weights
            raise TrainingDiverged(stop_line(epoch, self.train_cfg.num_epochs, f"the gradient norm is {gn} (the "
                                             "weights were not updated)", self.checkpoints))
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update()
        return gn

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far in the run (restored on resume: the schedule's count)."""
        return int(self.lr_scheduler.last_epoch)

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ modes and weights
    def train_mode(self) -> None:
        """Switch the transformer to training mode (a walk over every module: only when evaluation left it off)."""
        if not self.model.training:
            self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    def eval_weights(self):
        """The weights evaluation and saving use: the EMA when on, else the trained ones (a context; a sharded
        model's gathered weights are freed before and after the swap, so no forward sees the other values)."""
        return self.ema.swapped(self.model) if self.ema is not None else contextlib.nullcontext()

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The transformer without the distributed wrapper (for saving)."""
        return self.accelerator.unwrap_model(self.model)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every trained parameter and EMA shadow tensor, as this process holds them (a sharded
        model's local shards), for the health check before a save."""
        named = [(n, p) for n, p in self.unwrapped.named_parameters() if p.requires_grad]
        return named + ([(f"EMA ema.{i}", v) for i, v in enumerate(self.ema.shadow)] if self.ema is not None else [])

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: Path, epoch: int, *, sampler, keep: int, objective=None, health: dict | None = None) -> None:
        """Checkpoint epoch ``epoch`` (weights, optimizer, schedule, EMA, the prompt sampler and the objective's
        state, and its ``health`` record) under ``root``, keeping the newest ``keep`` healthy ones and the best
        evaluated one. Every process calls it; under FSDP2 each writes its own shards (nothing is gathered),
        otherwise the main one writes (:mod:`flowgrpo.checkpoints.save_load`)."""
        save_checkpoint(root, epoch, model=self.unwrapped, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                        sampler=sampler, ema=self.ema, keep=keep, objective=objective, health=health)

    def resume(self, checkpoint: str, *, sampler, objective=None) -> int:
        """Load ``checkpoint`` (and the prompt sampler's and the objective's state); this run's optimiser settings
        win over the checkpoint's. Returns the epoch to train next."""
        t = self.train_cfg
        epoch = 1 + load_checkpoint(checkpoint, model=self.unwrapped, optimizer=self.optimizer,
                                    lr_scheduler=self.lr_scheduler, sampler=sampler, ema=self.ema,
                                    objective=objective)
        for group in self.optimizer.param_groups:
            group.update(betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay)
        self.lr_scheduler.base_lrs = [t.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
        line = resumed_line(resolve_checkpoint(checkpoint), epoch, t.num_epochs)
        if line is not None:  # a finished run: the run folder's "already finished" line says it alone
            logger.info("%s", line)
        return epoch


class SecondOptimizer:
    """AdamW over parameters an objective trains beside the model (DMD2's fake score, a module the objective builds
    itself, whole on every process): the same interface as :class:`Optimization` for the update loop
    (:func:`~flowgrpo.training.update.run_update` applies a step with it when the step's
    :attr:`~flowgrpo.algo.objectives.base.UpdateStep.optimizer` names it), without EMA, schedule or
    distributed wrapper. The gradients are averaged over the processes by one all-reduce per step (the loop's
    world-size factor turns the sum back into the mean over all rows), clipped to ``train.max_grad_norm`` and
    checked finite before the weights change. Its state (the AdamW moments and the step count) is part of the
    objective's checkpoint state (:meth:`state_dict`).

    Args:
        params: the trained parameters (requires_grad). train: the run's ``train`` section (betas, eps, weight
            decay, max_grad_norm). lr: the learning rate (constant). checkpoints: the run's checkpoint folder
            (named by a stop on a non-finite gradient). betas: AdamW's betas (None: ``train.adam_betas``).
    """

    sync_every_micro_batch = True  # nothing is deferred: the all-reduce runs in step()

    def __init__(self, params: list[torch.nn.Parameter], train, *, lr: float, checkpoints: Path,
                 betas: tuple[float, float] | None = None) -> None:
        self.params = list(params)
        self.checkpoints = checkpoints
        self.train_cfg = train
        betas = tuple(train.adam_betas) if betas is None else tuple(betas)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=train.adam_eps,
                                           weight_decay=train.weight_decay)
        self.steps = 0  # steps taken (restored by load_state_dict)
        self.norms: list[float] = []  # the gradient norm of each step taken since the last drain
        #: called after each step with the steps taken before it (TDM-R1's slow surrogate follows its surrogate)
        self.on_step: Callable[[int], None] | None = None

    def accumulating(self, *, sync: bool):
        """Nothing to defer (the gradients are reduced in :meth:`step`)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, epoch: int) -> float:
        """Average the gradients over the processes, clip, check and apply them; returns the norm before clipping.
        Raises :class:`~flowgrpo.watch.divergence.TrainingDiverged` on a non-finite norm (weights unchanged)."""
        from flowgrpo.distributed import dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if dist.world_size() > 1:
            flat = dist.all_reduce_sum(torch.cat([g.reshape(-1) for g in grads])) / dist.world_size()
            for p, g in zip(self.params, torch.split(flat, [g.numel() for g in grads]), strict=True):
                p.grad = g.view_as(p).clone()
        gn = float(torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.max_grad_norm))
        if not math.isfinite(gn):
            raise TrainingDiverged(stop_line(epoch, self.train_cfg.num_epochs, f"the second optimizer's gradient "
                                             f"norm is {gn} (the weights were not updated)", self.checkpoints))
        self.optimizer.step()
        self.steps += 1
        self.norms.append(gn)
        if self.on_step is not None:
            self.on_step(self.steps - 1)
        return gn

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{``<i>.<key>``: the AdamW state of parameter i (host copies), ``steps``: the step count}."""
        out = {"steps": torch.tensor(float(self.steps), dtype=torch.float64)}
        for i, p in enumerate(self.params):
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"{i}.{key}"] = value.detach().cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors (``ValueError`` when they name another parameter count)."""
        index = {int(k.split(".", 1)[0]) for k in state if k != "steps"}
        if index and max(index) >= len(self.params):
            raise ValueError(f"second optimizer state names parameter {max(index)}, but only {len(self.params)} "
                             "are trained")
        self.steps = int(state.get("steps", torch.tensor(0)))
        for i, p in enumerate(self.params):
            entry = {k.split(".", 1)[1]: v for k, v in state.items() if k != "steps" and int(k.split(".", 1)[0]) == i}
            if entry:
                self.optimizer.state[p] = {k: (v.to(p.device) if k != "step" else v.clone()) for k, v in entry.items()}


def resumed_line(checkpoint, epoch: int, num_epochs: int) -> str | None:
    """The console line of a resume from ``checkpoint`` whose next epoch is ``epoch`` (0-based, as
    ``metrics.jsonl``'s ``epoch`` and the checkpoint names: ``epoch_N`` holds the state after 0-based epoch N),
    counted from 1 as the epoch lines: ``resumed from …/epoch_1 (saved after epoch 2/10); continuing with epoch
    3/10``; None when no epoch is left (``epoch`` ≥ ``num_epochs``: :meth:`RunFolder.finished
    <flowgrpo.training.run_folder.RunFolder.finished>` reports it)."""
    if epoch >= num_epochs:
        return None
    return (f"resumed from {checkpoint} (saved after epoch {epoch}/{num_epochs}); continuing with epoch "
            f"{epoch + 1}/{num_epochs}")


def epoch_lr_factor(epoch: int, num_epochs: int, schedule: str, min_ratio: float = 0.0) -> float:
    """The learning rate of epoch ``epoch`` (0-based) of ``num_epochs``, as a fraction of ``train.lr``.

    ``constant``: 1. ``cosine``: ``m + (1 - m) · (1 + cos(π · epoch / num_epochs)) / 2`` with ``m = min_ratio``
    (SGDR without restarts, Loshchilov & Hutter, arXiv 1608.03983, eq. 5, with T_cur counted in epochs): 1 at
    epoch 0, falling to ``m`` after the last epoch. Raises ``ValueError`` for another schedule name."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * epoch / num_epochs))
    raise ValueError(f"train.lr_schedule={schedule!r} is not a schedule: choose constant or cosine")


def saved_line(epoch: int, num_epochs: int) -> str:
    """The console line of the checkpoint of 0-based epoch ``epoch`` (its folder ``epoch_<epoch>``: the names count
    from 0 and stay so, older runs resume by them), counted from 1 as the epoch lines and the resume line
    (:func:`resumed_line`): ``saved checkpoint epoch_1 (after epoch 2/3)``."""
    return f"saved checkpoint epoch_{epoch} (after epoch {epoch + 1}/{num_epochs})"
