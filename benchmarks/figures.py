#!/usr/bin/env python3
"""Write the engine-overhead figures of docs/benchmarks.md and README.md from their results file.

``benchmarks/fl_overhead.py --save benchmarks/measured/fl_overhead*.json`` measures (the
whole-run medians, ``--pairs`` against pfl-research, ``--breakdown``); this script renders what
it saved as the docs' tables (between ``<!-- fl_overhead:start -->`` and ``<!--
fl_overhead:end -->``, ``fl_overhead_pairs``, ``fl_overhead_breakdown``) and the README's
summary sentence (``<!-- benchmarks:start -->``), so none is typed by hand. ``--check`` only compares (``tests/unit/test_benchmark_figures.py``).

Run: ``python benchmarks/figures.py [--check]``
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speechbrain_fl.recipe.report import insert_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "measured"
DOCS, README = ROOT / "docs" / "benchmarks.md", ROOT / "README.md"
LABELS = {
    "plain": "plain loop",
    "brain": "plain loop, `Brain.fit` for the local steps",
    "local": "engine, `backend: local`",
    "ray": "engine, `backend: ray`",
    "local_rdp": "engine, `backend: local`, RDP accountant",
    "pfl": "pfl-research 0.6.0",
    "pfl_eps": "pfl-research 0.6.0, with its PLD accountant (`pfl_eps`)",
}


def _ratio(runs: dict, kind: str, base: str, metric: str) -> float:
    return runs[kind][metric] / runs[base][metric]


def docs_table(results: dict) -> str:
    """The whole-run / steady-round table: each kind's medians and its ratio to the plain loop.

    ratio = median(kind) / median(plain loop), both from the same interleaved passes.
    """
    runs = results["runs"]
    lines = [
        "| | whole run | vs plain | steady round | vs plain |",
        "|---|---|---|---|---|",
    ]
    for key, m in runs.items():
        kind, _, dp = key.partition(",")
        base = "plain" + (",dp" if dp else "")
        label = LABELS.get(kind, kind) + (", DP" if dp else "")
        lines.append(
            f"| {label} | {m['whole']:.2f} s | {_ratio(runs, key, base, 'whole'):.1f}x | "
            f"{m['steady'] * 1000:.0f} ms | {_ratio(runs, key, base, 'steady'):.1f}x |"
        )
    low, high = results["load_average"]
    lines.append("")
    lines.append(
        f"`{results['command']}`: {results['repeats']} interleaved passes, {results['rounds']} "
        f"rounds a run, medians; {results['machine']}, load average {low:.1f}-{high:.1f} at "
        "the runs' starts."
    )
    return "\n".join(lines)


def pairs_table(results: dict) -> str:
    """Ours / pfl-research over pairs of fresh processes: the median of the pairs' ratios
    r_i = t_ours,i / t_pfl,i, with their range."""
    lines = ["| ours / pfl-research | steady round | whole run |", "|---|---|---|"]
    for setting, label in (("no_dp", "no DP"), ("dp", "DP, pfl reporting its epsilon")):
        fig = results["settings"].get(setting)
        if fig:
            cells = [
                f"{fig[k]['ratio']:.2f}x (pairs {fig[k]['min']:.2f}-{fig[k]['max']:.2f})"
                for k in ("steady", "whole")
            ]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    pairs = max(fig["pairs"] for fig in results["settings"].values())
    lines += ["", f"`{results['command']}`: {pairs} pairs, {results['rounds']} rounds a run; "
                  f"{results['machine']}."]  # fmt: skip
    return "\n".join(lines)


def breakdown_table(results: dict) -> str:
    """Milliseconds per client update of each timed part (medians of the runs), nested parts
    indented under their part; the engine's whole steady round per client update and the
    plain loop's in the same runs."""
    settings = results["settings"]
    figs = sorted(settings.values(), key=lambda fig: -len(fig["parts"]))  # DP's has all parts
    order = list(dict.fromkeys(p[0] for fig in figs for p in fig["parts"]))
    depth = {p[0]: p[1] for fig in settings.values() for p in fig["parts"]}
    value = {s: {p[0]: p[2] for p in fig["parts"]} for s, fig in settings.items()}
    lines = ["| part | no DP | DP |", "|---|---|---|"]
    for label in order:
        cells = [f"{value[s][label]:.2f}" if label in value.get(s, {}) else "-"
                 for s in ("no_dp", "dp")]  # fmt: skip
        lines.append(f"| {'. ' * depth[label]}{label} | {cells[0]} | {cells[1]} |")
    for key, label in (("engine", "**steady round per client update**"),
                       ("plain", "plain loop, whole client update (same runs)")):  # fmt: skip
        cells = [f"{settings[s][key]:.2f}" if s in settings else "-" for s in ("no_dp", "dp")]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines += ["", f"`{results['command']}`: medians of {results['repeats']} runs, "
                  f"{results['machine']}."]  # fmt: skip
    return "\n".join(lines)


def readme_sentence(results: dict) -> str:
    """The README's summary: the engine's steady round and whole run against the two loops."""
    runs = results["runs"]
    steady = _ratio(runs, "local", "plain", "steady")
    steady_dp = _ratio(runs, "local,dp", "plain,dp", "steady")
    whole = _ratio(runs, "local", "plain", "whole")
    brain = _ratio(runs, "local", "brain", "steady")
    text = (
        f"on a toy workload (32 clients of a 101k-parameter MLP, 4 local steps each) a steady "
        f"round of the engine (local backend) takes {steady:.1f}x a plain torch loop's "
        f"({steady_dp:.1f}x with DP) and {brain:.1f}x that loop's with SpeechBrain's "
        f"`Brain.fit` for the local steps; a whole run, imports included, {whole:.1f}x"
    )
    pairs = results.get("pairs")
    if pairs:
        nodp, dp = pairs["settings"]["no_dp"], pairs["settings"]["dp"]
        text += (
            f"; against pfl-research on the same workload, a steady round takes "
            f"{nodp['steady']['ratio']:.2f}x pfl's ({dp['steady']['ratio']:.2f}x with DP) and "
            f"a whole run {nodp['whole']['ratio']:.2f}x ({dp['whole']['ratio']:.2f}x)"
        )
    low, high = results["load_average"]
    text += f" (measured with the machine busy: load average {low:.1f}-{high:.1f})."
    return textwrap.fill(text, width=96, break_on_hyphens=False)


def rendered() -> dict[Path, list[tuple[str, str]]]:
    """``{file: [(marker name, text), ...]}`` from the results files."""

    def read(name):
        path = RESULTS / f"{name}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    results, pairs = read("fl_overhead"), read("fl_overhead_pairs")
    tables = [("fl_overhead", docs_table(results))]
    if pairs:
        tables.append(("fl_overhead_pairs", pairs_table(pairs)))
    breakdown = read("fl_overhead_breakdown")
    if breakdown:
        tables.append(("fl_overhead_breakdown", breakdown_table(breakdown)))
    return {
        DOCS: tables,
        README: [("benchmarks", readme_sentence({**results, "pairs": pairs}))],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for path, tables in rendered().items():
        old = new = path.read_text(encoding="utf-8")
        for name, text in tables:
            new = insert_table(new, name, text)
        if new != old:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale figures in {', '.join(stale)}: run python benchmarks/figures.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
