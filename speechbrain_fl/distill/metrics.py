"""Collapse-aware classification metrics with speaker-level bootstrap intervals.

For DP-direct and the student of the Private-Gender recipe: accuracy, balanced accuracy,
macro-F1, per-class recall, **MajPred** (the share of test predictions equal to D_priv's
majority class: 1 means the model collapsed to it) and the share of the most-predicted class.
The class set is fixed (``classes``), so a class never predicted still counts (recall 0, F1 0).
Every metric is a function of the K x K confusion matrix; a bootstrap replicate's matrix is a
sum of per-speaker matrices drawn with replacement (speakers are the resampling unit), computed
with :func:`speechbrain_fl.metrics.resampling.speaker_bootstrap`, and the formulas of
:mod:`speechbrain_fl.metrics.classification`. Written here rather than in
``speechbrain_fl.metrics`` because the shared ``bootstrap_classification`` infers the classes
from the data and has no MajPred.

Example
-------
>>> r = collapse_report(speakers=["a", "b", "c", "d"], labels=[0, 0, 1, 2],
...                     predictions=[0, 0, 0, 0], classes=["m", "f", "o"], majority_class=0,
...                     num_resamples=200)
>>> r["majpred"]["value"], r["accuracy"]["value"], round(r["balanced_accuracy"]["value"], 3)
(1.0, 0.5, 0.333)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from speechbrain_fl.metrics.classification import accuracy, balanced_accuracy, macro_f1
from speechbrain_fl.metrics.resampling import check_bootstrap_settings, speaker_bootstrap

__all__ = ["METRICS", "collapse_report", "confusion_matrix"]

METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "majpred", "top_share")


def confusion_matrix(labels, predictions, num_classes: int) -> np.ndarray:
    """(K, K) counts, rows = true class."""
    labels, predictions = np.asarray(labels, int), np.asarray(predictions, int)
    return np.bincount(labels * num_classes + predictions, minlength=num_classes**2).reshape(
        num_classes, num_classes
    )


def _metrics(confusion: np.ndarray, majority: int) -> dict[str, np.ndarray]:
    total = confusion.sum(axis=(-2, -1))
    predicted = confusion.sum(axis=-2)  # (..., K) column sums
    return {
        "accuracy": accuracy(confusion),
        "balanced_accuracy": balanced_accuracy(confusion),
        "macro_f1": macro_f1(confusion),  # a true class never predicted: F1 = 0
        "majpred": predicted[..., majority] / total,
        "top_share": predicted.max(axis=-1) / total,
    }


def _recall(confusion: np.ndarray) -> np.ndarray:
    support = confusion.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(support > 0, np.diagonal(confusion, axis1=-2, axis2=-1) / support, np.nan)


def collapse_report(
    *,
    speakers: Sequence[str],
    labels: Sequence[int],
    predictions: Sequence[int],
    classes: Sequence[str],
    majority_class: int,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> dict:
    """Metrics of :data:`METRICS` and per-class recall, each ``{"value", "ci": [lo, hi]}``.

    Arguments
    ---------
    speakers : sequence of str
        Speaker of each test record (resampling unit).
    labels, predictions : sequences of int
        Class indices into ``classes``.
    classes : sequence of str
        Class names (fixed class set).
    majority_class : int
        Index of D_priv's majority class (for MajPred).
    num_resamples, confidence, seed :
        Bootstrap settings (seed: of the resampling only; the CI is not a privacy mechanism).

    Returns
    -------
    dict
        ``{metric: {"value", "ci"}}`` plus ``"per_class_recall": {class: {"value", "ci"}}``,
        ``"predicted_share": {class: share}``, ``"confusion"`` (list of lists) and ``"n"``.
    """
    check_bootstrap_settings(num_resamples, confidence)
    k, n = len(classes), len(labels)
    if n == 0:
        raise ValueError("no test records: cannot compute metrics")
    if len(speakers) != n or len(predictions) != n:
        raise ValueError(
            f"speakers, labels, predictions differ in length: "
            f"{len(speakers)}, {n}, {len(predictions)}"
        )
    if not 0 <= majority_class < k:
        raise ValueError(f"majority_class {majority_class} outside [0, {k})")
    true, pred = np.asarray(labels, int), np.asarray(predictions, int)
    for name, values in (("labels", true), ("predictions", pred)):
        if values.min() < 0 or values.max() >= k:
            raise ValueError(f"{name} outside [0, {k}) for classes {list(classes)}")
    names, spk = np.unique(np.asarray([str(s) for s in speakers]), return_inverse=True)
    per_speaker = np.bincount((spk * k + true) * k + pred, minlength=names.size * k * k)
    per_speaker = per_speaker.reshape(names.size, k * k).astype(np.float64)
    total = per_speaker.sum(axis=0).reshape(k, k)

    def statistic(sums: np.ndarray) -> np.ndarray:  # (k*k, n) column sums -> (metrics, n)
        confusion = np.moveaxis(sums, 0, -1).reshape(*sums.shape[1:], k, k)
        values = _metrics(confusion, majority_class)
        return np.concatenate(
            [np.stack([values[name] for name in METRICS]), np.moveaxis(_recall(confusion), -1, 0)]
        )

    with warnings.catch_warnings():  # a replicate without a class has NaN recall: dropped below
        warnings.simplefilter("ignore")
        boot = speaker_bootstrap(
            per_speaker, statistic, num_resamples=num_resamples, confidence=confidence, seed=seed
        )
    replicates = np.asarray(boot.replicates).reshape(len(METRICS) + k, -1)
    point, recall = _metrics(total, majority_class), _recall(total)

    def interval(row: np.ndarray) -> list[float]:
        values = row[np.isfinite(row)]
        if not values.size:
            return [np.nan, np.nan]
        low, high = np.quantile(values, [(1 - confidence) / 2, (1 + confidence) / 2])
        return [float(low), float(high)]

    out: dict = {}
    for i, name in enumerate(METRICS):
        out[name] = {"value": float(point[name]), "ci": interval(replicates[i])}
    out["per_class_recall"] = {
        cls: {"value": float(recall[c]), "ci": interval(replicates[len(METRICS) + c])}
        for c, cls in enumerate(classes)
    }
    out["predicted_share"] = {cls: float(total[:, c].sum() / n) for c, cls in enumerate(classes)}
    out["confusion"] = total.astype(int).tolist()
    out["n"] = int(n)
    return out
