"""Bad input is refused before any work: one table, ``tests/recipes/bad_inputs.csv``.

Each row (``recipe,script,hparams,flags,expected``) runs the recipe's real script with the
flags, a fresh output folder and a fresh cache folder. The run must fail, print ``expected`` (a
substring of the one error message naming the file, key or value), and leave both folders
uncreated: no corpus synthesis, no features, no pretraining, no experiment directory happened.
A new recipe adds rows.
"""

from __future__ import annotations

import pytest

from tests.recipes.runner import BAD_COLUMNS, ROOT, load_bad_inputs, run_bad_input

BAD_INPUTS = load_bad_inputs()


def test_bad_inputs_table_is_well_formed(tmp_path):
    for row in BAD_INPUTS:
        assert (ROOT / row.script).is_file() and (ROOT / row.hparams).is_file(), row.id
    bad = tmp_path / "b.csv"
    bad.write_text(",".join(BAD_COLUMNS) + "\nMLS,s.py,h.yaml,--x 1,\n")
    with pytest.raises(ValueError, match=r"b\.csv, line 2: every column is required"):
        load_bad_inputs(bad)


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[row.id for row in BAD_INPUTS])
def test_refused_before_any_work(row, tmp_path):
    proc = run_bad_input(row, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{row.id}: the run did not fail\n{output[-2000:]}"
    assert row.expected in output, f"{row.id}: {row.expected!r} not in\n{output[-3000:]}"
    assert not (tmp_path / "out").exists(), f"{row.id}: the output folder was created"
    assert not (tmp_path / "cache").exists(), f"{row.id}: work started in the cache folder"
