"""A client's reply records, built without Flower's per-item type checks where they pass.

Flower's ``MetricRecord(metrics)`` and ``RecordDict(records)`` check every key and value as
they store it (``MetricRecord``: ``isinstance`` against the scalar types and every element of
a list; ``RecordDict``: a look-up of the old value, which raises and catches ``KeyError`` for a
new key, and an ``isinstance`` against a union built per call), ~2 us an item: a DP reply's
MetricRecord of list-valued norms cost ~25 us, its RecordDict ~7 us. Where the values are
plainly valid (checked here, more cheaply and more strictly) the records are filled directly,
with the ``__dict__`` Flower's constructors give them, verified once at import (otherwise,
and for any other value, Flower's constructors run, with their errors).
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, MetricRecord, RecordDict

__all__ = ["metric_record", "reply_record"]


def _plain_metric(value: Any) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` (not ``bool``, not a subclass), or a
    non-empty list of values of one of those two types: values ``MetricRecord`` accepts."""
    kind = type(value)
    if kind is int or kind is float:
        return True
    if kind is not list or not value:
        return False
    first = type(value[0])
    return (first is int or first is float) and all(type(v) is first for v in value)


def _same_fields(made: Any, direct: Any) -> bool:
    return list(vars(made)) == list(vars(direct)) and all(
        vars(made)[k] == vars(direct)[k] for k in vars(made)
    )


def _fields_only() -> bool:
    """Whether Flower's ``MetricRecord(metrics)`` and ``RecordDict(records)`` store exactly the
    items in their ``_data`` dict (Flower 1.42: type checks, then the item), as done here."""
    metrics = {"n": 3, "loss": 0.5, "norms": [0.1, 0.2], "flags": [1, 0]}
    direct = MetricRecord()
    direct.__dict__["_data"].update(metrics)
    if not _same_fields(MetricRecord(metrics), direct):
        return False
    records = {"arrays": ArrayRecord(), "metrics": direct}
    made, direct_dict = RecordDict(records), RecordDict()
    direct_dict.__dict__["_data"].update(records)
    return _same_fields(made, direct_dict) and made["metrics"] is direct


_DIRECT = _fields_only()


def metric_record(metrics: dict[str, Any]) -> MetricRecord:
    """``MetricRecord(metrics)``; stored directly where every key is a ``str`` and every value
    plainly valid (:func:`_plain_metric`).

    Example
    -------
    >>> dict(metric_record({"num-examples": 3, "train-loss": 0.5}))
    {'num-examples': 3, 'train-loss': 0.5}
    """
    if _DIRECT and all(type(k) is str and _plain_metric(v) for k, v in metrics.items()):
        record = MetricRecord()
        record.__dict__["_data"].update(metrics)
        return record
    return MetricRecord(metrics)


def reply_record(arrays: ArrayRecord, metrics: MetricRecord) -> RecordDict:
    """``RecordDict({"arrays": arrays, "metrics": metrics})``, stored directly.

    Example
    -------
    >>> list(reply_record(ArrayRecord(), MetricRecord()))
    ['arrays', 'metrics']
    """
    if _DIRECT and type(arrays) is ArrayRecord and type(metrics) is MetricRecord:
        record = RecordDict()
        record.__dict__["_data"].update({"arrays": arrays, "metrics": metrics})
        return record
    return RecordDict({"arrays": arrays, "metrics": metrics})
