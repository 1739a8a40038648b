"""Speaker-level percentile bootstrap (Bisani & Ney, 2004) on top of ``scipy.stats.bootstrap``.

Utterances of one speaker are correlated, so the resampling unit is the *speaker*: a bootstrap
replicate draws ``S`` speakers with replacement out of the ``S`` test speakers and keeps all
utterances of every drawn speaker (the alpha-split paper, Section V: "speaker-level percentile
bootstrap, B = 10,000, 95% CI, with all utterances from each sampled speaker included").

Every metric here (WER, accuracy, F1, ...) is a function of *sums* of per-utterance counts, so
the utterances of each speaker are first summed into one row of per-speaker totals ``T`` (S x k).
A replicate is then the statistic of the column sums of ``S`` rows drawn with replacement. This is
``scipy.stats.bootstrap`` with the ``k`` columns as *paired* samples (one speaker draw shared by
every column), a *vectorised* statistic (one call per batch of replicates, no Python loop over
B) and the *percentile* interval: the ``(1 - c)/2`` and ``(1 + c)/2`` quantiles of the replicates.

The WER and classification modules (``speechbrain_fl/metrics/wer.py``,
``speechbrain_fl/metrics/classification.py``) only say which counts to sum and which statistic
to apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

DEFAULT_NUM_RESAMPLES = 10_000
# Entries of one batch of resampled totals (~32 MiB as float64): bounds memory for any B and S.
_BATCH_ENTRIES = 1 << 22


def check_counts(name: str, values, length: int | None = None) -> np.ndarray:
    """Return ``values`` as a 1-D float64 array of finite non-negative counts or raise.

    Example
    -------
    >>> check_counts("num_edits", [1, 2]).tolist()
    [1.0, 2.0]
    """
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if length is not None and array.shape[0] != length:
        raise ValueError(f"{name} has {array.shape[0]} entries, expected {length}")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {float(array[bad[0]])} is not a finite count >= 0")
    return array


def check_bootstrap_settings(num_resamples: int, confidence: float) -> None:
    """Raise ``ValueError`` unless B is a positive integer and the confidence is in (0, 1)."""
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, int | np.integer):
        raise ValueError(f"num_resamples must be an integer, got {num_resamples!r}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def speaker_totals(*, speakers: Sequence[str], **counts) -> tuple[np.ndarray, dict]:
    """Sum per-utterance counts per speaker.

    Arguments
    ---------
    speakers : sequence of str
        Speaker of each utterance.
    **counts : array-like
        Per-utterance counts, e.g. ``num_edits=..., num_ref_tokens=...``.

    Returns
    -------
    names : numpy.ndarray
        Sorted unique speaker names (length S).
    totals : dict
        For each keyword, an array of length S with the per-speaker sums.

    Example
    -------
    >>> names, t = speaker_totals(speakers=["b", "a", "b"], num_edits=[1, 2, 3])
    >>> names.tolist(), t["num_edits"].tolist()
    (['a', 'b'], [2.0, 4.0])
    """
    labels = np.asarray([str(s) for s in speakers])
    if labels.size == 0:
        raise ValueError("no utterances: cannot bootstrap an empty test set")
    names, inverse = np.unique(labels, return_inverse=True)
    totals = {
        key: np.bincount(
            inverse, weights=check_counts(key, values, labels.size), minlength=names.size
        )
        for key, values in counts.items()
    }
    return names, totals


@dataclass(frozen=True)
class SpeakerBootstrap:
    """Replicates and percentile interval of one speaker-level bootstrap.

    ``replicates`` has shape ``(B,)`` for a scalar statistic and ``(m, B)`` for ``m`` statistics
    computed together; ``ci_low`` and ``ci_high`` are floats or arrays of length ``m``.
    """

    replicates: np.ndarray
    ci_low: float | np.ndarray
    ci_high: float | np.ndarray


def speaker_bootstrap(
    totals: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> SpeakerBootstrap:
    """Speaker-level percentile bootstrap of ``statistic(column sums)``.

    Arguments
    ---------
    totals : numpy.ndarray
        (S x k) per-speaker totals (:func:`speaker_totals`), one row per speaker.
    statistic : callable
        Maps the resampled column sums, an array of shape ``(k, n)`` (``n`` replicates), to the
        statistic of each replicate, shape ``(n,)`` or ``(m, n)``; e.g. ``lambda s: s[0] / s[1]``
        for a ratio of sums.
    num_resamples : int
        B.
    confidence : float
        Coverage of the percentile interval.
    seed : int or None
        Seed of ``numpy.random.default_rng``; ``None`` draws one from the OS.

    Returns
    -------
    SpeakerBootstrap

    Notes
    -----
    Each replicate draws ``S`` speaker indices uniformly with replacement (``scipy.stats.bootstrap``
    with ``paired=True`` draws them once for all ``k`` columns), in batches of at most ~4M
    resampled entries. With a single speaker every replicate is the full set, so the interval
    is the point (scipy needs two observations; the answer is exact here).

    Example
    -------
    >>> t = np.array([[1.0, 10.0], [3.0, 10.0], [2.0, 10.0]])  # edits, words per speaker
    >>> b = speaker_bootstrap(t, lambda s: s[0] / s[1], num_resamples=500)
    >>> b.replicates.shape, b.ci_low <= 0.2 <= b.ci_high
    ((500,), True)
    """
    check_bootstrap_settings(num_resamples, confidence)
    totals = np.asarray(totals, dtype=np.float64)
    if totals.ndim != 2 or totals.shape[0] == 0:
        raise ValueError(
            f"totals must be a non-empty (speakers x counts) array, got {totals.shape}"
        )
    num_speakers, num_columns = totals.shape
    if num_speakers == 1:
        point = np.asarray(statistic(totals.T))
        replicates = np.repeat(point, num_resamples, axis=-1)
        low = high = point[..., 0] if point.ndim > 1 else float(point[0])
        return SpeakerBootstrap(replicates, low, high)

    def resampled(*columns, axis=-1):
        return statistic(np.stack([column.sum(axis=axis) for column in columns]))

    result = stats.bootstrap(
        tuple(totals.T),
        resampled,
        n_resamples=int(num_resamples),
        batch=max(1, _BATCH_ENTRIES // (num_speakers * num_columns)),
        vectorized=True,
        paired=True,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    if np.ndim(low) == 0:
        low, high = float(low), float(high)
    return SpeakerBootstrap(result.bootstrap_distribution, low, high)
