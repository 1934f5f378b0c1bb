"""Mixed devices, caught without a GPU: the real trainer runs one epoch (rollout, rewards, advantages, plan,
recompute, update with KL, EMA, evaluation, checkpoint) with the model on a fake accelerator
(:mod:`tests.training.fake_device`), where an operation mixing accelerator and host tensors fails as it does on CUDA.

On a real GPU, ``acc.add(terms, m.cpu(), …)`` multiplying a CUDA ratio by a CPU mask raised "Expected all tensors
to be on the same device"; the same class of fault fails here on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import build_config
from tests.training.fake_device import FakeAccelerator


def _modules(adapter, objective=None) -> list[torch.nn.Module]:
    """The modules on the accelerator: the pipeline's, the frozen reference and an objective's own model (a
    distillation teacher, built on the model's device before training)."""
    mods = [c for c in adapter.pipe.components.values() if isinstance(c, torch.nn.Module)]
    teacher = getattr(objective, "teacher", None)
    return mods + [m for m in (adapter.frozen_reference, teacher) if m is not None]


def _config(tmp_path, tiny_flux_dir, name: str, chunker: dict | None = None, train: dict | None = None, **algo):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    return build_config({
        "output_dir": str(tmp_path / name),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 2,
                  "train_batch_size": 2, "optimizer_steps_per_epoch": 2, "inner_epochs": 2, "lr": 1e-3,
                  "ema_decay": 0.9, **(train or {})},
        "algo": {"kl_beta": 0.01, "recompute_old_log_probs": True, **algo},
        "chunker": chunker or {"name": "chunk", "chunk_sizes": [1, 2]},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts), "eval_prompts": str(prompts), "eval_num_prompts": 2},
        "logging": {"progress": False, "save_rollout_stats": True},
    })


def _run_on_fake_accelerator(monkeypatch, config) -> FakeAccelerator:
    """``run(config)`` with the model on the fake accelerator; the mode records the host reads of each update (the
    update loop, :func:`~flowgrpo.training.update.run_update`, of any objective) in ``update_reads``. Checkpointed
    functions (``torch.utils.checkpoint``) are checked again when the backward recomputes them."""
    import torch.utils.checkpoint

    from flowgrpo.algo.objectives import reward_backprop
    from flowgrpo.runner import run
    from flowgrpo.training import loop
    from flowgrpo.training.loop import Trainer

    modes = []
    fit, update, checkpoint = Trainer.fit, loop.run_update, torch.utils.checkpoint.checkpoint

    def fit_on_accelerator(self):
        mode = FakeAccelerator(*_modules(self.adapter, self.objective))
        monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", mode.recomputing(checkpoint))
        monkeypatch.setattr(reward_backprop, "checkpoint", mode.recomputing(checkpoint))
        # the EMA and an old copy are built from the parameters before the mode: on their device, as on a GPU
        shadows = [*(self.optim.ema.shadow if self.optim.ema is not None else []),
                   *(self.objective.old.shadow if getattr(self.objective, "old", None) is not None else [])]
        if shadows:
            mode.place(shadows)
        mode.update_reads = []  # host reads of each update phase
        modes.append(mode)
        with mode:
            return fit(self)

    def counted_update(*args, **kwargs):
        before = modes[0].reads()
        out = update(*args, **kwargs)
        modes[0].update_reads.append(modes[0].reads() - before)
        return out

    monkeypatch.setattr(Trainer, "fit", fit_on_accelerator)
    monkeypatch.setattr(loop, "run_update", counted_update)
    run(config)
    return modes[0]


def test_fake_accelerator_catches_what_cuda_catches():
    lin = torch.nn.Linear(3, 2)
    with FakeAccelerator(lin) as mode:
        y = lin(torch.ones(4, 3).to(lin.weight.device))  # moved: fine
        assert y.device == torch.device("meta")
        y * torch.tensor(2.0)  # a host 0-dim scalar beside a device tensor: fine, as on CUDA
        with pytest.raises(RuntimeError, match="same device"):
            y * torch.ones(4, 2)  # a host tensor: refused
        with pytest.raises(RuntimeError, match="same device"):
            lin(torch.ones(4, 3))
        float(y.sum())
    assert mode.syncs["__float__"] == 1


def test_checkpointed_functions_are_checked_again_when_the_backward_recomputes_them():
    """A backward runs outside the mode (it is dispatched through the mode's handler): a checkpointed function's
    recomputation would run unchecked, its ``device=x.device`` factories making real ``meta`` tensors, unless the
    checkpoint is :meth:`FakeAccelerator.recomputing`'s."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(3, 2)
    dev = torch.device("meta")  # the accelerator's device, read in the forward (as ReFL's steps read x0.device)

    def step(z):
        return lin(z) * torch.full((z.shape[0], 1), 2.0, device=dev)

    with FakeAccelerator(lin) as mode:
        x = torch.ones(4, 3).to(lin.weight.device)
        assert x.device == dev
        with pytest.raises((NotImplementedError, RuntimeError), match="meta"):  # a real meta tensor recomputed
            checkpoint(step, x, use_reentrant=False).sum().backward()
        lin.zero_grad()
        mode.recomputing(checkpoint)(step, x, use_reentrant=False).sum().backward()
    assert lin.bias.grad.tolist() == [8.0, 8.0]  # d/db sum(2·(Wx + b)) over 4 rows


@pytest.mark.slow
def test_trainer_epoch_keeps_each_tensor_on_one_device(tmp_path, tiny_flux_dir, monkeypatch):
    cfg = _config(tmp_path, tiny_flux_dir, "fake")
    mode = _run_on_fake_accelerator(monkeypatch, cfg)
    assert mode.syncs  # the mode was active: results were read back to the host
    # host reads in the update: one per optimizer step (the gradient-norm guard) and three for the statistics,
    # however many chunks and statistics (2 chunks x 2 micro-batches per step here)
    t = cfg.train
    assert mode.update_reads == [t.inner_epochs * t.optimizer_steps_per_epoch + 3], mode.update_reads


@pytest.mark.slow
def test_egrpo_epoch_keeps_each_tensor_on_one_device(tmp_path, tiny_flux_dir, monkeypatch):
    # E-GRPO's shared anchors, branches and merged jumps (records with jump > 1) on the fake accelerator
    cfg = _config(tmp_path, tiny_flux_dir, "egrpo", chunker={"name": "entropy_merge", "sde_fraction": 0.5,
                                                             "entropy_threshold": 0.9})
    mode = _run_on_fake_accelerator(monkeypatch, cfg)
    t = cfg.train
    assert mode.update_reads and mode.update_reads[0] <= t.inner_epochs * t.optimizer_steps_per_epoch + 3


@pytest.mark.slow
@pytest.mark.parametrize("algo", [
    {"policy_loss": "grpo_guard"},  # keeps the rollout policy's transition means between phases
    {"policy_loss": "sapo", "group_filter": {"name": "gfpo", "keep": 2}},  # the filter phase's masks
], ids=["grpo_guard", "sapo_gfpo"])
def test_other_losses_and_the_filter_keep_each_tensor_on_one_device(tmp_path, tiny_flux_dir, monkeypatch, algo):
    train = {"group_size": 4, "rollout_batch_size": 4, "train_batch_size": 4} if "group_filter" in algo else None
    cfg = _config(tmp_path, tiny_flux_dir, "losses", chunker={"name": "per_step"}, train=train, **algo)  # G' 4, keep 2
    mode = _run_on_fake_accelerator(monkeypatch, cfg)
    assert mode.update_reads
