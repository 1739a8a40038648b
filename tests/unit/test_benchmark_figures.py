"""The engine-overhead figures of README.md and docs/benchmarks.md are their results files'."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _figures():
    spec = importlib.util.spec_from_file_location(
        "bench_figures", ROOT / "benchmarks" / "figures.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_docs_figures_match_the_results_files(capsys):
    assert _figures().main(["--check"]) == 0, capsys.readouterr().out


def test_the_ratios_are_each_kind_over_the_plain_loop_of_its_setting():
    figures = _figures()
    results = {
        "command": "c", "rounds": 10, "repeats": 3, "machine": "m", "load_average": [1.0, 2.0],
        "runs": {
            "plain": {"whole": 2.0, "steady": 0.1}, "local": {"whole": 3.0, "steady": 0.15},
            "brain": {"whole": 4.0, "steady": 0.3}, "plain,dp": {"whole": 2.0, "steady": 0.05},
            "local,dp": {"whole": 5.0, "steady": 0.1},
        },
    }  # fmt: skip
    table = figures.docs_table(results)
    assert "| engine, `backend: local` | 3.00 s | 1.5x | 150 ms | 1.5x |" in table
    assert "| engine, `backend: local`, DP | 5.00 s | 2.5x | 100 ms | 2.0x |" in table
    sentence = figures.readme_sentence({**results, "pairs": None})
    assert "1.5x a plain torch loop's (2.0x with DP) and 0.5x that loop's" in sentence
