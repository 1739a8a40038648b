"""Validation of client replies (fault handling, issue item 4).

A reply is rejected, with a reason naming the node and the offending tensor, when the ClientApp
raised (Flower turns the exception into an error reply), when it carries no ArrayRecord or
MetricRecord, when its tensor names or shapes differ from the global trainable parameters, or
when any tensor or reported statistic is non-finite. A client that exceeded the round timeout
sends no reply at all; the server counts it from the cohort (see
:func:`speechbrain_fl.fl.strategy.DPFedAvg.aggregate_train`). Rejected replies never reach the
aggregate, so nothing non-finite can reach the global model through them.
"""

from __future__ import annotations

import math

import torch
from flwr.app import Message

from .aggregation import ClientUpdate

__all__ = ["ReplyRejected", "parse_train_reply"]


class ReplyRejected(Exception):
    """A client reply that cannot be aggregated; ``str(err)`` says why."""


def parse_train_reply(
    message: Message, *, expected_shapes: dict[str, tuple[int, ...]], allow_partial: bool = False
) -> ClientUpdate:
    """Turn a training reply into a :class:`ClientUpdate` or raise :class:`ReplyRejected`.

    Arguments
    ---------
    message : flwr.app.Message
        The reply.
    expected_shapes : dict of str to tuple
        Name and shape of every global trainable parameter.
    allow_partial : bool
        Accept a reply carrying a non-empty subset of the names (the tensors its client
        trained), for rules with ``accepts_partial`` (e.g. :mod:`.layerwise`).

    Returns
    -------
    ClientUpdate
        The delta (float32 tensors) and the flattened metrics.
    """
    node = message.metadata.src_node_id
    if message.has_error():
        raise ReplyRejected(f"node {node}: client error: {message.error.reason}")
    content = message.content
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        raise ReplyRejected(
            f"node {node}: expected one ArrayRecord and one MetricRecord, got "
            f"{list(content.array_records)} and {list(content.metric_records)}"
        )
    arrays = next(iter(content.array_records.values()))
    metrics = dict(next(iter(content.metric_records.values())))
    names = set(arrays.keys())
    partial_ok = allow_partial and names and names <= set(expected_shapes)
    if names != set(expected_shapes) and not partial_ok:
        missing = sorted(set(expected_shapes) - names)
        extra = sorted(names - set(expected_shapes))
        raise ReplyRejected(
            f"node {node}: wrong tensor names (missing {missing}, unexpected {extra})"
        )
    delta: dict[str, torch.Tensor] = {}
    for name, tensor in arrays.to_torch_state_dict().items():
        if tuple(tensor.shape) != tuple(expected_shapes[name]):
            raise ReplyRejected(
                f"node {node}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected_shapes[name])}"
            )
        if not torch.is_floating_point(tensor):
            raise ReplyRejected(f"node {node}: tensor {name!r} has dtype {tensor.dtype}")
        if not bool(torch.isfinite(tensor).all()):
            raise ReplyRejected(f"node {node}: tensor {name!r} has non-finite values")
        delta[name] = tensor
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if not all(math.isfinite(float(v)) for v in values):
            raise ReplyRejected(f"node {node}: metric {key!r} is non-finite ({value})")
    if float(metrics.get("num-examples", 1)) <= 0:
        raise ReplyRejected(f"node {node}: num-examples must be > 0, got {metrics['num-examples']}")
    return ClientUpdate(node_id=node, delta=delta, metrics=metrics)
