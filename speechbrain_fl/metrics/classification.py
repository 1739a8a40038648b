"""Classification metrics with speaker-level bootstrap intervals (for the SUPERB-style recipes).

Accuracy, balanced accuracy and macro-F1 are all functions of the confusion matrix, and the
confusion matrix of a bootstrap replicate is a sum of per-speaker confusion matrices: the
(S x K^2) per-speaker confusion counts go to the speaker-level bootstrap of
``speechbrain_fl/metrics/resampling.py`` and the metric formulas run vectorised on the (B, K, K)
resampled matrices. As for WER, speakers are the resampling unit (Bisani & Ney, 2004).

Classes are those present in the labels or predictions; in a replicate, a class with no true
example is left out of balanced accuracy, and one absent from both labels and predictions is
left out of macro-F1 (scikit-learn's behaviour when ``labels`` is inferred).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speechbrain_fl.metrics.resampling import (
    DEFAULT_NUM_RESAMPLES,
    check_bootstrap_settings,
    speaker_bootstrap,
)

METRICS = ("accuracy", "balanced_accuracy", "macro_f1")


def accuracy(confusion: np.ndarray) -> np.ndarray:
    """Trace / total of (..., K, K) confusion matrices (rows = true class)."""
    return np.trace(confusion, axis1=-2, axis2=-1) / confusion.sum(axis=(-2, -1))


def balanced_accuracy(confusion: np.ndarray) -> np.ndarray:
    """Mean per-class recall over classes with at least one true example."""
    support = confusion.sum(axis=-1)
    diagonal = np.diagonal(confusion, axis1=-2, axis2=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        recall = np.where(support > 0, diagonal / support, np.nan)
    return np.nanmean(recall, axis=-1)


def macro_f1(confusion: np.ndarray) -> np.ndarray:
    """Mean over classes of F1 = 2 TP / (2 TP + FP + FN), classes seen in labels or predictions."""
    tp = np.diagonal(confusion, axis1=-2, axis2=-1)
    denominator = confusion.sum(axis=-1) + confusion.sum(axis=-2)  # = 2 TP + FN + FP
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(denominator > 0, 2 * tp / denominator, np.nan)
    return np.nanmean(f1, axis=-1)


_FUNCTIONS = {"accuracy": accuracy, "balanced_accuracy": balanced_accuracy, "macro_f1": macro_f1}


def bootstrap_classification(
    *,
    speakers: Sequence[str],
    labels: Sequence,
    predictions: Sequence,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> dict[str, dict[str, object]]:
    """Accuracy, balanced accuracy and macro-F1 with speaker-level percentile intervals.

    Arguments
    ---------
    speakers : sequence of str
        Speaker of each example (the resampling unit).
    labels, predictions : sequences
        True and predicted class of each example (any hashable labels).
    num_resamples : int
        B.
    confidence : float
        Coverage of the intervals.
    seed : int or None
        Seed of the resampling generator.

    Returns
    -------
    dict
        ``{metric: {"value", "ci": [lo, hi]}}`` for each of :data:`METRICS`.

    Example
    -------
    >>> r = bootstrap_classification(speakers=["a", "a", "b", "c"], labels=[0, 1, 1, 0],
    ...                              predictions=[0, 1, 0, 0], num_resamples=200)
    >>> r["accuracy"]["value"], round(r["macro_f1"]["value"], 3)
    (0.75, 0.733)
    """
    check_bootstrap_settings(num_resamples, confidence)
    n = len(speakers)
    if n == 0:
        raise ValueError("no examples: cannot bootstrap an empty test set")
    if len(labels) != n or len(predictions) != n:
        raise ValueError(
            f"speakers, labels and predictions differ in length: "
            f"{n}, {len(labels)}, {len(predictions)}"
        )
    classes, codes = np.unique(
        np.concatenate([np.asarray(labels), np.asarray(predictions)]), return_inverse=True
    )
    true, pred = codes[:n], codes[n:]
    names, spk = np.unique(np.asarray([str(s) for s in speakers]), return_inverse=True)
    k, s = classes.size, names.size
    per_speaker = (
        np.bincount((spk * k + true) * k + pred, minlength=s * k * k)
        .reshape(s, k * k)
        .astype(np.float64)
    )
    total = per_speaker.sum(axis=0).reshape(k, k)

    def metrics(sums: np.ndarray) -> np.ndarray:  # (k*k, n) resampled confusion counts
        confusion = np.moveaxis(sums, 0, -1).reshape(*sums.shape[1:], k, k)
        return np.stack([_FUNCTIONS[name](confusion) for name in METRICS])

    boot = speaker_bootstrap(
        per_speaker, metrics, num_resamples=num_resamples, confidence=confidence, seed=seed
    )
    return {
        name: {
            "value": float(_FUNCTIONS[name](total)),
            "ci": [float(boot.ci_low[i]), float(boot.ci_high[i])],
        }
        for i, name in enumerate(METRICS)
    }
