"""Every recipe hparams file runs end to end in ``--debug`` mode: one generic runner over
``tests/recipes/recipes.csv`` (SpeechBrain's ``tests/recipes/*.csv`` pattern).

Each row runs the real script on the real HyperPyYAML file with its debug flags (Flower's
Simulation Engine on Ray and the real privacy mechanisms, shrunk by ``--debug`` and the flags)
into a temporary output folder, then checks what its ``checks`` cell lists:

- ``file_exists=[a,b/c]``: files under the output folder;
- ``json_keys=[test.WER,privacy]``: dotted keys present (and not null) in ``results.json``;
- ``json_equals=[method=flat]``: a dotted key of ``results.json`` equal to a string;
- ``csv_rows=[rounds.csv=3]``: data rows of a CSV file under the output folder;
- ``stdout=[WER]``: text the script printed;
- ``results=[teacher/results.json]``: the JSON file the ``json_*`` checks read (default
  ``results.json``).

A row with ``depends=<row id>`` runs after that row in its output folder (a hand-off through
the outputs); ``marks=heavy`` leaves a row out of the default run and CI.

A new recipe adds rows; its recipe-specific invariants go to its own test file, which reads the
same runs through the ``recipe_run`` fixture of ``tests/recipes/conftest.py``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.recipes.runner import ROOT, ROWS, load_rows, lookup, parse_checks, results_file


def test_every_hparams_file_has_a_row():
    """One row per hparams file of every recipe that has rows (base and model presets aside)."""
    rows = {row.hparams for row in ROWS}
    for recipe in sorted({row.recipe for row in ROWS}):
        folder = ROOT / "recipes" / recipe / "hparams"
        files = {
            str(p.relative_to(ROOT))
            for p in folder.glob("*.yaml")
            if p.name != "base.yaml"  # the layer every method file sits on, not a run
        }
        assert files, f"recipes/{recipe}/hparams has no hparams file"
        assert files and files <= rows, f"no row in recipes.csv for {sorted(files - rows)}"
    for row in ROWS:
        assert (ROOT / row.script).is_file() and (ROOT / row.hparams).is_file(), row.id
        parse_checks(row.checks)


def test_every_recipe_has_rows():
    recipes = {p.parent.parent.name for p in (ROOT / "recipes").glob("*/hparams/*.yaml")}
    assert recipes <= {row.recipe for row in ROWS}, "a recipe without rows in recipes.csv"


HEADER = "recipe,script,hparams,flags,checks,depends,marks\n"


def test_malformed_csv_is_named(tmp_path):
    bad = tmp_path / "r.csv"
    bad.write_text("recipe,script,hparams,flags\nA,s.py,h.yaml,\n")
    with pytest.raises(ValueError, match=r"r\.csv: header must be"):
        load_rows(bad)
    bad.write_text(HEADER + "A,s.py,h/b.yaml,,,A/a,\nA,s.py,h/a.yaml,,,,\n")
    with pytest.raises(ValueError, match="A/b depends on 'A/a', not an earlier row"):
        load_rows(bad)
    bad.write_text(HEADER + "A,s.py,h/a.yaml,,,,fast\n")
    with pytest.raises(ValueError, match=r"A/a: unknown marks \['fast'\]"):
        load_rows(bad)
    with pytest.raises(ValueError, match="unknown check 'exists'"):
        parse_checks("exists=[a]")
    with pytest.raises(ValueError, match="cannot parse 'oops'"):
        parse_checks("file_exists=[a] oops")


@pytest.mark.slow
@pytest.mark.parametrize(
    "row_id",
    [pytest.param(row.id, marks=[getattr(pytest.mark, m) for m in row.mark_names]) for row in ROWS],
)
def test_recipe_debug_run(row_id, recipe_run):
    run = recipe_run(row_id)
    out: Path = run.output_folder
    checks = parse_checks(run.row.checks)
    missing = [name for name in checks.get("file_exists", []) if not (out / name).is_file()]
    assert not missing, f"{row_id}: missing outputs {missing}"
    if checks.get("json_keys") or checks.get("json_equals"):
        results = json.loads((out / results_file(checks)).read_text())
        for key in checks.get("json_keys", []):
            assert lookup(results, key) is not None, f"{row_id}: results.json {key} is null"
        for pair in checks.get("json_equals", []):
            key, expected = pair.split("=", 1)
            assert str(lookup(results, key)) == expected, f"{row_id}: results.json {key}"
    for pair in checks.get("csv_rows", []):
        name, count = pair.split("=", 1)
        with (out / name).open(newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))[1:]
        assert len(rows) == int(count), f"{row_id}: {name} has {len(rows)} data rows"
    for text in checks.get("stdout", []):
        assert text in run.stdout, f"{row_id}: {text!r} not printed"
