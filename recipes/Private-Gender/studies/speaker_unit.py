#!/usr/bin/env python3
"""Speaker-level DP-SGD against one clip per speaker, at equal epsilon per speaker.

The embedded corpus with ``--clips`` clips per speaker (``corpus_clips_per_speaker``), smaller
than the recipe's default so that a run takes under a minute: ``--speakers`` speakers in D_priv
(train), half as many in D_aux (dev), a third in test. Three teacher runs per seed, each with
its DP-direct baseline:

* ``speaker``: ``privacy_unit: speaker``, every clip of D_priv, ``batch_size`` = clips x 100;
* ``one clip``: ``max_clips_per_speaker: 1`` (clip-level DP-SGD on one clip per speaker is
  speaker-level), ``batch_size`` 100;
* ``clip (reference)``: clip-level DP-SGD on every clip, ``batch_size`` = clips x 100: its
  epsilon holds per clip only, per speaker the group bound k epsilon.

The first two have the same speaker sampling rate q, steps T and sigma (hence the same epsilon
per speaker) and the same expected number of speakers per step; they differ in what a sampled
speaker contributes (the mean gradient of all its clips, or one clip). The DP noise and the
sampling come from the OS, so every run differs; ``--seed`` sets the initialisations.

    > python recipes/Private-Gender/studies/speaker_unit.py --seeds 1 2 3

Prints a markdown table (mean and sd of the balanced accuracy over the seeds) and writes the
runs to ``<root>/speaker_unit.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

STUDIES_DIR = Path(__file__).resolve().parent
RECIPE_DIR = STUDIES_DIR.parent
sys.path[:0] = [str(STUDIES_DIR), str(RECIPE_DIR)]

import train_teacher  # noqa: E402


def runs(clips: int) -> dict[str, list[str]]:
    """Name -> teacher.yaml overrides of each compared setting."""
    return {
        "speaker": ["--privacy_unit", "speaker", "--batch_size", str(100 * clips)],
        "one clip": ["--max_clips_per_speaker", "1", "--batch_size", "100"],
        "clip (reference)": ["--batch_size", str(100 * clips)],
    }


def run_one(name: str, overrides: list[str], *, seed: int, args) -> dict:
    """One teacher run; its balanced accuracies and privacy figures."""
    corpus = json.dumps({"train": args.speakers, "dev": args.speakers // 2,
                         "test": args.speakers // 3, "validated_only": 2})  # fmt: skip
    out = args.root / f"{name.split()[0]}_{seed}"
    result = train_teacher.main([
        "hparams/teacher.yaml", "--seed", str(seed), "--output_folder", str(out),
        "--cache_folder", str(args.root / "cache"), "--corpus_speakers", corpus,
        "--corpus_clips_per_speaker", str(args.clips), "--target_epsilon", str(args.epsilon),
        "--audit_canaries", "0", "--bootstrap_resamples", "200", *overrides,
    ])  # fmt: skip
    return {
        "teacher": result["teacher"]["test"]["balanced_accuracy"]["value"],
        "dp_direct": result["dp_direct"]["balanced_accuracy"]["value"],
        "epsilon": result["privacy"]["epsilon"],
        "sigma": result["privacy"]["noise_multiplier"],
        "q": result["privacy"]["sampling_rate"],
        "steps": result["privacy"]["steps"],
        "unit": result["privacy"]["unit"].split(":")[0],
    }


def table(results: dict[str, list[dict]], clips: int) -> str:
    """Markdown rows: mean ± sd over the seeds."""

    def cell(values):
        if len(values) == 1:
            return f"{values[0]:.3f}"
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"

    lines = ["| setting | ε | ε holds per | q | T | σ | teacher bal. acc. | DP-direct bal. acc. |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        first = rows[0]
        per = f"clip (speaker: {clips} ε, group)" if name == "clip (reference)" else "speaker"
        lines.append(
            f"| {name} | {first['epsilon']:.2f} | {per} | {first['q']:.3f} | {first['steps']} | "
            f"{first['sigma']:.2f} | {cell([r['teacher'] for r in rows])} | "
            f"{cell([r['dp_direct'] for r in rows])} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("results/Private-Gender/speaker_unit"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--speakers", type=int, default=600)
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--epsilon", type=float, default=1.0)
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name, overrides in runs(args.clips).items():
            results.setdefault(name, []).append(run_one(name, overrides, seed=seed, args=args))
            (args.root / "speaker_unit.json").write_text(json.dumps(results, indent=2))
    print(table(results, args.clips))


if __name__ == "__main__":
    main()
