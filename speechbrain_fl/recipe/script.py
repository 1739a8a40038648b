"""A recipe script's entry point: one module per script per process, then parse, check, lock, run.

Every recipe script (``train_fl.py``, ``train_teacher.py``, ...) ends the same way::

    if __name__ == "__main__":
        run_recipe(__file__)

:func:`run_recipe` imports the script as the federated engines import a task factory
(:func:`speechbrain_fl.fl.task.import_factory`, by its file path, once per process), so the
command line, the ServerApp and the local backend's clients share one copy of the module: one
``RECIPE``, one per-process model cache. Run as ``__main__`` instead, the script would be a
second copy beside the one the engine loads. It then calls ``RECIPE.run_script(argv,
main)`` (:meth:`Recipe.run_script`): SpeechBrain's ``sb.parse_arguments``, the layered hparams
(:func:`speechbrain_fl.recipe.hparams.load_run_hparams`), the recipe's checks before any work,
the run lock of the output folders, then the script's ``main(run)``.

:func:`recipe_module` is that import alone, for a script that runs another file's task (SUPERB's
``train_fl.py`` runs ``superb_task.py``'s). The recipe folder goes on ``sys.path`` and on the
``PYTHONPATH`` of the processes this one starts (Ray workers), so the recipe's own modules
(``mls_brain``, ``superb_data``) import as they do when the script runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from speechbrain_fl.recipe.hparams import load_run_hparams, resolve_hparams_path
from speechbrain_fl.utils.run_lock import RunLockedError
from speechbrain_fl.utils.run_lock import hold_run_lock as run_lock

__all__ = ["Recipe", "RecipeRun", "recipe_module", "run_recipe"]


def recipe_module(script: str | os.PathLike) -> ModuleType:
    """The module of a recipe file as every process of a run imports it (once per process).

    Example
    -------
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "my_recipe.py"
    >>> _ = path.write_text("RUNS = []\\n")
    >>> recipe_module(path) is recipe_module(str(path))
    True
    """
    from speechbrain_fl.fl.task import import_factory

    path = Path(script).resolve()
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, *paths) if p)
    # import_factory imports the script under one module name per process and returns an
    # attribute of it: its __name__ names the module
    return sys.modules[import_factory(f"{path}:__name__")]


def run_recipe(
    script: str | os.PathLike | ModuleType, argv: Sequence[str] | None = None, *, main: str = "main"
) -> Any:
    """Run a recipe script: ``RECIPE.run_script(argv, main)`` of its one module (see above).

    Arguments
    ---------
    script : str, PathLike or module
        The script (``__file__`` in its ``__main__``), or its module already imported.
    argv : sequence of str, optional
        The command line (default ``sys.argv[1:]``); a study passes its own.
    main : str
        The script's function run with the :class:`RecipeRun`.

    Returns
    -------
    Any
        What ``main`` returns.
    """
    module = script if isinstance(script, ModuleType) else recipe_module(script)
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{module.__file__}: RECIPE must be a speechbrain_fl.recipe.Recipe")
    return recipe.run_script(list(sys.argv[1:] if argv is None else argv), getattr(module, main))


@dataclass
class RecipeRun:
    """What the script's ``main`` works with (:meth:`Recipe.run_script`).

    Arguments
    ---------
    hparams : dict
        The loaded, debug-shrunk and checked hparams.
    run_opts : dict
        The SpeechBrain run options (a federated recipe: the supported ones the user set).
    hparams_path : str
        The resolved hparams file (given to the engine's task spec).
    overrides : dict
        Hparams overrides and run options in one mapping (the task spec's overrides).
    base_file : str
        The file the hparams were loaded from (copied as ``hyperparams.yaml``).
    merged : dict
        The hparams overrides applied to it.
    started : float
        ``time.time()`` when the command line was parsed (a run's total time starts there).
    """

    hparams: dict[str, Any]
    run_opts: dict[str, Any]
    hparams_path: str
    overrides: dict[str, Any] = field(default_factory=dict)
    base_file: str = ""
    merged: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    @property
    def experiment(self) -> dict[str, Any]:
        """The keyword arguments of ``sb.create_experiment_directory`` for this run."""
        kwargs = {
            "experiment_directory": self.hparams["output_folder"],
            "hyperparams_to_save": self.base_file,
            "overrides": self.merged,
        }
        if "log_config" in self.run_opts:
            kwargs["log_config"] = self.run_opts["log_config"]
        return kwargs


@dataclass
class Recipe:
    """A recipe script's frame: hparams loading and checks, the run lock (module docstring).

    Arguments
    ---------
    recipe_dir : Path
        The recipe folder: hparams paths resolve against it.
    check : callable
        Every value check of the recipe, before any work; raises ``ValueError`` (or
        ``OSError`` for a missing file) naming the key and value. ``check(hparams)``, or
        ``check(hparams, hparams_file, overrides)`` with ``check_source`` (to name the file
        and the command-line values in its messages).
    default_hparams : str, optional
        The hparams file of a task factory called without one.
    debug_caps, debug_values : mapping
        The ``--debug`` sizes (:func:`~speechbrain_fl.recipe.hparams.shrink_for_debug`).
    defaults : callable, optional
        ``defaults(hparams)``: fills values derived from others (before the debug sizes).
    lock_folders : callable, optional
        ``lock_folders(hparams) -> [folder, ...]``: the folders one run holds (default
        ``[output_folder]``), so a second run on them stops at once.
    check_source : bool
        Call ``check`` with the hparams file and the overrides too.
    """

    recipe_dir: Path
    check: Callable[..., None]
    default_hparams: str | None = None
    debug_caps: Mapping[str, Any] = field(default_factory=dict)
    debug_values: Mapping[str, Any] = field(default_factory=dict)
    defaults: Callable[[dict[str, Any]], None] | None = None
    lock_folders: Callable[[dict[str, Any]], Sequence[str | os.PathLike]] | None = None
    check_source: bool = False

    def run_options(self, run_opts: Mapping[str, Any]) -> dict[str, Any]:
        """The run options the recipe honours (all of them; a federated recipe filters)."""
        return dict(run_opts)

    def load(self, hparams_file, overrides=None, run_opts=None):
        """Hparams of a run (layered files, defaults, ``--debug`` sizes, checks), run options.

        Returns
        -------
        tuple
            ``(hparams, run_opts, base_file, merged_overrides)``.
        """
        run_opts = self.run_options(run_opts or {})
        # SpeechBrain's --debug: a run of seconds in <output_folder>_debug and
        # <cache_folder>_debug, its sizes in the merged overrides (the saved hyperparams.yaml)
        hparams, base_file, merged = load_run_hparams(
            hparams_file,
            overrides,
            recipe_dir=self.recipe_dir,
            debug=bool(run_opts.get("debug")),
            debug_caps=self.debug_caps,
            debug_values=self.debug_values,
            defaults=self.defaults,
        )
        if self.check_source:
            self.check(hparams, base_file, merged)
        else:
            self.check(hparams)
        return hparams, run_opts, base_file, merged

    def hparams_path(self, hparams_file) -> str:
        """The resolved hparams file (working directory, recipe folder, app root)."""
        return str(resolve_hparams_path(hparams_file, recipe_dir=self.recipe_dir))

    def parse(self, argv) -> RecipeRun:
        """A script's command line: ``sb.parse_arguments`` then :meth:`load` (nothing written)."""
        import speechbrain as sb

        started = time.time()
        hparams_file, sb_run_opts, overrides = sb.parse_arguments(list(argv))
        hparams, run_opts, base_file, merged = self.load(hparams_file, overrides, sb_run_opts)
        return RecipeRun(
            hparams=hparams,
            run_opts=run_opts,
            hparams_path=self.hparams_path(hparams_file),
            overrides={**merged, **run_opts},
            base_file=str(base_file),
            merged=merged,
            started=started,
        )

    def run_script(self, argv, main: Callable[[RecipeRun], Any]) -> Any:
        """Parse and check, lock the run's folders, run ``main(run)``.

        SpeechBrain's order: ``sb.parse_arguments`` -> hparams (every check, before any work)
        -> the recipe's ``main``, which starts with ``sb.create_experiment_directory``. A user
        error found before any work is one message naming the key or file, as argparse does
        (exit status 2), and so is an output folder another run holds (its pid named).
        """
        try:
            run = self.parse(argv)
        except (ValueError, OSError) as err:
            print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        folders = (
            self.lock_folders(run.hparams) if self.lock_folders else [run.hparams["output_folder"]]
        )
        with contextlib.ExitStack() as stack:
            try:
                for folder in folders:
                    stack.enter_context(run_lock(folder))
            except RunLockedError as err:
                print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
                raise SystemExit(2) from None
            return main(run)
