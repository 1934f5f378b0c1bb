"""Specification of the one update loop (flowgrpo.training.update.run_update): what it does with what an objective
hands it (optimizer steps, micro-batches, a loss sum per micro-batch, hooks, metrics), checked on a recording
optimizer and an objective whose losses are scalars of one weight, so every expected gradient is a hand sum."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flowgrpo.algo.objectives import MicroBatchAt, UpdateStep
from flowgrpo.training.update import run_update


class RecordingOptim:
    """The optimizer interface the loop uses, recording every call; plain SGD-free: it keeps each step's gradient."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.events: list[tuple] = []
        self.grads: list[float] = []
        self.steps = 0
        self.lr = 0.25
        self.sync_every_micro_batch = False  # parallel.gradient_sync=step

    def train_mode(self) -> None:
        self.events.append(("train_mode",))

    @contextlib.contextmanager
    def accumulating(self, *, sync: bool):
        self.events.append(("enter", sync))
        yield
        self.events.append(("exit",))

    def backward(self, loss: torch.Tensor) -> None:
        self.events.append(("backward", float(loss)))
        loss.backward()

    def step(self, epoch: int) -> float:
        self.events.append(("step", epoch))
        self.grads.append(float(self.w.grad) if self.w.grad is not None else 0.0)
        self.steps += 1
        return 10.0 * self.steps  # a norm per step: 10, 20, …

    def zero_grad(self) -> None:
        self.events.append(("zero_grad",))
        self.w.grad = None


class Adapter:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.scopes = 0

    @contextlib.contextmanager
    def attention(self):
        self.scopes += 1
        yield


class Toy:
    """Micro-batch items are numbers c; the loss of item c is c·w (its gradient c), or None for c = 0."""

    def __init__(self, optim: RecordingOptim, steps: list[UpdateStep]) -> None:
        self.optim, self.steps = optim, steps
        self.seen: list[tuple[float, MicroBatchAt]] = []
        self.hooks: list[tuple] = []

    def update_steps(self, work):
        return self.steps

    def update_state(self, work):
        return {"recorded": []}

    def micro_batches(self, work, step, inner):
        return [c * (inner + 1) for c in step.plan]  # a later pass may hand other micro-batches

    def loss(self, adapter, work, item, state, at):
        self.seen.append((item, at))
        if not at.filler:
            state["recorded"].append(item)
        return None if item == 0 else item * self.optim.w

    def after_step(self, steps_before):
        self.hooks.append(("after_step", steps_before))

    def after_epoch(self, steps):
        self.hooks.append(("after_epoch", steps))

    def update_metrics(self, adapter, work, state):
        return {"toy/recorded": sum(state["recorded"])}


class Work:
    epoch = 4


def test_each_step_back_propagates_its_micro_batches_scaled_to_the_mean_over_its_rows():
    optim, adapter = RecordingOptim(), Adapter()
    steps = [UpdateStep([1.0, 2.0], rows=3.0, progress=2), UpdateStep([4.0, 0.0, 5.0], rows=2.0, progress=1, fillers=1),
             UpdateStep([], rows=0.0), UpdateStep([7.0], rows=0.0)]
    toy = Toy(optim, steps)
    out = run_update(toy, adapter, optim, Work(), inner_epochs=2, progress=False)
    # gradients, by hand: step 1 (1 + 2)/3; step 2 4/2, the filler 5 weighted 0, the 0 item has no loss; the empty
    # step takes no optimizer step; step 4 7/max(0, 1); the second pass doubles every item
    assert optim.grads == pytest.approx([1.0, 2.0, 7.0, 2.0, 4.0, 14.0])
    backwards = [e[1] for e in optim.events if e[0] == "backward"]
    assert backwards == pytest.approx([1 / 3, 2 / 3, 2.0, 0.0, 7.0, 2 / 3, 4 / 3, 4.0, 0.0, 14.0])
    # each micro-batch in its own accumulation context, reducing only in the step's last one
    enters = [e[1] for e in optim.events if e[0] == "enter"]
    assert enters == [False, True, False, False, True, True] * 2
    # the step follows the step's micro-batches, zero_grad follows every step (also the empty one)
    kinds = [e[0] for e in optim.events if e[0] in ("step", "zero_grad")]
    assert kinds == ["step", "zero_grad", "step", "zero_grad", "zero_grad", "step", "zero_grad"] * 2
    assert all(e[1] == 4 for e in optim.events if e[0] == "step")  # the epoch names a stop on a bad norm
    assert [at for _, at in toy.seen][:6] == [MicroBatchAt(0, 0), MicroBatchAt(0, 0), MicroBatchAt(0, 1),
                                             MicroBatchAt(0, 1), MicroBatchAt(0, 1, filler=True), MicroBatchAt(0, 3)]
    assert toy.hooks == [("after_step", k) for k in range(6)] + [("after_epoch", 6)]
    assert out == {"toy/recorded": pytest.approx(3 * (1 + 2 + 4 + 0 + 7)), "policy/grad_norm": pytest.approx(35.0),
                   "train/lr": 0.25}
    assert adapter.scopes == 1  # one attention scope for the whole update
    assert optim.events[0] == ("train_mode",)


def test_the_world_size_scales_each_loss(monkeypatch):
    """On P processes a micro-batch's loss sum is scaled by P / (the step's rows on all processes): DDP's average of
    the gradients over the processes then gives the mean over all the step's rows."""
    from flowgrpo.distributed import dist

    monkeypatch.setattr(dist, "world_size", lambda: 4)
    optim = RecordingOptim()
    run_update(Toy(optim, [UpdateStep([3.0], rows=8.0)]), Adapter(), optim, Work(), inner_epochs=1, progress=False)
    assert optim.grads == pytest.approx([3.0 * 4 / 8])


def test_no_step_taken_reports_no_grad_norm_and_inner_epochs_are_checked():
    optim = RecordingOptim()
    out = run_update(Toy(optim, [UpdateStep([], rows=0.0)]), Adapter(), optim, Work(), inner_epochs=1,
                     progress=False)
    assert out == {"toy/recorded": 0, "train/lr": 0.25}
    with pytest.raises(ValueError, match="inner_epochs must be >= 1, got 0"):
        run_update(Toy(optim, []), Adapter(), optim, Work(), inner_epochs=0, progress=False)


def test_a_last_micro_batch_without_gradient_after_deferred_ones_stops_on_several_processes(monkeypatch):
    """With gradient_sync=step the earlier micro-batches' gradients are reduced over the processes in the step's
    last backward (DDP's no_sync, FSDP2's deferred reduce-scatter); a last micro-batch with no loss (None: every
    transition on a frozen module) makes no backward, so the step would apply gradients never averaged. It stops, in
    one line, before the optimizer step; a None that is not last, one process, or gradient_sync=micro_batch is fine."""
    from flowgrpo.distributed import dist

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    optim = RecordingOptim()
    with pytest.raises(RuntimeError, match=r"^update pass 1, optimizer step 2: the step's last micro-batch has no "
                                           r"gradient .*set parallel.gradient_sync=micro_batch") as err:
        run_update(Toy(optim, [UpdateStep([1.0], rows=1.0), UpdateStep([1.0, 0.0], rows=1.0)]), Adapter(), optim,
                   Work(), inner_epochs=1, progress=False)
    assert "\n" not in str(err.value)
    assert [e[0] for e in optim.events].count("step") == 1  # the first step only: the weights were not updated
    for steps, every in (([UpdateStep([0.0, 1.0], rows=1.0)], False), ([UpdateStep([1.0, 0.0], rows=1.0)], True),
                         ([UpdateStep([0.0, 0.0], rows=1.0)], False)):
        optim = RecordingOptim()
        optim.sync_every_micro_batch = every
        run_update(Toy(optim, steps), Adapter(), optim, Work(), inner_epochs=1, progress=False)
    monkeypatch.setattr(dist, "world_size", lambda: 1)
    optim = RecordingOptim()
    run_update(Toy(optim, [UpdateStep([1.0, 0.0], rows=1.0)]), Adapter(), optim, Work(), inner_epochs=1,
               progress=False)
    assert optim.grads == pytest.approx([1.0])
