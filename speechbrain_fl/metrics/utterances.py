"""Per-utterance WER counts of a test set: the ``test_utterances.csv`` file and its comparisons.

Every ASR run writes ``<output_folder>/test_utterances.csv`` with the columns
``ID,spk_id,language,num_edits,num_ref_tokens`` (one row per scored test utterance; ``language``
may be empty), written by :func:`write_utterance_details` and read back by
:func:`read_utterance_details`. The counts come from SpeechBrain's ``ErrorRateStats``
(:func:`utterance_errors_from_stats`). :func:`wer_report` gives the ``test`` section of
``results.json`` (overall and per-language WER with speaker-level bootstrap intervals of
``speechbrain_fl/metrics/wer.py``), and :func:`paired_bootstrap_details` compares two runs on
the same utterances (``recipes/MLS/studies/compare.py`` pairs two such files by ``ID``).
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speechbrain_fl.metrics.resampling import DEFAULT_NUM_RESAMPLES, check_counts
from speechbrain_fl.metrics.wer import (
    PairedWERComparison,
    WERInterval,
    bootstrap_wer,
    corpus_wer,
    paired_bootstrap_wer,
)
from speechbrain_fl.utils.atomic import atomic_open

logger = logging.getLogger(__name__)

UTTERANCE_COLUMNS = ("ID", "spk_id", "language", "num_edits", "num_ref_tokens")


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
        object.__setattr__(self, "num_edits", check_counts("num_edits", self.num_edits, n))
        object.__setattr__(
            self, "num_ref_tokens", check_counts("num_ref_tokens", self.num_ref_tokens, n)
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
        Destination file; parent folders are created, and the file appears whole or not at all
        (:func:`speechbrain_fl.utils.atomic.atomic_open`).
    rows : UtteranceErrors or iterable of mappings
        The per-utterance counts.

    Returns
    -------
    Path
    """
    details = rows if isinstance(rows, UtteranceErrors) else UtteranceErrors.from_rows(rows)
    path = Path(path)
    with atomic_open(path, newline="") as handle:
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
