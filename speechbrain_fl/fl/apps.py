"""Module-level ServerApp and ClientApp for the Deployment Engine (``flwr run .``).

``pyproject.toml`` names ``speechbrain_fl.fl.apps:server_app`` and ``...:client_app``. Both read
the run config (``[tool.flwr.app.config]``, overridable with ``flwr run --run-config``):

- ``task``: ``"package.module:factory"``, a recipe factory ``factory(hparams, overrides) ->
  FLTask`` (default :func:`speechbrain_fl.fl.toy.toy_task`);
- ``hparams``: path of the recipe's hparams file (``""`` for none); a SuperNode may override it
  with ``--node-config "hparams=/local/path.yaml"`` when its files live elsewhere;
- every other key is passed to the factory as an override (e.g. ``num-rounds``).

Each SuperNode gets its partition with ``--node-config "partition-id=i num-partitions=K"``.
"""

from __future__ import annotations

import importlib
from typing import Any

from flwr.app import Context

from .client import ClientTask, make_client_app
from .server import ServerTask, make_server_app
from .task import FLTask

__all__ = ["client_app", "load_task", "server_app"]

RESERVED = ("task", "hparams")


def load_task(run_config: dict[str, Any], node_config: dict[str, Any] | None = None) -> FLTask:
    """Import the recipe factory named by ``run_config['task']`` and build its FLTask."""
    ref = str(run_config.get("task", "speechbrain_fl.fl.toy:toy_task"))
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"run config 'task'={ref!r} must be 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"run config 'task'={ref!r} cannot be imported: {err}") from err
    hparams = (node_config or {}).get("hparams") or run_config.get("hparams") or None
    overrides = {k: v for k, v in run_config.items() if k not in RESERVED}
    return factory(str(hparams) if hparams else None, overrides)


def _build_client(context: Context) -> ClientTask:
    return load_task(dict(context.run_config), dict(context.node_config)).build_client(context)


def _build_server(context: Context) -> ServerTask:
    return load_task(dict(context.run_config)).build_server(context)


server_app = make_server_app(_build_server)
client_app = make_client_app(_build_client)
