"""``copy.deepcopy`` of a Flower Message, without ``deepcopy``'s generic machinery.

The local backend (:mod:`speechbrain_fl.fl.engines.local_grid`) hands every client its own copy of the server's
message, as the Ray path's pickling does: a client that edits its message (a config value, an
``Array``'s ``data``, the ArrayRecord itself) must not edit the server's message, whose
ArrayRecord is the strategy's ``current_arrays``, nor the next client's. ``copy.deepcopy``
does that, at ~0.1-0.2 ms a message on one CPU thread: a Message of a small model is ~170
objects (metadata fields, records, six ``Array`` objects and their shapes), and for each one
``deepcopy`` looks up a copier, calls ``__reduce_ex__`` and ``copyreg.__newobj__`` and rebuilds
the state dictionary.

:func:`message_copy` returns the same structure as ``deepcopy`` and shares what ``deepcopy``
shares: a new object for every Flower record object (``Message``, ``Metadata``, ``Error``,
``RecordDict``, ``ArrayRecord``, ``ConfigRecord``, ``MetricRecord``, ``Array``), dict, list
and tuple of copies, and the immutable leaves themselves (``int``, ``float``, ``str``,
``bytes``, ...; an ``Array``'s ``data`` is ``bytes``, so the payload is shared, not copied,
exactly as ``deepcopy`` shares it). Anything else goes to ``copy.deepcopy`` with the same memo,
so an object reached twice is copied once, as by ``deepcopy``. A Flower record object is
copied as ``deepcopy`` copies it (``cls.__new__(cls)`` and its ``__dict__``, copied) only when
its class has no copy hook of its own (``__deepcopy__``, ``__reduce_ex__``, ``__reduce__``,
``__getstate__``, ``__setstate__``, non-empty ``__slots__``); a Flower release that adds one
gets ``copy.deepcopy`` for that class (:data:`STRUCTURAL`). Tested equal to ``deepcopy`` and
isolated from the original (``tests/unit/test_fl_wire_isolation.py``).

Example
-------
>>> from flwr.app import ArrayRecord, ConfigRecord, RecordDict
>>> import numpy as np
>>> arrays, config = ArrayRecord([np.ones(2)]), ConfigRecord({"lr": 0.1})
>>> original = RecordDict({"arrays": arrays, "config": config})
>>> copied = message_copy(original)  # a Message's content, here on its own
>>> copied["config"]["lr"] = 1.0
>>> original["config"]["lr"], copied["arrays"]["0"] is arrays["0"]
(0.1, False)
>>> copied["arrays"]["0"].data is arrays["0"].data  # immutable bytes: shared
True
"""

from __future__ import annotations

import copy
import types
from typing import Any, TypeVar

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)

__all__ = ["STRUCTURAL", "message_copy"]

T = TypeVar("T")

#: Types ``copy.deepcopy`` returns as they are (its ``_deepcopy_atomic`` types that a message
#: holds); a value of one of these is shared by the copy.
_ATOMIC = frozenset(
    {
        type(None),
        int,
        float,
        bool,
        complex,
        str,
        bytes,
        type,
        range,
        types.FunctionType,
        types.BuiltinFunctionType,
    }
)

_HOOKS = ("__deepcopy__", "__reduce_ex__", "__reduce__", "__getstate__", "__setstate__", "__copy__")


def _plain(cls: type) -> bool:
    """Whether ``deepcopy`` copies instances of ``cls`` as ``cls.__new__(cls)`` plus a deep copy
    of their ``__dict__``: no copy hook of its own and no named ``__slots__``."""
    for base in cls.__mro__[:-1]:  # every class but ``object``
        if any(hook in vars(base) for hook in _HOOKS) or vars(base).get("__slots__"):
            return False
    return True


#: The Flower classes copied here (the others, and these if a Flower release gives them a
#: copy hook, go to ``copy.deepcopy``).
_RECORDS = (Message, Metadata, Error, RecordDict, ArrayRecord, ConfigRecord, MetricRecord, Array)
STRUCTURAL = frozenset(cls for cls in _RECORDS if _plain(cls))


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)`` for the types of a Flower message (see the module)."""
    cls = type(value)
    if cls in _ATOMIC:
        return value
    key = id(value)
    if key in memo:
        return memo[key]
    if cls in STRUCTURAL:
        new = cls.__new__(cls)
        memo[key] = new
        new.__dict__.update(
            {k: v if type(v) in _ATOMIC else _copy(v, memo) for k, v in value.__dict__.items()}
        )
    elif cls is dict:
        new = {}
        memo[key] = new
        for k, v in value.items():
            new[k if type(k) in _ATOMIC else _copy(k, memo)] = (
                v if type(v) in _ATOMIC else _copy(v, memo)
            )
    elif cls is list:
        new = []
        memo[key] = new
        new.extend(v if type(v) in _ATOMIC else _copy(v, memo) for v in value)
    elif cls is tuple:
        if all(type(v) in _ATOMIC for v in value):
            return value  # deepcopy returns a tuple of unchanged items as it is
        items = tuple(_copy(v, memo) for v in value)
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        new = memo.setdefault(key, items)
    else:
        return copy.deepcopy(value, memo)
    return new  # (no keep-alive list as deepcopy's: the originals live in ``message``)


def message_copy(message: T) -> T:
    """Return what ``copy.deepcopy(message)`` returns, sharing only immutable leaves.

    Arguments
    ---------
    message : flwr.app.Message
        The message (any object: what is not a Flower record goes to ``copy.deepcopy``).

    Returns
    -------
    flwr.app.Message
        A copy no change of which reaches ``message``.
    """
    return _copy(message, {})
