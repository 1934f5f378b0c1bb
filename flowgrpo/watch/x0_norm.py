"""The rollout's x₀ norm and a warning on its sustained drift.

DiffusionNFT's release logs ``x0_norm``, the mean of x₀² over the rollout's final clean latents, and its maximum.
Its users report the norm drifting up while the images brighten and the reward stays flat (DiffusionNFT issue #47),
and runs that stay at the base model or turn to noise (#22); docs/training.md, "Watching the x₀ norm", says what to
look at. Here every objective's rollout logs (:func:`x0_norm_metrics`):

* ``rollout/x0_norm``: the mean over the epoch's B samples (all processes) of each sample's mean x₀² over its latent
  elements (the final latents the model decodes, in the model's latent units: a unit-variance latent space gives
  about 1);
* ``rollout/x0_norm_max``: the largest of the B per-sample means.

:class:`X0NormWatch` compares the mean of ``rollout/x0_norm`` over the last ``window`` epochs with its mean over the
run's first ``window`` epochs (the baseline) and returns one warning line when the ratio leaves
[1 / (1 + ``drift``), 1 + ``drift``] (``logging.x0_norm_window``, default 5 epochs, and ``logging.x0_norm_drift``,
default 0.25); it warns again only after the ratio came back inside.
"""

from __future__ import annotations

import torch

from flowgrpo.distributed import dist
from flowgrpo.records import FinalSamples, Trajectory

KEY = "rollout/x0_norm"
MAX_KEY = "rollout/x0_norm_max"


def final_latents(record: FinalSamples | Trajectory) -> torch.Tensor:
    """The (B, …) final clean latents of a rollout record: a forward-process rollout's ``x0``, a trajectory's last
    latents ``latents[:, -1]`` (σ = 0). Raises ``ValueError`` for another record."""
    if isinstance(record, FinalSamples):
        return record.x0
    if isinstance(record, Trajectory):
        return record.latents[:, -1]
    raise ValueError(f"x0 norm: expected a FinalSamples or a Trajectory rollout record, got {type(record).__name__}")


def x0_norm_metrics(record: FinalSamples | Trajectory) -> dict[str, float]:
    """``rollout/x0_norm`` and ``rollout/x0_norm_max`` of a rollout record (module docstring), over the samples of
    every process (a collective: every process calls it). Computed in float64 from the float32 latents."""
    x0 = final_latents(record)
    per_sample = x0.detach().double().reshape(x0.shape[0], -1).pow(2).mean(dim=1)  # (B_local,)
    every = dist.gather_cat(per_sample)
    return {KEY: float(every.mean()), MAX_KEY: float(every.max())}


class X0NormWatch:
    """Watches ``rollout/x0_norm`` over the epochs for a sustained drift (module docstring).

    Args:
        window: epochs in the baseline (the run's first ``window`` epochs with the figure) and in the recent mean
            (the last ``window``); an integer >= 1.
        drift: the allowed relative change f > 0: a recent mean above (1 + f) × baseline, or below
            baseline / (1 + f), is a drift.
        history: the run's earlier epoch records (a resumed run's ``metrics.jsonl``), in any order.

    Raises:
        ValueError: a window below 1 or a drift not above 0.
    """

    def __init__(self, window: int = 5, drift: float = 0.25, history: list[dict] = ()) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"x0 norm window must be an integer >= 1, got {window!r}")
        if not drift > 0:
            raise ValueError(f"x0 norm drift must be > 0, got {drift!r}")
        self.window, self.drift = window, float(drift)
        self.values: dict[int, float] = {}
        self.drifting = False
        for r in sorted(history, key=lambda r: r.get("epoch", 0)):
            self.observe(r)

    def observe(self, record: dict) -> str | None:
        """Take an epoch record (``epoch`` 0-based and ``rollout/x0_norm``; a record without the figure is
        skipped). Returns the warning line when this epoch starts a drift (the recent and the baseline windows
        both full and apart), else None."""
        value = record.get(KEY)
        if value is None or "epoch" not in record:
            return None
        self.values[int(record["epoch"])] = float(value)
        epochs = sorted(self.values)
        if len(epochs) < 2 * self.window:
            return None
        baseline = sum(self.values[e] for e in epochs[:self.window]) / self.window
        recent = sum(self.values[e] for e in epochs[-self.window:]) / self.window
        ratio = recent / baseline if baseline > 0 else float("inf")
        was, self.drifting = self.drifting, not 1 / (1 + self.drift) <= ratio <= 1 + self.drift
        if not self.drifting or was:
            return None
        way = "up" if ratio > 1 else "down"
        return (f"epoch {epochs[-1] + 1}: the rollout's x0 norm (mean x0^2 of the final latents) drifted {way}: "
                f"{recent:.4g} over the last {self.window} epochs against {baseline:.4g} over the first "
                f"{self.window} (x{ratio:.3g}, allowed x{1 / (1 + self.drift):.3g}-x{1 + self.drift:.3g}); with a "
                "flat reward this is DiffusionNFT #47 (brightening images) or #22 (noise): see docs/training.md, "
                "'Watching the x0 norm'")
