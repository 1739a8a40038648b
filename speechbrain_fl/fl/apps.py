"""Module-level ServerApp and ClientApp for ``flwr run`` (simulation federation or Deployment).

``pyproject.toml`` names ``speechbrain_fl.fl.apps:server_app`` and ``...:client_app``. Both read
the run config (``[tool.flwr.app.config]``, overridable with ``flwr run --run-config``) as a
:class:`~speechbrain_fl.fl.task.TaskSpec`:

- ``task``: ``"package.module:factory"`` or ``"recipes/<Dataset>/train.py:factory"``, a recipe
  factory ``factory(hparams, overrides) -> FLTask`` (default
  :func:`speechbrain_fl.fl.toy.toy_task`);
- ``hparams``: path of the recipe's hparams file (``""`` for none), relative to the app root;
  a SuperNode may override it with ``--node-config "hparams=/local/path.yaml"``;
- ``overrides``: one YAML mapping, in the recipe's YAML vocabulary, passed to the factory
  (``"{number_of_rounds: 2, debug: true}"``; Flower accepts only declared keys and scalar
  values, hence one string).

Each SuperNode gets its partition with ``--node-config "partition-id=i num-partitions=K"``.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .client import ClientTask, make_client_app
from .server import run_server
from .task import TaskSpec, load_task

__all__ = ["client_app", "server_app"]


class _RunConfigClient:
    """``build_client`` reading the spec from the context; cached per worker by
    :func:`make_client_app` under the spec (the run config is the same for every message)."""

    cache_key = "run-config"

    def __call__(self, context: Context) -> ClientTask:
        spec = TaskSpec.from_run_config(dict(context.run_config), dict(context.node_config))
        return load_task(spec).build_client(context)


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    task = load_task(TaskSpec.from_run_config(dict(context.run_config)))
    result = run_server(grid, task.build_server(context))
    if task.on_result is not None:
        task.on_result(result)


client_app = make_client_app(_RunConfigClient())
