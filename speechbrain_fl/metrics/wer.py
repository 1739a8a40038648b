"""Corpus WER with speaker-level percentile bootstrap intervals, single and paired.

The corpus WER is a ratio of sums, ``WER = sum_u e_u / sum_u r_u`` (``e_u`` edits and ``r_u``
reference words of utterance ``u``). With per-speaker totals ``E_s`` and ``R_s`` and the count
matrix ``N`` (``N[b, s]`` = how often speaker ``s`` is drawn in replicate ``b``), the replicates
are ``WER*_b = (N @ E)_b / (N @ R)_b`` (resampling in ``speechbrain_fl/metrics/resampling.py``).
The paired version draws the *same* speakers for both systems and bootstraps
``WER_A - WER_B``; Bisani & Ney's "probability of improvement" is reported as well.

SpeechBrain computes the WER itself (``ErrorRateStats``, the source of the per-utterance counts,
see ``speechbrain_fl/metrics/utterances.py``) but has no resampling. WERs in this module are
fractions (0.1657), as in the paper's tables, not the percentages that
``ErrorRateStats.summarize()`` prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speechbrain_fl.metrics.resampling import (
    DEFAULT_NUM_RESAMPLES,
    check_bootstrap_settings,
    check_counts,
    speaker_bootstrap,
    speaker_totals,
)


def corpus_wer(*, num_edits, num_ref_tokens) -> float:
    """Corpus WER = sum(num_edits) / sum(num_ref_tokens) (a fraction, not a percentage).

    Example
    -------
    >>> corpus_wer(num_edits=[1, 2], num_ref_tokens=[10, 10])
    0.15
    """
    edits = check_counts("num_edits", num_edits)
    refs = check_counts("num_ref_tokens", num_ref_tokens, edits.shape[0])
    total = refs.sum()
    if total <= 0:
        raise ValueError("num_ref_tokens sum to 0: the WER is undefined")
    return float(edits.sum() / total)


def _check_speaker_refs(names: np.ndarray, refs: np.ndarray, label: str) -> None:
    empty = np.flatnonzero(refs <= 0)
    if empty.size:
        raise ValueError(
            f"speaker {str(names[empty[0]])!r} has no reference words in {label}: a replicate "
            "drawing only such speakers would have an undefined WER"
        )


def _wer_totals(speakers, *, edits: dict, refs: dict) -> tuple[np.ndarray, np.ndarray]:
    """Speaker names and the (S x 2n) totals ``[E_1, R_1, E_2, R_2, ...]`` of n systems."""
    names, totals = speaker_totals(speakers=speakers, **edits, **refs)
    for key in refs:
        _check_speaker_refs(names, totals[key], key)
    columns = [totals[key] for pair in zip(edits, refs, strict=True) for key in pair]
    return names, np.stack(columns, axis=1)


def _ratio(sums: np.ndarray) -> np.ndarray:
    return sums[0] / sums[1]


def _difference(sums: np.ndarray) -> np.ndarray:
    return sums[0] / sums[1] - sums[2] / sums[3]


def _single(speakers, num_edits, num_ref_tokens, *, num_resamples, confidence, seed):
    names, totals = _wer_totals(
        speakers, edits={"num_edits": num_edits}, refs={"num_ref_tokens": num_ref_tokens}
    )
    boot = speaker_bootstrap(
        totals, _ratio, num_resamples=num_resamples, confidence=confidence, seed=seed
    )
    return names, totals, boot


def _paired(speakers, edits_a, edits_b, refs_a, refs_b, *, num_resamples, confidence, seed):
    names, totals = _wer_totals(
        speakers,
        edits={"num_edits_a": edits_a, "num_edits_b": edits_b},
        refs={"num_ref_tokens": refs_a, "num_ref_tokens_b": refs_b},
    )
    boot = speaker_bootstrap(
        totals, _difference, num_resamples=num_resamples, confidence=confidence, seed=seed
    )
    return names, totals, boot


def wer_replicates(
    *,
    speakers: Sequence[str],
    num_edits,
    num_ref_tokens,
    num_edits_b=None,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    seed: int | None = 0,
) -> np.ndarray:
    """The B bootstrap replicates behind :func:`bootstrap_wer` (or, with ``num_edits_b``,
    the paired differences ``WER*_A - WER*_B`` behind :func:`paired_bootstrap_wer`).

    Same seed, same draws: the percentiles of this array are the reported interval.

    Example
    -------
    >>> r = wer_replicates(speakers=["a", "b"], num_edits=[0, 1], num_ref_tokens=[1, 1],
    ...                    num_resamples=8)
    >>> sorted(set(r.tolist())) <= [0.0, 0.5, 1.0]
    True
    """
    options = dict(num_resamples=num_resamples, confidence=0.5, seed=seed)
    if num_edits_b is None:
        return _single(speakers, num_edits, num_ref_tokens, **options)[2].replicates
    return _paired(speakers, num_edits, num_edits_b, num_ref_tokens, num_ref_tokens, **options)[
        2
    ].replicates


@dataclass(frozen=True)
class WERInterval:
    """A corpus WER and its speaker-level percentile bootstrap interval."""

    wer: float
    ci_low: float
    ci_high: float
    confidence: float
    num_resamples: int
    num_speakers: int
    num_utterances: int

    @property
    def ci_key(self) -> str:
        """``"WER_ci95"`` for a 95% interval (the ``results.json`` key)."""
        return f"WER_ci{round(self.confidence * 100):d}"

    def to_dict(self) -> dict[str, object]:
        """``{"WER", "WER_ci95": [lo, hi], "num_speakers", "num_utterances"}``."""
        return {
            "WER": self.wer,
            self.ci_key: [self.ci_low, self.ci_high],
            "num_speakers": self.num_speakers,
            "num_utterances": self.num_utterances,
        }


def bootstrap_wer(
    *,
    speakers: Sequence[str],
    num_edits,
    num_ref_tokens,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> WERInterval:
    """Corpus WER with a speaker-level percentile bootstrap interval (Bisani & Ney, 2004).

    Arguments
    ---------
    speakers : sequence of str
        Speaker of each utterance; all utterances of a drawn speaker are kept together.
    num_edits : array-like
        Edits per utterance.
    num_ref_tokens : array-like
        Reference words per utterance.
    num_resamples : int
        B, the number of bootstrap replicates (the paper uses 10,000).
    confidence : float
        Coverage of the interval (0.95 gives the 2.5th and 97.5th percentiles).
    seed : int or None
        Seed of the resampling generator; ``None`` draws one from the OS. The default 0 makes a
        reported interval reproducible.

    Returns
    -------
    WERInterval

    Example
    -------
    >>> ci = bootstrap_wer(speakers=["a", "a", "b", "c"], num_edits=[1, 0, 2, 1],
    ...                    num_ref_tokens=[5, 5, 10, 10], num_resamples=2000, seed=0)
    >>> round(ci.wer, 3), ci.ci_low <= ci.wer <= ci.ci_high
    (0.133, True)
    """
    check_bootstrap_settings(num_resamples, confidence)
    names, totals, boot = _single(
        speakers,
        num_edits,
        num_ref_tokens,
        num_resamples=num_resamples,
        confidence=confidence,
        seed=seed,
    )
    return WERInterval(
        wer=float(totals[:, 0].sum() / totals[:, 1].sum()),
        ci_low=boot.ci_low,
        ci_high=boot.ci_high,
        confidence=confidence,
        num_resamples=int(num_resamples),
        num_speakers=int(names.size),
        num_utterances=len(speakers),
    )


@dataclass(frozen=True)
class PairedWERComparison:
    """Paired speaker-level bootstrap of ``WER_A - WER_B`` on the same utterances.

    ``p_value`` is the two-sided bootstrap fraction ``2 * min(P*(d <= 0), P*(d >= 0))`` (capped
    at 1), and ``prob_a_better`` Bisani & Ney's probability of improvement ``P*(d < 0)``, i.e.
    the fraction of replicates in which A has the lower WER. Both are bootstrap estimates, not
    exact tests.
    """

    wer_a: float
    wer_b: float
    difference: float
    ci_low: float
    ci_high: float
    p_value: float
    prob_a_better: float
    confidence: float
    num_resamples: int
    num_speakers: int
    num_utterances: int

    @property
    def significant(self) -> bool:
        """True when the interval of the difference excludes 0."""
        return self.ci_low > 0.0 or self.ci_high < 0.0

    def to_dict(self) -> dict[str, object]:
        """All fields plus ``significant``, JSON-ready."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["significant"] = self.significant
        return out


def paired_bootstrap_wer(
    *,
    speakers: Sequence[str],
    num_edits_a,
    num_edits_b,
    num_ref_tokens,
    num_ref_tokens_b=None,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> PairedWERComparison:
    """Paired speaker-level percentile bootstrap of the WER difference of two systems.

    Each replicate draws one set of speakers (with replacement) and evaluates both systems on
    it, so the between-speaker variance common to both cancels in ``WER*_A - WER*_B``.

    Arguments
    ---------
    speakers : sequence of str
        Speaker of each utterance (same utterances, same order, for both systems).
    num_edits_a, num_edits_b : array-like
        Edits per utterance of system A and B.
    num_ref_tokens : array-like
        Reference words per utterance (of A, and of B unless ``num_ref_tokens_b`` is given).
    num_ref_tokens_b : array-like, optional
        Reference words per utterance of B when its text normalisation differs.
    num_resamples : int
        B.
    confidence : float
        Coverage of the interval.
    seed : int or None
        Seed of the resampling generator.

    Returns
    -------
    PairedWERComparison

    Example
    -------
    >>> r = paired_bootstrap_wer(speakers=["a", "b", "c", "d"], num_edits_a=[1, 1, 2, 1],
    ...                          num_edits_b=[3, 4, 4, 3], num_ref_tokens=[10] * 4,
    ...                          num_resamples=1000)
    >>> round(r.difference, 3), r.significant
    (-0.225, True)
    """
    check_bootstrap_settings(num_resamples, confidence)
    names, totals, boot = _paired(
        speakers,
        num_edits_a,
        num_edits_b,
        num_ref_tokens,
        num_ref_tokens if num_ref_tokens_b is None else num_ref_tokens_b,
        num_resamples=num_resamples,
        confidence=confidence,
        seed=seed,
    )
    wer_a = float(totals[:, 0].sum() / totals[:, 1].sum())
    wer_b = float(totals[:, 2].sum() / totals[:, 3].sum())
    diffs = boot.replicates
    p_value = min(1.0, 2.0 * min(float(np.mean(diffs <= 0)), float(np.mean(diffs >= 0))))
    return PairedWERComparison(
        wer_a=wer_a,
        wer_b=wer_b,
        difference=wer_a - wer_b,
        ci_low=boot.ci_low,
        ci_high=boot.ci_high,
        p_value=p_value,
        prob_a_better=float(np.mean(diffs < 0)),
        confidence=confidence,
        num_resamples=int(num_resamples),
        num_speakers=int(names.size),
        num_utterances=len(speakers),
    )
