"""Speaker-level percentile bootstrap confidence intervals for WER (Bisani & Ney, 2004).

The corpus WER is a ratio of sums, ``WER = sum_u e_u / sum_u r_u`` (``e_u`` edits and ``r_u``
reference words of utterance ``u``). Utterances of one speaker are correlated, so the resampling
unit is the *speaker*: a bootstrap replicate draws ``S`` speakers with replacement out of the
``S`` test speakers and keeps all utterances of every drawn speaker (the alpha-split paper,
Section V: "speaker-level percentile bootstrap, B = 10,000, 95% CI, with all utterances from each
sampled speaker included"). With per-speaker totals ``E_s`` and ``R_s`` and the count matrix
``N`` (``N[b, s]`` = how often speaker ``s`` is drawn in replicate ``b``), the replicates are

    WER*_b = (N @ E)_b / (N @ R)_b,

computed as one matrix product per block of replicates (no Python loop over ``B``). The
percentile interval is the ``(1 - c)/2`` and ``(1 + c)/2`` quantiles of the ``WER*_b``. The paired
version draws the *same* speakers for both systems and bootstraps ``WER_A - WER_B`` (Bisani &
Ney's "probability of improvement" is reported as well).

Hand-written because SpeechBrain computes the WER itself (``ErrorRateStats``, used here as the
source of per-utterance counts) but has no resampling, and ``scipy.stats.bootstrap`` resamples
observations, not clusters, and would need one Python call per replicate for a ratio of sums.

Per-utterance details file
--------------------------
Every ASR run writes ``<output_folder>/test_utterances.csv`` with the columns
``ID,spk_id,language,num_edits,num_ref_tokens`` (one row per scored test utterance; ``language``
may be empty), written by :func:`write_utterance_details` and read back by
:func:`read_utterance_details`. ``recipes/MLS/compare.py`` pairs two such files by ``ID``.

WERs in this module are fractions (0.1657), as in the paper's tables, not the percentages that
``ErrorRateStats.summarize()`` prints.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

UTTERANCE_COLUMNS = ("ID", "spk_id", "language", "num_edits", "num_ref_tokens")
DEFAULT_NUM_RESAMPLES = 10_000
# Entries of one block of the (B x S) count matrix (~32 MiB as int64 or float64).
_BLOCK_ENTRIES = 1 << 22


def _count_array(name: str, values, length: int | None = None) -> np.ndarray:
    """Return ``values`` as a 1-D float64 array of finite non-negative counts or raise."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if length is not None and array.shape[0] != length:
        raise ValueError(f"{name} has {array.shape[0]} entries, expected {length}")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {float(array[bad[0]])} is not a finite count >= 0")
    return array


@dataclass(frozen=True)
class UtteranceErrors:
    """Per-utterance WER counts of one system on one test set.

    Arguments
    ---------
    ids : tuple of str
        Utterance IDs, unique.
    speakers : tuple of str
        Speaker of each utterance (the bootstrap's resampling unit).
    languages : tuple of str
        Language of each utterance, ``""`` where unknown.
    num_edits : numpy.ndarray
        Insertions + deletions + substitutions per utterance.
    num_ref_tokens : numpy.ndarray
        Reference words per utterance.

    Example
    -------
    >>> d = UtteranceErrors.from_rows([
    ...     {"ID": "u1", "spk_id": "s1", "language": "de", "num_edits": 1, "num_ref_tokens": 4},
    ...     {"ID": "u2", "spk_id": "s2", "language": "de", "num_edits": 0, "num_ref_tokens": 4},
    ... ])
    >>> d.wer
    0.125
    """

    ids: tuple[str, ...]
    speakers: tuple[str, ...]
    languages: tuple[str, ...]
    num_edits: np.ndarray
    num_ref_tokens: np.ndarray

    def __post_init__(self):
        n = len(self.ids)
        if len(self.speakers) != n or len(self.languages) != n:
            raise ValueError(
                f"ids, speakers and languages differ in length: "
                f"{n}, {len(self.speakers)}, {len(self.languages)}"
            )
        if len(set(self.ids)) != n:
            seen, dup = set(), None
            for key in self.ids:
                if key in seen:
                    dup = key
                    break
                seen.add(key)
            raise ValueError(f"utterance ID {dup!r} appears more than once")
        object.__setattr__(self, "num_edits", _count_array("num_edits", self.num_edits, n))
        object.__setattr__(
            self, "num_ref_tokens", _count_array("num_ref_tokens", self.num_ref_tokens, n)
        )

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, object]]) -> UtteranceErrors:
        """Build from mappings with the keys of :data:`UTTERANCE_COLUMNS`."""
        ids, speakers, languages, edits, refs = [], [], [], [], []
        for index, row in enumerate(rows):
            missing = [c for c in UTTERANCE_COLUMNS if c not in row and c != "language"]
            if missing:
                raise ValueError(f"row {index} lacks the key(s) {missing}")
            ids.append(str(row["ID"]))
            speakers.append(str(row["spk_id"]))
            languages.append(str(row.get("language") or ""))
            try:
                edits.append(float(row["num_edits"]))
                refs.append(float(row["num_ref_tokens"]))
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {index} (ID {row['ID']!r}): {err}") from err
        return cls(tuple(ids), tuple(speakers), tuple(languages), np.array(edits), np.array(refs))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def wer(self) -> float:
        """Corpus WER = sum of edits / sum of reference words."""
        return corpus_wer(num_edits=self.num_edits, num_ref_tokens=self.num_ref_tokens)

    def rows(self) -> list[dict[str, object]]:
        """One dict per utterance with the keys of :data:`UTTERANCE_COLUMNS`."""
        return [
            {
                "ID": key,
                "spk_id": spk,
                "language": lang,
                "num_edits": _as_number(e),
                "num_ref_tokens": _as_number(r),
            }
            for key, spk, lang, e, r in zip(
                self.ids,
                self.speakers,
                self.languages,
                self.num_edits,
                self.num_ref_tokens,
                strict=True,
            )
        ]

    def take(self, indices: Sequence[int] | np.ndarray) -> UtteranceErrors:
        """The utterances at ``indices``, in that order."""
        idx = np.asarray(indices, dtype=np.int64)
        return UtteranceErrors(
            tuple(self.ids[i] for i in idx),
            tuple(self.speakers[i] for i in idx),
            tuple(self.languages[i] for i in idx),
            self.num_edits[idx],
            self.num_ref_tokens[idx],
        )


def _as_number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def corpus_wer(*, num_edits, num_ref_tokens) -> float:
    """Corpus WER = sum(num_edits) / sum(num_ref_tokens) (a fraction, not a percentage).

    Example
    -------
    >>> corpus_wer(num_edits=[1, 2], num_ref_tokens=[10, 10])
    0.15
    """
    edits = _count_array("num_edits", num_edits)
    refs = _count_array("num_ref_tokens", num_ref_tokens, edits.shape[0])
    total = refs.sum()
    if total <= 0:
        raise ValueError("num_ref_tokens sum to 0: the WER is undefined")
    return float(edits.sum() / total)


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
            inverse, weights=_count_array(key, values, labels.size), minlength=names.size
        )
        for key, values in counts.items()
    }
    return names, totals


def resample_speaker_counts(
    num_speakers: int, *, num_resamples: int, rng: np.random.Generator
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield blocks of the (B x S) bootstrap count matrix.

    Row ``b`` counts how often each of the ``S`` speakers is drawn when ``S`` speakers are drawn
    uniformly with replacement (one multinomial(S, 1/S) vector per replicate, built from integer
    draws and ``bincount``). Blocks hold at most ~4M entries, so memory stays bounded for any B.

    Arguments
    ---------
    num_speakers : int
        S.
    num_resamples : int
        B.
    rng : numpy.random.Generator
        Source of the draws.

    Returns
    -------
    iterator of (int, numpy.ndarray)
        ``(first_row, counts)`` with ``counts`` of shape (rows, S), float64.

    Example
    -------
    >>> blocks = list(resample_speaker_counts(3, num_resamples=5, rng=np.random.default_rng(0)))
    >>> blocks[0][1].sum(axis=1).tolist()
    [3.0, 3.0, 3.0, 3.0, 3.0]
    """
    rows_per_block = max(1, _BLOCK_ENTRIES // num_speakers)
    for start in range(0, num_resamples, rows_per_block):
        rows = min(rows_per_block, num_resamples - start)
        draws = rng.integers(0, num_speakers, size=(rows, num_speakers))
        draws += (np.arange(rows) * num_speakers)[:, None]
        counts = np.bincount(draws.ravel(), minlength=rows * num_speakers)
        yield start, counts.reshape(rows, num_speakers).astype(np.float64)


def _resampled_sums(
    totals: np.ndarray, *, num_resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """(B x k) matrix of resampled sums N @ totals for a (S x k) matrix of speaker totals."""
    out = np.empty((num_resamples, totals.shape[1]))
    for start, counts in resample_speaker_counts(
        totals.shape[0], num_resamples=num_resamples, rng=rng
    ):
        out[start : start + counts.shape[0]] = counts @ totals
    return out


def check_bootstrap_settings(num_resamples: int, confidence: float) -> None:
    """Raise ``ValueError`` unless B is a positive integer and the confidence is in (0, 1)."""
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, int | np.integer):
        raise ValueError(f"num_resamples must be an integer, got {num_resamples!r}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def _check_speaker_refs(names: np.ndarray, refs: np.ndarray, label: str) -> None:
    empty = np.flatnonzero(refs <= 0)
    if empty.size:
        raise ValueError(
            f"speaker {str(names[empty[0]])!r} has no reference words in {label}: a replicate drawing "
            "only such speakers would have an undefined WER"
        )


def percentile_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """The ((1 - c) / 2, (1 + c) / 2) quantiles of bootstrap replicates (percentile method)."""
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


def _wer_replicates(speakers, num_edits, num_ref_tokens, *, num_resamples, seed):
    names, totals = speaker_totals(
        speakers=speakers, num_edits=num_edits, num_ref_tokens=num_ref_tokens
    )
    _check_speaker_refs(names, totals["num_ref_tokens"], "num_ref_tokens")
    matrix = np.stack([totals["num_edits"], totals["num_ref_tokens"]], axis=1)
    sums = _resampled_sums(matrix, num_resamples=num_resamples, rng=np.random.default_rng(seed))
    wer = float(matrix[:, 0].sum() / matrix[:, 1].sum())
    return names, sums[:, 0] / sums[:, 1], wer


def _difference_replicates(speakers, edits_a, edits_b, refs_a, refs_b, *, num_resamples, seed):
    names, totals = speaker_totals(
        speakers=speakers,
        num_edits_a=edits_a,
        num_edits_b=edits_b,
        num_ref_tokens=refs_a,
        num_ref_tokens_b=refs_b,
    )
    _check_speaker_refs(names, totals["num_ref_tokens"], "num_ref_tokens")
    _check_speaker_refs(names, totals["num_ref_tokens_b"], "num_ref_tokens_b")
    keys = ("num_edits_a", "num_ref_tokens", "num_edits_b", "num_ref_tokens_b")
    matrix = np.stack([totals[k] for k in keys], axis=1)
    sums = _resampled_sums(matrix, num_resamples=num_resamples, rng=np.random.default_rng(seed))
    diffs = sums[:, 0] / sums[:, 1] - sums[:, 2] / sums[:, 3]
    wer_a = float(matrix[:, 0].sum() / matrix[:, 1].sum())
    wer_b = float(matrix[:, 2].sum() / matrix[:, 3].sum())
    return names, diffs, wer_a, wer_b


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
    check_bootstrap_settings(num_resamples, 0.5)
    if num_edits_b is None:
        return _wer_replicates(
            speakers, num_edits, num_ref_tokens, num_resamples=num_resamples, seed=seed
        )[1]
    return _difference_replicates(
        speakers,
        num_edits,
        num_edits_b,
        num_ref_tokens,
        num_ref_tokens,
        num_resamples=num_resamples,
        seed=seed,
    )[1]


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
    names, replicates, wer = _wer_replicates(
        speakers, num_edits, num_ref_tokens, num_resamples=num_resamples, seed=seed
    )
    low, high = percentile_interval(replicates, confidence)
    return WERInterval(
        wer=wer,
        ci_low=low,
        ci_high=high,
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
    names, diffs, wer_a, wer_b = _difference_replicates(
        speakers,
        num_edits_a,
        num_edits_b,
        num_ref_tokens,
        num_ref_tokens if num_ref_tokens_b is None else num_ref_tokens_b,
        num_resamples=num_resamples,
        seed=seed,
    )
    low, high = percentile_interval(diffs, confidence)
    p_value = min(1.0, 2.0 * min(float(np.mean(diffs <= 0)), float(np.mean(diffs >= 0))))
    return PairedWERComparison(
        wer_a=wer_a,
        wer_b=wer_b,
        difference=wer_a - wer_b,
        ci_low=low,
        ci_high=high,
        p_value=p_value,
        prob_a_better=float(np.mean(diffs < 0)),
        confidence=confidence,
        num_resamples=int(num_resamples),
        num_speakers=int(names.size),
        num_utterances=len(speakers),
    )


def bootstrap_details(
    details: UtteranceErrors,
    *,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> WERInterval:
    """:func:`bootstrap_wer` on an :class:`UtteranceErrors`."""
    return bootstrap_wer(
        speakers=details.speakers,
        num_edits=details.num_edits,
        num_ref_tokens=details.num_ref_tokens,
        num_resamples=num_resamples,
        confidence=confidence,
        seed=seed,
    )


def wer_by_language(
    details: UtteranceErrors,
    *,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> dict[str, WERInterval]:
    """Per-language WER, each with its own speaker-level bootstrap interval.

    Utterances without a language (``""``) are left out. Each language gets an independent
    generator spawned from ``seed`` (``numpy.random.SeedSequence.spawn``).

    Example
    -------
    >>> d = UtteranceErrors(("1", "2", "3"), ("a", "b", "c"), ("de", "de", "fr"),
    ...                     np.array([1, 3, 2]), np.array([10, 10, 10]))
    >>> {k: round(v.wer, 2) for k, v in wer_by_language(d, num_resamples=100).items()}
    {'de': 0.2, 'fr': 0.2}
    """
    languages = sorted({lang for lang in details.languages if lang})
    seeds = np.random.SeedSequence(seed).spawn(len(languages))
    labels = np.asarray(details.languages)
    out = {}
    for lang, child in zip(languages, seeds, strict=True):
        subset = details.take(np.flatnonzero(labels == lang))
        out[lang] = bootstrap_details(
            subset,
            num_resamples=num_resamples,
            confidence=confidence,
            seed=child.generate_state(1)[0],
        )
    return out


def wer_report(
    details: UtteranceErrors,
    *,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> dict[str, object]:
    """The ``test`` section of ``results.json``: overall and per-language WER with intervals.

    Returns
    -------
    dict
        ``{"WER", "WER_ci95": [lo, hi], "num_speakers", "num_utterances", "num_resamples",
        "per_language": {lang: {"WER", "WER_ci95", "num_speakers", "num_utterances"}}}``.

    Example
    -------
    >>> d = UtteranceErrors(("1", "2"), ("a", "b"), ("de", "fr"), np.array([1, 3]),
    ...                     np.array([10, 10]))
    >>> sorted(wer_report(d, num_resamples=100)["per_language"])
    ['de', 'fr']
    """
    overall = bootstrap_details(
        details, num_resamples=num_resamples, confidence=confidence, seed=seed
    )
    report = overall.to_dict()
    report["num_resamples"] = int(num_resamples)
    report["per_language"] = {
        lang: interval.to_dict()
        for lang, interval in wer_by_language(
            details, num_resamples=num_resamples, confidence=confidence, seed=seed
        ).items()
    }
    return report


def utterance_errors_from_stats(
    stats,
    *,
    speaker_of: Mapping[str, str],
    language_of: Mapping[str, str] | None = None,
) -> UtteranceErrors:
    """Per-utterance counts from a SpeechBrain ``ErrorRateStats``.

    ``stats.scores`` (speechbrain 1.1) is a list of dicts from
    ``speechbrain.utils.edit_distance.wer_details_by_utterance`` with keys ``key``, ``scored``,
    ``num_edits``, ``num_ref_tokens``, ... Utterances with ``scored == False`` are left out, as
    ``wer_summary`` does, so the WER here equals ``stats.summarize("WER") / 100``.

    Arguments
    ---------
    stats : speechbrain.utils.metric_stats.ErrorRateStats
        Filled by ``append`` during evaluation.
    speaker_of : mapping
        Utterance ID -> speaker ID (e.g. the test manifest's ``spk_id`` column).
    language_of : mapping, optional
        Utterance ID -> language.

    Returns
    -------
    UtteranceErrors

    Example
    -------
    >>> from speechbrain.utils.metric_stats import ErrorRateStats
    >>> s = ErrorRateStats()
    >>> s.append(ids=["u1", "u2"], predict=[["a", "b"], ["c"]], target=[["a", "x"], ["c"]])
    >>> d = utterance_errors_from_stats(s, speaker_of={"u1": "s1", "u2": "s2"})
    >>> round(d.wer, 6) == round(s.summarize("WER") / 100, 6)
    True
    """
    scores = getattr(stats, "scores", None)
    if scores is None:
        raise TypeError(f"expected an ErrorRateStats with .scores, got {type(stats).__name__}")
    rows, skipped = [], 0
    for detail in scores:
        key = detail["key"]
        if not detail.get("scored", True):
            skipped += 1
            continue
        if key not in speaker_of:
            raise ValueError(f"utterance {key!r} has no speaker in speaker_of")
        if language_of is not None and key not in language_of:
            raise ValueError(f"utterance {key!r} has no language in language_of")
        rows.append(
            {
                "ID": key,
                "spk_id": speaker_of[key],
                "language": "" if language_of is None else language_of[key],
                "num_edits": detail["num_edits"],
                "num_ref_tokens": detail["num_ref_tokens"],
            }
        )
    if skipped:
        logger.warning("%d unscored utterance(s) left out of the WER details", skipped)
    return UtteranceErrors.from_rows(rows)


def align_utterances(
    a: UtteranceErrors, b: UtteranceErrors, *, names: tuple[str, str] = ("A", "B")
) -> tuple[UtteranceErrors, UtteranceErrors]:
    """Put two systems' details in the same utterance order, checking they cover the same set.

    Raises ``ValueError`` naming (up to five) IDs missing from either side, and any utterance
    whose speaker differs between the two.

    Example
    -------
    >>> a = UtteranceErrors(("1", "2"), ("s", "t"), ("", ""), np.array([1, 0]), np.array([3, 3]))
    >>> b = a.take([1, 0])
    >>> align_utterances(a, b)[1].ids
    ('1', '2')
    """
    index_b = {key: i for i, key in enumerate(b.ids)}
    only_a = [key for key in a.ids if key not in index_b]
    only_b = sorted(set(b.ids) - set(a.ids))
    if only_a or only_b:
        parts = []
        for label, missing in ((names[1], only_a), (names[0], only_b)):
            if missing:
                shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                parts.append(f"{len(missing)} utterance(s) missing from {label}: {shown}")
        raise ValueError("the two runs were scored on different utterances; " + "; ".join(parts))
    b_aligned = b.take([index_b[key] for key in a.ids])
    for key, spk_a, spk_b in zip(a.ids, a.speakers, b_aligned.speakers, strict=True):
        if spk_a != spk_b:
            raise ValueError(f"utterance {key!r} has speaker {spk_a!r} in A and {spk_b!r} in B")
    return a, b_aligned


def paired_bootstrap_details(
    a: UtteranceErrors,
    b: UtteranceErrors,
    *,
    names: tuple[str, str] = ("A", "B"),
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> PairedWERComparison:
    """:func:`paired_bootstrap_wer` of ``WER_a - WER_b`` for two systems' per-utterance details.

    The details are aligned first (:func:`align_utterances`: same utterances and speakers, else
    ``ValueError``). When the reference word counts differ (another text normalisation), each
    WER keeps its own counts and a warning says so.

    Example
    -------
    >>> a = UtteranceErrors(("1", "2"), ("s", "t"), ("", ""), np.array([0, 1]), np.array([4, 4]))
    >>> b = UtteranceErrors(("2", "1"), ("t", "s"), ("", ""), np.array([2, 2]), np.array([4, 4]))
    >>> round(paired_bootstrap_details(a, b, num_resamples=200).difference, 3)
    -0.375
    """
    a, b = align_utterances(a, b, names=names)
    refs_b = None
    if not np.array_equal(a.num_ref_tokens, b.num_ref_tokens):
        logger.warning(
            "reference word counts differ between %s and %s (different text normalisation?); "
            "each WER uses its own counts",
            *names,
        )
        refs_b = b.num_ref_tokens
    return paired_bootstrap_wer(
        speakers=a.speakers,
        num_edits_a=a.num_edits,
        num_edits_b=b.num_edits,
        num_ref_tokens=a.num_ref_tokens,
        num_ref_tokens_b=refs_b,
        num_resamples=num_resamples,
        confidence=confidence,
        seed=seed,
    )


def write_utterance_details(
    path: str | Path, rows: UtteranceErrors | Iterable[Mapping[str, object]]
) -> Path:
    """Write ``test_utterances.csv`` (columns :data:`UTTERANCE_COLUMNS`).

    Arguments
    ---------
    path : str or Path
        Destination file; parent folders are created.
    rows : UtteranceErrors or iterable of mappings
        The per-utterance counts.

    Returns
    -------
    Path
    """
    details = rows if isinstance(rows, UtteranceErrors) else UtteranceErrors.from_rows(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=UTTERANCE_COLUMNS)
        writer.writeheader()
        writer.writerows(details.rows())
    return path


def read_utterance_details(path: str | Path) -> UtteranceErrors:
    """Read a ``test_utterances.csv`` written by :func:`write_utterance_details`.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file and the
    missing column or bad row otherwise.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"per-utterance WER details not found: {path}")
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [c for c in UTTERANCE_COLUMNS if c not in header and c != "language"]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; header is {header}")
        try:
            details = UtteranceErrors.from_rows(reader)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
    if len(details) == 0:
        raise ValueError(f"{path}: no utterances")
    return details
