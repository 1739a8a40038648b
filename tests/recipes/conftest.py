"""Session fixtures that run the rows of ``tests/recipes/recipes.csv`` (``runner.py``).

A row runs at most once per pytest session (:func:`recipe_run`), so the generic runner
(``test_recipes.py``) and a recipe's own test file (e.g. ``test_mls_recipe.py``) check the same
outputs without a second run. Generated corpora and seed models go to one session cache folder
per recipe. A row with ``depends`` runs after that row, in its output folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.runner import ROWS, RecipeRun, run_script


@pytest.fixture(scope="session")
def recipe_cache(tmp_path_factory):
    """One cache folder per recipe for the whole session (corpora, seed models)."""
    root = tmp_path_factory.mktemp("recipe_cache")

    def folder(recipe: str) -> Path:
        path = root / recipe
        path.mkdir(exist_ok=True)
        return path

    return folder


@pytest.fixture(scope="session")
def recipe_run(tmp_path_factory, recipe_cache):
    """``recipe_run(row_id) -> RecipeRun``: runs a row of ``recipes.csv`` once per session."""
    done: dict[str, RecipeRun] = {}
    by_id = {row.id: row for row in ROWS}

    def run(row_id: str) -> RecipeRun:
        if row_id not in done:
            row = by_id[row_id]
            if row.depends:  # runs after the row it depends on, in that row's output folder
                out = run(row.depends).output_folder
            else:
                out = tmp_path_factory.mktemp(row_id.replace("/", "_")) / "out"
            proc = run_script(row, out, recipe_cache(row.recipe))
            done[row_id] = RecipeRun(row, out, proc.returncode, proc.stdout, proc.stderr)
        result = done[row_id]
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        return result

    return run
