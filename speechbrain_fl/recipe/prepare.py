"""Prepare once per run, and the record of the options a preparation was made with.

A federated recipe's task factory runs in several processes (the script or ServerApp, every
Ray actor or SuperNode); :func:`prepare_once` lets the first one prepare the data and the
others read what it prepared. Its cache key is what the preparation read of the hparams and
run options (:class:`InputRecorder`), hashed: no list of keys to keep by hand. A ``<dataset>_prepare.py`` records the options its manifests were
made with (:func:`save_prepare_options`, SpeechBrain's ``skip()`` habit) and skips when they
match (:func:`prepared_with`), so a changed option re-prepares. Both files are written
atomically (:func:`speechbrain_fl.utils.atomic.atomic_open`): a killed run never leaves a record that
a later run would read as complete.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from speechbrain_fl.utils.atomic import atomic_open

__all__ = [
    "OPTIONS_FILE",
    "PREPARED_FILE",
    "InputRecorder",
    "canonical",
    "prepare_once",
    "prepared_with",
    "save_prepare_options",
]

OPTIONS_FILE = "prepare_options.json"


def save_prepare_options(
    save_folder: str | os.PathLike,
    options: Mapping[str, Any],
    report: Mapping[str, Any] | None = None,
    *,
    name: str = OPTIONS_FILE,
) -> Path:
    """Record the options (and a report) a preparation was made with; write it last.

    Arguments
    ---------
    save_folder : str or PathLike
        The preparation's output folder.
    options : mapping
        Everything that shapes the prepared files (JSON-serialisable).
    report : mapping, optional
        What the preparation found (counts, skipped files), kept beside the options.
    name : str
        The record's file name (``prepare_options.json``).

    Returns
    -------
    Path
        The record, written atomically.

    Example
    -------
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_prepare_options(d, {"seed": 1}, {"rows": 3})
    >>> prepared_with(d, {"seed": 1}), prepared_with(d, {"seed": 2})
    (True, False)
    """
    path = Path(save_folder) / name
    with atomic_open(path) as handle:
        json.dump({"options": dict(options), "report": dict(report or {})}, handle, indent=2)
    return path


def prepared_with(
    save_folder: str | os.PathLike,
    options: Mapping[str, Any],
    files: Iterable[str] = (),
    *,
    name: str = OPTIONS_FILE,
) -> bool:
    """True if the saved record's options equal ``options`` and every one of ``files`` exists.

    ``files`` are relative to ``save_folder`` (the manifests the preparation writes). A missing
    or unreadable record is "not prepared".
    """
    path = Path(save_folder) / name
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(saved, dict) or saved.get("options") != json.loads(json.dumps(options)):
        return False
    return all((Path(save_folder) / f).is_file() for f in files)


PREPARED_FILE = "prepared.json"
_ABSENT = {"absent": True}  # the recorded value of a key read but not present


def canonical(value: Any, _depth: int = 0) -> Any:
    """A JSON value standing for ``value``, equal in every process for equal settings.

    Plain data stays as it is (tuples become lists, paths strings); a function or class is its
    ``module:qualname``; a ``functools.partial`` (HyperPyYAML's ``!name:``) its function and
    arguments; an object (``!new:``) its type and attributes; anything else its ``repr``,
    unless that holds a memory address, which differs between processes (then its type).

    Example
    -------
    >>> import functools
    >>> canonical({"k": (1, 2.5), "f": functools.partial(max, 3)})
    {'k': [1, 2.5], 'f': {'partial': 'builtins:max', 'args': [3], 'keywords': {}}}
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if _depth > 8:
        return _qualified(type(value))
    deeper = functools.partial(canonical, _depth=_depth + 1)
    if isinstance(value, Mapping):
        return {str(k): deeper(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [deeper(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((deeper(v) for v in value), key=repr)
    if isinstance(value, functools.partial):
        return {"partial": deeper(value.func), "args": deeper(value.args),
                "keywords": deeper(value.keywords)}  # fmt: skip
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return _qualified(value)
    if hasattr(value, "__dict__"):
        return {"type": _qualified(type(value)), "state": deeper(vars(value))}
    text = repr(value)
    return _qualified(type(value)) if " at 0x" in text else text


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


class InputRecorder(dict):
    """A copy of a mapping that records which keys are read, and their values when first read.

    A key read is an input of the computation given the recorder: ``[]``, ``get``, ``in``, and
    iteration (every key, then). A key written before it was read is not one; a write goes to
    the original mapping too, so the computation's changes stay visible to its caller.
    :attr:`inputs` maps each key read to :func:`canonical` of its value.

    Example
    -------
    >>> hp = InputRecorder({"seed": 1, "rounds": 5, "lr": 0.1})
    >>> hp["seed"] + (hp.get("workers") or 0)
    1
    >>> hp.inputs
    {'seed': 1, 'workers': {'absent': True}}
    """

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self._original = data
        self.inputs: dict[str, Any] = {}
        self._written: set[str] = set()

    def _note(self, key: Any) -> None:
        if key not in self.inputs and key not in self._written:
            self.inputs[key] = canonical(dict.get(self, key)) if dict.__contains__(self, key) \
                else _ABSENT  # fmt: skip

    def _note_all(self) -> None:
        for key in dict.keys(self):
            self._note(key)

    def __getitem__(self, key):
        self._note(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._note(key)
        return dict.get(self, key, default)

    def __contains__(self, key) -> bool:
        self._note(key)
        return dict.__contains__(self, key)

    def __iter__(self):
        self._note_all()
        return dict.__iter__(self)

    def keys(self):
        self._note_all()
        return dict.keys(self)

    def items(self):
        self._note_all()
        return dict.items(self)

    def values(self):
        self._note_all()
        return dict.values(self)

    def copy(self) -> dict:
        self._note_all()
        return dict(dict.items(self))

    def __setitem__(self, key, value) -> None:
        self._written.add(key)
        dict.__setitem__(self, key, value)
        if isinstance(self._original, MutableMapping):
            self._original[key] = value


def _digest(inputs: Mapping[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _current(saved: Mapping[str, Mapping[str, Any]], inputs: Mapping[str, Mapping]) -> dict:
    """The current values, by :func:`canonical`, of the keys a saved preparation read."""
    if set(saved) != set(inputs):
        return {}
    return {
        name: {k: canonical(inputs[name][k]) if k in inputs[name] else _ABSENT for k in keys}
        for name, keys in saved.items()
    }


def prepare_once(
    folder: str | os.PathLike,
    prepare: Callable[..., Any],
    **inputs: Mapping[str, Any],
) -> Any:
    """Return ``prepare(**inputs)``'s JSON result, computed once per value of what it reads.

    The first caller runs ``prepare`` (corpus, manifests, partition, seed model: idempotent,
    cached steps) on recorders of its ``inputs`` (:class:`InputRecorder`) and writes
    ``<folder>/prepared.json`` atomically: the keys it read with their values (its
    *declared inputs*: declared by reading them), their SHA-256, and the result. A later
    caller (another process of the run: a Ray actor, a SuperNode) whose values of those keys
    hash the same reads the result and prepares nothing, so no process rewrites files another
    is reading. A changed value of a key ``prepare`` read prepares again; a key it never read
    (the number of rounds, the noise) is not part of the cache key. A hand-kept list of keys
    would go stale silently when the preparation starts reading one more, and keying on every
    value would prepare again for any change.

    Example
    -------
    >>> import tempfile
    >>> d, calls = tempfile.mkdtemp(), []
    >>> def prep(hparams):
    ...     calls.append(1)
    ...     return {"clients": hparams["clients"]}
    >>> prepare_once(d, prep, hparams={"clients": 4, "rounds": 1})
    {'clients': 4}
    >>> prepare_once(d, prep, hparams={"clients": 4, "rounds": 9}), len(calls)
    ({'clients': 4}, 1)
    >>> prepare_once(d, prep, hparams={"clients": 2, "rounds": 9}), len(calls)
    ({'clients': 2}, 2)
    """
    marker = Path(folder) / PREPARED_FILE
    if marker.is_file():
        try:
            saved = json.loads(marker.read_text(encoding="utf-8"))
            current = _current(saved["inputs"], inputs)
            if current and _digest(current) == saved["digest"]:
                return saved["result"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # an older or damaged record: prepare again
    recorders = {name: InputRecorder(values) for name, values in inputs.items()}
    result = prepare(**recorders)
    read = {name: recorder.inputs for name, recorder in recorders.items()}
    read = json.loads(json.dumps(read, default=str))
    # the caller gets what a later process reads back: plain JSON data, no recorder of the inputs
    result = json.loads(json.dumps(result))
    with atomic_open(marker) as handle:
        json.dump({"inputs": read, "digest": _digest(read), "result": result}, handle, indent=2)
    return result
