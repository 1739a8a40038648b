#!/usr/bin/env python3
"""Write the engine-overhead figures of docs/benchmarks.md and README.md from their results file.

``benchmarks/fl_overhead.py --save benchmarks/results/fl_overhead.json`` measures; this script
renders the medians it saved as the docs' table (between ``<!-- fl_overhead:start -->`` and
``<!-- fl_overhead:end -->``) and the README's summary sentence (``<!-- benchmarks:start -->``),
so neither is typed by hand. ``--check`` only compares (``tests/unit/test_benchmark_figures.py``).

Run: ``python benchmarks/figures.py [--check]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speechbrain_fl.recipe.report import insert_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "fl_overhead.json"
DOCS, README = ROOT / "docs" / "benchmarks.md", ROOT / "README.md"
LABELS = {
    "plain": "plain loop",
    "brain": "plain loop, `Brain.fit` for the local steps",
    "local": "engine, `backend: local`",
    "ray": "engine, `backend: ray`",
    "local_rdp": "engine, `backend: local`, RDP accountant",
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


def readme_sentence(results: dict) -> str:
    """The README's summary: the engine's steady round and whole run against the two loops."""
    runs = results["runs"]
    steady = _ratio(runs, "local", "plain", "steady")
    steady_dp = _ratio(runs, "local,dp", "plain,dp", "steady")
    whole = _ratio(runs, "local", "plain", "whole")
    brain = _ratio(runs, "local", "brain", "steady")
    return (
        f"on a toy workload (32 clients of a 101k-parameter MLP, 4 local steps each) a steady "
        f"round of the engine (local backend) takes {steady:.1f}x a plain torch loop's "
        f"({steady_dp:.1f}x with DP) and {brain:.1f}x that loop's with SpeechBrain's "
        f"`Brain.fit` for the local steps; a whole run, imports included, {whole:.1f}x"
    )


def rendered() -> dict[Path, tuple[str, str]]:
    """``{file: (marker name, text)}`` from the results file."""
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    return {
        DOCS: ("fl_overhead", docs_table(results)),
        README: ("benchmarks", readme_sentence(results)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for path, (name, text) in rendered().items():
        old = path.read_text(encoding="utf-8")
        new = insert_table(old, name, text)
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
