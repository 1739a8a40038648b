"""Checks of a decoded reply against what the server knows (counts, depth, size, range).

:func:`speechbrain_fl.fl.replies.parse_train_reply` checks that a reply is well formed (names,
shapes, dtypes, finite tensors and metrics); this module checks that its *claims* are possible,
against :class:`ReplyLimits`, what the server knows independently of the client:

- ``num-examples`` is an integer in ``1 .. 2**53`` (exact in a float64), at most the size of
  the reply's partition when the server knows the partition sizes (simulation:
  ``ServerTask.partition_sizes``), else at most the declared ``max_num_examples`` (deployment,
  an :class:`~speechbrain_fl.fl.config.FLConfig` key). An unbounded count would let one client
  dominate every weighted mean (the audit: ``num-examples=1e9`` made layer 1 the attacker's
  -1000 against two honest +1; ``1e308`` overflowed the weights to ``inf``).
- ``exit-depth`` (layer-wise rules, :mod:`.layerwise`): an integer that is one of the model's
  exits when the server's model declares them (``ReplyLimits.depth_names``), else an integer
  in ``1 .. 2**53`` when the rule weights by depth (so a weight ``n_i L_i`` stays finite); and the reply carries only tensors at or below that
  depth (the union of what a client training exit e <= depth updates).
- every value fits the global parameter's dtype (a float64 delta of 1e300 on a float32 model
  would make the parameter ``inf``);
- the update's L2 norm is at most ``max_update_norm`` when that FLConfig key is set (non-private
  runs; off by default): a guard of FedAvg against absurd updates (a float32 delta of 3e38
  made the global parameter 1e38). A private run's clip bounds every update already.

A failed check raises :class:`ReplyRejected` with the node and the
reason; the strategy drops the reply with one log line and the round goes on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .updates import ClientUpdate

__all__ = ["MAX_EXACT_COUNT", "ReplyLimits", "ReplyRejected", "check_reply"]


class ReplyRejected(Exception):
    """A client reply that cannot be aggregated; ``str(err)`` says why."""


#: The largest integer a float64 (the MetricRecord's number type) holds exactly.
MAX_EXACT_COUNT = 2**53

#: The reply metric holding a layer-wise client's L_max (see :mod:`.layerwise`).
DEPTH_METRIC = "exit-depth"


@dataclass(frozen=True)
class ReplyLimits:
    """What the server checks a reply's claims against (see the module docstring).

    Arguments
    ---------
    depth_names : mapping of int to frozenset of str, optional
        For a model with exits: exit depth -> the tensors a client declaring that depth may
        send. ``None``: the model declares no exits.
    require_depth : bool
        The rule needs an integer ``exit-depth`` >= 1 (depth-aware weighting, partial replies).
    partition_sizes : sequence of int, optional
        Examples in each partition (simulation); a reply's ``num-examples`` is at most its
        partition's and its ``partition-id`` must index this list.
    max_num_examples : int, optional
        A declared maximum of ``num-examples`` (deployment), used without partition sizes.
    max_update_norm : float, optional
        Largest accepted L2 norm of an update (float64); ``None``: no bound.
    dtypes : mapping of str to torch.dtype, optional
        The global parameters' dtypes: every value of a reply must fit them.

    Example
    -------
    >>> limits = ReplyLimits(max_num_examples=10)
    >>> try:
    ...     check_reply(ClientUpdate(3, {"w": torch.ones(2)}, {"num-examples": 11}), limits)
    ... except ReplyRejected as err:
    ...     print(err)
    node 3: num-examples=11 exceeds max_num_examples=10 (the declared maximum)
    """

    depth_names: Mapping[int, frozenset[str]] | None = None
    require_depth: bool = False
    partition_sizes: Sequence[int] | None = None
    max_num_examples: int | None = None
    max_update_norm: float | None = None
    dtypes: Mapping[str, torch.dtype] | None = None


def _is_integer(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
    )


def check_reply(update: ClientUpdate, limits: ReplyLimits) -> None:
    """Raise :class:`ReplyRejected` if ``update`` claims what the server knows is impossible.

    Arguments
    ---------
    update : ClientUpdate
        A decoded, well-formed reply.
    limits : ReplyLimits
        What the server knows.
    """
    node, metrics = update.node_id, update.metrics

    def reject(why: str) -> ReplyRejected:
        return ReplyRejected(f"node {node}: {why}")

    count = metrics.get("num-examples", 1)
    if not _is_integer(count) or not 1 <= count <= MAX_EXACT_COUNT:
        raise reject(f"num-examples={count!r} must be an integer in 1..2**53")
    if limits.partition_sizes is not None:
        partition = metrics.get("partition-id")
        if not _is_integer(partition) or not 0 <= partition < len(limits.partition_sizes):
            raise reject(
                f"partition-id={partition!r} is not one of the server's "
                f"{len(limits.partition_sizes)} partitions"
            )
        size = limits.partition_sizes[int(partition)]
        if count > size:
            raise reject(
                f"num-examples={count:g} exceeds the {size} examples of partition {int(partition)}"
            )
    elif limits.max_num_examples is not None and count > limits.max_num_examples:
        raise reject(
            f"num-examples={count:g} exceeds max_num_examples={limits.max_num_examples} "
            "(the declared maximum)"
        )
    if limits.depth_names is not None or limits.require_depth:
        _check_depth(update, limits, reject)
    if limits.dtypes is not None:
        for name, tensor in update.delta.items():
            dtype = limits.dtypes.get(name)
            if dtype is None or torch.finfo(tensor.dtype).max <= torch.finfo(dtype).max:
                continue
            peak = float(tensor.abs().max())
            if peak > torch.finfo(dtype).max:
                raise reject(
                    f"tensor {name!r} has values up to {peak:.3g}, beyond the range of the "
                    f"model's {str(dtype).replace('torch.', '')}"
                )
    if limits.max_update_norm is not None:
        norm = math.sqrt(
            math.fsum(float(t.detach().double().square().sum()) for t in update.delta.values())
        )
        if not norm <= limits.max_update_norm:
            raise reject(
                f"update norm {norm:.4g} exceeds max_update_norm={limits.max_update_norm:g}"
            )


def _check_depth(update: ClientUpdate, limits: ReplyLimits, reject) -> None:
    depth = update.metrics.get(DEPTH_METRIC)
    if depth is None:
        raise reject(f"no {DEPTH_METRIC!r} metric (the exit the client trained to)")
    if not _is_integer(depth) or not 1 <= depth <= MAX_EXACT_COUNT:
        raise reject(f"{DEPTH_METRIC}={depth!r} must be an integer in 1..2**53")
    depth = int(depth)
    if limits.depth_names is None:
        return
    exits = sorted(limits.depth_names)
    if depth not in limits.depth_names:
        raise reject(f"{DEPTH_METRIC}={depth} is not one of the model's exits {exits}")
    allowed = frozenset().union(*(limits.depth_names[e] for e in exits if e <= depth))
    beyond = sorted(set(update.delta) - allowed)
    if beyond:
        raise reject(
            f"{DEPTH_METRIC}={depth} but the reply carries {len(beyond)} tensors above that "
            f"depth (e.g. {beyond[0]!r})"
        )
