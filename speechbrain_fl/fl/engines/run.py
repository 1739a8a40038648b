"""Run an :class:`~speechbrain_fl.fl.task.FLTask` on Flower's Simulation or Deployment Engine.

:func:`run_simulation` runs the ServerApp and ClientApp on one machine: ``backend: local`` (the
default: clients one after another in this process,
:class:`~speechbrain_fl.fl.engines.local_grid.LocalGrid`) or ``backend: ray`` (Flower's
Simulation Engine, for clusters); why, in its notes. :func:`run_deployment` submits the same
task with ``flwr run`` to a SuperLink.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from flwr.app import Context, RecordDict
from flwr.common.logger import FLOWER_LOGGER, console_handler
from flwr.common.logger import log as flwr_log

from speechbrain_fl.fl.clientapp.train import make_client_app
from speechbrain_fl.fl.serverapp.main import make_server_app
from speechbrain_fl.fl.serverapp.task import ServerResult, ServerTask
from speechbrain_fl.fl.settings.checks import BACKENDS
from speechbrain_fl.fl.task import (
    FLTask,
    SpecClient,
    SpecServer,
    TaskSpec,
    load_task,
    resolved_settings,
)

DEPRECATION_NOTICE = "`run_simulation` function is deprecated"


class _DropDeprecationNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return DEPRECATION_NOTICE not in record.getMessage()


@contextlib.contextmanager
def _flower_logging() -> Iterator[None]:
    """Flower's lines once, without the ``run_simulation`` deprecation notice (see above)."""
    drop = _DropDeprecationNotice()
    FLOWER_LOGGER.addFilter(drop)
    detach = bool(logging.getLogger().handlers) and console_handler in FLOWER_LOGGER.handlers
    if detach:
        FLOWER_LOGGER.removeHandler(console_handler)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeFilter(drop)
        if detach:
            FLOWER_LOGGER.addHandler(console_handler)


__all__ = ["FlwrRunError", "run_deployment", "run_simulation"]


class FlwrRunError(subprocess.CalledProcessError):
    """``flwr run`` failed: a non-zero exit, or a run the SuperLink reports as failed.

    ``flwr run --stream`` exits 0 when the ServerApp raised; :func:`run_deployment`
    asks the SuperLink for the run's final status (``flwr ls --run-id``) and raises this, with
    the status, the command and the log tail in its message.
    """

    def __init__(self, returncode, cmd, output=None, stderr=None, status=None):
        super().__init__(returncode, cmd, output=output, stderr=stderr)
        self.status = status

    def __str__(self) -> str:
        tail = "\n".join(((self.output or "") + (self.stderr or "")).splitlines()[-40:])
        what = f"run status {self.status!r}" if self.status else f"exit status {self.returncode}"
        return f"flwr run failed ({what}): {self.cmd}\n{tail}"


def run_simulation(
    task: FLTask | TaskSpec,
    *,
    backend: str | None = None,
    num_supernodes: int | None = None,
    client_resources: dict[str, float] | None = None,
    ray_address: str | None = None,
    ray_init_args: dict[str, Any] | None = None,
    verbose: bool = False,
) -> ServerResult:
    """Run ``task`` on the Simulation Engine and return the server's result.

    Arguments
    ---------
    task : FLTask or TaskSpec
        The recipe's builders, or the spec of its factory (then Ray actors load the factory
        themselves and keep the built client per process, see :mod:`speechbrain_fl.fl.task`).
    backend : str, optional
        ``local`` or ``ray`` (see the module docstring); default: ``ray`` when ``ray_address``
        is given, else the server config's ``backend``.
    num_supernodes : int, optional
        Virtual SuperNodes; default the task's ``num_partitions``.
    client_resources : dict, optional
        Ray resources per ClientApp, e.g. ``{"num_cpus": 1, "num_gpus": 0.25}`` (``ray`` only).
    ray_address : str, optional
        Address of a running Ray cluster (``ray start --head``) to join.
    ray_init_args : dict, optional
        Extra ``ray.init`` arguments.
    verbose : bool
        Flower's DEBUG logging.

    Returns
    -------
    ServerResult

    Notes
    -----
    The process's exit afterwards skips CPython's final collections of the heap (long with
    torch, SpeechBrain and Flower loaded): :func:`~speechbrain_fl.utils.gc_freeze.freeze_at_exit`
    (``SB_FL_EXIT_GC=1`` keeps them).

    Notes
    -----
    - ``engine: simulation``: :func:`run_simulation` runs the recipe's ServerApp and ClientApp on
      one of two backends, chosen by the ``backend`` key of the federated config
      (:class:`~speechbrain_fl.fl.settings.config.FLConfig`, YAML ``backend: local | ray``) or the
      ``backend`` argument:

    - ``local`` (the default): :class:`~speechbrain_fl.fl.engines.local_grid.LocalGrid`, a Flower
    Grid that hands each message to the ClientApp in this process, one after another, each node
    with its own persistent Context. Same ServerApp, ClientApp and Messages as the Ray backend, and
    the same results for the same seeds (``tests/integration/test_fl_local_backend.py``). Each
    partition's client is built once per run and reused across rounds. - ``ray``:
    ``flwr.simulation.run_simulation`` with the Ray backend; one virtual SuperNode per partition,
    ``client_resources`` (``num_cpus``, ``num_gpus``) per ClientApp, and ``ray_address`` to join a
    running Ray cluster (a ``ray_address`` selects this backend). Given a
    :class:`~speechbrain_fl.fl.task.TaskSpec` (what a recipe script passes), only the spec travels
    to the Ray actors, which load the recipe's factory once each.

    Why ``local`` is the default on one machine (measured with ``benchmarks/fl_overhead.py``,
    README "Overhead of the Simulation Engine"): Ray's start, its actors' imports of torch, Flower
    and the recipe, the per-message pickling of the ClientApp and Flower's 0.1 s hand-off threads
    cost seconds per run and tens of milliseconds per client, more than a small model's training;
    the local backend has none of them. On the benchmark's workload (32 clients, 10 rounds, shared
    2-core machine) the whole run took 2.0x the plain loop on ``local`` against 7.9x on ``ray``
    (DP: 1.7x against 7.3x), the steady round 2.6x against 6.9x (DP: 2.5x against 6.4x); the MLS
    default's federated stage 133 s against 147 s. Ray stays the backend for a cluster
    (``ray_address``) and for several GPUs shared by fractional ``client_resources``; the
    Deployment Engine for many machines. The server task is built in this process before the
    backend starts (its config names the backend), then handed to the ServerApp. - Why not ``flwr
    run`` here: Flower 1.42 marks ``run_simulation`` deprecated in favour of ``flwr run`` against a
    simulation federation, and ``flwr run`` with the apps of
    :mod:`speechbrain_fl.fl.engines.flwr_apps` does run the same recipes (recipes/MLS/README.md). A
    recipe script keeps the in-process call because the ServerApp then runs in the script's
    process: its :class:`~speechbrain_fl.fl.serverapp.task.ServerResult` (final tensors, per-round
    budgets, privacy report) comes back as an object for the test evaluation and results.json, with
    no SuperLink process, no app bundle to build and no result file to read back. The deprecation
    notice, which Flower logs on every call, is filtered out of that one call; any other Flower
    warning still shows. Flower's lines are printed once: when the script has configured logging (a
    root handler, as ``sb.create_experiment_directory`` does), Flower's own console handler is
    detached for the call and its records go through the script's handlers (console and log file)
    only. - ``engine: deployment``: :func:`run_deployment` submits the apps declared in the
    repository's ``pyproject.toml`` (``[tool.flwr.app.components]``) with ``flwr run <app_dir>
    <superlink>`` to a running ``flower-superlink`` whose ``flower-supernode`` processes were each
    started with ``--node-config "partition-id=i num-partitions=K"``.
    """
    from speechbrain_fl.utils.gc_freeze import freeze_at_exit

    freeze_at_exit()
    if isinstance(task, TaskSpec):
        loaded = load_task(task)
        build_client = SpecClient(task)
    else:
        loaded = task
        build_client = task.build_client
    build_server = SpecServer(task) if isinstance(task, TaskSpec) else task.build_server
    num_supernodes = num_supernodes or loaded.num_partitions
    server_task = build_server(
        Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    )
    if backend is None:
        backend = "ray" if ray_address else getattr(server_task.config, "backend", "ray")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {list(BACKENDS)}")
    with _flower_logging():
        flwr_log(logging.INFO, "%s", resolved_settings(server_task.config))
    results: list[ServerResult] = []
    server_app = make_server_app(_Prebuilt(server_task), on_result=results.append)
    if backend == "local":
        _run_local(server_app, make_client_app(build_client, cache_size=num_supernodes),
                   num_supernodes=num_supernodes)  # fmt: skip
    else:
        _run_ray(
            server_app,
            make_client_app(build_client),
            num_supernodes=num_supernodes,
            client_resources=client_resources,
            ray_address=ray_address,
            ray_init_args=ray_init_args,
            verbose=verbose,
        )
    if not results:
        raise RuntimeError("the ServerApp ended without a result; see the Flower log above")
    if loaded.on_result is not None:
        loaded.on_result(results[0])
    return results[0]


class _Prebuilt:
    """``build_server`` returning the server task built before the backend started."""

    def __init__(self, server_task: ServerTask) -> None:
        self.server_task = server_task

    def __call__(self, context: Context) -> ServerTask:
        return self.server_task


def _run_local(server_app, client_app, *, num_supernodes: int) -> None:
    """The ServerApp on a :class:`~speechbrain_fl.fl.engines.local_grid.LocalGrid` (this process).

    The objects that exist before the run (the imported libraries, the server's task) are kept
    out of the garbage collector's full scans for its duration
    (:func:`~speechbrain_fl.utils.gc_freeze.frozen_heap`).
    """
    from speechbrain_fl.fl.engines.local_grid import LocalGrid
    from speechbrain_fl.utils.gc_freeze import frozen_heap

    grid = LocalGrid(client_app, num_nodes=num_supernodes)
    context = Context(
        run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )
    with frozen_heap(), _flower_logging(), grid.identity():
        server_app(grid=grid, context=context)


def _run_ray(
    server_app,
    client_app,
    *,
    num_supernodes: int,
    client_resources: dict[str, float] | None,
    ray_address: str | None,
    ray_init_args: dict[str, Any] | None,
    verbose: bool,
) -> None:
    """The ServerApp and ClientApp on Flower's Simulation Engine with the Ray backend."""
    from flwr.simulation import run_simulation as flwr_run_simulation

    init_args: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.ERROR,
        "log_to_driver": verbose,
    }
    if ray_address:
        init_args["address"] = ray_address
    else:
        init_args["num_cpus"] = os.cpu_count() or 1
    init_args.update(ray_init_args or {})
    with _flower_logging():
        flwr_run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=num_supernodes,
            backend_config={
                "client_resources": client_resources or {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": init_args,
            },
            verbose_logging=verbose,
        )


def run_deployment(
    superlink: str,
    *,
    app_dir: str | Path = ".",
    run_config: dict[str, Any] | None = None,
    stream: bool = True,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    federation_config: dict[str, Any] | None = None,
) -> subprocess.CompletedProcess:
    """Submit the repository's apps to a SuperLink with ``flwr run``.

    Arguments
    ---------
    superlink : str
        Name of a SuperLink connection in ``$FLWR_HOME/config.toml`` (``[superlink.<name>]``).
    app_dir : str or Path
        Folder with the ``pyproject.toml`` declaring the apps.
    run_config : dict, optional
        Values of ``[tool.flwr.app.config]``: ``task``, ``hparams`` and ``overrides`` (a dict,
        sent as one YAML mapping, e.g. ``{"number_of_rounds": 2}``).
    stream : bool
        Follow the run's logs until it ends.
    env : dict, optional
        Environment of the ``flwr`` process (e.g. ``FLWR_HOME``).
    timeout : float, optional
        Seconds before the ``flwr`` process is killed.
    federation_config : dict, optional
        ``flwr run --federation-config`` of a simulation SuperLink (e.g.
        ``{"num-supernodes": 4}``).

    Returns
    -------
    subprocess.CompletedProcess
        With ``stdout`` (text).

    Raises
    ------
    FlwrRunError
        (a ``CalledProcessError``) when ``flwr run`` exits non-zero or, with ``stream``, when
        the SuperLink reports the run as anything but ``finished:completed`` (a ServerApp
        that raised: ``flwr run`` itself exits 0 then).
    """
    _refuse_managed_local_superlink(superlink, env)
    cmd = [str(Path(sys.executable).with_name("flwr")), "run", str(app_dir), superlink]
    if run_config:
        pairs = []
        for key, value in run_config.items():
            if isinstance(value, Mapping):  # the factory's overrides: one YAML mapping
                value = yaml.safe_dump(dict(value), default_flow_style=True, width=10**9).strip()
            if isinstance(value, bool):
                text = str(value).lower()
            elif isinstance(value, str):
                text = json.dumps(value)  # a TOML basic string
            else:
                text = str(value)
            pairs.append(f"{key}={text}")
        cmd += ["--run-config", " ".join(pairs)]
    if federation_config:
        cmd += [
            "--federation-config",
            " ".join(
                f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                for k, v in federation_config.items()
            ),
        ]
    if stream:
        cmd.append("--stream")
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise FlwrRunError(proc.returncode, shlex.join(cmd), output=proc.stdout, stderr=proc.stderr)
    status = _run_status(proc.stdout, superlink, env) if stream else None
    if status is not None and status != "finished:completed":
        raise FlwrRunError(
            1, shlex.join(cmd), output=proc.stdout, stderr=proc.stderr, status=status
        )
    return proc


MANAGED_LOCAL_ADDRESSES = (":local:", ":local-in-memory:")


def _refuse_managed_local_superlink(superlink: str, env: dict[str, str] | None) -> None:
    """Refuse a connection to Flower's managed local SuperLink (``address = ":local:"``).

    ``flwr`` starts that SuperLink itself, without ``--disable-runtime-dependency-installation``
    (it ``uv sync``s the app into a fresh environment instead of the pinned one) and leaves it
    running after the run. Our helpers use an explicit SuperLink instead.
    """
    import tomllib

    home = Path((env or os.environ).get("FLWR_HOME") or Path.home() / ".flwr")
    path = home / "config.toml"
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return
    address = config.get("superlink", {}).get(superlink, {}).get("address")
    if address in MANAGED_LOCAL_ADDRESSES:
        raise ValueError(
            f"SuperLink connection {superlink!r} in {path} has address {address!r}: flwr would "
            "start a managed local SuperLink that installs the app's dependencies and keeps "
            "running; start `flower-superlink --insecure --simulation "
            "--disable-runtime-dependency-installation` and give its address instead "
            "(docs/deployment.md)"
        )


_RUN_ID = re.compile(r"[Ss]uccessfully started run (\d+)")


def _run_status(stdout: str, superlink: str, env: dict[str, str] | None) -> str | None:
    """``status`` of the run ``flwr run`` started (``finished:completed``, ...) or ``None``."""
    found = _RUN_ID.search(stdout or "")
    if not found:
        return None
    cmd = [str(Path(sys.executable).with_name("flwr")), "ls", superlink, "--run-id",
           found.group(1), "--format", "json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    try:
        runs = json.loads(proc.stdout[proc.stdout.index("{") :])["runs"]
        return str(runs[0]["status"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
