"""Validation of client replies: one bad client cannot crash a round.

A reply is rejected, with a reason naming the node and the offending tensor or metric, when the
ClientApp raised (Flower turns the exception into an error reply), when it carries no ArrayRecord
or MetricRecord, when its tensor names, shapes or dtypes differ from the global trainable
parameters, when an array's bytes do not decode (corrupt data, a non-native byte order, an
unsupported serialisation), when a metric is not a finite number where one belongs (a list, a
string) or not a list of finite numbers where a list belongs, or when any tensor is non-finite.
A client that exceeded the round timeout sends no reply at all; the server counts it from the
cohort, and takes one reply per sampled node only (see
:func:`speechbrain_fl.fl.strategy.DPFedAvg.aggregate_train`). Rejected replies never reach the
aggregate, so nothing non-finite can reach the global model through them.

The decoded tensors of a reply with one dtype are views of one buffer
(:func:`speechbrain_fl.privacy.packing.pack_update`'s layout), which the server's re-clipping
measures and scales with one operation each. They are float32 or wider: a float16 reply is
widened on decoding (exactly), so the re-clip's arithmetic is never narrower than float32 and
the aggregate (float64) reads the clipped values exactly.

The buffers can come from a :class:`BufferPool` the strategy keeps across rounds: a fresh
buffer per reply per round makes the allocator map fresh pages every round (measured on the
benchmark's private round: ~1,500 minor page faults a round, ~6 MB, most of them these
buffers); a pooled buffer is reused once no tensor refers to it any more.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from .npy_codec import decode
from .reply_checks import ReplyLimits, ReplyRejected, check_reply
from .updates import ClientUpdate

__all__ = ["BufferPool", "ReplyLimits", "ReplyRejected", "parse_train_reply"]


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
        trained), for rules with ``accepts_partial`` (e.g. :mod:`.layerwise`).
    limits : ReplyLimits, optional
        What the server knows (partition sizes, exits, ranges): the reply's claims are checked
        against it by :func:`speechbrain_fl.fl.reply_checks.check_reply`.
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
