"""``torchrun … tests/training/ledger_train.py CONFIG [CONFIG …]``: the training command
(``flowgrpo.runner.main``, the path ``flowgrpo/train.py`` runs) for each config in turn, in the same processes, with
the per-rank device-memory ledger of :mod:`device_ledger`. After each run every process writes
``<output_dir>/ledger_<global rank>.json``: its device peak and the phase of it, the most live bytes in each phase,
its host peak, the sizes a test compares them with: ``model_bytes`` (the transformer's parameters, whole),
``block_bytes`` (its largest FSDP2 unit's parameters, whole), and ``built_empty``: the pipeline components this
process built on the meta device instead of reading their weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_ledger  # noqa: E402 - after the path set-up
import torch  # noqa: E402

from flowgrpo import runner  # noqa: E402

LEDGER = device_ledger.DeviceLedger()
RUN: dict = {}


def _sizes(module) -> dict[str, int]:
    """Bytes of the module's parameters and of its largest block (FSDP2's unit), whole, in their dtypes."""
    from torch.distributed.tensor import DTensor

    def whole(params) -> int:
        return int(sum(p.numel() * p.element_size() for p in params))

    from torch.distributed.fsdp import FSDPModule

    module = getattr(module, "module", module)
    blocks = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    return {"model_bytes": whole(module.parameters()),
            "block_bytes": max((whole(b.parameters()) for b in blocks), default=0),
            "sharded": any(isinstance(p, DTensor) for p in module.parameters())}


def _recording_load(load):
    """The pipeline components this process built empty (parameters on the meta device) instead of reading."""
    def loaded(model, **kwargs):
        adapter = load(model, **kwargs)
        RUN["sizes"] = {"built_empty": sorted(n for n, m in adapter.pipe.components.items()
                                              if isinstance(m, torch.nn.Module)
                                              and any(p.is_meta for p in m.parameters()))}
        return adapter

    return loaded


def _recording(run):
    def recorded(config):
        RUN["config"] = config
        return run(config)

    return recorded


def _fit_then_size(fit):
    def sized(self):
        RUN["sizes"].update(_sizes(self.adapter.transformer))
        return fit(self)

    return sized


if __name__ == "__main__":
    import torch.distributed as td
    from accelerate.state import PartialState

    from flowgrpo.training.loop import Trainer

    runner._run = _recording(runner._run)
    runner.load_model_from_config = _recording_load(runner.load_model_from_config)
    device_ledger.install(LEDGER, lambda: RUN["config"])
    Trainer.fit = _fit_then_size(Trainer.fit)
    configs = sys.argv[1:]
    if len(configs) > 1:  # keep the process group for every run (as tests/training/sharded_train.py)
        PartialState.destroy_process_group = lambda self, group=None: None
    for config in configs:
        LEDGER.reset()
        runner.main([config])
        LEDGER.phase("end")
        device_ledger.write_report(LEDGER, RUN["config"].output_dir, RUN.get("sizes"))
    if len(configs) > 1 and td.is_initialized():
        td.destroy_process_group()
