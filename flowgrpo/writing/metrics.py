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

from flowgrpo.writing.outputs import append_text

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

    def pending(self, epoch: int) -> dict[str, float]:
        """The record :meth:`commit` would write now (NaN as None)."""
        return {"epoch": epoch, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                   for k, v in sorted(self.current.items())}}

    def commit(self, epoch: int) -> dict[str, float]:
        """Write the epoch's record and start a new one; returns the record."""
        record = self.pending(epoch)
        self.current = {}
        if self.main:
            append_text(self.path, json.dumps(record) + "\n")  # a hard-linked copy keeps its content
            if self.accelerator is not None and self.accelerator.trackers:
                self.accelerator.log({k: v for k, v in record.items() if v is not None and k != "epoch"},
                                     step=epoch)
        return record


def _clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration in seconds."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def epoch_line(record: dict, epoch: int, num_epochs: int, elapsed: float, eta: float, *,
               advantages: bool = True) -> str:
    """The console line of one epoch, from its ``metrics.jsonl`` record::

        epoch 5/80 · 0:31 elapsed · ETA 7:44 · reward 0.612 ± 0.301 · trained 100% of samples, 100% of steps
        · later clip 0.031 kl 1.2e-06

    ``epoch`` is 0-based (shown 1-based); ``elapsed`` and ``eta`` in seconds. The ``reward`` is the composed
    reward's mean ± population std over the epoch's B samples; ``trained`` the samples whose advantage is used
    (``adv/kept_frac``; in brackets the share with a learning signal, ``adv/learning_frac``, when it is smaller: a
    group of equal rewards has none; only with ``advantages``, for an objective that trains on them) and the
    share of the trajectory's transitions a trained sample trains (``plan/trained_frac``, a merged jump counting the
    grid steps it spans); ``later clip`` and
    ``kl`` the clip fraction and approximate KL (½·mean Δlog p²) of the off-policy optimizer steps
    (``policy_later/*``: the first step of an epoch is on-policy, its ratio exactly 1); ``kl_ref`` when a KL
    penalty is on; ``first-update mismatch`` only when ``policy/logprob_mismatch_max`` is not 0 (the training
    layout differs from the rollout's and old log-probs were not recomputed)."""
    parts = [f"epoch {epoch + 1}/{num_epochs}", f"{_clock(elapsed)} elapsed", f"ETA {_clock(eta)}"]
    mean, std = record.get("reward/total/mean"), record.get("reward/total/std")
    if mean is not None:
        parts.append(f"reward {mean:.4g} ± {std:.3g}" if std is not None else f"reward {mean:.4g}")
    kept, steps = record.get("adv/kept_frac"), record.get("plan/trained_frac")
    if kept is not None:  # "of steps" only from a chunker's plan (the forward objectives train no transitions)
        signal = record.get("adv/learning_frac")
        note = (f" ({signal:.0%} with a learning signal)" if advantages and signal is not None and signal < kept
                else "")
        parts.append(f"trained {kept:.0%} of samples{note}" + (f", {steps:.0%} of steps" if steps is not None else ""))
    if record.get("policy_later/clipfrac") is not None:
        parts.append(f"later clip {record['policy_later/clipfrac']:.3g} kl {record['policy_later/approx_kl']:.2g}")
    if record.get("policy/kl_ref"):
        parts.append(f"kl_ref {record['policy/kl_ref']:.2g}")
    if record.get("policy/logprob_mismatch_max"):
        parts.append(f"first-update mismatch {record['policy/logprob_mismatch_max']:.2g}")
    return " · ".join(parts)


def read_metrics(path: str | Path, *, quiet: bool = False) -> list[dict]:
    """The records of a ``metrics.jsonl`` (``[]`` when it does not exist), each a JSON object with an integer
    ``epoch``. A last line that does not parse is the record of a run killed while appending it: it is dropped, with
    a warning naming the file (none with ``quiet``: a resume warns once, in its preflight, and the run folder's
    copy is rewritten without it, :meth:`flowgrpo.training.run_folder.RunFolder.claim`).

    Raises:
        ValueError: any other line is not a JSON object with an integer ``epoch``: one line naming the file, the
            line number and the fix.
    """
    p = Path(path)
    if not p.exists():
        return []
    lines = [(i, line) for i, line in enumerate(p.read_text().splitlines(), 1) if line.strip()]
    records = []
    for n, (i, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError as err:
            if n == len(lines) - 1:
                if not quiet:
                    logger.warning("%s: its last line (line %d) is cut off (the run was killed while writing it): "
                                   "dropped, the records before it kept", p, i)
                break
            raise ValueError(f"{p}:{i}: not a JSON record ({err}); every line of metrics.jsonl is one epoch's "
                             "record: delete or repair that line (the checkpoints do not need it)") from None
        if not isinstance(record, dict) or not isinstance(record.get("epoch"), int):
            raise ValueError(f"{p}:{i}: not a metrics record (a JSON object with an integer 'epoch'); delete or "
                             "repair that line (the checkpoints do not need it)")
        records.append(record)
    return records
