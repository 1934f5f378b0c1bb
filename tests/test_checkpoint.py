"""Checkpoint and resume: bit-exact resume on CPU in float32, atomic writes, refusal of pickled objects."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from flowgrpo.checkpoints.health import resolve_checkpoint
from flowgrpo.checkpoints.save_load import CheckpointError, load_checkpoint, save_checkpoint
from flowgrpo.config import build_config
from flowgrpo.data.prompts import GroupSampler
from flowgrpo.training.ema import EMA
from flowgrpo.writing.metrics import read_metrics


def _cfg(tmp_path, tiny_flux_dir, name, **train):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na blue ball\na green tree\na yellow car\n")
    return build_config({
        "output_dir": str(tmp_path / name),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "lora_rank": 4},
        "sampling": {"num_steps": 3},
        "train": {"num_epochs": 4, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 4,
                  "optimizer_steps_per_epoch": 2, "train_batch_size": 2, "lr": 1e-2, "ema_decay": 0.5, **train},
        "algo": {"clip_range": 1e-2},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "data": {"train_prompts": str(prompts)},
        "logging": {"progress": False, "save_every": 2},
    })


def _strip(records):
    # wall time and resident memory are measurements of the machine, not of the run
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "memory/"))} for r in records]


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, tiny_flux_dir, caplog):
    from flowgrpo.runner import run

    with caplog.at_level(logging.INFO, logger="flowgrpo.training.loop"):
        run(_cfg(tmp_path, tiny_flux_dir, "full"))
    # folders count epochs from 0, the lines from 1: the save line says both (epoch_1 is after "epoch 2/4")
    saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved checkpoint")]
    assert saved[0] == "saved checkpoint epoch_1 (after epoch 2/4)", saved
    assert saved[-1] == "saved checkpoint epoch_3 (after epoch 4/4)", saved
    full = _strip(read_metrics(tmp_path / "full" / "metrics.jsonl"))
    ckpt = tmp_path / "full" / "checkpoints" / "epoch_1"
    assert ckpt.is_dir()
    run(_cfg(tmp_path, tiny_flux_dir, "resumed", resume_from=str(ckpt)))
    resumed = _strip(read_metrics(tmp_path / "resumed" / "metrics.jsonl"))
    assert [r["epoch"] for r in resumed] == [2, 3]
    assert resumed == full[2:]  # every logged value equal, not merely close
    from safetensors.torch import load_file

    # tensors, not file bytes: the header's adapter metadata lists peft's target modules, a set, whose order
    # follows the process's string-hash seed
    a = load_file(tmp_path / "full" / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "resumed" / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _parts():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, GroupSampler(10, 2, 0), EMA(list(model.parameters()), 0.9)


def test_failed_write_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    model, opt, sched, sampler, ema = _parts()
    save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, ema=ema)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, ema=ema)
    monkeypatch.undo()
    assert resolve_checkpoint(tmp_path).name == "epoch_0"
    assert not (tmp_path / "epoch_1").exists()
    model2, opt2, sched2, sampler2, ema2 = _parts()
    epoch = load_checkpoint(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2, ema=ema2)
    assert epoch == 0
    for k, v in model2.state_dict().items():
        assert torch.equal(v, good[k])


class _Killed(BaseException):
    """A process killed between two file-system steps (not an Exception: nothing may catch it)."""


_STEPS = (("os", "replace"), ("os", "rename"), ("os", "link"), ("shutil", "rmtree"), ("shutil", "copy2"))


def _kill_at(monkeypatch, k: int) -> list[str]:
    """Make the k-th (0-based) rename, link or tree removal of the process raise :class:`_Killed`, as a kill
    would stop it there; returns the log of the steps called."""
    import os
    import shutil

    modules = {"os": os, "shutil": shutil}
    calls: list[str] = []
    for mod, name in _STEPS:
        real = getattr(modules[mod], name)

        def step(*args, _real=real, _name=f"{mod}.{name}", **kwargs):
            calls.append(_name)
            if len(calls) - 1 == k:
                raise _Killed(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(modules[mod], name, step)
    return calls


@pytest.mark.parametrize(("resave", "sharded"), [(True, False), (False, False), (True, True)],
                         ids=["resave_latest_epoch", "new_epoch_rotating", "resave_latest_sharded"])
def test_a_kill_between_any_two_steps_leaves_latest_naming_a_complete_checkpoint(tmp_path, monkeypatch, resave,
                                                                                  sharded, request):
    """Re-saving the epoch ``latest`` names (a resumed run's final save), or saving a new one that rotates an old
    one out, killed at each file-system step in turn: ``latest`` always resolves to a complete checkpoint holding
    the old or the new weights, and the next save completes and leaves no hidden folder behind. ``sharded``: the
    sharded form (its tensors in a ``sharded/`` folder, cloned aside by hard links too)."""
    parts = request.getfixturevalue("sharded_parts") if sharded else _parts

    def weight(model) -> torch.Tensor:
        return model.a.weight.full_tensor() if sharded else model.weight.detach()

    k = 0
    while True:
        root = tmp_path / f"k{k}"
        model, opt, sched, sampler, ema = parts()
        save_checkpoint(root, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, keep=1)
        old_w = weight(model).clone()
        with torch.no_grad():
            (model.a if sharded else model).weight.add_(1.0)
        new_w = weight(model).clone()
        epoch = 0 if resave else 1
        calls = _kill_at(monkeypatch, k)
        try:
            save_checkpoint(root, epoch, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, keep=1)
            killed = False
        except _Killed:
            killed = True
        except CheckpointException as err:  # killed inside torch's distributed checkpoint, which wraps it
            assert all(isinstance(e, _Killed) for e, _ in err.failures.values()), err
            killed = True
        monkeypatch.undo()
        folder = resolve_checkpoint(root)  # never "not a complete checkpoint"
        model2, opt2, sched2, sampler2, _ = parts()
        load_checkpoint(root, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2)
        w = weight(model2)
        assert torch.equal(w, old_w) or torch.equal(w, new_w), (k, calls, folder)
        if not killed:
            assert torch.equal(w, new_w) and folder.name == f"epoch_{epoch}"
            assert k >= 3  # the re-save went through several steps, each one a kill point above
            break
        # the run resumed and saved again: it completes, and nothing hidden is left over
        save_checkpoint(root, epoch, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, keep=1)
        assert resolve_checkpoint(root).name == f"epoch_{epoch}"
        assert sorted(p.name for p in root.iterdir()) == [f"epoch_{epoch}", "latest"], (k, calls)
        k += 1


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickled_object_is_refused(tmp_path):
    model, opt, sched, sampler, ema = _parts()
    folder = save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler)
    with (folder / "optimizer.pt").open("wb") as f:
        pickle.dump({"state": _Evil()}, f)
    state = json.loads((folder / "state.json").read_text())  # who writes the file can write the list of sizes too
    state["files"]["optimizer.pt"] = (folder / "optimizer.pt").stat().st_size
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="only tensors and plain data"):
        load_checkpoint(tmp_path, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler)


def test_mismatched_checkpoint_names_the_problem(tmp_path):
    model, opt, sched, sampler, _ = _parts()
    save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler)
    other = torch.nn.Linear(3, 5)
    with pytest.raises(RuntimeError):
        load_checkpoint(tmp_path, model=other, optimizer=torch.optim.AdamW(other.parameters()),
                        lr_scheduler=sched, sampler=sampler)
    state = json.loads((tmp_path / "epoch_0" / "state.json").read_text())
    assert state["sampler"]["position"] == 0


class _Blocks(torch.nn.Module):
    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)


@pytest.fixture
def sharded_parts():
    """A model sharded with FSDP2 on a one-process group (DTensor parameters: the sharded checkpoint form), AdamW
    stepped once, an EMA; the group is released after the test."""
    from flowgrpo import parallel
    from flowgrpo.distributed import dist

    def make():
        torch.manual_seed(0)
        model = parallel.shard(_Blocks(), mesh=parallel.device_mesh(torch.device("cpu")), param_dtype=None,
                               reshard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        return model, opt, sched, GroupSampler(10, 2, 0), EMA(list(model.parameters()), 0.9)

    yield make
    dist.release_own_group()


def test_a_sharded_checkpoint_refuses_code_and_names_a_missing_or_corrupt_file(tmp_path, sharded_parts):
    model, opt, sched, sampler, ema = sharded_parts()
    folder = save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, ema=ema)
    shards = folder / "sharded"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp"]
    assert not (folder / "trainable.safetensors").exists()
    model2, opt2, sched2, sampler2, ema2 = sharded_parts()
    load_checkpoint(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2, ema=ema2)
    for (n, a), b in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), n
    data = (shards / "__0_0.distcp").read_bytes()
    (shards / "__0_0.distcp").write_bytes(data[: len(data) // 2])  # truncated (a full disk, a cut copy)
    with pytest.raises(CheckpointError, match=rf"not as it was written: sharded/__0_0.distcp has {len(data) // 2} "
                                              rf"of its {len(data)} bytes"):
        load_checkpoint(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2, ema=ema2)
    state = json.loads((folder / "state.json").read_text())  # a checkpoint without the list of sizes (an older
    (folder / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "files"}))  # version's)
    with pytest.raises(CheckpointError, match=r"sharded.*corrupt or unreadable"):  # found when it is read
        load_checkpoint(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2, ema=ema2)
    (shards / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: sharded/__0_0.distcp is missing"):
        load_checkpoint(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2, ema=ema2)
    (shards / ".metadata").write_bytes(pickle.dumps(_Evil()))  # the metadata is a pickle: it may not run code
    with pytest.raises(CheckpointError, match="only tensors and plain data.*forbidden"):
        load_checkpoint(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2, sampler=sampler2, ema=ema2)


def test_an_ema_in_host_memory_averages_as_on_the_device():
    """``parallel.ema=cpu``: the shadow lives in host memory and follows ema ← d·ema + (1 − d)·θ (by hand:
    d = 0.5, θ = 1 then 3 from 0 gives 0.5 then 1.75); a swap puts it in the model and restores the weights."""
    p = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([p], 0.5, place="cpu")
    assert ema.shadow[0].device.type == "cpu"
    for value in (1.0, 3.0):
        with torch.no_grad():
            p.fill_(value)
        ema.update()
    assert torch.equal(ema.shadow[0], torch.full((3,), 1.75))
    with ema.swapped():
        assert torch.equal(p.detach(), torch.full((3,), 1.75))
    assert torch.equal(p.detach(), torch.full((3,), 3.0))
    with pytest.raises(ValueError, match="EMA place must be one of"):
        EMA([p], 0.5, place="disk")


def test_the_sharded_full_fine_tune_reference_is_a_structure_on_the_meta_device(tiny_flux_dir):
    """Under ``parallel.sharding=fsdp2`` the frozen reference holds no weights until it is sharded (no whole copy
    per process): its parameters are on the meta device with the policy's names, shapes and dtypes, its buffers
    real."""
    from flowgrpo.models import load_model
    from flowgrpo.models.lora import setup_trainable

    adapter = load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)
    setup_trainable(adapter, finetune="full", rank=4, alpha=4.0, target_modules=["to_q"], need_reference=True,
                    sharded=True)
    ref, tr = adapter.frozen_reference, adapter.transformer
    policy = dict(tr.named_parameters())
    assert [n for n, _ in ref.named_parameters()] == list(policy)
    for n, r in ref.named_parameters():
        assert r.is_meta and not r.requires_grad and r.shape == policy[n].shape and r.dtype == policy[n].dtype, n
    assert not any(p.is_meta for p in tr.parameters())
    for (n, a), (_, b) in zip(ref.named_buffers(), tr.named_buffers(), strict=True):
        assert not a.is_meta and torch.equal(a, b), n


def test_a_malformed_list_of_file_sizes_is_a_reason_not_a_crash(tmp_path):
    """``incomplete`` reads ``state.json``'s ``files`` as {relative path: int bytes}; any other shape (a list, a
    size that is a string) makes the checkpoint not intact, in one line, instead of an AttributeError in the
    resume's scan of the checkpoints."""
    from flowgrpo.checkpoints.health import incomplete, is_healthy

    folder = tmp_path / "epoch_0"
    folder.mkdir()
    (folder / "rng.pt").write_bytes(b"1234")
    for files in ([["rng.pt", 4]], {"rng.pt": "4"}, None):
        (folder / "state.json").write_text(json.dumps({"epoch": 0, "lr_scheduler": {}, "sampler": {}, "files": files}))
        why = incomplete(folder)
        assert why == "its state.json's 'files' is not a mapping of file names to sizes in bytes", files
        assert not is_healthy(folder)
    (folder / "state.json").write_text(json.dumps({"epoch": 0, "lr_scheduler": {}, "sampler": {},
                                                   "files": {"rng.pt": 4}}))
    assert incomplete(folder) is None and is_healthy(folder)
