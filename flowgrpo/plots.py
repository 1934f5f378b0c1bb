"""Pictures for the run folder: the reward curve, captioned sample grids and the before/after comparison
(matplotlib, Agg backend)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

CAPTION_CHARS = 22  # characters per caption line at font size 6 under a 1.6-inch-wide image
CAPTION_LINES = 3


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: element i is the mean of ``values[max(0, i − window + 1) : i + 1]``."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def reward_curve_figure(records: list[dict]):
    """One panel per optimised reward component (``reward/<name>/mean``; ``total`` only when there are several
    components, since with one it is the same curve) with the per-epoch value and a smoothed line (trailing mean
    over √(epochs) epochs), then one panel per evaluation figure (``eval/<name>/mean`` and whole-set figures such
    as ``eval/correctness``; per-group figures ``eval/<group>/<figure>`` and real-data figures left out), as
    points. Returns the matplotlib figure."""
    comps = sorted({k.split("/")[1] for r in records for k in r
                    if k.startswith("reward/") and k.endswith("/mean") and r[k] is not None} - {"total"})
    if len(comps) > 1:
        comps.append("total")
    evals = sorted({k for r in records for k in r if k.startswith("eval/") and not k.endswith("_real")
                    and (k.endswith("/mean") or k.count("/") == 1)})
    panels = [f"reward/{c}/mean" for c in comps] + evals
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 3.4), squeeze=False,
                             layout="constrained")
    for ax, key in zip(axes.flat, panels, strict=False):
        pts = [(r["epoch"], r[key]) for r in records if r.get(key) is not None]
        if key.startswith("eval/"):
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color="C1")
            ax.set_title(f"evaluation: {key.removeprefix('eval/').removesuffix('/mean')}", fontsize=9)
        else:
            if pts:
                xs, ys = (list(v) for v in zip(*pts, strict=True))
                ax.plot(xs, ys, color="C0", alpha=0.3, label="per epoch")
                ax.plot(xs, smooth(ys, max(1, round(len(ys) ** 0.5))), color="C0", label="smoothed")
                ax.legend(fontsize=7)
            ax.set_title(f"reward: {key.split('/')[1]}", fontsize=9)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    return fig


def reward_curve(records: list[dict], path: str | Path) -> None:
    """Save :func:`reward_curve_figure` of the ``metrics.jsonl`` records to ``path`` (PNG)."""
    _save(reward_curve_figure(records), Path(path))


def _wrap(caption: str) -> str:
    lines = []
    for part in caption.split("\n"):
        lines += textwrap.wrap(part, CAPTION_CHARS) or [""]
    if len(lines) > CAPTION_LINES:
        lines = lines[:CAPTION_LINES]
        lines[-1] = lines[-1][: CAPTION_CHARS - 1] + "…"
    return "\n".join(lines)


def video_stills(videos: torch.Tensor, max_frames: int = 4) -> torch.Tensor:
    """(N, 3, H, k·W): up to ``max_frames`` frames of each video (N, F, 3, H, W), evenly spaced from the first to
    the last, side by side in time order; images (N, 3, H, W) are returned unchanged."""
    if videos.ndim != 5:
        return videos
    f = videos.shape[1]
    idx = torch.linspace(0, f - 1, min(f, max_frames)).round().long()
    strip = videos[:, idx]  # (N, k, 3, H, W)
    n, k, c, h, w = strip.shape
    return strip.permute(0, 2, 3, 1, 4).reshape(n, c, h, k * w)


def sample_grid_figure(images: torch.Tensor, captions: list[str], ncols: int = 8, title: str | None = None,
                       footer: list[str] | None = None, alerts: list[bool] | None = None):
    """A grid of (N, 3, H, W) images in [0, 1] (videos (N, F, 3, H, W): a strip of frames each,
    :func:`video_stills`), each captioned below (wrapped to at most three lines of :data:`CAPTION_CHARS`
    characters, so captions never run into each other), and an optional ``footer`` row of text panels, one per
    column (red where ``alerts`` says so). Returns the matplotlib figure."""
    images = video_stills(images)
    n = images.shape[0]
    ncols = max(1, min(ncols, n))
    nrows = (n + ncols - 1) // ncols + (1 if footer else 0)
    fig, axes = plt.subplots(nrows, ncols, figsize=(1.6 * ncols, 2.1 * nrows), squeeze=False,
                             layout="constrained")
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).clamp(0, 1).cpu().numpy())
            ax.text(0.5, -0.03, _wrap(captions[i]), transform=ax.transAxes, ha="center", va="top", fontsize=6)
    if footer:
        alerts = alerts or [False] * len(footer)
        for ax, text, alert in zip(axes[-1], footer, alerts, strict=False):
            ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=7,
                    color="red" if alert else "black")
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def sample_grid(images: torch.Tensor, captions: list[str], path: str | Path, ncols: int = 8,
                title: str | None = None, footer: list[str] | None = None, alerts: list[bool] | None = None) -> None:
    """Save :func:`sample_grid_figure` to ``path`` (PNG)."""
    _save(sample_grid_figure(images, captions, ncols, title, footer, alerts), Path(path))


def before_after(img_before: torch.Tensor, img_after: torch.Tensor, captions: list[str], path: str | Path,
                 footer: list[str] | None = None, alerts: list[bool] | None = None, k: int = 20) -> None:
    """``before_after.png``: the first ``k`` evaluation images before (top rows) and after (next rows), ten a
    row, and an optional last row of text panels, one per column (a task's per-group figures, when its
    evaluation set cycles the groups so that column g shows group g; ``alerts`` marks panels drawn in red)."""
    k = min(k, img_before.shape[0])
    sample_grid(torch.cat([img_before[:k], img_after[:k]]),
                [f"before: {c}" for c in captions[:k]] + [f"after: {c}" for c in captions[:k]], path,
                ncols=10, title="ODE samples before (top) / after (below), same seeds", footer=footer or None,
                alerts=alerts)


def edits_before_after(sources: list[torch.Tensor], img_before: torch.Tensor, img_after: torch.Tensor,
                       captions: list[str], path: str | Path) -> None:
    """``before_after.png`` of an editing or image-to-video run: one column per prompt (at most ``len(sources)``),
    its source image ((H', W', 3) uint8, resized to the generated size) on top of the images before and after
    training; videos (N, F, 3, H, W) are shown as strips of frames (:func:`video_stills`), the source at the
    strip's left on white."""
    k = min(len(sources), img_before.shape[0])
    size = tuple(img_before.shape[-2:])
    src = torch.cat([
        torch.nn.functional.interpolate(s.permute(2, 0, 1).unsqueeze(0).float() / 255, size=size, mode="bilinear",
                                        antialias=True, align_corners=False)
        for s in sources[:k]
    ]).clamp(0, 1)
    img_before, img_after = video_stills(img_before[:k]), video_stills(img_after[:k])
    src = torch.nn.functional.pad(src, (0, img_before.shape[-1] - src.shape[-1]), value=1.0)
    sample_grid(torch.cat([src, img_before, img_after]),
                [f"source: {c}" for c in captions[:k]] + [f"before: {c}" for c in captions[:k]]
                + [f"after: {c}" for c in captions[:k]], path, ncols=k,
                title="edits: source (top), before training, after training")
