"""The SUPERB run's output names: the folder names the deep exit, the table says '-' for memory.

a default run wrote ``heterogeneous_None`` (``exit: null``) and its
results table printed "None" in the memory columns when memory was not measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
sys.path.insert(0, str(RECIPE))

from superb_report import results_table  # noqa: E402
from superb_task import load_hparams  # noqa: E402


@pytest.mark.parametrize(
    ("hparams", "overrides", "folder"),
    [
        ("hparams/kws.yaml", {}, "kws12/heterogeneous_6/"),
        ("hparams/er.yaml", {}, "er/heterogeneous_9/"),
        ("hparams/kws.yaml", {"scenario": "homogeneous", "exit": 3}, "kws12/homogeneous_3/"),
        ("hparams/sid.yaml", {"scenario": "centralized"}, "sid/centralized_9/"),
    ],
)
def test_output_folder_names_the_exit(hparams, overrides, folder):
    loaded, _, _ = load_hparams(RECIPE / hparams, overrides)
    assert folder in loaded["output_folder"]
    assert "None" not in loaded["output_folder"]
    assert loaded["exit"] == int(folder.split("_")[-1].rstrip("/"))


def test_readmes_baselines_get_their_own_folders():
    """The README's baseline commands run one after another without a resume refusal.

    Each changes a key the engine refuses to change on resume (``shallow_clients``,
    ``depth_policy``, ``server_momentum``): their output folders must differ from the default's.
    """
    variants = [
        {},
        {"shallow_clients": "drop"},
        {"server_momentum": 0.9},
        {"depth_policy": "memory_budget", "client_memory_budgets_mb": [900, 1200, 2000]},
        {"aggregation": "fedavg_full"},
        {"weighting": "samples"},
    ]
    folders = [load_hparams(RECIPE / "hparams/kws.yaml", v)[0]["output_folder"] for v in variants]
    assert len(set(folders)) == len(folders), folders


def _results(memory):
    return {
        "task": "kws12",
        "scenario": "heterogeneous",
        "aggregation": "layerwise",
        "weighting": "depth_aware",
        "checkpoint": "tiny",
        "test": {"3": {"accuracy": 0.5, "ci95": [0.4, 0.6]}},
        "memory_mb": memory.get("parts", {}),
        "memory_saved_pct": memory.get("saved", {}),
        "memory_rss_mb": memory.get("rss", {}),
    }


def test_table_without_memory_says_not_measured():
    table = results_table(_results({}))
    assert "None" not in table
    assert "memory: not measured" in table
    row = next(line for line in table.splitlines() if line.strip().startswith("3"))
    assert row.count("-") >= 3  # train, saved and RSS cells


def test_table_with_memory_rounds_to_one_decimal():
    parts = {"3": {"total": 119.24, "weights": 1, "gradients": 1, "optimizer": 2}}
    table = results_table(_results({"parts": parts, "saved": {"3": 43.27}, "rss": {"3": 826.04}}))
    assert "119.2" in table and "43.3" in table and "826.0" in table
    assert "not measured" not in table and "None" not in table
