"""Every check of a client reply, in one place: its form (:func:`parse_train_reply`), then its
claims (:func:`check_reply`). One bad client cannot crash a round.

The form: a reply is rejected, with a reason naming the node and the offending tensor or metric,
when the ClientApp raised, when it carries no ArrayRecord or MetricRecord, when its tensor
names, shapes or dtypes differ from the global trainable parameters, when an array's bytes do
not decode, when a metric is not a finite number (or list of them) where one belongs, or when
any tensor is non-finite. Decoded tensors of one dtype are views of one buffer (from a
:class:`BufferPool` kept across rounds), float32 or wider.

The claims, against :class:`ReplyLimits` (what the server knows independently of the client):
``num-examples`` an integer in ``1 .. 2**53`` and at most the partition's size (simulation) or
``max_num_examples`` (deployment); ``exit-depth`` one of the model's exits, the reply carrying
only tensors at or below it; every value fitting the parameter's dtype; the update's L2 norm at
most ``max_update_norm`` when set (non-private runs). A failed check raises
:class:`ReplyRejected`; the strategy drops the reply with one log line and the round goes on.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.npy_codec import decode

__all__ = [
    "MAX_EXACT_COUNT",
    "BufferPool",
    "ReplyLimits",
    "ReplyRejected",
    "check_reply",
    "parse_train_reply",
]


class ReplyRejected(Exception):
    """A client reply that cannot be aggregated; ``str(err)`` says why."""


#: The largest integer a float64 (the MetricRecord's number type) holds exactly.
MAX_EXACT_COUNT = 2**53

#: The reply metric holding a layer-wise client's L_max (see :mod:`speechbrain_fl.fl.aggregate.layerwise`).
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


class BufferPool:
    """1-D NumPy buffers of one dtype and size, reused once nothing refers to them.

    A buffer handed out by :meth:`get` is free again when no tensor or array made from it is
    alive: ``torch.from_numpy`` keeps a reference to the array for as long as any view of it
    lives, so the array's reference count says whether anything still uses it (a rule or a
    caller that kept an update's tensors keeps its buffer; the pool then makes another).

    Arguments
    ---------
    max_bytes : int
        The most bytes the pool keeps; beyond it :meth:`get` returns unpooled buffers (a large
        model's replies are not held between rounds).

    Example
    -------
    >>> pool = BufferPool()
    >>> a = pool.get(np.dtype(np.float32), 4)
    >>> a is pool.get(np.dtype(np.float32), 4)  # ``a`` is still referenced: another one
    False
    >>> key = id(a); del a
    >>> id(pool.get(np.dtype(np.float32), 4)) == key  # free again: the same buffer
    True
    """

    #: References to a free pooled array inside :meth:`get`: the pool's list, the loop
    #: variable and ``sys.getrefcount``'s own argument.
    _FREE_REFS = 3

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = int(max_bytes)
        self._arrays: dict[tuple[str, int], list[np.ndarray]] = {}
        self._bytes = 0

    def get(self, dtype: np.dtype, size: int) -> np.ndarray:
        """A free 1-D buffer of ``size`` elements of ``dtype`` (contents undefined)."""
        arrays = self._arrays.setdefault((dtype.str, int(size)), [])
        for array in arrays:
            if sys.getrefcount(array) == self._FREE_REFS:
                return array
        array = np.empty(size, dtype=dtype)
        if self._bytes + array.nbytes <= self.max_bytes:
            arrays.append(array)
            self._bytes += array.nbytes
        return array


def parse_train_reply(
    message: Message,
    *,
    expected_shapes: dict[str, tuple[int, ...]],
    allow_partial: bool = False,
    limits: ReplyLimits | None = None,
    pool: BufferPool | None = None,
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
        trained), for rules with ``accepts_partial`` (e.g. :mod:`speechbrain_fl.fl.aggregate.layerwise`).
    limits : ReplyLimits, optional
        What the server knows (partition sizes, exits, ranges): the reply's claims are checked
        against it by :func:`speechbrain_fl.fl.serverapp.replies.check_reply`.
    pool : BufferPool, optional
        Where the decoded reply's buffer comes from (default: a new array).

    Returns
    -------
    ClientUpdate
        The delta (float32 or float64 tensors) and the flattened metrics.
    """
    node = message.metadata.src_node_id
    if message.has_error():
        raise ReplyRejected(f"node {node}: client error: {message.error.reason}")
    array_records, metric_records = _records(message.content)
    if len(array_records) != 1 or len(metric_records) != 1:
        raise ReplyRejected(
            f"node {node}: expected one ArrayRecord and one MetricRecord, got "
            f"{list(array_records)} and {list(metric_records)}"
        )
    arrays = next(iter(array_records.values()))
    metrics = dict(next(iter(metric_records.values())))
    names = set(arrays.keys())
    partial_ok = allow_partial and names and names <= set(expected_shapes)
    if names != set(expected_shapes) and not partial_ok:
        missing = sorted(set(expected_shapes) - names)
        extra = sorted(names - set(expected_shapes))
        raise ReplyRejected(
            f"node {node}: wrong tensor names (missing {missing}, unexpected {extra})"
        )
    decoded = {}
    for name in expected_shapes:  # the parameter order, whatever the reply's order
        if name not in names:  # a partial reply (allowed above): the client did not train it
            continue
        try:
            array = decode(arrays[name])  # Array.numpy(), the .npy header cached
        except Exception as err:  # corrupt bytes, another serialisation: any decode error
            raise ReplyRejected(
                f"node {node}: tensor {name!r} cannot be decoded ({type(err).__name__}: {err})"
            ) from None
        if tuple(array.shape) != tuple(expected_shapes[name]):
            raise ReplyRejected(
                f"node {node}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"expected {tuple(expected_shapes[name])}"
            )
        if array.dtype.kind != "f" or array.dtype.itemsize not in (2, 4, 8):
            raise ReplyRejected(f"node {node}: tensor {name!r} has dtype {array.dtype}")
        if not array.dtype.isnative:
            raise ReplyRejected(
                f"node {node}: tensor {name!r} has non-native byte order ({array.dtype.str})"
            )
        decoded[name] = array
    delta, buffer = _to_tensors(decoded, pool)
    # NumPy's isfinite (~30x torch's on one CPU thread), once over the packed buffer when
    # there is one (widening float16 keeps finiteness); per tensor to name the first bad one
    if not (buffer is not None and bool(np.isfinite(buffer).all())):
        for name, array in decoded.items():
            if not bool(np.isfinite(array).all()):
                raise ReplyRejected(f"node {node}: tensor {name!r} has non-finite values")
    for key, value in metrics.items():
        problem = _metric_problem(key, value)
        if problem:
            raise ReplyRejected(f"node {node}: metric {key!r} {problem} (got {value!r:.80})")
    update = ClientUpdate(node_id=node, delta=delta, metrics=metrics)
    check_reply(update, limits or ReplyLimits())
    return update


def _records(content: RecordDict) -> tuple[dict[str, ArrayRecord], dict[str, MetricRecord]]:
    """``content.array_records`` and ``content.metric_records`` (same keys, same order) in one
    pass: Flower's properties build a synced dictionary, type-checking every entry, per call."""
    arrays, metrics = {}, {}
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            arrays[key] = record
        elif isinstance(record, MetricRecord):
            metrics[key] = record
    return arrays, metrics


#: Metrics that must be one number, and metrics that must be a list of numbers.
SCALAR_METRICS = (
    "num-examples",
    "train-loss",
    "joint-norm",
    "clip-ratio",
    "partition-id",
    "exit-depth",
)
LIST_METRICS = ("group-norms", "group-clipped", "component-norms", "component-clipped")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: The exact types of a list whose items :func:`_all_numbers` checks in one pass.
_PLAIN_NUMBERS = frozenset({int, float})


def _all_numbers(values: list) -> bool:
    """``all(_is_number(v) for v in values)``: for a list of plain ints and floats (the
    client's norms, clip flags) one set of the item types and one C-level ``map`` of
    ``math.isfinite``; other item types (bool, subclasses) one by one."""
    if set(map(type, values)) <= _PLAIN_NUMBERS:
        return all(map(math.isfinite, values))
    return all(_is_number(v) for v in values)


def _metric_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the metric ``key`` (``None`` when it can)."""
    if key in LIST_METRICS or (key not in SCALAR_METRICS and isinstance(value, list)):
        if not isinstance(value, list) or not _all_numbers(value):
            return "must be a list of finite numbers"
        return None
    if not _is_number(value):
        return "must be a finite number"
    if key == "partition-id" and (value < 0 or not float(value).is_integer()):
        return "must be an integer >= 0"
    return None


def _to_tensors(
    decoded: dict[str, np.ndarray], pool: BufferPool | None = None
) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
    """Torch tensors of ``decoded``, at least float32: views of one buffer when they share a dtype.

    The decoded arrays are read-only views of the reply's bytes; the buffer is the one copy
    the server makes of a reply (written in place by the re-clip). Returns the tensors and
    that buffer (``None`` for mixed dtypes: one array each).

    A float16 array is widened to float32 (exactly) here, so that the server's re-clipping and
    everything after it runs in float32 or wider whatever the wire dtype: float16 arithmetic
    (a row norm, a scale factor rounded to float16) is too coarse for the clipping margin.
    """
    dtypes = {a.dtype for a in decoded.values()}
    if not dtypes:
        return {}, None
    if len(dtypes) != 1:
        tensors = {
            k: torch.from_numpy(np.array(a, dtype=np.promote_types(a.dtype, np.float32)))
            for k, a in decoded.items()
        }
        return tensors, None
    dtype = np.promote_types(dtypes.pop(), np.float32)
    parts = [a.reshape(-1) for a in decoded.values()]
    if pool is None:
        flat = np.concatenate(parts, dtype=dtype)
    else:
        flat = np.concatenate(parts, out=pool.get(dtype, sum(a.size for a in parts)))
    buffer = torch.from_numpy(flat)
    out, offset = {}, 0
    for name, array in decoded.items():
        out[name] = buffer[offset : offset + array.size].view(array.shape)
        offset += array.size
    return out, flat
