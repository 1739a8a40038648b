"""studies/er_folds.py: ER averaged over the five IEMOCAP sessions (hand values; the debug-size runs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "SUPERB"
sys.path[:0] = [str(RECIPE), str(RECIPE / "studies")]

from er_folds import average_folds, folds_table, main  # noqa: E402


def _result(values):
    return {
        "task": "er",
        "test": {e: {"accuracy": a, "ci95": [a - 0.1, a + 0.1]} for e, a in values.items()},
    }


def test_mean_and_sd_by_hand():
    folds = {1: {"3": 0.4, "9": 0.5}, 2: {"3": 0.6, "9": 0.7}, 3: {"3": 0.5, "9": 0.9}}
    out = average_folds({k: _result(v) for k, v in folds.items()})
    assert out["3"]["mean"] == pytest.approx(0.5)
    # sd over (0.4, 0.6, 0.5): sqrt((0.01 + 0.01 + 0) / 2) = 0.1
    assert out["3"]["sd"] == pytest.approx(0.1)
    assert out["9"]["mean"] == pytest.approx(0.7)
    assert out["9"]["sd"] == pytest.approx(math.sqrt((0.04 + 0 + 0.04) / 2))
    assert out["9"]["folds"] == {1: 0.5, 2: 0.7, 3: 0.9}
    table = folds_table(out)
    assert "session 3" in table and "0.7000" in table


def test_only_the_exits_every_fold_trained():
    out = average_folds({1: _result({"3": 0.4, "9": 0.5}), 2: _result({"9": 0.7})})
    assert list(out) == ["9"]
    one = average_folds({4: _result({"9": 0.3})})
    assert one["9"]["sd"] is None and one["9"]["mean"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="no fold results"):
        average_folds({})


def test_bad_fold_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not IEMOCAP sessions"):
        main(["--folds", "6", "--grid_folder", str(tmp_path)])


@pytest.mark.slow
@pytest.mark.heavy
def test_five_folds_on_the_generated_corpus_in_debug_size(tmp_path):
    """Every fold runs on the embedded corpus (--debug) and the mean is the folds' mean."""
    summary = main(
        [
            "--grid_folder",
            str(tmp_path / "folds"),
            "--",
            "--debug",
            "--cache_folder",
            str(tmp_path / "cache"),
            "--corpus_options",
            "{sessions: 5, utterances_per_emotion: 1}",
            "--num_clients",
            "2",
            "--measure_memory",
            "False",
        ]
    )
    sessions = set()
    for k in range(1, 6):
        result = json.loads((tmp_path / "folds" / f"fold{k}" / "results.json").read_text())
        assert result["task"] == "er"
        sessions.add(k)
        for e, entry in summary.items():
            assert entry["folds"][k] == pytest.approx(result["test"][e]["accuracy"])
    assert sessions == {1, 2, 3, 4, 5}
    for entry in summary.values():
        assert entry["mean"] == pytest.approx(sum(entry["folds"].values()) / 5)
    assert json.loads((tmp_path / "folds" / "folds.json").read_text()).keys() == summary.keys()
