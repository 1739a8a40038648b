"""docs/adaptive_clipping.md's comparison with Flower is the study's results file, as generated.

The table between the ``adaptive-vs-flower`` markers is what ``benchmarks/adaptive_clip_vs_flower.py
--table`` prints from ``benchmarks/studies/adaptive_vs_flower.json``; the file's own figures hold
what the docs say of them (Flower's sigma_Delta is ours, the pair's epsilon is the accountant's).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "adaptive_clip_vs_flower.py"
RESULTS = ROOT / "benchmarks" / "studies" / "adaptive_vs_flower.json"
DOC = ROOT / "docs" / "adaptive_clipping.md"


def _script():
    spec = importlib.util.spec_from_file_location("adaptive_clip_vs_flower", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_table_is_the_results_file():
    result = json.loads(RESULTS.read_text())
    text = DOC.read_text()
    match = re.search(r"<!-- adaptive-vs-flower:start -->\n(.*?)\n<!-- adaptive-vs-flower:end -->",
                      text, re.S)  # fmt: skip
    assert match, "docs/adaptive_clipping.md lost its adaptive-vs-flower markers"
    assert match.group(1).strip() == _script().markdown_table(result).strip()


def test_results_file_supports_what_the_docs_say():
    result = json.loads(RESULTS.read_text())
    p = result["privacy"]
    assert p["flower_update_noise_multiplier"] == pytest.approx(p["our_update_noise_multiplier"])
    assert p["epsilon_pair_dp_accounting_rdp"] == pytest.approx(p["epsilon_ours_at_z_rdp"])
    last = result["settings"]["rounds"]
    ours = result["by_round"]["ours"][last]
    flower = result["by_round"]["flower"][last]
    fixed = result["by_round"]["flower_unclipped_bit"][last]
    assert flower["median_clip"] < ours["median_clip"] / 5  # Flower's clip runs away
    assert flower["ks_pvalue_vs_ours"] < 0.001
    assert fixed["ks_pvalue_vs_ours"] > 0.05  # one line changed: the same distribution
    rows = result["by_round"]["flower_unclipped_bit"][1 : last + 1]
    assert min(r["ks_pvalue_vs_ours"] for r in rows) > 0.05  # at no round either
