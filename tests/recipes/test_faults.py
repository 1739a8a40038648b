"""Faults met during a run: one table, ``tests/recipes/faults.csv``.

Each row (``recipe,script,hparams,flags,fault,target,expected``) takes the session cache of
the ``recipes.csv`` row with the same script and hparams (its generated corpus and seed model,
made by that row's run), copies it, injects the fault into the copy (``runner.inject_fault``:
``unreadable_train_file`` overwrites the first training file matching ``target`` with text,
``undecodable_train_file`` its frames after the header with noise), and
runs the script with the row's flags on the copy, in a fresh output folder. ``expected``:

- ``finishes:<results file>:<dotted key>``: the run exits 0, its log names the file, and the
  value at the key of the results file (a list or mapping) names it;
- ``counted:<results file>:<dotted key>``: the run exits 0, its log names the file, and the
  value at the key is a count of at least 1 (the server holds counts, never the file's name);
- ``refused:<text>``: the run stops before any training with one ``<script>: error: ...`` line
  containing ``text`` and the file's name.

A new recipe adds rows.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.recipes.runner import (
    FAULT_COLUMNS,
    ROOT,
    ROWS,
    inject_fault,
    load_faults,
    lookup,
    run_fault,
)

FAULTS = load_faults()
RECIPE_ROWS = {(row.script, row.hparams): row for row in ROWS}


def test_faults_table_is_well_formed(tmp_path):
    for row in FAULTS:
        assert (ROOT / row.script).is_file() and (ROOT / row.hparams).is_file(), row.id
        assert (row.script, row.hparams) in RECIPE_ROWS, f"{row.id}: no recipes.csv row"
    bad = tmp_path / "f.csv"
    bad.write_text(",".join(FAULT_COLUMNS) + "\nMLS,s.py,h.yaml,--x 1,power_cut,a/*.flac,x\n")
    with pytest.raises(ValueError, match=r"f\.csv, line 2: fault 'power_cut'"):
        load_faults(bad)


def _names(value, name: str) -> bool:
    """Whether a list or mapping (its keys) holds an entry ending with the file's name."""
    entries = list(value) if isinstance(value, (list, dict)) else []
    return any(str(entry).endswith(name) for entry in entries)


@pytest.mark.slow
@pytest.mark.parametrize("row", FAULTS, ids=[row.id for row in FAULTS])
def test_fault(row, tmp_path, recipe_run, recipe_cache):
    recipe_run(RECIPE_ROWS[(row.script, row.hparams)].id)  # warms the recipe's session cache
    cache = tmp_path / "cache"
    shutil.copytree(recipe_cache(row.recipe), cache)
    broken = inject_fault(row, cache)
    proc = run_fault(row, tmp_path / "out", cache)
    output = proc.stdout + proc.stderr
    kind, parts = row.outcome
    if kind == "refused":
        assert proc.returncode == 2, f"{row.id}: not refused\n{output[-3000:]}"
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and parts[0] in errors[0] and broken.name in errors[0], output
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, f"{row.id}: the run failed\n{output[-5000:]}"
    assert broken.name in output, f"{row.id}: no log line names {broken}"
    results = json.loads((tmp_path / "out" / parts[0]).read_text())
    if kind == "counted":
        count = lookup(results, parts[1])
        assert isinstance(count, int) and count >= 1, f"{row.id}: {parts[1]} is {count!r}"
        return
    assert _names(
        lookup(results, parts[1]), broken.name
    ), f"{row.id}: {parts[1]} does not name {broken.name}: {lookup(results, parts[1])}"
