"""Figures of the Private-Gender recipe, drawn like :mod:`speechbrain_fl.plots`' figures.

* :func:`plot_confusion`: a confusion matrix with counts and row-normalised shares
  (``plots/confusion_<model>.png``).
* :func:`plot_grad_norms`: histograms of per-sample gradient L2 norms with the clip ``C``
  (``plots/grad_norms_dsaf.png``, the DSAF diagnostic), titled with their coefficient of
  variation ``CV = std / mean``.

Both are drawn on ``matplotlib.figure.Figure`` objects (no pyplot, nothing global touched) and
saved by the package's save helper (:func:`speechbrain_fl.plots._save`: Agg canvas, 120 dpi,
tight bounding box), so every figure of the repository is written the same way.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from speechbrain_fl.plots import _save as save_figure

__all__ = ["plot_confusion", "plot_grad_norms"]


def plot_confusion(confusion, classes, path: str | os.PathLike, *, title: str) -> Path:
    """Confusion matrix: cell ``(i, j)`` = count of true ``i`` predicted ``j`` and its share
    of row ``i`` (``n_ij / sum_k n_ik``, the colour)."""
    cm = np.asarray(confusion, dtype=float)
    norm = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    fig = Figure(figsize=(4, 3.6), layout="tight")
    ax = fig.subplots()
    ax.imshow(norm, vmin=0, vmax=1, cmap="Blues")
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(
                j,
                i,
                f"{int(cm[i, j])}\n{norm[i, j]:.2f}",
                ha="center",
                va="center",
                color="white" if norm[i, j] > 0.5 else "black",
                fontsize=8,
            )
    ax.set_xticks(range(len(classes)), classes)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, integer_x=False)


def plot_grad_norms(norms: dict[str, np.ndarray], path: str | os.PathLike, *, clip: float) -> Path:
    """One histogram per entry of ``norms`` (name -> per-sample norms), ``C`` dashed."""
    fig = Figure(figsize=(4.2 * len(norms), 3.2), layout="tight")
    axes = fig.subplots(1, len(norms))
    for ax, (name, values) in zip(np.atleast_1d(axes), norms.items(), strict=True):
        cv = float(np.std(values) / np.mean(values))
        ax.hist(values, bins=40, color="tab:orange" if name.startswith("without") else "tab:blue")
        ax.axvline(clip, color="k", ls="--", lw=1, label=f"C = {clip:g}")
        ax.set_title(f"{name}: CV = {cv:.2f}", fontsize=9)
        ax.set_xlabel("per-sample gradient L2 norm")
        ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, integer_x=False)
