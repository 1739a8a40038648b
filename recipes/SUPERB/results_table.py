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
import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    return json.loads(results.read_text())


def _cell(results, exit_):
    entry = results["test"].get(str(exit_))
    if entry is None:
        return "-"
    metric = "WER" if "WER" in entry else "accuracy"
    lo, hi = entry["ci95"]
    return f"{entry[metric]:.3f} [{lo:.3f}, {hi:.3f}]"


def tables_markdown(results, best_exit, shallow=3):
    """The two tables as markdown from ``{run name: results.json}``."""
    metric = "WER" if next(iter(results.values()))["task"] == "asr" else "accuracy"
    lines = []
    if any(k.startswith("centralized_") for k in results):
        lines += [
            f"Table 1: test {metric} [95% CI] by exit and scenario",
            "",
            "| Scenario | " + " | ".join(f"exit {e}" for e in EXITS) + " |",
            "|---|" + "---|" * len(EXITS),
        ]
        for scenario in ("centralized", "homogeneous"):
            cells = [
                _cell(results[f"{scenario}_{e}"], e) for e in EXITS if f"{scenario}_{e}" in results
            ]
            lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
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
    return "\n".join(lines)


def write_readme(task, markdown, readme=RECIPE_DIR / "README.md"):
    """Replace the text between the task's markers in the README."""
    text = readme.read_text(encoding="utf-8")
    start, end = f"<!-- results:{task}:start -->", f"<!-- results:{task}:end -->"
    if start not in text or end not in text:
        raise ValueError(f"{readme} has no {start} ... {end} markers")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    readme.write_text(pattern.sub(start + "\n" + markdown + "\n" + end, text), encoding="utf-8")


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
