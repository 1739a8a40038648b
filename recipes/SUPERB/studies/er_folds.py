#!/usr/bin/env python3
"""ER the SUPERB way: one run per leave-one-session-out fold, the accuracy averaged over folds.

SUPERB scores IEMOCAP emotion recognition as the mean test accuracy of the five folds (session
k held out for test, ``test_session: k``, k = 1..5). This runner starts ``train_fl.py`` once per
fold (``<grid_folder>/fold<k>``; a fold whose ``results.json`` exists is reused, so an
interrupted run resumes), then writes ``<grid_folder>/folds.json`` and prints, per trained
exit e,

    mean_e = (1 / K) sum_k acc_{e,k}
    sd_e   = sqrt( sum_k (acc_{e,k} - mean_e)^2 / (K - 1) )          (K >= 2)

beside every fold's accuracy and its 95% speaker-bootstrap interval (each fold's own test
session). Extra arguments after ``--`` go to every ``train_fl.py`` run.

    > python recipes/SUPERB/studies/er_folds.py --hparams hparams/er.yaml
    > python recipes/SUPERB/studies/er_folds.py --folds 1 2 -- --debug --scenario homogeneous --exit 3

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from speechbrain_fl.recipe import render_table

RECIPE_DIR = Path(__file__).resolve().parents[1]  # recipes/SUPERB
ROOT = RECIPE_DIR.parents[1]
SESSIONS = (1, 2, 3, 4, 5)


def run_fold(hparams, fold, folder, extra_args=()):
    """``train_fl.py <hparams> --test_session <fold>`` into ``<folder>/fold<fold>`` (reused).

    Returns the run's ``results.json`` content.
    """
    out = Path(folder) / f"fold{fold}"
    results = out / "results.json"
    if not results.is_file():
        cmd = [sys.executable, str(RECIPE_DIR / "train_fl.py"), str(hparams)]
        cmd += ["--test_session", str(fold), "--output_folder", str(out), *extra_args]
        print("running:", " ".join(cmd), flush=True)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        )
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return json.loads(results.read_text())


def average_folds(fold_results, metric="accuracy"):
    """Per exit: the folds' metric, their mean and sample standard deviation.

    Arguments
    ---------
    fold_results : mapping
        ``{fold: results.json content}``.
    metric : str
        The key of ``results["test"][exit]`` to average.

    Returns
    -------
    dict
        ``{exit: {"folds": {fold: value}, "ci95": {fold: [lo, hi]}, "mean": m, "sd": s}}``
        (``sd`` is None for one fold); only the exits every fold trained.

    Example
    -------
    >>> r = lambda a: {"test": {"9": {"accuracy": a, "ci95": [a - 0.1, a + 0.1]}}}
    >>> out = average_folds({1: r(0.5), 2: r(0.7)})
    >>> round(out["9"]["mean"], 3), round(out["9"]["sd"], 4)
    (0.6, 0.1414)
    """
    if not fold_results:
        raise ValueError("average_folds: no fold results")
    exits = set.intersection(*(set(r["test"]) for r in fold_results.values()))
    out = {}
    for e in sorted(exits, key=int):
        values = {k: float(r["test"][e][metric]) for k, r in sorted(fold_results.items())}
        mean = sum(values.values()) / len(values)
        sd = (
            math.sqrt(sum((v - mean) ** 2 for v in values.values()) / (len(values) - 1))
            if len(values) > 1
            else None
        )
        out[e] = {
            "folds": values,
            "ci95": {k: r["test"][e]["ci95"] for k, r in sorted(fold_results.items())},
            "mean": mean,
            "sd": sd,
        }
    return out


def folds_table(summary):
    """Text table: one row per exit, the mean (sd) over folds and every fold's value."""
    folds = sorted({k for entry in summary.values() for k in entry["folds"]})
    header = ["exit", "mean", "sd"] + [f"session {k}" for k in folds]
    rows = []
    for e, entry in summary.items():
        sd = "-" if entry["sd"] is None else f"{entry['sd']:.4f}"
        cells = []
        for k in folds:
            lo, hi = entry["ci95"][k]
            cells.append(f"{entry['folds'][k]:.4f} [{lo:.3f}, {hi:.3f}]")
        rows.append([e, f"{entry['mean']:.4f}", sd, *cells])
    return render_table(header, rows, style="text")


def main(argv=None):
    """Run every fold (or reuse it), average, write ``folds.json``, print the table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hparams", default="hparams/er.yaml")
    parser.add_argument("--folds", type=int, nargs="+", default=list(SESSIONS))
    parser.add_argument("--grid_folder", default="results/SUPERB/er_folds")
    args = parser.parse_args(argv)
    bad = [k for k in args.folds if k not in SESSIONS]
    if bad:
        raise SystemExit(f"--folds: {bad} are not IEMOCAP sessions {list(SESSIONS)}")
    folder = Path(args.grid_folder)
    fold_results = {}
    for k in args.folds:
        result = run_fold(args.hparams, k, folder, passthrough)
        if result["task"] != "er":
            raise SystemExit(f"{args.hparams}: task {result['task']!r}, not er")
        fold_results[k] = result
    summary = average_folds(fold_results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "folds.json").write_text(json.dumps(summary, indent=2))
    print(folds_table(summary))
    return summary


if __name__ == "__main__":
    main()
