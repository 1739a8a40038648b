#!/usr/bin/env python3
"""Compare the test WER of two runs with a paired speaker-level bootstrap.

Each ASR run of this recipe writes ``<output_folder>/test_utterances.csv`` with one row per
scored test utterance and the columns ``ID,spk_id,language,num_edits,num_ref_tokens``
(``speechbrain_fl.metrics.write_utterance_details``). This script pairs the two files by
utterance ID, draws the same test speakers with replacement for both runs B times (all
utterances of a drawn speaker kept together; Bisani & Ney, 2004; the alpha-split paper,
Section V) and prints WER_A, WER_B, their difference with its percentile confidence interval,
the two-sided bootstrap p-value and whether the difference is significant (interval excludes 0).

Usage::

    python recipes/MLS/compare.py results/flat/1986 results/alpha_split/1986
    python recipes/MLS/compare.py a/test_utterances.csv b/test_utterances.csv --num-resamples 10000

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

from speechbrain_fl.metrics import (
    DEFAULT_NUM_RESAMPLES,
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


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    *,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    confidence: float = 0.95,
    seed: int | None = 0,
):
    """Paired bootstrap of ``WER_A - WER_B`` for two runs (folders or details CSVs).

    Returns
    -------
    speechbrain_fl.metrics.PairedWERComparison
    """
    return paired_bootstrap_details(
        read_utterance_details(details_path(run_a)),
        read_utterance_details(details_path(run_b)),
        names=(str(run_a), str(run_b)),
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
    parser.add_argument("--num-resamples", type=int, default=DEFAULT_NUM_RESAMPLES)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = compare_runs(
            args.run_a,
            args.run_b,
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
