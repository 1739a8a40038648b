"""Module-level ServerApp and ClientApp for ``flwr run`` (simulation federation or Deployment).

``pyproject.toml`` names ``speechbrain_fl.fl.engines.flwr_apps:server_app`` and ``...:client_app``;
both read the run config as a :class:`~speechbrain_fl.fl.task.TaskSpec` and build the recipe's
task from it (how a node is set up and admitted: :class:`AdmittingGrid`'s notes).
"""

from __future__ import annotations

import json
import logging
import time
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import FLOWER_LOGGER, console_handler, log
from flwr.serverapp import Grid, ServerApp

from speechbrain_fl.fl.clientapp.train import ClientTask, make_client_app
from speechbrain_fl.fl.engines.fingerprint import (
    BaseModelMismatch,
    check_base_fingerprint,
    frozen_fingerprint,
)
from speechbrain_fl.fl.node_data import NodeData, bound_node, pack_folder, unpack_folder
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.serverapp.task import ServerTask
from speechbrain_fl.fl.task import FLTask, TaskSpec, load_task, resolved_settings

__all__ = ["AdmittingGrid", "NodeNotSetUp", "client_app", "node_setup_content", "server_app"]

SETUP = "query.setup"
SETUP_RECORD, MODEL_RECORD, REPLY_RECORD, STATE_RECORD = (
    "sbfl-setup", "sbfl-model", "sbfl-setup-reply", "sbfl-setup")  # fmt: skip
SETUP_TIMEOUT = 900.0
"""Seconds a node has to answer the setup (it builds its model: a minute for a real preset)."""
RETRY_AFTER = 30.0


class NodeNotSetUp(RuntimeError):
    """A node asked to train before the server's setup message checked its base model."""


def node_setup_content(task: FLTask, server_task: ServerTask) -> RecordDict:
    """The setup message's content: fingerprint, prepared settings, the shipped model folder."""
    setup = task.node_setup or {}
    files = pack_folder(setup["model_folder"]) if setup.get("model_folder") else None
    content = RecordDict(
        {
            SETUP_RECORD: ConfigRecord(
                {
                    "fingerprint": frozen_fingerprint(server_task.brain.modules),
                    "prepared": json.dumps(setup.get("prepared")) if "prepared" in setup else "",
                    "shipped": files is not None,
                }
            )
        }
    )
    if files is not None:
        content[MODEL_RECORD] = ConfigRecord(files)
    return content


class AdmittingGrid:
    """A Grid that sets up each new node before the strategy may see it.

    ``get_node_ids`` sends every node not seen before the setup message and returns only the
    nodes whose setup succeeded; a refused node (base model mismatch, a build error) is logged
    once with its reason and never returned, so it is never sampled. A node that did not
    answer is asked again after :data:`RETRY_AFTER` seconds. A node that disconnects, or
    answers that it lost its setup (:meth:`send_and_receive`), is set up again when it is next
    connected: a SuperNode restarted with its key keeps its node ID but not the setup held in
    its run state. Everything else is the wrapped Grid's.

    Notes
    -----
    ``pyproject.toml`` names ``speechbrain_fl.fl.engines.flwr_apps:server_app`` and
    ``...:client_app``. Both read the run config (``[tool.flwr.app.config]``, overridable with
    ``flwr run --run-config``) as a :class:`~speechbrain_fl.fl.task.TaskSpec`
    (:meth:`~speechbrain_fl.fl.task.TaskSpec.from_run_config`: the typed kebab-case keys
    ``num-server-rounds``, ``sampling-rate``, ``method``, ``clip``, ``noise-multiplier``,
    ``local-epochs``, and ``task``, ``hparams``, ``overrides`` for the rest).

    Before the first round the ServerApp *sets up* every node it will sample (a ``query.setup``
    message, :class:`AdmittingGrid`), so the model comes from the server and no file is shared:

    - the server sends the SHA-256 fingerprint of its frozen base
      (:func:`speechbrain_fl.fl.engines.fingerprint.frozen_fingerprint`), the run's prepared
      settings (``FLTask.node_setup["prepared"]``: what a data-owning node needs to build its side
      without preparing anything) and, when it is a small local folder, the model folder itself
      (the tiny embedded seed models: shipped whole,
      :func:`~speechbrain_fl.fl.node_data.pack_folder`);
    - the node writes what it got under ``<work-dir>/sbfl_run_<run id>/``, builds its client from
      its own data (``node_config`` ``data-folder`` / ``data-manifest``,
      :mod:`speechbrain_fl.fl.node_data`) and its own base (``base-model``, or the shipped copy),
      and compares the fingerprints; a mismatch is refused with
      :class:`~speechbrain_fl.fl.engines.fingerprint.BaseModelMismatch`, named in the server's log,
      and the node is never sampled;
    - the starting *trainable* state is the server's: every round's train message carries the
      global trainable tensors and the client loads them before training
      (:func:`speechbrain_fl.fl.clientapp.train.train_round`), so a node's own initialisation of
      them is never used.

    Every later build of the client (one per message on a SuperNode, whose ClientApp is a fresh
    process per message) checks the fingerprint again against the one kept in the node's
    ``Context.state``; a node that skipped the setup is refused (:class:`NodeNotSetUp`).
    """

    def __init__(self, grid: Grid, content: RecordDict, *, timeout: float = SETUP_TIMEOUT):
        self._grid = grid
        self._content = content
        self._timeout = timeout
        self.admitted: set[int] = set()
        self.refused: dict[int, str] = {}
        self._asked: dict[int, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        """The wrapped Grid's replies; a node that answers :class:`NodeNotSetUp` (restarted
        between two of the server's looks at the connected nodes) is no longer admitted, so
        that the next :meth:`get_node_ids` sets it up again. Its reply is returned as it
        came: the round counts it as failed."""
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error() and NodeNotSetUp.__name__ in str(reply.error.reason):
                if node in self.admitted:
                    log(WARNING, "node %d: lost its setup (restarted); set up again", node)
                self.admitted.discard(node)
                self._asked.pop(node, None)
        return replies

    def get_node_ids(self):
        """The connected nodes whose setup succeeded (new ones are set up first)."""
        nodes = list(self._grid.get_node_ids())
        gone = self.admitted.difference(nodes)
        if gone:  # a node that returns may be a restarted SuperNode: set up again
            log(INFO, "nodes %s disconnected; each is set up again if it returns", sorted(gone))
            self.admitted -= gone
            for node in gone:
                self._asked.pop(node, None)
        now = time.monotonic()
        new = [
            n
            for n in nodes
            if n not in self.admitted
            and n not in self.refused
            and now - self._asked.get(n, -RETRY_AFTER) >= RETRY_AFTER
        ]
        if new:
            self._set_up(new)
        return [n for n in nodes if n in self.admitted]

    def _set_up(self, nodes: list[int]) -> None:
        messages = []
        for node in nodes:
            self._asked[node] = time.monotonic()
            content = RecordDict(dict(self._content.items()))
            messages.append(Message(content=content, message_type=SETUP, dst_node_id=node))
        for reply in self._grid.send_and_receive(messages, timeout=self._timeout):
            node = reply.metadata.src_node_id
            if node not in self._asked or node in self.admitted or node in self.refused:
                continue
            if reply.has_error():
                reason = f"its setup failed: {reply.error.reason}"
            else:
                answer = reply.content.config_records.get(REPLY_RECORD, ConfigRecord())
                reason = None if answer.get("ok") else str(answer.get("error", "no answer"))
            if reason is None:
                self.admitted.add(node)
                log(INFO, "node %d: set up (frozen base fingerprint matches)", node)
            else:
                self.refused[node] = reason
                log(WARNING, "node %d: refused, %s; it is never sampled", node, reason)


class _RunConfigClient:
    """``build_client`` reading the spec from the context; cached per worker by
    :func:`make_client_app` under the spec (the run config is the same for every message).

    On a data-owning SuperNode the task is built for the node's data from what the server's
    setup sent; every build checks the frozen base against the server's fingerprint.
    """

    cache_key = "run-config"

    def __call__(self, context: Context) -> ClientTask:
        spec = TaskSpec.from_run_config(dict(context.run_config), dict(context.node_config))
        state = context.state.config_records.get(STATE_RECORD)
        if state is None or "fingerprint" not in state:
            raise NodeNotSetUp(
                f"node {context.node_id} was asked to train before the server's setup message "
                "(the ServerApp sets up every node before sampling it)"
            )
        node = NodeData.from_node_config(dict(context.node_config))
        if node is None:
            client = load_task(spec).build_client(context)
        else:
            setup_file = node.run_dir(context.run_id) / "setup.json"
            if not setup_file.is_file():
                raise NodeNotSetUp(f"node {context.node_id}: no {setup_file} from the setup")
            setup = json.loads(setup_file.read_text(encoding="utf-8"))
            with bound_node(node, setup):
                client = load_task(spec).build_client(context)
        check_base_fingerprint(
            str(state["fingerprint"]), client.brain.modules, where=f"node {context.node_id}"
        )
        return client


def _flower_lines_once() -> None:
    """Flower's records through the process's root handlers only, when it has some.

    The ServerApp process of ``flwr run`` (and a recipe's ``create_experiment_directory``)
    installs root handlers; Flower's own console handler would print each Flower line a second
    time.
    """
    if logging.getLogger().handlers and console_handler in FLOWER_LOGGER.handlers:
        FLOWER_LOGGER.removeHandler(console_handler)


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    spec = TaskSpec.from_run_config(dict(context.run_config))
    task = load_task(spec)
    server_task = task.build_server(context)
    _flower_lines_once()
    log(INFO, "%s", resolved_settings(server_task.config))
    result = run_server(AdmittingGrid(grid, node_setup_content(task, server_task)), server_task)
    if task.on_result is not None:
        task.on_result(result)


client_app = make_client_app(_RunConfigClient())


@client_app.query("setup")
def _setup(msg: Message, context: Context) -> Message:
    """Keep what the server sent, build the client, compare the frozen bases; reply ok/error."""
    setup = msg.content.config_records[SETUP_RECORD]
    fingerprint = str(setup["fingerprint"])
    try:
        node = NodeData.from_node_config(dict(context.node_config))
        if node is not None:
            run_dir = node.run_dir(context.run_id)
            run_dir.mkdir(parents=True, exist_ok=True)
            model_folder = None
            if setup.get("shipped") and MODEL_RECORD in msg.content.config_records:
                files = dict(msg.content.config_records[MODEL_RECORD])
                model_folder = unpack_folder(files, run_dir / "model")
            prepared = json.loads(setup["prepared"]) if setup.get("prepared") else None
            record = {"prepared": prepared, "model_folder": model_folder}
            (run_dir / "setup.json").write_text(json.dumps(record), encoding="utf-8")
        context.state[STATE_RECORD] = ConfigRecord({"fingerprint": fingerprint})
        _RunConfigClient()(context)
        answer = {"ok": True, "fingerprint": fingerprint}
    except (BaseModelMismatch, ValueError, OSError, RuntimeError) as err:
        if STATE_RECORD in context.state:
            del context.state[STATE_RECORD]
        answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    return Message(content=RecordDict({REPLY_RECORD: ConfigRecord(answer)}), reply_to=msg)
