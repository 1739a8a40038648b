"""The studies script's tables and README rewriting (no training: synthetic results)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "Private-Gender"))

import studies  # noqa: E402


def _res(bacc, majpred, eps=0.99, aux=380):
    block = {"balanced_accuracy": {"value": bacc, "ci": [bacc - 0.1, bacc + 0.1]},
             "macro_f1": {"value": bacc, "ci": [0.0, 1.0]},
             "majpred": {"value": majpred, "ci": [majpred, majpred]}}  # fmt: skip
    return {"privacy": {"epsilon": eps}, "dp_direct": block, "test": block,
            "kd": {"aux_records": aux}}  # fmt: skip


def test_tables_and_readme_block(tmp_path):
    results = {
        "epsilon": {"1.0": _res(0.4, 1.0), "None": _res(0.9, 0.7, eps=None)},
        "binary": _res(0.9, 0.7),  # one run stored unwrapped
        "aux": {"25": _res(0.6, 0.8, aux=25)},
    }
    built = studies.tables(results)
    assert len(built) == 3
    eps_table = next(t for k, t in built.items() if k.startswith("Epsilon"))
    # Results written before the joint figure existed show "-" in the joint column.
    assert "| target ε = ∞ (no DP) | ∞ (no DP) | - | 0.900 [0.80, 1.00]" in eps_table
    joint = {**_res(0.4, 1.0), "privacy_joint": {"epsilon": 1.43}}
    assert studies._row("r", joint)[:3] == ["r", "0.99", "1.43"]
    assert "\\|D_aux\\| = 25" in next(t for k, t in built.items() if k.startswith("|D_aux|"))
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{studies.BEGIN}\nold\n{studies.END}\ntail\n")
    studies.write_readme(built, readme, "note\n")
    text = readme.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text
    assert text.count("####") == 3
    with pytest.raises(ValueError, match="no <!-- studies:begin -->"):
        (tmp_path / "other.md").write_text("nothing")
        studies.write_readme(built, tmp_path / "other.md", "note")
