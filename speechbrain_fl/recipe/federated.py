"""The federated recipe skeleton: load a run, prepare it once, build both sides, simulate.

Every federated recipe (MLS, SUPERB) has the same frame around what is its own (its Brain, its
data pipeline, its analysis):

1. **load** (:meth:`FederatedRecipe.load`): SpeechBrain's run options checked for a federated
   run, the layered hparams (:mod:`speechbrain_fl.recipe.hparams`), the recipe's defaults, the
   ``--debug`` sizes, then every value check of the recipe, before any corpus, feature or
   pretraining work;
2. **settings once per run** (:meth:`FederatedRecipe.prepare`): the first process of the run
   prepares data and the seed model, the others read ``<save_folder>/prepared.json``
   (:func:`speechbrain_fl.recipe.prepare.prepare_once`), as typed
   :class:`~speechbrain_fl.recipe.settings.RunSettings`;
3. **a per-process model cache** (:class:`ModelCache`): a Ray actor or SuperNode trains many
   clients one after another on one model (the engine loads the global tensors before each
   local training and restores them after), so a process builds it once;
4. **the task** (:meth:`FederatedRecipe.task`): the client and server builders bound to the
   settings as an :class:`~speechbrain_fl.fl.task.FLTask`, the one factory both engines load
   (``<recipe>/<script>.py:<factory>``);
5. **the simulation run** (:meth:`FederatedRecipe.simulate`): the task's spec on Flower's
   Simulation Engine from the script, under the output folder's run lock.

The script's entry point (:func:`speechbrain_fl.recipe.script.run_recipe`: the script's one
module, ``sb.parse_arguments``, the checked hparams, the run lock, then the recipe's ``main``)
and its report (:mod:`speechbrain_fl.recipe.report`) complete a recipe; see
``docs/adding_a_recipe.md``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from speechbrain_fl.recipe.prepare import prepare_once
from speechbrain_fl.recipe.run_options import federated_run_options, split_overrides
from speechbrain_fl.recipe.script import Recipe, RecipeRun
from speechbrain_fl.recipe.settings import RunSettings

__all__ = ["FederatedRecipe", "ModelCache", "RecipeRun"]


class ModelCache:
    """One model per process, rebuilt only when its key changes.

    Example
    -------
    >>> cache, calls = ModelCache(), []
    >>> build = lambda: calls.append(1) or object()
    >>> cache.get({"seed": 1}, build) is cache.get({"seed": 1}, build), len(calls)
    (True, 1)
    >>> _ = cache.get({"seed": 2}, build); len(calls)
    2
    """

    def __init__(self) -> None:
        self._key: str | None = None
        self._model: Any = None

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        """The model for ``key`` (JSON-comparable), built with ``build()`` when new."""
        text = json.dumps(key, sort_keys=True, default=str)
        if text != self._key:
            self._model = None  # free the old model before building the new one
            self._model = build()
            self._key = text
        return self._model

    def clear(self) -> None:
        """Forget the model."""
        self._key, self._model = None, None


@dataclass
class FederatedRecipe(Recipe):
    """A federated recipe's frame (see the module docstring).

    Arguments
    ---------
    recipe_dir, check, default_hparams, debug_caps, debug_values, defaults :
        As in :class:`~speechbrain_fl.recipe.script.Recipe` (``default_hparams``: the file of
        a factory called without one, ``hparams/fedavg.yaml``).
    task_ref : str
        The task factory as the engines load it, ``"<path to script>.py:<factory>"``.
    node_manifest : callable, optional
        ``node_manifest(node, hparams) -> str``: a data-owning SuperNode's training manifest,
        prepared from its ``data-folder`` in the recipe's real layout (only that folder);
        default ``data-manifest`` or ``<data-folder>/train.csv``
        (:class:`~speechbrain_fl.fl.node_data.NodeData`).
    """

    task_ref: str = ""
    node_manifest: Callable[[Any, dict[str, Any]], str] | None = None
    # the runs this process loaded, by the cache key of the spec that runs them (:meth:`spec`)
    _runs: dict[str, RecipeRun] = field(default_factory=dict, init=False, repr=False)

    # -- 1. load --------------------------------------------------------------------------
    def run_options(self, run_opts):
        """The run options a federated run honours; the others are refused, named."""
        return federated_run_options(run_opts)

    def load_for_task(self, hparams_path=None, overrides=None):
        """A factory's hparams: the run this process loaded for the spec, else :meth:`load`.

        In the script's process the factory is called with the spec of a run the script has
        already loaded (:meth:`spec` remembers it): that run's hparams and run options are
        returned, not loaded again, so the hparams of a run are loaded once per process. A Ray
        actor or a ``flwr run`` process loads them here, from the one mapping of hparams
        overrides and run options the spec carries (as ``flwr run --run-config`` sends them;
        hyphens read as underscores). ``stage`` is popped and returned. Returns ``(hparams,
        run_opts, stage)``.
        """
        from speechbrain_fl.fl.task import TaskSpec

        key = TaskSpec(self.task_ref, hparams_path, dict(overrides or {})).cache_key
        if key in self._runs:
            run = self._runs[key]
            return run.hparams, run.run_opts, (overrides or {}).get("stage", "train")
        values, run_opts = split_overrides(overrides)
        stage = values.pop("stage", "train")
        hparams, run_opts, _, _ = self.load(hparams_path or self.default_hparams, values, run_opts)
        return hparams, run_opts, stage

    def parse(self, argv) -> RecipeRun:
        """:meth:`Recipe.parse`; ``engine`` other than ``simulation`` is refused here, before
        any work (a script drives the Simulation Engine; ``flwr run`` loads the factory)."""
        run = super().parse(argv)
        engine = run.hparams.get("engine", "simulation")
        if engine != "simulation":
            raise ValueError(
                f"engine: {engine!r}: the script drives the Simulation Engine; for the "
                "Deployment Engine start a SuperLink and SuperNodes and use `flwr run` with "
                "task = the recipe's factory (see the recipe's README)"
            )
        return run

    # -- 2. settings once per run ---------------------------------------------------------
    def prepare(
        self,
        hparams: Mapping[str, Any],
        run_opts: Mapping[str, Any],
        *,
        make: Callable[[dict[str, Any], dict[str, Any]], Mapping[str, Any]],
    ) -> dict[str, Any]:
        """``make(hparams, run_opts)``'s JSON result, once per run (``<save_folder>/prepared.json``).

        The preparation's cache key is what ``make`` reads of ``hparams`` and ``run_opts``
        (:func:`~speechbrain_fl.recipe.prepare.prepare_once`): a change of a value it read
        prepares again, a change of any other key does not. A recipe converts the result back
        to its :class:`RunSettings` subclass.

        On a data-owning SuperNode (``node_config`` with ``data-folder`` or ``data-manifest``,
        :mod:`speechbrain_fl.fl.node_data`) nothing is prepared: the result is the server's,
        sent in the setup message, with the data paths, device and model folder made the
        node's own (:func:`~speechbrain_fl.fl.node_data.localize_settings`); the node's training
        manifest is ``node_manifest(node, hparams)`` when the recipe gives that hook (a folder
        in the recipe's real layout), else ``data-manifest`` or ``<data-folder>/train.csv``.
        """
        from speechbrain_fl.fl.node_data import current_node

        bound = current_node()
        if bound is not None:
            return self._node_prepared(bound, hparams)
        os.makedirs(hparams["output_folder"], exist_ok=True)
        result = prepare_once(hparams["save_folder"], make, hparams=hparams, run_opts=run_opts)
        self._last_prepared = result
        return result

    def _node_prepared(self, bound, hparams) -> dict[str, Any]:
        from speechbrain_fl.fl.node_data import localize_settings

        node, setup = bound
        if not setup or "prepared" not in setup:
            raise RuntimeError(
                "this SuperNode has its own data (node_config data-folder/data-manifest) but "
                "has not received the server's setup message for this run"
            )
        prepared = setup["prepared"]
        manifest = (
            self.node_manifest(node, dict(hparams)) if self.node_manifest else node.train_manifest
        )
        model_folder = setup.get("model_folder")
        if isinstance(prepared.get("settings"), dict):  # {"settings": ..., "info": ...}
            local = dict(prepared)
            local["settings"] = localize_settings(
                prepared["settings"], node, manifest=manifest, model_folder=model_folder
            )
            return local
        return localize_settings(prepared, node, manifest=manifest, model_folder=model_folder)

    # -- 4. the task ----------------------------------------------------------------------
    def task(
        self,
        settings: RunSettings,
        *,
        build_client: Callable,
        build_server: Callable,
        on_result: Callable | None = None,
        info: dict[str, Any] | None = None,
        train_logger: Any = None,
        **server_kwargs: Any,
    ):
        """An :class:`~speechbrain_fl.fl.task.FLTask` with both builders bound to ``settings``.

        ``build_client(context, *, settings)``; ``build_server(context, *, settings,
        **server_kwargs)`` (e.g. ``fl_config``). ``train_logger`` (the YAML's) is set on the
        built :class:`~speechbrain_fl.fl.serverapp.task.ServerTask`: the round lines go through it. The task's ``node_setup`` is what the ServerApp
        sends data-owning SuperNodes before the first round: the prepared result of this
        process's :meth:`prepare` without the paths of the server's data
        (:func:`~speechbrain_fl.fl.node_data.sent_to_nodes`) and the model folder to ship (when
        small).
        """
        from speechbrain_fl.fl.node_data import sent_to_nodes
        from speechbrain_fl.fl.task import FLTask

        prepared = getattr(self, "_last_prepared", None)
        model = settings.model if isinstance(settings.model, dict) else {}
        node_setup = None
        if prepared is not None:
            node_setup = {
                "prepared": sent_to_nodes(prepared),
                "model_folder": model.get("folder") or model.get("source"),
            }
        server = functools.partial(build_server, settings=settings, **server_kwargs)
        if train_logger is not None:
            server = functools.partial(_with_train_logger, server, train_logger)
        return FLTask(
            build_client=functools.partial(build_client, settings=settings),
            build_server=server,
            num_partitions=settings.num_clients,
            on_result=on_result,
            info={} if info is None else info,
            node_setup=node_setup,
        )

    # -- 5. the simulation run ------------------------------------------------------------
    def spec(self, run: RecipeRun, **extra_overrides: Any):
        """The :class:`~speechbrain_fl.fl.task.TaskSpec` of this run (``extra`` overrides added).

        The kit remembers ``run`` under the spec, so the factory called with it in this process
        reuses the loaded hparams (:meth:`load_for_task`).
        """
        from speechbrain_fl.fl.task import TaskSpec

        spec = TaskSpec(self.task_ref, run.hparams_path, {**run.overrides, **extra_overrides})
        self._runs[spec.cache_key] = run
        return spec

    @staticmethod
    def simulate(spec, hparams: Mapping[str, Any]):
        """Run ``spec`` on Flower's Simulation Engine; returns the ServerResult.

        Refuses ``engine`` other than ``simulation`` (the Deployment Engine runs with ``flwr
        run``), and passes the hparams' client resources and Ray address.
        """
        from speechbrain_fl.fl.engines.run import run_simulation

        if hparams["engine"] != "simulation":
            raise ValueError(
                f"engine: {hparams['engine']!r}: the script drives the Simulation Engine; for "
                "the Deployment Engine start a SuperLink and SuperNodes and use `flwr run` with "
                f"task = the recipe's factory (see the recipe's README)"
            )
        return run_simulation(
            spec,
            client_resources={
                "num_cpus": hparams["num_cpus_per_client"],
                "num_gpus": hparams["num_gpus_per_client"],
            },
            ray_address=hparams["ray_address"],
        )


def _with_train_logger(build_server: Callable, train_logger: Any, context: Any):
    """``build_server(context)`` with the YAML's ``train_logger`` on its ServerTask."""
    task = build_server(context)
    if task.train_logger is None:
        task.train_logger = train_logger
    return task
