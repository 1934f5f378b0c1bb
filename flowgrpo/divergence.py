"""When a run has diverged: the rule that keeps a diverging run from writing checkpoints, and its one-line stop.

A checkpoint is written only from healthy weights, because writing one rotates an older one out
(``logging.checkpoints_total_limit``): a diverging run must not replace its good checkpoints with bad ones. The run
is **healthy** after an epoch when

1. every metric of the epoch's update (``policy/*``, ``policy_later/*``, ``train/lr``) is finite: a NaN or
   infinite loss statistic, ratio or gradient norm means the update itself broke;
2. no KL figure of the epoch rose far above the run's own history: it is flagged when it exceeds both its floor
   (:data:`RISE_FLOORS`) and :data:`RISE_FACTOR` (1000) times the largest value of that figure in the run's
   earlier epochs (those of ``metrics.jsonl`` before this run's first epoch included, so a resumed run is judged
   against the run it continues); with no earlier value, when it exceeds ``RISE_FACTOR`` times its floor. The
   floors lie far beyond what a trust region of these losses allows (clip ranges ~1e-4): ``approx_kl``
   (½·mean Δlog p² per step) 1e-2, i.e. per-step log-ratios of ~0.14 per latent dim; ``kl_ref`` (the KL to the
   reference per latent dim, which grows over a healthy run) 1.0;
3. and, when a checkpoint is about to be written, every trained parameter (and EMA weight) is finite.

A run that breaks the rule stops at once with :class:`TrainingDiverged`: one line naming the figure, its value,
the epoch (1-based, as the console's epoch lines) and the last healthy checkpoint, which is left as it is. A
non-finite gradient norm stops the run the same way, before the optimizer step (the weights are not updated).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from flowgrpo import dist

RISE_FACTOR = 1e3
#: per KL figure, the value below which it is never flagged (rule 2)
RISE_FLOORS = {"policy/kl_ref": 1.0, "policy_later/kl_ref": 1.0, "policy/approx_kl": 1e-2,
               "policy_later/approx_kl": 1e-2}
KL_FIGURES = tuple(RISE_FLOORS)
_UPDATE_PREFIXES = ("policy/", "policy_later/", "train/lr")


class TrainingDiverged(FloatingPointError):
    """The run stopped because its update diverged; the message is one line (the training command prints it
    without a traceback)."""


def last_checkpoint(checkpoints: str | Path) -> str:
    """What the stop line says about the checkpoints: the one ``latest`` names, or that none was written yet."""
    pointer = Path(checkpoints) / "latest"
    if pointer.is_file():
        return f"the last checkpoint, {Path(checkpoints) / pointer.read_text().strip()}, is intact"
    return "no checkpoint was written yet"


def stop_line(epoch: int, num_epochs: int, what: str, checkpoints: str | Path) -> str:
    """``epoch E/N: <what>; <last checkpoint>. …`` with ``epoch`` 0-based (shown 1-based, as the epoch lines)."""
    return (f"epoch {epoch + 1}/{num_epochs}: the run diverged: {what}; {last_checkpoint(checkpoints)}. Resume "
            "from a healthy checkpoint with a lower train.lr (or a larger algo.kl_beta)")


class DivergenceWatch:
    """Rules 1 and 2 of the module docstring over a run's epoch records.

    Args:
        history: the run's earlier epoch records (``metrics.jsonl``), whose KL figures set the baseline.
    """

    def __init__(self, history: list[dict] = ()) -> None:
        self.largest: dict[str, float] = {}
        for record in history:
            self.update(record)

    def update(self, record: dict) -> None:
        """Add a healthy epoch's KL figures to the baseline."""
        for key in KL_FIGURES:
            v = record.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                self.largest[key] = max(v, self.largest.get(key, v))

    def flag(self, record: dict) -> str | None:
        """What makes the epoch's ``record`` unhealthy (the figure, its value and the baseline), or None."""
        for key, v in record.items():
            if key.startswith(_UPDATE_PREFIXES) and isinstance(v, float) and not math.isfinite(v):
                return f"{key} = {v}"
        for key in KL_FIGURES:
            v = record.get(key)
            if not isinstance(v, int | float):
                continue
            before = self.largest.get(key)
            floor = RISE_FLOORS[key]
            limit = RISE_FACTOR * floor if before is None else max(floor, RISE_FACTOR * before)
            if v > limit:
                seen = "no earlier epoch" if before is None else f"at most {before:.3g} in the earlier epochs"
                return f"{key} = {v:.3g} ({seen}; the limit is {limit:.3g})"
        return None

    def check(self, record: dict, epoch: int, num_epochs: int, checkpoints: str | Path) -> None:
        """Raise :class:`TrainingDiverged` when ``record`` (epoch ``epoch``, 0-based) is unhealthy, else add it to
        the baseline. Every process holds the same records, so every process stops together."""
        what = self.flag(record)
        if what is not None:
            raise TrainingDiverged(stop_line(epoch, num_epochs, what, checkpoints))
        self.update(record)


def check_weights(named: list[tuple[str, torch.Tensor]], epoch: int, num_epochs: int,
                  checkpoints: str | Path) -> None:
    """Rule 3: raise :class:`TrainingDiverged` naming the first tensor of ``named`` (name, tensor) that holds a
    NaN or infinite value, and how many it holds; one read per device the tensors live on, and one collective, so
    every process stops together (a sharded model holds different values on each)."""
    from torch.distributed.tensor import DTensor

    named = [(n, t.to_local() if isinstance(t, DTensor) else t) for n, t in named]  # this process's shards
    counts = [0] * len(named)
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, n in zip(idx, torch.stack([(~torch.isfinite(named[i][1].detach())).sum() for i in idx]).tolist(),
                        strict=True):
            counts[i] = n
    first = next((i for i, n in enumerate(counts) if n), None)
    bad = "" if first is None else (f"{counts[first]} of the {named[first][1].numel()} values of the trained weight "
                                    f"{named[first][0]} are NaN or infinite")
    flagged = dist.all_reduce_max(torch.tensor([float(bool(bad))], dtype=torch.float64))
    if float(flagged[0]):
        raise TrainingDiverged(stop_line(epoch, num_epochs, bad or "another process holds non-finite weights",
                                         checkpoints) + "; no checkpoint was written from these weights")


def run_history(out: str | Path, resume_from: str | None, epoch: int) -> list[dict]:
    """The epoch records before ``epoch`` (0-based) of the run a trainer continues: ``out/metrics.jsonl``, else
    (a resume into a new folder) the ``metrics.jsonl`` of the checkpoint's run folder; none for a fresh run."""
    from flowgrpo.checkpoint import resolve_checkpoint
    from flowgrpo.metrics import read_metrics

    if not resume_from or epoch == 0:
        return []
    for folder in (Path(out), resolve_checkpoint(resume_from).parent.parent):
        records = [r for r in read_metrics(folder / "metrics.jsonl") if r.get("epoch", epoch) < epoch]
        if records:
            return records
    return []
