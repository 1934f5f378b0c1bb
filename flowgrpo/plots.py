"""Pictures for the run folder: the reward curve and captioned sample grids (matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def reward_curve(records: list[dict], path: str | Path) -> None:
    """Plot every ``reward/<name>/mean`` (and ``eval/…``) over epochs into ``path`` (PNG)."""
    keys = sorted({k for r in records for k in r if k.endswith("/mean") and k.startswith(("reward/", "eval/"))})
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in keys:
        pts = [(r["epoch"], r[k]) for r in records if r.get(k) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if k.startswith("eval/") else None, label=k)
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if keys:
        ax.legend(fontsize=7)
    _save(fig, Path(path))


def sample_grid(images: torch.Tensor, captions: list[str], path: str | Path, ncols: int = 8,
                title: str | None = None) -> None:
    """Save (N, 3, H, W) images in [0, 1] as a grid with one caption under each image."""
    n = images.shape[0]
    ncols = max(1, min(ncols, n))
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(1.6 * ncols, 1.9 * nrows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).clamp(0, 1).cpu().numpy())
            ax.set_title(captions[i], fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    _save(fig, Path(path))
