"""The recipe-facing bundle an engine runs, and how an engine finds it.

A federated recipe exposes one factory ``factory(hparams_path, overrides) -> FLTask`` (e.g.
:func:`speechbrain_fl.fl.toy.toy_task`, ``mls_task`` in ``recipes/MLS/train_fl.py``). Both
engines reach it through a :class:`TaskSpec`, ``"<module or script.py>:<factory>"`` plus the
hparams path and overrides:

- ``flwr run`` (simulation federation or Deployment Engine): :mod:`speechbrain_fl.fl.apps`
  reads the spec from the run config in the ServerApp and in every ClientApp;
- the Simulation Engine from a script: :func:`speechbrain_fl.fl.engine.run_simulation` given a
  spec ships only the spec to the Ray actors, which load the factory themselves.

Decision (ours): the factory may live in a recipe *script* (SpeechBrain's habit: ``train.py``
outside the package), named by a path relative to the app root, the folder holding the
``speechbrain_fl`` package and ``pyproject.toml`` (Flower's FAB root, whose ``fab-include``
lists the recipes). A script is imported once per process under a private module name
(:func:`import_factory`) and :func:`load_task` keeps one built task per spec per process, so a
Ray actor or a SuperNode runs the factory once, not once per message (Flower pickles the
ClientApp with every message; this cache is module-level and survives that).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from flwr.app import Context

from .client import ClientTask
from .server import ServerTask

__all__ = ["APP_ROOT", "FLTask", "TaskSpec", "import_factory", "load_task"]

APP_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TASK = "speechbrain_fl.fl.toy:toy_task"

_LOADED: dict[str, FLTask] = {}


@dataclass
class FLTask:
    """Builders of the two sides of a federated recipe.

    Arguments
    ---------
    build_client : callable
        ``build_client(context) -> ClientTask``.
    build_server : callable
        ``build_server(context) -> ServerTask``.
    num_partitions : int
        Number of clients K the data is partitioned into (SuperNodes in simulation).
    on_result : callable, optional
        ``on_result(result)``, called with the :class:`~speechbrain_fl.fl.server.ServerResult`
        in the ServerApp's process when the rounds end, on either engine (e.g. to write the
        final model as a checkpoint).
    info : dict
        What the factory wants its caller to see (e.g. the prepared paths); not used by engines.
    """

    build_client: Callable[[Context], ClientTask]
    build_server: Callable[[Context], ServerTask]
    num_partitions: int
    on_result: Callable[[Any], None] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """Where a recipe's factory is and what to call it with.

    Arguments
    ---------
    task : str
        ``"package.module:factory"`` or ``"path/to/script.py:factory"`` (relative to the working
        directory, then to :data:`APP_ROOT`).
    hparams : str, optional
        The hparams file passed to the factory.
    overrides : mapping
        Passed to the factory (JSON-serialisable values).

    Example
    -------
    >>> spec = TaskSpec.from_run_config({"task": "speechbrain_fl.fl.toy:toy_task",
    ...                                  "overrides": "{number_of_rounds: 2, num_partitions: 3}"})
    >>> spec.hparams, load_task(spec).num_partitions
    (None, 3)
    """

    task: str = DEFAULT_TASK
    hparams: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], node_config: Mapping[str, Any] | None = None
    ) -> TaskSpec:
        """Read a Flower run config: ``task``, ``hparams`` and ``overrides``.

        Flower only accepts run-config keys that ``[tool.flwr.app.config]`` declares, and its
        values are scalars, so the factory's overrides travel as one YAML mapping in the string
        ``overrides`` (e.g. ``"{number_of_rounds: 2, languages: [english, german]}"``), in the
        recipe's YAML vocabulary. A SuperNode's ``--node-config hparams=...`` wins over the run
        config's ``hparams``.
        """
        hparams = (node_config or {}).get("hparams") or run_config.get("hparams") or None
        text = str(run_config.get("overrides", "") or "")
        try:
            overrides = yaml.safe_load(text) if text.strip() else {}
        except yaml.YAMLError as err:
            raise ValueError(f"run config overrides={text!r} is not YAML: {err}") from err
        if not isinstance(overrides, dict):
            raise ValueError(f"run config overrides={text!r} must be a YAML mapping")
        return cls(
            task=str(run_config.get("task", DEFAULT_TASK)),
            hparams=str(hparams) if hparams else None,
            overrides=overrides,
        )

    @property
    def cache_key(self) -> str:
        """A stable text key of the spec (same spec, same key in every process)."""
        return json.dumps([self.task, self.hparams, dict(self.overrides)], sort_keys=True)


def import_factory(ref: str) -> Callable[..., FLTask]:
    """Import ``"module:factory"`` or ``"script.py:factory"`` (once per process).

    Raises
    ------
    ValueError
        Naming the reference when it is malformed or cannot be imported.
    """
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise ValueError(f"task {ref!r} must be 'package.module:factory' or 'script.py:factory'")
    try:
        if target.endswith(".py"):
            module = _import_script(target)
        else:
            module = importlib.import_module(target)
        return getattr(module, attr)
    except (ImportError, AttributeError, FileNotFoundError) as err:
        raise ValueError(f"task {ref!r} cannot be imported: {err}") from err


def _import_script(target: str):
    candidates = [Path(target), APP_ROOT / target]
    path = next((c.resolve() for c in candidates if c.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no script {target!r} (tried {', '.join(map(str, candidates))})")
    # a readable module name (it names the script's loggers: "SUPERB_superb_task - ..."); the
    # hashed one only if another file already holds that name in this process
    name = f"{path.parent.name}_{path.stem}"
    held = sys.modules.get(name)
    if held is not None and Path(getattr(held, "__file__", "") or "").resolve() != path:
        name = "_sbfl_task_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load_task(spec: TaskSpec) -> FLTask:
    """Build the spec's FLTask, once per process (see the module docstring)."""
    key = spec.cache_key
    if key not in _LOADED:
        factory = import_factory(spec.task)
        _LOADED[key] = factory(spec.hparams, dict(spec.overrides))
    return _LOADED[key]


class SpecClient:
    """Picklable ``build_client`` that loads the task from its spec in the worker process.

    Its ``cache_key`` lets :func:`speechbrain_fl.fl.client.make_client_app` keep the built
    ClientTask in the worker's module-level cache across messages.
    """

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.cache_key = spec.cache_key

    def __call__(self, context: Context) -> ClientTask:
        return load_task(self.spec).build_client(context)


class SpecServer:
    """Picklable ``build_server`` that loads the task from its spec."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec

    def __call__(self, context: Context) -> ServerTask:
        return load_task(self.spec).build_server(context)
