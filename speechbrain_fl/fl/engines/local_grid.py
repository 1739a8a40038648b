"""A Flower Grid that runs the ClientApp in this process: the ``local`` simulation backend.

:class:`LocalGrid` implements :class:`flwr.serverapp.Grid` without the Simulation Engine's
LinkState, threads and Ray actors: ``send_and_receive`` hands each message to the ClientApp in
the calling thread, one after another. The ServerApp, ClientApp and Messages are those the Ray
backend runs, so a recipe changes only its ``backend`` key (what Flower's engine keeps and what
this class decides: :class:`LocalGrid`'s notes).
"""

from __future__ import annotations

import contextlib
import copy
import random
import secrets
import time
import traceback
import uuid
from collections.abc import Iterable, Iterator
from logging import ERROR, WARNING

import numpy as np
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import (
    NODE_ID_NUM_BYTES,
    NUM_PARTITIONS_KEY,
    PARTITION_ID_KEY,
    SUPERLINK_NODE_ID,
    ErrorCode,
)
from flwr.common.logger import log
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid"]


def _random_id(num_bytes: int, exclude: set[int]) -> int:
    """A random non-zero id of ``num_bytes`` bytes, not in ``exclude`` (as Flower draws them)."""
    while True:
        value = secrets.randbits(8 * num_bytes - 1)  # positive as a signed 64-bit integer
        if value not in exclude and value not in (0, SUPERLINK_NODE_ID):
            return value


class _ProcessState:
    """The RNG states and torch's thread count of this process when made; :meth:`restore`
    puts them back (as often as called: the saved states are not consumed).

    NumPy's legacy state is kept with its 624-word key as a list: ``np.random.set_state``
    copies the key word by word, and indexing a list costs a fraction of indexing an ndarray
    (the same state, tested). Should a NumPy release
    refuse the list, the key goes back as the ndarray ``get_state`` returned.
    """

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.torch = torch.get_rng_state()
        self.numpy = np.random.get_state()
        self.python = random.getstate()
        name, key, *rest = self.numpy
        self._numpy_fast: tuple | None = (name, key.tolist(), *rest)

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self._numpy_fast is not None:
            try:
                np.random.set_state(self._numpy_fast)
            except (TypeError, ValueError):
                self._numpy_fast = None
        if self._numpy_fast is None:
            np.random.set_state(self.numpy)
        random.setstate(self.python)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


class LocalGrid(Grid):
    """A :class:`flwr.serverapp.Grid` delivering every message to ``client_app`` in process.

    Arguments
    ---------
    client_app : flwr.clientapp.ClientApp
        The ClientApp every node runs.
    num_nodes : int
        Virtual nodes; node ``i`` gets ``partition-id`` ``i`` of ``num_nodes``.
    run_id : int, optional
        The run's id; random by default (as Flower's ``run_simulation``).

    Notes
    -----
    Flower's Simulation Engine puts an :class:`flwr.superlink.grid.InMemoryGrid` in front of a
    LinkState, three hand-off threads polling every 0.1 s, and a pool of Ray actors, each a
    separate process that imports torch, Flower and the recipe and receives the ClientApp and every
    message pickled. On one machine that machinery costs more than a small model's whole round
    (measured in ``benchmarks/fl_overhead.py``). :class:`LocalGrid` implements the same
    :class:`flwr.serverapp.Grid` interface with none of it: ``send_and_receive`` hands each message
    to the ClientApp in the calling thread, one after another, and returns the replies. The
    ServerApp, the ClientApp and the Messages are the very objects the Ray backend runs, so a
    recipe changes nothing but the ``backend`` key
    (:func:`speechbrain_fl.fl.engines.run.run_simulation`).

    What it keeps of Flower's Simulation Engine (``flwr/server/superlink/fleet/vce/vce_api.py``):

    - one virtual node per partition with a random 64-bit node id and a persistent
      :class:`flwr.app.Context` (``node_config`` ``partition-id`` / ``num-partitions``, a ``state``
      RecordDict kept across rounds, an empty ``run_config`` that must not change);
    - message ids, ``run_id``/``src_node_id`` checks on push, ``delivered_at`` on delivery;
    - a ClientApp that raises becomes an error reply (``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``,
      the same reason text), so the strategy sees a failed client, not a crashed run;
    - ``timeout``, per client (ours). Flower's engines run a cohort's clients side by side, so
      their round timeout bounds each client's own time; run one after another, a timeout for the
      whole cohort would drop every client not started before it ran out (on one GPU, a real-preset
      round of ~94 clients takes far longer than 900 s) while the noise stays calibrated to the
      expected cohort qK. Here each client gets ``timeout`` seconds of its own: a client whose call
      took longer gets no reply, as a slow client of a parallel engine, and is logged and recorded
      in :attr:`LocalGrid.dropped` (a running client is not interrupted: there is no other thread
      to interrupt it from).

    Decisions (ours):

    - Isolation. The ClientApp gets a copy of each message (the Ray path pickles it; a client that
      edits its message must not edit the server's copy, whose ArrayRecord is the strategy's
      ``current_arrays``, or the next client's): ``copy.deepcopy`` of the message.
    - Process-global state a client touches is put back after each call: the torch, NumPy and
      ``random`` RNG states (the client's ``torch.manual_seed`` must not reseed the server, whose
      RNG states the checkpoint saves: the server's random stream is the Ray path's) and torch's
      intra-op thread count (a builder's ``torch.set_num_threads``, meant for one Ray actor per
      CPU, must not slow the server's evaluation). The states are read once per
      ``send_and_receive`` (or ``pull_messages``) and written back after every client: nothing runs
      between two clients of one call but this class, so every client starts from the states the
      server had when it called, as when each call was wrapped on its own.
    - Sequential, not a process pool: on this 2-core machine the clients of a small model take
      milliseconds each, and a pool would bring back the per-process imports, model builds and
      pickling that make the Ray path slow (one build per partition per worker instead of one per
      partition); a GPU machine runs one model best from one process.

    Example
    -------
    >>> from flwr.app import RecordDict, Message
    >>> from speechbrain_fl.fl.clientapp.train import make_client_app
    >>> from speechbrain_fl.fl.toy import toy_client
    >>> grid = LocalGrid(make_client_app(toy_client), num_nodes=2)
    >>> with grid.identity():
    ...     queries = [Message(RecordDict(), n, "query") for n in grid.get_node_ids()]
    ...     replies = grid.send_and_receive(queries)
    >>> sorted(int(r.content["metrics"]["partition-id"]) for r in replies)
    [0, 1]
    """

    def __init__(self, client_app: ClientApp, *, num_nodes: int, run_id: int | None = None) -> None:
        if num_nodes < 1:
            raise ValueError(f"LocalGrid: num_nodes={num_nodes} must be >= 1")
        self.client_app = client_app
        self._run = Run.create_empty(run_id if run_id is not None else _random_id(8, set()))
        self._run.primary_task_id = 1
        self.contexts: dict[int, Context] = {}
        for partition in range(num_nodes):
            node_id = _random_id(NODE_ID_NUM_BYTES, set(self.contexts))
            self.contexts[node_id] = Context(
                run_id=self._run.run_id,
                node_id=node_id,
                node_config={PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: num_nodes},
                state=RecordDict(),
                run_config={},
            )
        self._pending: dict[str, Message] = {}
        self._replies: dict[str, Message] = {}
        self.client_seconds: list[float] = []  # wall time of each ClientApp call
        # (partition id, seconds, timeout) of every reply dropped for time
        self.dropped: list[tuple[int, float, float]] = []

    # -- Grid interface ------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        """Set the run this Grid operates in."""
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run
        for context in self.contexts.values():
            context.run_id = run.run_id

    @property
    def run(self) -> Run:
        """Run information (a copy)."""
        return Run(**vars(self._run))

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message (Flower deprecates this in favour of the Message constructor)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """The virtual nodes' ids."""
        return list(self.contexts)

    def get_nodes(self) -> Iterable[NodeInfo]:
        """The virtual nodes."""
        return [NodeInfo(node_id=n) for n in self.contexts]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue messages for their nodes; like Flower's LinkState, an invalid one is logged
        and gets no id."""
        ids = []
        for msg in messages:
            meta = msg.metadata
            if meta.reply_to_message_id or meta.message_id or meta.delivered_at:
                log(ERROR, "LocalGrid: not an unsent instruction message: %s", meta)
                continue
            if meta.run_id != self._run.run_id:
                log(ERROR, "LocalGrid: invalid run ID for Message: %s", meta.run_id)
                continue
            if meta.dst_node_id not in self.contexts:
                log(ERROR, "LocalGrid: invalid destination node ID: %s", meta.dst_node_id)
                continue
            meta.__dict__["_message_id"] = str(uuid.uuid4())
            self._pending[meta.message_id] = msg
            ids.append(meta.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the pending messages among ``message_ids`` and return (and forget) their
        replies."""
        return self._collect(list(message_ids), timeout=None)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages``, run each on its node, return the replies (see the module
        docstring for ``timeout``)."""
        ids = list(self.push_messages(messages))
        return self._collect(ids, timeout=timeout)

    # -- delivery ------------------------------------------------------------------------
    @contextlib.contextmanager
    def identity(self) -> Iterator[None]:
        """Set Flower's task identity (the run id and the SuperLink as the sender that new
        Messages read) for the ServerApp's calls, and put the previous one back after."""
        saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
        TaskIdentity.task_id = self._run.primary_task_id or 1
        TaskIdentity.run_id = self._run.run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        try:
            yield
        finally:
            TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved

    def _collect(self, ids: list[str], *, timeout: float | None) -> list[Message]:
        """Run each pending message; a client slower than ``timeout`` seconds gets no reply."""
        replies = []
        process = _ProcessState() if any(i in self._pending for i in ids) else None
        for message_id in ids:
            if message_id in self._pending:
                message = self._pending.pop(message_id)
                reply = self._deliver(message, process)
                seconds = self.client_seconds[-1]
                if timeout is not None and seconds > timeout:
                    partition = self.contexts[message.metadata.dst_node_id].node_config[
                        PARTITION_ID_KEY
                    ]
                    self.dropped.append((int(partition), seconds, float(timeout)))
                    log(
                        WARNING,
                        "LocalGrid: client of partition %s took %.1f s, over its timeout of "
                        "%g s: dropped from the round (no reply), as a parallel engine drops a "
                        "slow client",
                        partition,
                        seconds,
                        timeout,
                    )
                    continue
                self._replies[message_id] = reply
            if message_id in self._replies:
                replies.append(self._replies.pop(message_id))
        return replies

    def _deliver(self, message: Message, process: _ProcessState) -> Message:
        """Run ``message`` through the ClientApp on its node's Context; errors become replies.

        ``process`` (the server's RNG states and thread count) is restored after the call."""
        message.metadata.delivered_at = str(time.time())
        context = self.contexts[message.metadata.dst_node_id]
        run_config = dict(context.run_config)
        start = time.perf_counter()
        try:
            try:
                reply = self.client_app(message=copy.deepcopy(message), context=context)
            finally:
                process.restore()
            if dict(context.run_config) != run_config:
                raise ValueError(
                    "The `run_config` field of the `Context` object cannot be modified "
                    f"(run_id: {context.run_id})."
                )
        except Exception as err:  # noqa: BLE001  (a failed client is a reply, as in Flower)
            log(ERROR, "ClientApp of node %s raised: %s", context.node_id, err)
            log(ERROR, traceback.format_exc())
            reason = str(type(err)) + ":<'" + str(err) + "'>"
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                reply_to=message,
            )
        self.client_seconds.append(time.perf_counter() - start)
        reply.metadata.__dict__["_message_id"] = str(uuid.uuid4())
        return reply
