"""``torchrun … tests/training/mesh_train.py CONFIG [CONFIG …]``: the training command (``flowgrpo.runner.run``) for
each config in turn, in the same processes, each followed by ``<output_dir>/collectives_<global rank>.json``:

* ``reduce_scatter``: calls of ``torch.distributed.reduce_scatter_single`` (FSDP2 reduces each unit's gradients
  with one per backward that syncs), and ``reduce_scatter_ranks``, the group sizes they ran over;
* ``all_reduce``: calls of ``torch.distributed.all_reduce`` by group size (``{"2": n, …}``: HSDP's cross-replica
  reduction runs over the replica groups; clipping's norm and the metrics over every process);
* ``backward``: calls of ``Optimization.backward`` (one per pack), ``steps``: optimizer steps;
* ``units``: the FSDP2 modules of the trained transformer that hold trained parameters (each reduce-scatters once
  per syncing backward; LoRA leaves the root's embedders and norms untrained);
* ``mesh``: the device mesh's shape (replicate, shard, context) and the names of its dimensions;
* ``offload``: the FSDP2 offload policy of each unit of the trained transformer, by class name;
* ``encoders``: per text encoder of the pipeline, [elements this process holds, elements of the whole encoder].

The counters wrap the functions FSDP2 calls (``torch.distributed.<name>``, looked up at each call), so a count is
what went over the process group, not what our code meant to do.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed  # noqa: E402 - after the path set-up

from flowgrpo import parallel, runner  # noqa: E402
from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.distributed import dist
from flowgrpo.models.quiet import quiet_libraries  # noqa: E402
from flowgrpo.training import optim  # noqa: E402

COUNTS: Counter = Counter()


def _counted(name: str, fn):
    def call(*args, **kwargs):
        group = kwargs.get("group")
        size = torch.distributed.get_world_size(group) if group is not None else dist.world_size()
        COUNTS[name] += 1
        COUNTS[f"{name}@{size}"] += 1
        return fn(*args, **kwargs)

    return call


def _counted_method(name: str, fn):
    def call(self, *args, **kwargs):
        COUNTS[name] += 1
        return fn(self, *args, **kwargs)

    return call


def _units(model) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for m in model.modules() if isinstance(m, FSDPModule)
               and any(fp.sharded_param.requires_grad for g in m._get_fsdp_state()._fsdp_param_groups
                       for fp in g.fsdp_params))


def _elements(module) -> list[int]:
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return [int(local), int(sum(p.numel() for p in params))]


def _report(trainer) -> dict:
    from torch.distributed.fsdp import FSDPModule

    mesh = parallel.device_mesh(trainer.optim.accelerator.device, trainer.cfg.parallel)
    return {"reduce_scatter": COUNTS["reduce_scatter"],
            "reduce_scatter_ranks": sorted({int(k.split("@")[1]) for k in COUNTS if k.startswith("reduce_scatter@")}),
            "all_reduce": {k.split("@")[1]: v for k, v in COUNTS.items() if k.startswith("all_reduce@")},
            "backward": COUNTS["backward"], "steps": COUNTS["steps"],
            "units": _units(trainer.optim.model),
            "offload": sorted({type(g.offload_policy).__name__ for m in trainer.optim.model.modules()
                               if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups}),
            "encoders": {name: _elements(part) for name, part in trainer.adapter.pipe.components.items()
                         if parallel.is_encoder(name) and isinstance(part, torch.nn.Module)},
            "mesh": {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names)}}


if __name__ == "__main__":
    from accelerate.state import PartialState

    PartialState.destroy_process_group = lambda self, group=None: None  # keep the group for every run
    torch.distributed.reduce_scatter_single = _counted("reduce_scatter", torch.distributed.reduce_scatter_single)
    torch.distributed.all_reduce = _counted("all_reduce", torch.distributed.all_reduce)
    optim.Optimization.backward = _counted_method("backward", optim.Optimization.backward)
    optim.Optimization.step = _counted_method("steps", optim.Optimization.step)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    quiet_libraries()
    for path in sys.argv[1:]:
        COUNTS.clear()
        config = load_config(path)
        runner.run(config)
        folder = Path(config.output_dir)
        (folder / f"collectives_{dist.rank()}.json").write_text(json.dumps(_report(runner._TRAINER)))
    torch.distributed.destroy_process_group()
