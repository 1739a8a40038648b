"""The recipe kit: the frame every recipe of this repository shares, one module per job.

- :mod:`~speechbrain_fl.recipe.script`: a script's entry point (:func:`run_recipe`: the script's
  one module per process, then parse, check, lock, ``main(run)``) and :class:`Recipe`;
- :mod:`~speechbrain_fl.recipe.hparams`: the hparams path lookup (working directory, then the
  recipe folder), layered method files on a ``base.yaml``, the ``--debug`` sizes and
  folders;
- :mod:`~speechbrain_fl.recipe.run_options`: SpeechBrain's run options in a federated run;
- :mod:`~speechbrain_fl.recipe.prepare`: prepare once per run (keyed on what the preparation
  read), the prepare-options record;
- :mod:`~speechbrain_fl.recipe.seed_model`: the cached seed model (key, build, save);
- :mod:`~speechbrain_fl.recipe.settings`: :class:`RunSettings`, the typed prepared run;
- :mod:`~speechbrain_fl.recipe.federated`: :class:`FederatedRecipe`, the skeleton (load,
  settings once per run, per-process model cache, builders -> FLTask, simulation);
- :mod:`~speechbrain_fl.recipe.report`: results.json, the results table, README tables;
- :func:`run_lock` (:func:`speechbrain_fl.utils.run_lock.hold_run_lock`): one run per output folder.

A recipe keeps what is its own: its Brain, its data pipeline, its analysis
(``docs/adding_a_recipe.md``).
"""

from speechbrain_fl.recipe.federated import FederatedRecipe, ModelCache
from speechbrain_fl.recipe.hparams import (
    APP_ROOT,
    debug_folder,
    debug_overrides,
    load_layered_hparams,
    load_run_hparams,
    resolve_hparams_path,
    shrink_for_debug,
)
from speechbrain_fl.recipe.prepare import (
    OPTIONS_FILE,
    PREPARED_FILE,
    InputRecorder,
    canonical,
    prepare_once,
    prepared_with,
    save_prepare_options,
)
from speechbrain_fl.recipe.report import (
    insert_table,
    markers,
    print_summary,
    timing_line,
    update_readme_table,
    write_results,
    write_rows,
)
from speechbrain_fl.recipe.run_options import (
    REFUSED_RUN_OPTIONS,
    SUPPORTED_RUN_OPTIONS,
    federated_run_options,
    split_overrides,
)
from speechbrain_fl.recipe.script import Recipe, RecipeRun, recipe_module, run_recipe
from speechbrain_fl.recipe.seed_model import cache_tag, cached_seed_model, file_digest
from speechbrain_fl.recipe.settings import RunSettings
from speechbrain_fl.run_outputs import render_table
from speechbrain_fl.utils.run_lock import hold_run_lock as run_lock

__all__ = [
    "APP_ROOT",
    "FederatedRecipe",
    "InputRecorder",
    "ModelCache",
    "OPTIONS_FILE",
    "PREPARED_FILE",
    "REFUSED_RUN_OPTIONS",
    "Recipe",
    "RecipeRun",
    "RunSettings",
    "SUPPORTED_RUN_OPTIONS",
    "cache_tag",
    "cached_seed_model",
    "canonical",
    "debug_folder",
    "debug_overrides",
    "federated_run_options",
    "file_digest",
    "insert_table",
    "load_layered_hparams",
    "load_run_hparams",
    "markers",
    "prepare_once",
    "prepared_with",
    "print_summary",
    "recipe_module",
    "render_table",
    "resolve_hparams_path",
    "run_lock",
    "run_recipe",
    "save_prepare_options",
    "shrink_for_debug",
    "split_overrides",
    "timing_line",
    "update_readme_table",
    "write_results",
    "write_rows",
]
