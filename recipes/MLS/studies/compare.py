#!/usr/bin/env python3
"""Compare the test WER of two runs with a paired speaker-level bootstrap.

Each ASR run of this recipe writes ``<output_folder>/test_utterances.csv`` with one row per
scored test utterance and the columns ``ID,spk_id,language,num_edits,num_ref_tokens``
(``speechbrain_fl.metrics.write_utterance_details``). This script pairs the two files by
utterance ID, draws the same test speakers with replacement for both runs B times (all
utterances of a drawn speaker kept together; Bisani & Ney, 2004; the alpha-split paper,
Section V) and prints WER_A, WER_B, their difference with its percentile confidence interval,
the two-sided bootstrap p-value and whether the difference is significant (interval excludes 0).

Several seeds: ``--also A2 B2`` (repeatable) adds another pair of runs of the same two systems
(e.g. the same methods at other test-only ``sampler_seed``/``noise_seed`` values). The pairs are
pooled (:func:`pool_seeds`): each WER is the mean over the seeds' runs (sum of edits over sum of
reference words), and a drawn speaker brings its utterances of every seed, so the interval
covers both the speakers and the runs' cohort/noise draws.

Usage::

    python recipes/MLS/studies/compare.py results/flat/1986 results/alpha_split/1986
    python recipes/MLS/studies/compare.py a/test_utterances.csv b/test_utterances.csv --num-resamples 10000
    python recipes/MLS/studies/compare.py s1/flat s1/pfl_uniform --also s2/flat s2/pfl_uniform

Exit status: 0 after printing the comparison, 2 for bad input (missing file, different
utterance sets), with the reason on stderr.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from speechbrain_fl.metrics import (
    DEFAULT_NUM_RESAMPLES,
    UtteranceErrors,
    paired_bootstrap_details,
    read_utterance_details,
)

DETAILS_FILE = "test_utterances.csv"


def details_path(run: str | Path) -> Path:
    """The details CSV of a run folder, or ``run`` itself when it is a file.

    Raises ``FileNotFoundError`` naming what is missing.
    """
    run = Path(run)
    if run.is_dir():
        path = run / DETAILS_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{run} is a folder without {DETAILS_FILE}: was the run evaluated on the test set?"
            )
        return path
    if run.is_file():
        return run
    raise FileNotFoundError(f"no run folder or details file at {run}")


def pool_seeds(details: list[UtteranceErrors]) -> UtteranceErrors:
    """Several runs' details on the same test set as one set, speakers kept.

    Utterance ``u`` of the ``k``-th run becomes ``"<k>/u"`` with its speaker unchanged, so a
    speaker-level bootstrap draws a speaker with all its utterances of every run, and the
    pooled WER is ``sum_k sum_u edits / sum_k sum_u ref words``: the mean of the runs' WERs
    weighted by words (equal weights here: every run scores the same utterances).

    Example
    -------
    >>> import numpy as np
    >>> a = UtteranceErrors(("1",), ("s",), ("",), np.array([1]), np.array([4]))
    >>> b = UtteranceErrors(("1",), ("s",), ("",), np.array([3]), np.array([4]))
    >>> p = pool_seeds([a, b]); p.ids, p.speakers, p.wer
    (('0/1', '1/1'), ('s', 's'), 0.5)
    """
    if not details:
        raise ValueError("pool_seeds needs at least one run's details")
    return UtteranceErrors(
        tuple(f"{k}/{u}" for k, d in enumerate(details) for u in d.ids),
        tuple(s for d in details for s in d.speakers),
        tuple(lang for d in details for lang in d.languages),
        np.concatenate([d.num_edits for d in details]),
        np.concatenate([d.num_ref_tokens for d in details]),
    )


def compare_runs(
    run_a: str | Path | list,
    run_b: str | Path | list,
    *,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
):
    """Paired bootstrap of ``WER_A - WER_B`` for two runs (folders or details CSVs).

    ``run_a`` and ``run_b`` may be lists of runs of equal length (one per seed, paired in
    order): they are pooled by :func:`pool_seeds` before the bootstrap.

    Returns
    -------
    speechbrain_fl.metrics.PairedWERComparison
    """
    runs_a = list(run_a) if isinstance(run_a, list | tuple) else [run_a]
    runs_b = list(run_b) if isinstance(run_b, list | tuple) else [run_b]
    if len(runs_a) != len(runs_b):
        raise ValueError(f"{len(runs_a)} runs of A against {len(runs_b)} of B: pair them by seed")
    return paired_bootstrap_details(
        pool_seeds([read_utterance_details(details_path(r)) for r in runs_a]),
        pool_seeds([read_utterance_details(details_path(r)) for r in runs_b]),
        names=(" + ".join(map(str, runs_a)), " + ".join(map(str, runs_b))),
        num_resamples=num_resamples,
        confidence=confidence,
        seed=seed,
    )


def format_comparison(result, *, name_a: str, name_b: str) -> str:
    """Human-readable report of a :class:`PairedWERComparison`."""
    pct = round(result.confidence * 100)
    verdict = (
        f"significant: {'A' if result.difference < 0 else 'B'} has the lower WER"
        if result.significant
        else f"not significant: the {pct}% interval contains 0"
    )
    return "\n".join(
        [
            f"A: {name_a}",
            f"B: {name_b}",
            f"utterances: {result.num_utterances}, speakers: {result.num_speakers}, "
            f"bootstrap resamples: {result.num_resamples}",
            f"WER_A        = {result.wer_a:.4f}",
            f"WER_B        = {result.wer_b:.4f}",
            f"WER_A - WER_B = {result.difference:+.4f}  {pct}% CI "
            f"[{result.ci_low:+.4f}, {result.ci_high:+.4f}]",
            f"p (two-sided bootstrap) = {result.p_value:.4f}; "
            f"P(A better) = {result.prob_a_better:.4f}",
            verdict,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help=f"run folder (with {DETAILS_FILE}) or the CSV itself")
    parser.add_argument("run_b", help="the same, for the second system")
    parser.add_argument(
        "--also",
        nargs=2,
        action="append",
        default=[],
        metavar=("RUN_A", "RUN_B"),
        help="another pair of runs of the same two systems (another seed), pooled",
    )
    parser.add_argument("--num-resamples", type=int, default=DEFAULT_NUM_RESAMPLES)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = compare_runs(
            [args.run_a, *(a for a, _ in args.also)],
            [args.run_b, *(b for _, b in args.also)],
            num_resamples=args.num_resamples,
            confidence=args.confidence,
            seed=args.seed,
        )
    except (OSError, ValueError) as err:
        print(f"compare.py: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_comparison(result, name_a=args.run_a, name_b=args.run_b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
