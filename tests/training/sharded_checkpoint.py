"""``torchrun … tests/training/sharded_checkpoint.py ROOT JOB [JOB …]``, and the same parts in one process: a small
block model, AdamW, an EMA and an old copy (the forward-process objectives' state), sharded with FSDP2 when run
under torchrun, and the checkpoint jobs of ``tests/training/test_sharded_checkpoint.py``:

* ``step NAME``: one deterministic AdamW step (the same input on every process), then ``save_checkpoint`` to
  ``ROOT/NAME`` and the gathered state (whole tensors, through ``full_state_dict``: a path independent of the
  checkpoint's) to ``ROOT/NAME.expected.safetensors`` by the main process;
* ``resume SRC NAME``: ``load_checkpoint`` of ``ROOT/SRC`` into a fresh model, the gathered state after the load to
  ``ROOT/NAME.loaded.safetensors``, then ``step NAME``;
* ``fsdp2`` (one process): the later jobs shard the model on a one-process group (another mesh than two
  processes').

Each process writes ``ROOT/reads_<rank>.json``: the checkpoint files it opened with ``safetensors`` or
``torch.load`` (the whole-tensor files a process must not read when it only needs its shards).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flowgrpo import parallel  # noqa: E402 - after the path set-up
from flowgrpo.algo.objectives.nft import NFTConfig  # noqa: E402
from flowgrpo.algo.objectives.old_copy import OldCopy  # noqa: E402
from flowgrpo.checkpoints import save_load
from flowgrpo.checkpoints.state_dicts import full_tensor, optimizer_state, trainable_state  # noqa: E402
from flowgrpo.data.prompts import GroupSampler  # noqa: E402
from flowgrpo.distributed import dist
from flowgrpo.training.ema import EMA  # noqa: E402

READS: list[str] = []


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, 2 * width)
        self.b = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(torch.nn.Module):
    """Three blocks of width 128 (800 kB of float32 weights: a checkpoint file's per-tensor overhead is small
    beside each process's half) and an output layer."""

    _no_split_modules = ["Block"]

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(3))
        self.out = torch.nn.Linear(width, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Objective:
    """The part of a forward-process objective a checkpoint holds: its old copy."""

    def __init__(self, params) -> None:
        self.old = OldCopy(params, NFTConfig(decay_ramp=0.25, decay_cap=0.5))

    def state_dict(self):
        return self.old.state_dict()

    def load_state_dict(self, state):
        self.old.load_state_dict(state)


def parts(sharded: bool):
    torch.manual_seed(0)
    model = Net()
    if sharded:
        parallel.shard(model, mesh=parallel.device_mesh(torch.device("cpu")), param_dtype=None, reshard=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, GroupSampler(10, 2, 0), EMA(params, 0.5), Objective(params)


def step(model, opt, sched, ema, objective) -> None:
    x = torch.linspace(-1, 1, 5 * 128).reshape(5, 128)
    model(x).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    ema.update()
    objective.old.update(int(sched.last_epoch))


def gathered(model, opt, ema, objective) -> dict[str, torch.Tensor]:
    """Every tensor of the state, whole (``full_state_dict`` gathering; the EMA and old copy by ``full_tensor``)."""
    out = {f"model.{k}": v for k, v in trainable_state(model).items()}
    osd = optimizer_state(model, opt)
    out |= {f"optim.{k}.{m}": v for k, s in osd.get("state", {}).items() for m, v in s.items()}
    out |= {k: full_tensor(v).detach().cpu() for k, v in ema.state_dict().items()}
    out |= {k: full_tensor(v).detach().cpu() for k, v in objective.state_dict().items()}
    return {k: v.contiguous().float().reshape(v.shape) for k, v in out.items()}


def save_gathered(path: Path, state: dict) -> None:
    from safetensors.torch import save_file

    if dist.rank() == 0:
        save_file(state, path)
    dist.barrier()


def run_step(root: Path, name: str, model, opt, sched, sampler, ema, objective) -> None:
    step(model, opt, sched, ema, objective)
    save_load.save_checkpoint(root / name, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler,
                               ema=ema, objective=objective)
    save_gathered(root / f"{name}.expected.safetensors", gathered(model, opt, ema, objective))


def record_reads() -> None:
    """Note every file opened by ``safetensors.torch.load_file`` or ``torch.load`` (in READS)."""
    import safetensors.torch

    real_load_file, real_load = safetensors.torch.load_file, torch.load

    def load_file(path, *args, **kwargs):
        READS.append(Path(path).name)
        return real_load_file(path, *args, **kwargs)

    def load(f, *args, **kwargs):
        READS.append(Path(f).name if isinstance(f, str | os.PathLike) else type(f).__name__)
        return real_load(f, *args, **kwargs)

    save_load.load_file = load_file
    torch.load = load


def main(root: Path, jobs: list[str]) -> None:
    sharded = "WORLD_SIZE" in os.environ
    if sharded:
        torch.distributed.init_process_group("gloo")
    record_reads()
    own_group = False
    while jobs:
        kind = jobs.pop(0)
        if kind == "fsdp2":
            sharded = own_group = True
            continue
        model, opt, sched, sampler, ema, objective = parts(sharded)
        if kind == "resume":
            src = jobs.pop(0)
            save_load.load_checkpoint(root / src, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler,
                                       ema=ema, objective=objective)
            save_gathered(root / f"{jobs[0]}.loaded.safetensors", gathered(model, opt, ema, objective))
        run_step(root, jobs.pop(0), model, opt, sched, sampler, ema, objective)
    if "WORLD_SIZE" in os.environ:
        (root / f"reads_{dist.rank()}.json").write_text(json.dumps(READS))
        torch.distributed.destroy_process_group()
    elif own_group:
        dist.release_own_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
