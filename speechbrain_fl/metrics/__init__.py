"""Metrics with speaker-level bootstrap confidence intervals.

- ``resampling.py``: the speaker-level percentile bootstrap (``scipy.stats.bootstrap``, paired
  over per-speaker totals).
- ``wer.py``: corpus WER with its interval, and the paired WER difference of two systems.
- ``utterances.py``: per-utterance WER counts (``test_utterances.csv``), the ``results.json``
  test section, and the paired comparison of two runs' utterances.
- ``classification.py``: accuracy, balanced accuracy and macro-F1 with intervals.

Their public names are importable from here.
"""

from speechbrain_fl.metrics.classification import METRICS, bootstrap_classification
from speechbrain_fl.metrics.resampling import (
    DEFAULT_NUM_RESAMPLES,
    SpeakerBootstrap,
    check_bootstrap_settings,
    speaker_bootstrap,
    speaker_totals,
)
from speechbrain_fl.metrics.utterances import (
    UTTERANCE_COLUMNS,
    UtteranceErrors,
    align_utterances,
    bootstrap_details,
    paired_bootstrap_details,
    read_utterance_details,
    utterance_errors_from_stats,
    wer_by_language,
    wer_report,
    write_utterance_details,
)
from speechbrain_fl.metrics.wer import (
    PairedWERComparison,
    WERInterval,
    bootstrap_wer,
    corpus_wer,
    paired_bootstrap_wer,
    wer_replicates,
)

__all__ = [
    "METRICS",
    "bootstrap_classification",
    "DEFAULT_NUM_RESAMPLES",
    "SpeakerBootstrap",
    "check_bootstrap_settings",
    "speaker_bootstrap",
    "speaker_totals",
    "UTTERANCE_COLUMNS",
    "UtteranceErrors",
    "align_utterances",
    "bootstrap_details",
    "paired_bootstrap_details",
    "read_utterance_details",
    "utterance_errors_from_stats",
    "wer_by_language",
    "wer_report",
    "write_utterance_details",
    "PairedWERComparison",
    "WERInterval",
    "bootstrap_wer",
    "corpus_wer",
    "paired_bootstrap_wer",
    "wer_replicates",
]
