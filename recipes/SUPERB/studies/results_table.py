#!/usr/bin/env python3
"""Run the SUPERB scenario grid on the embedded default and write its result tables.

Layout of the paper's tables (their bodies were lost from the paper's text; the numbers here
are ours, on the embedded espeak-ng corpus):

- Table 1: metric by exit (3, 6, 9, 12) x scenario (centralized, homogeneous FL);
- Table 2: heterogeneous FL (50% of clients at exit 3, 50% at the best exit) with
  ``fedavg_full`` and with layer-wise aggregation under each weighting (depth_aware, samples,
  uniform), reported at both trained exits, beside the baselines that show what heterogeneous
  depth is for: everyone at the weakest depth (homogeneous FL at exit 3), deep clients only
  (``shallow_clients: drop``: the weak devices are left out) and homogeneous FL at the best
  exit (every client deep, an upper reference); then layer-wise (depth_aware) at the deep exit
  minus each of them (paired speaker bootstrap).

Each cell is one ``train_fl.py`` run per seed (``--seeds``; a subprocess; runs whose
``results.json`` exists are reused, so an interrupted grid resumes). With several seeds a cell
is the accuracy pooled over the seeds' test clips (each seed generates its own corpus), its
interval and every paired difference a bootstrap over (seed, speaker) units. The tables go to
``<grid_folder>/tables.md`` (and, with ``--readme FILE``, between the markers
``<!-- results:<task>:start -->`` and ``<!-- results:<task>:end -->`` of that file), and a
figure of the metric per exit per scenario to ``<grid_folder>/metric_by_exit.png``.

    > python recipes/SUPERB/studies/results_table.py --hparams hparams/kws.yaml
    > python recipes/SUPERB/studies/results_table.py --hparams hparams/kws.yaml --tables 2 --rounds 10

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

RECIPE_DIR = Path(__file__).resolve().parents[1]  # recipes/SUPERB
ROOT = RECIPE_DIR.parents[1]
EXITS = (3, 6, 9, 12)


def grid(best_exit, tables, shallow=3):
    """``[(name, overrides)]`` of the runs the tables need (one seed)."""
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
            runs.append((f"homogeneous_{shallow}", {"scenario": "homogeneous", "exit": shallow}))
        runs.append(("heterogeneous_deep_only", {"shallow_clients": "drop"}))
        runs.append(("heterogeneous_fedavg_full", {"aggregation": "fedavg_full"}))
        for weighting in ("depth_aware", "samples", "uniform"):
            runs.append((f"heterogeneous_layerwise_{weighting}", {"weighting": weighting}))
    return runs


def seeded(runs, seeds):
    """``[(folder name, overrides)]``: every run once per seed (``<name>/s<seed>``)."""
    return [(f"{name}/s{seed}", {**overrides, "seed": seed}) for name, overrides in runs
            for seed in seeds]  # fmt: skip


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


def _runs(results):
    """A cell's runs: one results.json, or a list of them (one per seed)."""
    return list(results) if isinstance(results, (list, tuple)) else [results]


def _cell(results, exit_):
    runs = _runs(results)
    entries = [r["test"].get(str(exit_)) for r in runs]
    if any(e is None for e in entries):
        return "-"
    metric = "WER" if "WER" in entries[0] else "accuracy"
    if len(runs) == 1:
        lo, hi = entries[0]["ci95"]
        return f"{entries[0][metric]:.3f} [{lo:.3f}, {hi:.3f}]"
    pooled = pooled_accuracy(runs, exit_)
    if pooled is None:  # no per-clip predictions (ASR): the mean and the seeds' range
        values = [e[metric] for e in entries]
        return f"{np.mean(values):.3f} (seeds {min(values):.3f}-{max(values):.3f})"
    value, (lo, hi) = pooled
    return f"{value:.3f} [{lo:.3f}, {hi:.3f}]"


def _value(results, exit_):
    runs = _runs(results)
    entries = [r["test"].get(str(exit_)) for r in runs]
    if any(e is None for e in entries):
        return None
    metric = "WER" if "WER" in entries[0] else "accuracy"
    if len(runs) > 1:
        pooled = pooled_accuracy(runs, exit_)
        if pooled is not None:
            return pooled[0]
    return float(np.mean([e[metric] for e in entries]))


def _unit_predictions(results, exit_):
    """``{(run index, clip id): ((run index, speaker), correct)}`` over a cell's runs, or None."""
    out = {}
    for k, run in enumerate(_runs(results)):
        preds = _predictions(run, exit_)
        if preds is None:
            return None
        out.update({(k, i): ((k, spk), ok) for i, (spk, ok) in preds.items()})
    return out


def pooled_accuracy(runs, exit_, *, num_resamples=2000, seed=0):
    """Accuracy over the clips of several runs (seeds), CI by a (seed, speaker) bootstrap.

    ``acc = sum_u c_u / sum_u n_u`` over units u = (seed, speaker) with c_u correct clips of
    n_u; a replicate draws the units with replacement. Returns ``(acc, (lo, hi))`` or None
    when a run has no per-clip predictions.
    """
    from speechbrain_fl.metrics.resampling import speaker_bootstrap, speaker_totals

    preds = _unit_predictions(runs, exit_)
    if preds is None:
        return None
    keys = sorted(preds)
    _, totals = speaker_totals(
        speakers=[str(preds[k][0]) for k in keys],
        correct=[preds[k][1] for k in keys],
        clips=[1.0] * len(keys),
    )
    table = np.stack([totals["correct"], totals["clips"]], axis=1)
    boot = speaker_bootstrap(table, lambda t: t[0] / t[1], num_resamples=num_resamples, seed=seed)
    return float(table[:, 0].sum() / table[:, 1].sum()), (float(boot.ci_low), float(boot.ci_high))


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
    tells whether the *difference* is beyond speaker sampling noise. ``run_a`` and ``run_b``
    may be lists of runs, one per seed, in the same seed order: the units are then (seed,
    speaker), so the interval also spans the seeds' training variance. Returns
    ``(difference, (lo, hi))`` or None when a run has no per-clip predictions (ASR).
    """
    from speechbrain_fl.metrics.resampling import speaker_bootstrap, speaker_totals

    a, b = _unit_predictions(run_a, exit_a), _unit_predictions(run_b, exit_b)
    if a is None or b is None:
        return None
    if set(a) != set(b):
        raise ValueError("the two runs were tested on different clips; cannot pair them")
    ids = sorted(a)
    _, totals = speaker_totals(
        speakers=[str(a[i][0]) for i in ids],
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
    first = _runs(next(iter(results.values())))[0]
    metric = "WER" if first["task"] == "asr" else "accuracy"
    better = min if metric == "WER" else max
    lines = []
    hetero = "heterogeneous_layerwise_depth_aware"
    if any(k.startswith("centralized_") for k in results):
        lines += _table1_lines(results, best_exit, shallow, metric=metric, better=better)
    if hetero in results or "heterogeneous_fedavg_full" in results:
        lines += _table2_lines(results, best_exit, shallow, metric=metric)
    return "\n".join(lines)


def _table1_lines(results, best_exit, shallow, *, metric, better):
    """Table 1 (exit x scenario, best exit of each column in bold) and best exit - exit 12."""
    hetero = "heterogeneous_layerwise_depth_aware"
    lines = []
    columns = [
        ("centralized", {e: results.get(f"centralized_{e}") for e in EXITS}),
        ("homogeneous FL", {e: results.get(f"homogeneous_{e}") for e in EXITS}),
    ]
    if hetero in results:
        columns.append(
            (
                f"heterogeneous FL (exits {shallow}+{best_exit}, layer-wise depth-aware)",
                {e: results[hetero] for e in EXITS if str(e) in _runs(results[hetero])[0]["test"]},
            )
        )
    best = {}
    for name, runs in columns:
        scored = {e: _value(r, e) for e, r in runs.items() if r is not None}
        scored = {e: v for e, v in scored.items() if v is not None}
        top = better(scored.values()) if scored else None
        best[name] = [e for e in EXITS if e in scored and scored[e] == top]  # ties: all
    lines += [
        f"Table 1: test {metric} [95% CI] by exit and scenario (best exit of each column in bold)",
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
    against_12 = []
    for scenario in ("centralized", "homogeneous"):
        name = "centralized" if scenario == "centralized" else "homogeneous FL"
        tops = best.get(name) or []
        if not tops or f"{scenario}_12" not in results:
            continue
        if tops == [12]:
            against_12.append(f"- {name}: exit 12 is the best exit")
            continue
        e_best = tops[0]
        tie = " (tied best)" if 12 in tops else ""
        diff = paired_difference(
            results[f"{scenario}_{e_best}"], e_best, results[f"{scenario}_12"], 12
        )
        against_12.append(f"- {name}: exit {e_best} - exit 12{tie} = {_difference_text(diff)}")
    if against_12:
        lines += ["", "Best exit minus exit 12, same test clips (paired speaker bootstrap "
                  "95% CI):"] + against_12  # fmt: skip
    lines.append("")
    return lines


def _table2_lines(results, best_exit, shallow, *, metric):
    """Table 2 (the heterogeneous settings at both exits) and layer-wise - each baseline."""
    hetero = "heterogeneous_layerwise_depth_aware"
    lines = []
    lines += [
        f"Table 2: test {metric} [95% CI]; heterogeneous = 50% of clients at exit {shallow}, "
        f"50% at exit {best_exit}",
        "",
        f"| Setting | exit {shallow} | exit {best_exit} |",
        "|---|---|---|",
    ]
    names = (
        [
            (
                f"homogeneous_{shallow}",
                f"everyone at the weakest depth (homogeneous FL, exit {shallow})",
            ),
            (
                "heterogeneous_deep_only",
                f"deep clients only (the exit-{shallow} clients dropped)",
            ),
            ("heterogeneous_fedavg_full", "heterogeneous + fedavg_full"),
        ]
        + [
            (f"heterogeneous_layerwise_{w}", f"heterogeneous + layer-wise ({w})")
            for w in ("depth_aware", "samples", "uniform")
        ]
        + [
            (
                f"homogeneous_{best_exit}",
                f"every client deep (homogeneous FL, exit {best_exit})",
            )
        ]
    )
    for key, label in names:
        if key in results:
            r = results[key]
            lines.append(f"| {label} | {_cell(r, shallow)} | {_cell(r, best_exit)} |")
    if hetero in results:
        lines += ["", f"Layer-wise (depth_aware) at exit {best_exit} minus each baseline, "
                  "same test clips (paired speaker bootstrap 95% CI):"]  # fmt: skip
        against = [
            (
                f"homogeneous_{shallow}",
                shallow,
                f"everyone at exit {shallow} (its exit {shallow})",
            ),
            ("heterogeneous_deep_only", best_exit, "deep clients only"),
            ("heterogeneous_fedavg_full", best_exit, "fedavg_full"),
            ("heterogeneous_layerwise_samples", best_exit, "layer-wise (samples)"),
        ]
        for key, e, label in against:
            if key in results:
                diff = paired_difference(results[hetero], best_exit, results[key], e)
                lines.append(f"- minus {label}: {_difference_text(diff)}")
        if "heterogeneous_fedavg_full" in results:
            diff = paired_difference(
                results[hetero], shallow, results["heterogeneous_fedavg_full"], shallow
            )
            lines.append(f"- at exit {shallow}, minus fedavg_full: {_difference_text(diff)}")
        if len(_runs(results[hetero])) > 1:
            lines += per_seed_markdown(results, names, against, hetero, best_exit, shallow)
    return lines


def per_seed_markdown(results, names, against, hetero, best_exit, shallow):
    """Table 2 per seed: each cell's metric at both exits, then each paired difference.

    ``names`` are the table's ``(cell, label)`` rows and ``against`` its ``(cell, exit,
    label)`` baselines; a cell's runs are in the ``--seeds`` order, and the seeds are read
    from each run's ``results.json``. Returns the markdown lines.
    """
    seeds = [r.get("seed", k) for k, r in enumerate(_runs(results[hetero]))]
    lines = [
        "",
        f"Per seed, test metric at exit {shallow} / exit {best_exit}:",
        "",
        "| Setting | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
    ]
    for key, label in names:
        if key not in results:
            continue
        cells = []
        for run in _runs(results[key]):
            values = [run["test"].get(str(e)) for e in (shallow, best_exit)]
            metric = "WER" if any(v and "WER" in v for v in values) else "accuracy"
            cells.append(" / ".join("-" if v is None else f"{v[metric]:.3f}" for v in values))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Layer-wise (depth_aware) at exit {best_exit} minus each baseline, per seed:"]
    for key, e, label in against:
        if key not in results:
            continue
        pairs = zip(_runs(results[hetero]), _runs(results[key]), strict=True)
        diffs = [_difference_text(paired_difference(a, best_exit, b, e)) for a, b in pairs]
        lines.append(
            f"- minus {label}: "
            + "; ".join(f"seed {s} {d}" for s, d in zip(seeds, diffs, strict=True))
        )
    return lines


def write_readme(task, markdown, readme):
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
        exits = sorted(int(e) for e in _runs(r)[0]["test"])
        values = [_value(r, e) for e in exits]
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
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="one run per seed per cell (default: the hparams seed, one run)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these cells of the grid (names as in the tables)",
    )
    parser.add_argument("--best_exit", type=int, default=None, help="default: the task file's")
    parser.add_argument("--cache_folder", default=None, help="cache_folder override")
    parser.add_argument(
        "--readme", default=None, help="also write the tables between this file's markers"
    )
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
    shallow = int(hparams["shallow_exit"])
    cells = [c for c in grid(best, args.tables, shallow) if not args.only or c[0] in args.only]
    seeds = args.seeds or [int(hparams["seed"])]
    results = {}
    for name, overrides in cells:
        runs = [
            run(args.hparams, n, o, folder, extra) for n, o in seeded([(name, overrides)], seeds)
        ]
        results[name] = runs[0] if len(runs) == 1 else runs
    markdown = tables_markdown(results, best, shallow)
    plot(results, Path(folder) / "metric_by_exit.png")
    print("\n" + markdown)
    (Path(folder) / "tables.md").write_text(markdown + "\n", encoding="utf-8")
    if args.readme:
        write_readme(hparams["task"], markdown, args.readme)


if __name__ == "__main__":
    main()
