"""One metrics sink: ``metrics.jsonl`` (one JSON object per epoch), the console, and accelerate's trackers
(tensorboard, wandb). Core code hands metrics here and never calls a tracker directly."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

logger = logging.getLogger(__name__)


class MetricsSink:
    """Collects namespaced scalars (``reward/<name>/mean``, ``policy/clipfrac``, ``timing/<phase>``) per epoch.

    Args:
        path: the ``metrics.jsonl`` file (appended; only the main process writes).
        accelerator: an ``accelerate.Accelerator`` whose trackers receive the same scalars, or None.
        main_process: whether this process writes.
    """

    def __init__(self, path: str | Path, accelerator=None, main_process: bool = True) -> None:
        self.path = Path(path)
        self.accelerator = accelerator
        self.main = main_process
        self.current: dict[str, float] = {}

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the phase's wall seconds to ``timing/<phase>`` and its peak memory to ``memory/<phase>_peak_gb``
        (the accelerator's allocated peak on CUDA; the process's resident set at the phase's end on CPU)."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}"
            self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() if cuda else psutil.Process().memory_info().rss
            mkey = f"memory/{phase}_peak_gb"
            self.current[mkey] = max(self.current.get(mkey, 0.0), peak / 2**30)

    def log(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.current[k] = float(v)

    def commit(self, epoch: int) -> dict[str, float]:
        """Write the epoch's record and start a new one; returns the record."""
        record = {"epoch": epoch, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                     for k, v in sorted(self.current.items())}}
        self.current = {}
        if self.main:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.accelerator is not None and self.accelerator.trackers:
                self.accelerator.log({k: v for k, v in record.items() if v is not None and k != "epoch"},
                                     step=epoch)
            brief = {k: record[k] for k in ("reward/total/mean", "policy/clipfrac", "policy/approx_kl")
                     if record.get(k) is not None}
            logger.info("epoch %d %s", epoch, " ".join(f"{k}={v:.4g}" for k, v in brief.items()))
        return record


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
