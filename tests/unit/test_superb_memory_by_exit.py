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
