"""When a run has diverged: the rule that keeps a diverging run from writing checkpoints, and its one-line stop.

A checkpoint is written only from healthy weights, because writing one rotates an older one out
(``logging.checkpoints_total_limit``): a diverging run must not replace its good checkpoints with bad ones. The run
is **healthy** after an epoch when

1. every metric of the epoch's update (``policy/*``, ``policy_later/*``, ``train/lr``, the forward-process
   objectives' ``objective/*``, the weights' ``health/*``) is finite: a NaN or infinite loss statistic, ratio or
   gradient norm means the update itself broke;
2. no KL figure of the epoch rose far above the run's own history: it is flagged when it exceeds both its floor
   (:data:`RISE_FLOORS`) and :data:`RISE_FACTOR` (1000) times the largest value of that figure in the run's
   earlier epochs (those of ``metrics.jsonl`` before this run's first epoch included, so a resumed run is judged
   against the run it continues); with no earlier value, when it exceeds ``RISE_FACTOR`` times its floor. The
   floors lie far beyond what a trust region of these losses allows (clip ranges ~1e-4): ``approx_kl``
   (½·mean Δlog p² per step) 1e-2, i.e. per-step log-ratios of ~0.14 per latent dim; ``kl_ref`` (the KL to the
   reference per latent dim, which grows over a healthy run; ``policy/``, ``policy_later/`` and the forward
   objectives' ``objective/kl_ref``) 1.0;
3. when a checkpoint is about to be written, every trained parameter (and EMA weight) is finite;
4. the new weights themselves look healthy (:class:`WeightHealth`), measured right after the update from the
   weights alone, so the rule holds when no later step of the epoch measures them (``optimizer_steps_per_epoch:
   1``): the norm of the trained weights grew at most :data:`GROWTH_LIMIT` (2)-fold in the epoch, and one
   transformer call on a fixed probe gives a finite velocity whose RMS is at most :data:`PROBE_FACTOR` (100)
   times that of the weights the run started from.

A run that breaks the rule stops at once with :class:`TrainingDiverged`: one line naming the figure, its value,
the epoch (1-based, as the console's epoch lines), the last healthy checkpoint, which is left as it is, and the
way out (a resume from it, or a new start when there is none). A non-finite gradient norm stops the run the same
way, before the optimizer step (the weights are not updated), and so do images with NaN or infinite values from a
rollout or an evaluation (weights that diverged past every check, or a checkpoint written by an older version);
the newest checkpoint, when it holds those weights, is then marked unhealthy
(:func:`flowgrpo.checkpoints.health.mark_unhealthy`), so that ``train.resume_from=auto`` skips it.

The collapse guard (:class:`CollapseWatch`) is a warning, not a stop: an evaluation figure that falls more than
``logging.collapse_fraction`` below the run's best; the best evaluated checkpoint is kept out of the rotation
(:func:`flowgrpo.checkpoints.health.rotation_victims`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from flowgrpo.distributed import dist

RISE_FACTOR = 1e3
#: per KL figure, the value below which it is never flagged (rule 2)
RISE_FLOORS = {"policy/kl_ref": 1.0, "policy_later/kl_ref": 1.0, "policy/approx_kl": 1e-2,
               "policy_later/approx_kl": 1e-2, "objective/kl_ref": 1.0}
KL_FIGURES = tuple(RISE_FLOORS)
_UPDATE_PREFIXES = ("policy/", "policy_later/", "train/lr", "objective/", "health/")


class TrainingDiverged(FloatingPointError):
    """The run stopped because its update diverged; the message is one line (the training command prints it
    without a traceback)."""


def last_checkpoint(checkpoints: str | Path) -> str:
    """What the stop line says about the checkpoints: the newest healthy one (the one ``latest`` names, never
    one marked unhealthy), or that none was written yet."""
    from flowgrpo.checkpoints.health import newest_healthy

    folder = newest_healthy(checkpoints)
    if folder is not None:
        return f"the last checkpoint, {folder}, is intact"
    return "no checkpoint was written yet"


def stop_line(epoch: int, num_epochs: int, what: str, checkpoints: str | Path) -> str:
    """``epoch E/N: <what>; <last checkpoint>. <the way out>`` with ``epoch`` 0-based (shown 1-based, as the
    epoch lines); the way out is a resume (``train.resume_from=auto`` picks the newest healthy checkpoint) when
    one was written, else a new run."""
    from flowgrpo.checkpoints.health import newest_healthy

    advice = ("Resume from it (train.resume_from=auto) with a lower train.lr (or a larger objective.kl_beta)"
              if newest_healthy(checkpoints) is not None else
              "Start it again with a lower train.lr (or a larger objective.kl_beta): train.resume_from=auto restarts a "
              "run that has no checkpoint")
    return f"epoch {epoch + 1}/{num_epochs}: the run diverged: {what}; {last_checkpoint(checkpoints)}. {advice}"


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
        return WeightHealth.flag(record)

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
    (a resume into a new folder) the ``metrics.jsonl`` of the checkpoint's run folder; none for a fresh run. Read
    quietly: the preflight read the same files before the model loaded and warned of a cut-off last line once
    (:func:`flowgrpo.preflight.check_output_dir`); this runs on every process."""
    from flowgrpo.checkpoints.health import resolve_checkpoint
    from flowgrpo.writing.metrics import read_metrics

    if not resume_from or epoch == 0:
        return []
    for folder in (Path(out), resolve_checkpoint(resume_from).parent.parent):
        records = [r for r in read_metrics(folder / "metrics.jsonl", quiet=True)
                   if r.get("epoch", epoch) < epoch]
        if records:
            return records
    return []


#: the probe's velocity may grow to this many times its size at the run's start before it is flagged (rule 4)
PROBE_FACTOR = 100.0
#: the trained weights' norm may grow by this factor in one epoch before it is flagged (rule 4)
GROWTH_LIMIT = 2.0
PROBE_SIGMA = 0.5


def _norm(params: list[torch.Tensor]) -> float:
    """The L2 norm of all of ``params`` together (a sharded DTensor's whole norm: a collective every process
    calls in the same order)."""
    from torch.distributed.tensor import DTensor

    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        n = torch.linalg.vector_norm(p.detach().float())
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.double().cpu() ** 2
    return float(sq.sqrt())


class WeightHealth:
    """Rule 4 of the module docstring: the new weights' own health after an update, measured from the weights
    alone, so it holds whether or not a later step of the same epoch measures them.

    * ``health/weight_growth``: ‖w after‖ / ‖w before‖ of the trained parameters over the epoch's update (one norm
      each side, no copy of the weights); flagged above :data:`GROWTH_LIMIT`. Adam moves every weight by about
      ``train.lr`` per step, so a runaway learning rate multiplies the norm (``train.lr=1000`` on the tiny model:
      ~10⁴), while a healthy epoch changes it by a few percent.
    * ``health/probe_rms``: the RMS of the velocity of the new trained weights on a fixed probe (the run's first
      training prompt, noise seeded by ``train.seed``, σ = 0.5, one transformer call without gradient); flagged
      when NaN or infinite, or above :data:`PROBE_FACTOR` times ``health/probe_rms_start`` (the probe of the
      weights the run started from, carried in every record so a resumed run keeps the first start's). A flow
      model's velocity ε − x₀ has an RMS of order one; a diverged one's is orders of magnitude larger or not
      finite.

    Args:
        adapter: the model adapter (its ``velocity`` runs the trained weights).
        params: the trained parameters (the prepared module's: a sharded model's DTensors).
        prompt, guidance_scale, seed: the probe's prompt, guidance and noise seed.
        start: ``health/probe_rms_start`` of the run this one continues (None: measured before the first update,
            from the weights the run starts from).
    """

    def __init__(self, adapter, params: list[torch.Tensor], *, prompt: str, metadata: dict, guidance_scale: float,
                 seed: int, start: float | None = None) -> None:
        self.adapter, self.params, self.guidance = adapter, params, guidance_scale
        self.prompt, self.metadata, self.seed = prompt, metadata, seed
        self.embeds = self.latents = None  # made on first use, where the model runs
        self.start = start
        self.before: float | None = None

    @torch.no_grad()
    def probe(self) -> float:
        """RMS of the trained weights' velocity on the probe (NaN or inf when the weights produce such)."""
        from flowgrpo.rng import make_generator
        from flowgrpo.sampling.rollout import encode_rows

        if self.latents is None:
            self.embeds = encode_rows(self.adapter, [self.prompt], [self.metadata])
            self.latents = self.adapter.initial_latents(1, [make_generator(self.seed, "health probe")])
        sigma = torch.full((1,), PROBE_SIGMA, device=self.latents.device)
        v = self.adapter.velocity(self.latents, sigma, self.embeds, self.guidance)
        return float(v.double().pow(2).mean().sqrt())

    def begin(self) -> None:
        """Call before the epoch's update: the norm of the weights it starts from (and, in the run's first epoch,
        the probe of the weights the run starts from)."""
        if self.start is None:
            self.start = self.probe()
        self.before = _norm(self.params)

    def measure(self) -> dict[str, float]:
        """After the update: the ``health/*`` figures of the epoch's record."""
        after = _norm(self.params)
        growth = after / self.before if self.before else (1.0 if after == 0 else math.inf)
        return {"health/weight_growth": growth, "health/probe_rms": self.probe(), "health/probe_rms_start": self.start}

    @staticmethod
    def flag(record: dict) -> str | None:
        """What rule 4 finds unhealthy in ``record`` (a finite check of these figures is rule 1's), or None."""
        growth = record.get("health/weight_growth")
        if isinstance(growth, float) and math.isfinite(growth) and growth > GROWTH_LIMIT:
            return (f"health/weight_growth = {growth:.3g} (the norm of the trained weights grew {growth:.3g}-fold in "
                    f"one epoch; the limit is {GROWTH_LIMIT:g})")
        rms, start = record.get("health/probe_rms"), record.get("health/probe_rms_start")
        if isinstance(rms, float) and isinstance(start, float) and math.isfinite(rms) and start > 0:
            if rms > PROBE_FACTOR * start:
                return (f"health/probe_rms = {rms:.3g} (the new weights' velocity on the fixed probe; "
                        f"{start:.3g} at the run's start, the limit is {PROBE_FACTOR * start:.3g})")
        return None


class CollapseWatch:
    """The collapse guard's warning: an evaluation figure that falls more than ``fraction`` below the best the run
    has reached (a collapse shows in no update figure and makes nothing NaN).

    Args:
        metric: the evaluation figure (``eval/...``, higher is better); None: nothing is watched.
        fraction: the relative fall, (best − value) / |best|, above which a warning is given (0: never).
        history: the run's earlier epoch records (``metrics.jsonl``), whose figures set the best.
        keep_best: ``logging.keep_best``; the warning says what is kept only when it is (and that the base model's
            best, "before training", is in no checkpoint).
    """

    def __init__(self, metric: str | None, fraction: float, history: list[dict] = (), keep_best: bool = True) -> None:
        self.metric, self.fraction, self.keep_best = metric, fraction, keep_best
        self.best: tuple[float, str] | None = None  # (value, where: "epoch N" or "before training")
        for record in history:
            self.observe(record, f"epoch {record.get('epoch', 0) + 1}")

    def observe(self, figures: dict, where: str) -> str | None:
        """Add the evaluation ``figures`` of ``where`` (``epoch N``, 1-based, or ``before training``); returns
        the warning when its figure fell more than ``fraction`` below the best so far, else None."""
        value = figures.get(self.metric) if self.metric else None
        if not isinstance(value, int | float) or not math.isfinite(value):
            return None
        warning = None
        if self.best is not None and self.fraction > 0:
            best, at = self.best
            fall = (best - value) / abs(best) if best else (math.inf if value < best else 0.0)
            if fall > self.fraction:
                warning = (f"{where}: {self.metric} = {value:.4g}, {100 * fall:.0f}% below its best, {best:.4g} at "
                           f"{at} (logging.collapse_fraction={self.fraction:g}): the policy may be collapsing; "
                           + ("the best evaluated checkpoint is kept out of the rotation (logging.keep_best)"
                              if self.keep_best else
                              "logging.keep_best is off: the rotation may remove the best evaluated checkpoint"))
                if at == "before training":
                    warning += ("; its best is the base model's, which no checkpoint holds: start again from the "
                                "base model with a lower train.lr")
        if self.best is None or value > self.best[0]:
            self.best = (float(value), where)
        return warning
