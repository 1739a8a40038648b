"""results_table.py: the grid of runs and the tables' layout, from fake results.json content."""

from __future__ import annotations

import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
sys.path.insert(0, str(RECIPE))

from results_table import grid, tables_markdown, write_readme  # noqa: E402


def _result(values):
    return {
        "task": "kws12",
        "test": {str(e): {"accuracy": v, "ci95": [v - 0.1, v + 0.1]} for e, v in values.items()},
    }


def test_grid_covers_both_tables():
    names = [n for n, _ in grid(6, [1, 2])]
    assert {f"centralized_{e}" for e in (3, 6, 9, 12)} <= set(names)
    assert "homogeneous_6" in names and names.count("homogeneous_6") == 1
    assert "heterogeneous_fedavg_full" in names
    assert {n for n, _ in grid(6, [2])} == {
        "homogeneous_6",
        "heterogeneous_fedavg_full",
        "heterogeneous_layerwise_depth_aware",
        "heterogeneous_layerwise_samples",
        "heterogeneous_layerwise_uniform",
    }


def test_tables_markdown_and_readme_markers(tmp_path):
    results = {
        f"{s}_{e}": _result({e: 0.5}) for s in ("centralized", "homogeneous") for e in (3, 6, 9, 12)
    }
    results["heterogeneous_fedavg_full"] = _result({3: 0.3, 6: 0.4})
    results["heterogeneous_layerwise_depth_aware"] = _result({3: 0.6, 6: 0.7})
    text = tables_markdown(results, 6)
    assert "| centralized | 0.500 [0.400, 0.600] |" in text
    assert "| heterogeneous + fedavg_full | 0.300 [0.200, 0.400] | 0.400 [0.300, 0.500] |" in text
    assert "layer-wise (depth_aware) | 0.600" in text and "uniform" not in text
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- results:kws12:start -->\nold\n<!-- results:kws12:end -->\nb\n")
    write_readme("kws12", text, readme)
    content = readme.read_text()
    assert "old" not in content and "Table 2" in content and content.endswith("b\n")
