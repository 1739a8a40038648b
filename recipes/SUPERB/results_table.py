#!/usr/bin/env python3
"""Run the SUPERB scenario grid on the embedded default and write the README's result tables.

Layout of the paper's tables (their bodies were lost from the paper's text; the numbers here
are ours, on the embedded espeak-ng corpus):

- Table 1: metric by exit (3, 6, 9, 12) x scenario (centralized, homogeneous FL);
- Table 2: homogeneous FL at the task's best exit vs heterogeneous FL (50% of clients at exit
  3, 50% at the best exit) with ``fedavg_full`` vs with layer-wise aggregation under each
  weighting (depth_aware, samples, uniform), reported at both trained exits.

Each cell is one ``train_fl.py`` run (a subprocess; runs whose ``results.json`` exists are
reused, so an interrupted grid resumes). The tables go between the markers
``<!-- results:<task>:start -->`` and ``<!-- results:<task>:end -->`` of the README, and a
figure of the metric per exit per scenario to ``<grid_folder>/metric_by_exit.png``.

    > python recipes/SUPERB/results_table.py --hparams hparams/kws.yaml
    > python recipes/SUPERB/results_table.py --hparams hparams/kws.yaml --tables 2 --rounds 10

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from speechbrain_fl.recipe import update_readme_table

RECIPE_DIR = Path(__file__).resolve().parent
ROOT = RECIPE_DIR.parents[1]
EXITS = (3, 6, 9, 12)


def grid(best_exit, tables):
    """``[(name, overrides)]`` of the runs the tables need."""
    runs = []
    if 1 in tables:
        for e in EXITS:
            runs.append((f"centralized_{e}", {"scenario": "centralized", "exit": e}))
            runs.append((f"homogeneous_{e}", {"scenario": "homogeneous", "exit": e}))
    if 2 in tables:
        if 1 not in tables:
            runs.append(
                (f"homogeneous_{best_exit}", {"scenario": "homogeneous", "exit": best_exit})
            )
        runs.append(("heterogeneous_fedavg_full", {"aggregation": "fedavg_full"}))
        for weighting in ("depth_aware", "samples", "uniform"):
            runs.append((f"heterogeneous_layerwise_{weighting}", {"weighting": weighting}))
    return runs


def run(hparams, name, overrides, folder, extra):
    """One ``train_fl.py`` run (reused if its results.json exists)."""
    out = Path(folder) / name
    results = out / "results.json"
    if not results.is_file():
        cmd = [sys.executable, str(RECIPE_DIR / "train_fl.py"), hparams]
        cmd += ["--output_folder", str(out)]
        for key, value in {**overrides, **extra}.items():
            cmd += [f"--{key}", str(value)]
        print("running:", " ".join(cmd), flush=True)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        )
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return {**json.loads(results.read_text()), "_folder": str(out)}


def _cell(results, exit_):
    entry = results["test"].get(str(exit_))
    if entry is None:
        return "-"
    metric = "WER" if "WER" in entry else "accuracy"
    lo, hi = entry["ci95"]
    return f"{entry[metric]:.3f} [{lo:.3f}, {hi:.3f}]"


def _value(results, exit_):
    entry = results["test"].get(str(exit_))
    return None if entry is None else entry["WER" if "WER" in entry else "accuracy"]


def _predictions(results, exit_):
    """``{utterance id: (speaker, correct)}`` of one run's exit, or None (ASR, or no file)."""
    path = Path(results.get("_folder", "")) / "test_predictions.csv"
    if not path.is_file():
        return None
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    column = f"pred_{exit_}"
    if not rows or column not in rows[0]:
        return None
    return {r["ID"]: (r["spk_id"], float(r[column] == r["label"])) for r in rows}


def paired_difference(run_a, exit_a, run_b, exit_b, *, num_resamples=2000, seed=0):
    """Accuracy of (run_a, exit_a) minus (run_b, exit_b) on the same test clips, with a paired
    speaker-level bootstrap 95% CI (one speaker draw per replicate for both).

    Two runs' marginal intervals overlap easily on a small test split; the paired interval
    tells whether the *difference* is beyond speaker sampling noise (it does not cover the
    training-run variance: one run per cell). Returns ``(difference, (lo, hi))`` or None when a
    run has no per-clip predictions (ASR).
    """
    from speechbrain_fl.metrics.resampling import speaker_bootstrap, speaker_totals

    a, b = _predictions(run_a, exit_a), _predictions(run_b, exit_b)
    if a is None or b is None:
        return None
    if set(a) != set(b):
        raise ValueError("the two runs were tested on different clips; cannot pair them")
    ids = sorted(a)
    _, totals = speaker_totals(
        speakers=[a[i][0] for i in ids],
        correct_a=[a[i][1] for i in ids],
        correct_b=[b[i][1] for i in ids],
        clips=[1.0] * len(ids),
    )
    table = np.stack([totals["correct_a"], totals["correct_b"], totals["clips"]], axis=1)
    boot = speaker_bootstrap(
        table, lambda t: (t[0] - t[1]) / t[2], num_resamples=num_resamples, seed=seed
    )
    point = float((table[:, 0].sum() - table[:, 1].sum()) / table[:, 2].sum())
    return point, (float(boot.ci_low), float(boot.ci_high))


def _difference_text(diff):
    if diff is None:
        return "n/a"
    value, (lo, hi) = diff
    verdict = "beyond" if lo > 0 or hi < 0 else "within"
    return f"{value:+.3f} [{lo:+.3f}, {hi:+.3f}] ({verdict} speaker noise)"


def tables_markdown(results, best_exit, shallow=3):
    """The two tables (the paper's layout) as markdown from ``{run name: results.json}``.

    Table 1: one row per exit, one column per scenario (centralized, homogeneous FL, and the
    heterogeneous layer-wise depth-aware run at its two exits), the best exit of each column
    in bold, then the best exit against exit 12 per scenario (paired speaker bootstrap).
    Table 2: the heterogeneous settings at both trained exits, then layer-wise (depth-aware)
    against ``fedavg_full`` (paired).
    """
    first = next(iter(results.values()))
    metric = "WER" if first["task"] == "asr" else "accuracy"
    better = min if metric == "WER" else max
    lines = []
    hetero = "heterogeneous_layerwise_depth_aware"
    if any(k.startswith("centralized_") for k in results):
        columns = [
            ("centralized", {e: results.get(f"centralized_{e}") for e in EXITS}),
            ("homogeneous FL", {e: results.get(f"homogeneous_{e}") for e in EXITS}),
        ]
        if hetero in results:
            columns.append(
                (
                    f"heterogeneous FL (exits {shallow}+{best_exit}, layer-wise depth-aware)",
                    {e: results[hetero] for e in EXITS if str(e) in results[hetero]["test"]},
                )
            )
        best = {}
        for name, runs in columns:
            scored = {e: _value(r, e) for e, r in runs.items() if r is not None}
            scored = {e: v for e, v in scored.items() if v is not None}
            top = better(scored.values()) if scored else None
            best[name] = [e for e in EXITS if e in scored and scored[e] == top]  # ties: all
        lines += [
            f"Table 1: test {metric} [95% CI] by exit and scenario (best exit of each column "
            "in bold)",
            "",
            "| Exit | " + " | ".join(name for name, _ in columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for e in EXITS:
            cells = []
            for name, runs in columns:
                run = runs.get(e)
                cell = _cell(run, e) if run is not None else "-"
                cells.append(f"**{cell}**" if e in best[name] and cell != "-" else cell)
            lines.append(f"| {e} | " + " | ".join(cells) + " |")
        lines += ["", "Best exit minus exit 12, same test clips (paired speaker bootstrap 95% CI):"]
        for scenario in ("centralized", "homogeneous"):
            name = "centralized" if scenario == "centralized" else "homogeneous FL"
            tops = best.get(name) or []
            if not tops or f"{scenario}_12" not in results:
                continue
            if tops == [12]:
                lines.append(f"- {name}: exit 12 is the best exit")
                continue
            e_best = tops[0]
            tie = " (tied best)" if 12 in tops else ""
            diff = paired_difference(
                results[f"{scenario}_{e_best}"], e_best, results[f"{scenario}_12"], 12
            )
            lines.append(f"- {name}: exit {e_best} - exit 12{tie} = {_difference_text(diff)}")
        lines.append("")
    if "heterogeneous_fedavg_full" in results:
        lines += [
            f"Table 2: test {metric} [95% CI]; heterogeneous = 50% of clients at exit {shallow}, "
            f"50% at exit {best_exit}",
            "",
            f"| Setting | exit {shallow} | exit {best_exit} |",
            "|---|---|---|",
            f"| homogeneous FL (exit {best_exit}) | - | "
            f"{_cell(results[f'homogeneous_{best_exit}'], best_exit)} |",
        ]
        names = [("heterogeneous_fedavg_full", "heterogeneous + fedavg_full")] + [
            (f"heterogeneous_layerwise_{w}", f"heterogeneous + layer-wise ({w})")
            for w in ("depth_aware", "samples", "uniform")
        ]
        for key, label in names:
            if key in results:
                r = results[key]
                lines.append(f"| {label} | {_cell(r, shallow)} | {_cell(r, best_exit)} |")
        if hetero in results:
            lines += ["", "Layer-wise (depth_aware) minus fedavg_full, same test clips (paired "
                      "speaker bootstrap 95% CI):"]  # fmt: skip
            for e in (shallow, best_exit):
                diff = paired_difference(
                    results[hetero], e, results["heterogeneous_fedavg_full"], e
                )
                lines.append(f"- exit {e}: {_difference_text(diff)}")
    return "\n".join(lines)


def write_readme(task, markdown, readme=RECIPE_DIR / "README.md"):
    """Replace the task's table (markers ``<!-- results:<task>:start -->`` ... ``:end -->``).

    Through the kit's one README-table writer, :func:`speechbrain_fl.recipe.update_readme_table`.
    """
    update_readme_table(readme, f"results:{task}", markdown)


def plot(results, path):
    """Metric per exit per scenario (one line per run)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4))
    ax = fig.add_subplot()
    for name, r in sorted(results.items()):
        exits = sorted(int(e) for e in r["test"])
        values = [next(iter(r["test"][str(e)].values())) for e in exits]
        ax.plot(exits, values, "-o", label=name)
    ax.set_xlabel("exit (Transformer layer)")
    ax.set_ylabel("test metric")
    ax.set_xticks(list(EXITS))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None):
    """Run the grid, print and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hparams", default="hparams/kws.yaml")
    parser.add_argument("--tables", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--grid_folder", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="number_of_rounds override")
    parser.add_argument("--best_exit", type=int, default=None, help="default: the task file's")
    parser.add_argument("--cache_folder", default=None, help="cache_folder override")
    parser.add_argument("--no_readme", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(RECIPE_DIR))
    from superb_task import load_hparams

    hparams, _, _ = load_hparams(
        RECIPE_DIR / args.hparams if not Path(args.hparams).is_file() else args.hparams
    )
    best = args.best_exit or int(hparams["best_exit"])
    folder = args.grid_folder or f"results/SUPERB/grid/{hparams['task']}"
    extra = {"measure_memory": False}
    if args.rounds:
        extra["number_of_rounds"] = args.rounds
    if args.cache_folder:
        extra["cache_folder"] = args.cache_folder
    results = {
        name: run(args.hparams, name, overrides, folder, extra)
        for name, overrides in grid(best, args.tables)
    }
    markdown = tables_markdown(results, best, int(hparams["shallow_exit"]))
    plot(results, Path(folder) / "metric_by_exit.png")
    print("\n" + markdown)
    if not args.no_readme:
        write_readme(hparams["task"], markdown)


if __name__ == "__main__":
    main()
