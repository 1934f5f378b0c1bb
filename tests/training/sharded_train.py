"""``torchrun … tests/training/sharded_train.py CONFIG [CONFIG …]``: the training command (``flowgrpo.runner.run``)
for each config in turn, in the same processes (one start of the processes, several runs), each followed by a report
of every process, ``<output_dir>/process_<global rank>.json``:

* ``rank``, ``local_rank``, ``main``: the process's global and local rank, and whether it was the main process;
* ``transformer`` and ``reference``: [elements this process holds, elements of the whole module] of the trained
  transformer and of the frozen reference copy (full fine-tuning with KL), so a test sees whether they are
  sharded;
* ``optimizer_trains_model``: whether every parameter the optimizer steps is a parameter of the prepared module;
* ``bytes``: what this process holds of the transformer's weights, the optimizer state, the reference and the EMA;
* ``packs``: per update, this process's real (not filler) transformer calls of each optimizer step;
* ``scored``: the images :class:`tests.training.smooth_reward.MeanRed` scored in this process during the run
  (rollouts and evaluations; None when the run has no such reward);
* ``loaded``: whether this process read the transformer's weights at start (``read``) or built it on the meta
  device to receive its shards (``empty``), and whether the full fine-tune's reference was built on the meta
  device (``reference_on_meta``; None without a reference).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flowgrpo import runner  # noqa: E402 - after the path set-up
from flowgrpo.algo.objectives import sde_ratio  # noqa: E402
from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.distributed import dist
from flowgrpo.models import lora  # noqa: E402
from flowgrpo.models.quiet import quiet_libraries  # noqa: E402
from flowgrpo.training.loop import Trainer  # noqa: E402

PACKS: list[list[int]] = []
LOADED: dict = {}


def _recording_loader(load):
    def loaded(model, **kwargs):
        adapter = load(model, **kwargs)
        empty = any(p.is_meta for p in adapter.transformer.parameters())
        LOADED["transformer"] = "empty" if empty else "read"
        return adapter

    return loaded


def _recording_setup(setup):
    def done(adapter, **kwargs):
        params = setup(adapter, **kwargs)
        ref = adapter.frozen_reference
        LOADED["reference_on_meta"] = None if ref is None else all(p.is_meta for p in ref.parameters())
        return params

    return done


def _elements(module) -> list[int] | None:
    """[elements held by this process, elements of the whole module]; None for no module."""
    if module is None:
        return None
    from torch.distributed.tensor import DTensor

    module = getattr(module, "module", module)  # a ComputeIn wrapper
    params = list(module.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return [int(local), int(sum(p.numel() for p in params))]


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return int(sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors))


def _bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes this process holds of the transformer's weights, the optimizer state, the reference and the EMA."""
    ref = trainer.adapter.frozen_reference
    ref = getattr(ref, "module", ref)
    optim = trainer.optim
    state = [v for s in optim.optimizer.state.values() for v in s.values() if getattr(v, "dim", lambda: 0)() > 0]
    return {"weights": _local_bytes(trainer.adapter.transformer.parameters()), "optimizer": _local_bytes(state),
            "reference": 0 if ref is None else _local_bytes(ref.parameters()),
            "ema": 0 if optim.ema is None else _local_bytes(optim.ema.shadow)}


def _counting_schedule(schedule):
    def counted(*args, **kwargs):
        steps = schedule(*args, **kwargs)
        PACKS.append([len(s.work) - s.padding for s in steps])
        return steps

    return counted


def _scored() -> int | None:
    """The images MeanRed scored since the last report (then reset); None when it was never imported."""
    module = sys.modules.get("tests.training.smooth_reward")
    if module is None:
        return None
    count, module.SCORED[0] = module.SCORED[0], 0
    return count


def _report(trainer: Trainer) -> dict:
    model_params = {id(p) for p in trainer.optim.model.parameters()}
    trained = [p for g in trainer.optim.optimizer.param_groups for p in g["params"]]
    return {"rank": dist.rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "main": bool(trainer.main),
            "transformer": _elements(trainer.adapter.transformer),
            "reference": _elements(trainer.adapter.frozen_reference),
            "optimizer_trains_model": bool(trained) and all(id(p) in model_params for p in trained),
            "bytes": _bytes(trainer),
            "packs": list(PACKS), "scored": _scored(), "loaded": dict(LOADED)}


def write_report(folder: Path, trainer: Trainer) -> None:
    """``folder/process_<global rank>.json`` (the module docstring's fields)."""
    (folder / f"process_{dist.rank()}.json").write_text(json.dumps(_report(trainer)))


if __name__ == "__main__":
    import torch.distributed
    from accelerate.state import PartialState

    # accelerate's end_training destroys the process group, and a later Accelerator of the same process would
    # not make another: each later run would train alone. Keep it for all runs; destroy it after the last.
    PartialState.destroy_process_group = lambda self, group=None: None
    sde_ratio.schedule = _counting_schedule(sde_ratio.schedule)
    runner.load_model_from_config = _recording_loader(runner.load_model_from_config)
    lora.setup_trainable = _recording_setup(lora.setup_trainable)  # what runner's make_trainable calls
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    quiet_libraries()
    for path in sys.argv[1:]:
        PACKS.clear()
        LOADED.clear()
        config = load_config(path)
        runner.run(config)
        assert dist.world_size() == int(os.environ["WORLD_SIZE"]), "the run did not use every process"
        write_report(Path(config.output_dir), runner._TRAINER)
    torch.distributed.destroy_process_group()
