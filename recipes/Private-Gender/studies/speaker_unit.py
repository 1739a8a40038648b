#!/usr/bin/env python3
"""Speaker-level DP-SGD against one clip per speaker, at equal epsilon per speaker.

The embedded corpus with ``--clips`` clips per speaker (``corpus_clips_per_speaker``), smaller
than the recipe's default so that a run takes under a minute: ``--speakers`` speakers in D_priv
(train), half as many in D_aux (dev), a third in test. Four teacher runs per seed, each with
its DP-direct baseline:

* ``speaker, mean``: ``privacy_unit: speaker``, every clip of D_priv, ``batch_size`` =
  clips x 100, each sampled speaker's *mean* per-clip gradient clipped to C;
* ``speaker, sum``: the same with the *summed* per-clip gradient clipped to C
  (``speaker_reduction: sum``);
* ``one clip``: ``max_clips_per_speaker: 1`` (clip-level DP-SGD on one clip per speaker is
  speaker-level), ``batch_size`` 100;
* ``clip (reference)``: clip-level DP-SGD on every clip, ``batch_size`` = clips x 100: its
  epsilon holds per clip only, per speaker the group bound k epsilon.

The first three have the same speaker sampling rate q, steps T and sigma (hence the same epsilon
per speaker) and the same expected number of speakers per step; they differ in what a sampled
speaker contributes (the clipped mean or sum of all its clips' gradients, or one clip's). The DP
noise and the sampling come from the OS, so every run differs; ``--seed`` sets the
initialisations and the clip kept per speaker. Settings are compared by paired differences over
the seeds (``gender_stats.paired``: mean, 95% t-interval).

    > python recipes/Private-Gender/studies/speaker_unit.py --seeds 1 2 3 4 5

Writes the runs to ``<root>/speaker_unit.json`` (resumable: a stored (setting, seed) is not
rerun), prints the tables and writes them into the ``speaker-unit`` block of this folder's
README (``--no_readme``: print only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

STUDIES_DIR = Path(__file__).resolve().parent
RECIPE_DIR = STUDIES_DIR.parent
sys.path[:0] = [str(STUDIES_DIR), str(RECIPE_DIR)]

import train_teacher  # noqa: E402
from gender_stats import paired  # noqa: E402

from speechbrain_fl.recipe import run_recipe, update_readme_table  # noqa: E402

#: Paired comparisons (A, B) of the speaker-level settings, at equal epsilon per speaker.
PAIRS = [("speaker, sum", "speaker, mean"), ("speaker, sum", "one clip"),
         ("speaker, mean", "one clip")]  # fmt: skip


def runs(clips: int) -> dict[str, list[str]]:
    """Name -> teacher.yaml overrides of each compared setting."""
    speaker = ["--privacy_unit", "speaker", "--batch_size", str(100 * clips)]
    return {
        "speaker, mean": [*speaker, "--speaker_reduction", "mean"],
        "speaker, sum": [*speaker, "--speaker_reduction", "sum"],
        "one clip": ["--max_clips_per_speaker", "1", "--batch_size", "100"],
        "clip (reference)": ["--batch_size", str(100 * clips)],
    }


def slug(name: str) -> str:
    """Folder name of a setting: ``speaker, sum`` -> ``speaker_sum``."""
    return name.replace(",", "").replace("(", "").replace(")", "").replace(" ", "_")


def run_one(name: str, overrides: list[str], *, seed: int, args) -> dict:
    """One teacher run; its balanced accuracies and privacy figures."""
    corpus = json.dumps({"train": args.speakers, "dev": args.speakers // 2,
                         "test": args.speakers // 3, "validated_only": 2})  # fmt: skip
    out = args.root / f"{slug(name)}_{seed}"
    result = run_recipe(train_teacher, [
        "hparams/teacher.yaml", "--seed", str(seed), "--output_folder", str(out),
        "--cache_folder", str(args.root / "cache"), "--corpus_speakers", corpus,
        "--corpus_clips_per_speaker", str(args.clips), "--target_epsilon", str(args.epsilon),
        "--audit_canaries", "0", "--bootstrap_resamples", "200", *overrides,
    ])  # fmt: skip
    return {
        "seed": seed,
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

    lines = ["| setting | seeds | ε | ε holds per | q | T | σ | teacher bal. acc. "
             "| DP-direct bal. acc. |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        first = rows[0]
        per = f"clip (speaker: {clips} ε, group)" if name == "clip (reference)" else "speaker"
        lines.append(
            f"| {name} | {len(rows)} | {first['epsilon']:.2f} | {per} | {first['q']:.3f} | "
            f"{first['steps']} | {first['sigma']:.2f} | {cell([r['teacher'] for r in rows])} | "
            f"{cell([r['dp_direct'] for r in rows])} |"
        )
    return "\n".join(lines)


def paired_table(results: dict[str, list[dict]]) -> str:
    """Markdown rows of the paired differences of :data:`PAIRS` over the seeds both have."""
    lines = ["| Paired difference (A − B) | Seeds | Mean | 95% CI (t) | A > B in | Per seed |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for a, b in PAIRS:
        by_a = {r["seed"]: r for r in results.get(a, [])}
        by_b = {r["seed"]: r for r in results.get(b, [])}
        seeds = sorted(set(by_a) & set(by_b))
        if len(seeds) < 2:
            continue
        for model in ("teacher", "dp_direct"):
            c = paired([by_a[k][model] for k in seeds], [by_b[k][model] for k in seeds])
            verdict = "above 0" if c["ci"][0] > 0 else ("below 0" if c["ci"][1] < 0 else "spans 0")
            label = "teacher" if model == "teacher" else "DP-direct"
            lines.append(
                f"| {a} − {b}, {label} bal. acc. | {c['n']} | {c['mean']:+.3f} | "
                f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] ({verdict}) | {c['wins']}/{c['n']} | "
                + ", ".join(f"{d:+.2f}" for d in c["differences"])
                + " |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("results/Private-Gender/speaker_unit"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--speakers", type=int, default=600)
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--settings", nargs="+", help="run only these settings (default all)")
    parser.add_argument("--readme", type=Path, default=STUDIES_DIR / "README.md")
    parser.add_argument("--no_readme", action="store_true")
    args = parser.parse_args(argv)
    store = args.root / "speaker_unit.json"
    results: dict[str, list[dict]] = json.loads(store.read_text()) if store.is_file() else {}
    start, ran = time.time(), 0
    for seed in args.seeds:
        for name, overrides in runs(args.clips).items():
            if args.settings and name not in args.settings:
                continue
            if any(r.get("seed") == seed for r in results.get(name, [])):
                continue
            results.setdefault(name, []).append(run_one(name, overrides, seed=seed, args=args))
            ran += 1
            args.root.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps(results, indent=2))
    order = list(runs(args.clips))
    results = {k: sorted(results[k], key=lambda r: r["seed"]) for k in order if k in results}
    took = f"; {ran} runs in {(time.time() - start) / 60:.1f} min" if ran else ""
    note = (
        f"Written by `speaker_unit.py` ({args.speakers} / {args.speakers // 2} / "
        f"{args.speakers // 3} speakers × {args.clips} clips, ε = {args.epsilon}{took}). "
        "Balanced accuracy on test, mean ± sd over the seeds.\n\n"
    )
    body = note + table(results, args.clips) + "\n\n" + paired_table(results)
    if not args.no_readme:
        update_readme_table(args.readme, "speaker-unit", body)
    print(body)


if __name__ == "__main__":
    main()
