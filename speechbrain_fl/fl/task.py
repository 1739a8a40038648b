"""The recipe-facing bundle an engine runs, and how an engine finds it.

A federated recipe exposes one factory ``factory(hparams_path, overrides) -> FLTask`` (e.g.
:func:`speechbrain_fl.fl.toy.toy_task`, ``mls_task`` in ``recipes/MLS/train_fl.py``). Both
engines reach it through a :class:`TaskSpec`, ``"<module or script.py>:<factory>"`` plus the
hparams path and overrides:

- ``flwr run`` (simulation federation or Deployment Engine): :mod:`speechbrain_fl.fl.engines.flwr_apps`
  reads the spec from the run config in the ServerApp and in every ClientApp;
- the Simulation Engine from a script: :func:`speechbrain_fl.fl.engines.run.run_simulation` given a
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

from speechbrain_fl.fl.clientapp.train import ClientTask
from speechbrain_fl.fl.serverapp.task import ServerTask
from speechbrain_fl.fl.settings.secagg import trust_model

__all__ = ["APP_ROOT", "FLTask", "TaskSpec", "import_factory", "load_task", "resolved_settings"]

APP_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TASK = "speechbrain_fl.fl.toy:toy_task"

_LOADED: dict[str, FLTask] = {}

TYPED_KEYS: dict[str, tuple[str, type]] = {
    "num-server-rounds": ("number_of_rounds", int),
    "sampling-rate": ("sampling_rate", float),
    "method": ("method", str),
    "clip": ("clip", float),
    "noise-multiplier": ("noise_multiplier", float),
    "local-epochs": ("local_epochs", int),
}
"""Typed run-config keys (Flower's kebab-case) and the recipe YAML keys they set."""
UNSET: dict[type, Any] = {int: -1, float: -1, str: ""}
"""The value of a typed key that keeps the hparams file's value (TOML has no null)."""


def _typed(key: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``; ``ValueError`` naming the key when it is not one."""
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"run config {key}={value!r} must be a string")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"run config {key}={value!r} must be a number")
    if kind is int:
        if float(value) != int(value):
            raise ValueError(f"run config {key}={value!r} must be an integer")
        return int(value)
    return float(value)


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
        ``on_result(result)``, called with the :class:`~speechbrain_fl.fl.serverapp.task.ServerResult`
        in the ServerApp's process when the rounds end, on either engine (e.g. to write the
        final model as a checkpoint).
    info : dict
        What the factory wants its caller to see (e.g. the prepared paths); not used by engines.
    node_setup : dict, optional
        What the ServerApp of ``flwr run`` sends each SuperNode before the first round, beside
        the frozen base's fingerprint (:mod:`speechbrain_fl.fl.engines.flwr_apps`): ``prepared``, the run's
        prepared settings (JSON), and ``model_folder``, a local model folder shipped whole when
        small (:func:`speechbrain_fl.fl.node_data.pack_folder`). ``None``: the task needs no
        settings from the server (the toy) and the nodes build their own base.
    """

    build_client: Callable[[Context], ClientTask]
    build_server: Callable[[Context], ServerTask]
    num_partitions: int
    on_result: Callable[[Any], None] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    node_setup: dict[str, Any] | None = None


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
        """Read a Flower run config: the typed keys, ``task``, ``hparams`` and ``overrides``.

        The settings users change most are typed kebab-case keys (:data:`TYPED_KEYS`, declared
        in ``[tool.flwr.app.config]``): ``num-server-rounds``, ``sampling-rate``, ``method``,
        ``clip``, ``noise-multiplier``, ``local-epochs``. A typed key left at its "unset" value
        (``-1``, or ``""`` for ``method``: TOML has no null) keeps the hparams file's value.
        Everything else travels as one YAML mapping in the string ``overrides`` (e.g.
        ``"{languages: [english, german]}"``), in the recipe's YAML vocabulary, as Flower's
        values are scalars. A typed key and the same key in ``overrides`` with another value is
        refused (which one wins would be a guess). A SuperNode's ``--node-config hparams=...``
        wins over the run config's ``hparams``.

        Example
        -------
        >>> spec = TaskSpec.from_run_config({"num-server-rounds": 3, "clip": -1, "method": "",
        ...                                  "overrides": "{num_partitions: 2}"})
        >>> dict(spec.overrides)
        {'num_partitions': 2, 'number_of_rounds': 3}
        """
        hparams = (node_config or {}).get("hparams") or run_config.get("hparams") or None
        text = str(run_config.get("overrides", "") or "")
        try:
            overrides = yaml.safe_load(text) if text.strip() else {}
        except yaml.YAMLError as err:
            raise ValueError(f"run config overrides={text!r} is not YAML: {err}") from err
        if not isinstance(overrides, dict):
            raise ValueError(f"run config overrides={text!r} must be a YAML mapping")
        for flower_key, (yaml_key, kind) in TYPED_KEYS.items():
            value = run_config.get(flower_key, UNSET[kind])
            if value == UNSET[kind] or value is None:
                continue
            value = _typed(flower_key, value, kind)
            if yaml_key in overrides and overrides[yaml_key] != value:
                raise ValueError(
                    f"run config {flower_key}={value!r} and overrides {yaml_key}: "
                    f"{overrides[yaml_key]!r} disagree; give one"
                )
            overrides[yaml_key] = value
        unknown = sorted(set(run_config) - set(TYPED_KEYS) - {"task", "hparams", "overrides"})
        if unknown:
            raise ValueError(f"run config: unknown key(s) {unknown}")
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
    """Build the spec's FLTask, once per process (see the module docstring).

    On a data-owning SuperNode (:func:`speechbrain_fl.fl.node_data.current_node`) the task is
    built for that node's data and cached under it too.
    """
    from speechbrain_fl.fl.node_data import current_node

    key = spec.cache_key
    bound = current_node()
    if bound is not None:
        key = json.dumps([key, bound[0].key, bool(bound[1])], sort_keys=True)
    if key not in _LOADED:
        factory = import_factory(spec.task)
        _LOADED[key] = factory(spec.hparams, dict(spec.overrides))
    return _LOADED[key]


class SpecClient:
    """Picklable ``build_client`` that loads the task from its spec in the worker process.

    Its ``cache_key`` lets :func:`speechbrain_fl.fl.clientapp.train.make_client_app` keep the built
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


RESOLVED_FIELDS = ("num_rounds", "sampling_rate", "method", "clip", "noise_multiplier",
                   "local_epochs", "delta", "max_epsilon", "accountant", "population_size",
                   "noise_cohort_size", "accounting_population", "secure_aggregation",
                   "output_folder")  # fmt: skip


def resolved_settings(config: Any) -> str:
    """One line of the federated settings a run resolved to (both engines log it at start).

    The script (``run_simulation``) and ``flwr run`` (the ServerApp) print the same line for
    the same hparams, whatever way the values came (hparams file, typed run-config keys,
    overrides). It ends with the run's trust model (results.json's ``privacy.trust_model``
    name, :func:`speechbrain_fl.fl.settings.secagg.trust_model`), so a ``flwr run`` whose recipe writes no
    results.json still states in the ServerApp's log whether the server saw each update.

    Example
    -------
    >>> from speechbrain_fl.fl.settings.config import FLConfig
    >>> resolved_settings(FLConfig(output_folder="o", num_rounds=2))[:45]
    'federated settings: num_rounds=2 sampling_rat'
    >>> resolved_settings(FLConfig(output_folder="o")).split()[-1]
    "trust_model='central'"
    """
    values = " ".join(f"{name}={getattr(config, name, None)!r}" for name in RESOLVED_FIELDS)
    line = f"federated settings: {values}"
    if hasattr(config, "secure_aggregation"):
        line += f" trust_model={trust_model(config)['name']!r}"
    return line
