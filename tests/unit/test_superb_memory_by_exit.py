"""The memory study prints every exit of a task file, its parts, and exit 3's saving."""

from __future__ import annotations

import sys
from pathlib import Path

STUDIES = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB" / "studies"
sys.path.insert(0, str(STUDIES))


def test_memory_study_measures_every_exit_of_the_task_file(tmp_path, capsys):
    from memory_by_exit import main

    figures = main(["hparams/kws.yaml", "--seconds", "0.25", "--cache_folder", str(tmp_path)])
    assert sorted(figures) == [3, 6, 9, 12]
    totals = [figures[d]["total"] for d in sorted(figures)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    out = capsys.readouterr().out
    assert "kws12, model tiny, batch 8 x 0.25 s, method tensors" in out
    assert "Saved at exit 3 vs exit 12" in out and "43.27%" in out


def test_per_task_compares_exit_3_with_exit_12_under_both_measures(tmp_path):
    import json

    from memory_by_exit import main

    path = tmp_path / "memory.json"
    out = main(["--per_task", str(path), "--batch_size", "1", "--cache_folder", str(tmp_path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert [(r["task"], r["front_end"]) for r in out["rows"]] == [
        (task, front) for task in ("kws12", "sid", "er", "asr") for front in ("frozen", "trained")
    ]
    for row in out["rows"]:
        for measure in ("saved", "peak", "resident"):
            m = row[measure]
            assert 0 < m["exit3_mib"] < m["exit12_mib"]
            assert m["saving_pct"] == round(
                100 * (1 - m["exit3"]["total"] / m["exit12"]["total"]), 2
            )
        # the moments are held through the measured step: the peak holds weights and moments
        peak = row["peak"]["exit12"]
        assert peak["total"] >= peak["weights"] + peak["optimizer"] > 0
    assert set(out["paper_order_kws_sid_er_asr"]) == {
        f"{m}_{f}" for m in ("saved", "peak", "resident") for f in ("frozen", "trained")
    }
