"""Which node holds which partition: the answers to the server's ``query`` messages.

The answers order the nodes for Poisson sampling (:mod:`speechbrain_fl.fl.dp.sampling`). A partition id claimed by
a second node, or (deployment) a node that is not enrolled in ``node_partitions`` or answers
another partition than it is bound to, is refused: one data owner counts once in the
population, the cohort and the accountant (docs/fl_engine.md "Identity in deployment").
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

__all__ = ["connected_nodes", "enrol_nodes", "partition_id_of", "query_partitions"]


def partition_id_of(metrics: Any) -> int | None:
    """The integer ``partition-id`` of a query reply's metrics, or ``None`` when absent or bad.

    Example
    -------
    >>> partition_id_of({"partition-id": 2}), partition_id_of({"partition-id": [2]})
    (2, None)
    """
    value = metrics.get("partition-id") if hasattr(metrics, "get") else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not (math.isfinite(value) and float(value).is_integer() and value >= 0):
        return None
    return int(value)


def _refusal(
    node: int, partition: int, *, owner: Mapping[int, int], binding: Mapping[int, int] | None
) -> str | None:
    """Why ``node`` may not hold ``partition`` (None: it may)."""
    if binding is not None and node not in binding:
        return "its node id is not in node_partitions (not an enrolled SuperNode)"
    if binding is not None and binding[node] != partition:
        return (
            f"it answered partition-id={partition}, but node_partitions binds it to "
            f"partition {binding[node]}"
        )
    if partition in owner:
        return f"partition-id={partition} is already claimed by node {owner[partition]}"
    return None


def enrol_nodes(
    answers: Mapping[int, int],
    *,
    node_order: dict[int, int],
    refused: dict[int, str],
    binding: Mapping[int, int] | None,
) -> None:
    """Add the answering nodes to ``node_order`` (node -> partition) or to ``refused``.

    Nodes are taken in node-id order, so of two nodes claiming one partition in one query the
    higher node id is refused; each refusal is logged once with its reason.

    Example
    -------
    >>> order, refused = {}, {}
    >>> enrol_nodes({7: 0, 9: 0, 8: 1}, node_order=order, refused=refused, binding=None)
    >>> order, sorted(refused)
    ({7: 0, 8: 1}, [9])
    """
    owner = {p: n for n, p in node_order.items()}
    for node in sorted(answers):
        partition = answers[node]
        reason = _refusal(node, partition, owner=owner, binding=binding)
        if reason is not None:
            refused[node] = reason
            log(
                WARNING,
                "node %d: refused, %s; its replies are dropped (check the SuperNodes' "
                "--node-config)",
                node,
                reason,
            )
            continue
        owner[partition] = node
        node_order[node] = partition


def connected_nodes(grid: Grid, minimum: int) -> list[int]:
    """The connected nodes of ``grid``, waiting (0.1 s polls) until at least ``minimum`` are."""
    polls = 0
    while len(nodes := list(grid.get_node_ids())) < minimum:
        if polls % 20 == 0:
            log(INFO, "waiting for nodes: %d connected, %d needed", len(nodes), minimum)
        polls += 1
        time.sleep(0.1)
    return nodes


def query_partitions(grid: Grid, nodes: Sequence[int], *, timeout: float) -> dict[int, int]:
    """Ask ``nodes`` their ``partition-id`` (a ``query`` message); node -> its answer.

    One answer per node counts; a node that does not answer, answers with an error or
    without an integer ``partition-id`` (logged) is left out.
    """
    messages = [
        Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes
    ]
    asked, answers = set(nodes), {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if node not in asked or reply.has_error() or not reply.content.metric_records:
            continue
        asked.discard(node)  # one answer per node
        partition = partition_id_of(next(iter(reply.content.metric_records.values())))
        if partition is None:
            log(WARNING, "node %d: query reply without an integer partition-id", node)
        else:
            answers[node] = partition
    return answers
