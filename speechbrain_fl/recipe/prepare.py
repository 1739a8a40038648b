"""Prepare once per run, and the record of the options a preparation was made with.

A federated recipe's task factory runs in several processes (the script or ServerApp, every
Ray actor or SuperNode); :func:`prepare_once` lets the first one prepare the data and the
others read what it prepared. A ``<dataset>_prepare.py`` records the options its manifests were
made with (:func:`save_prepare_options`, SpeechBrain's ``skip()`` habit) and skips when they
match (:func:`prepared_with`), so a changed option re-prepares. Both files are written
atomically (:func:`speechbrain_fl.utils.atomic.atomic_open`): a killed run never leaves a record that
a later run would read as complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from speechbrain_fl.utils.atomic import atomic_open

__all__ = [
    "OPTIONS_FILE",
    "PREPARED_FILE",
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


def prepare_once(
    folder: str | os.PathLike, key: Mapping[str, Any], prepare: Callable[[], Any]
) -> Any:
    """Return ``prepare()``'s JSON result, computed once per ``key`` and kept in ``folder``.

    The first caller runs ``prepare`` (corpus, manifests, partition, seed model: idempotent,
    cached steps) and writes ``<folder>/prepared.json`` atomically with ``key``; a later caller
    with the same ``key`` reads it and prepares nothing, so the processes of one run (the script
    or the ServerApp first, then Ray actors or SuperNodes) never rewrite files another process
    is reading. A different ``key`` (a changed option) prepares again.

    Example
    -------
    >>> import tempfile
    >>> d, calls = tempfile.mkdtemp(), []
    >>> def prep():
    ...     calls.append(1)
    ...     return {"clients": 4}
    >>> prepare_once(d, {"seed": 1}, prep), prepare_once(d, {"seed": 1}, prep), len(calls)
    ({'clients': 4}, {'clients': 4}, 1)
    """
    key = json.loads(json.dumps(dict(key), default=str))
    marker = Path(folder) / PREPARED_FILE
    if marker.is_file():
        saved = json.loads(marker.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return saved["result"]
    result = prepare()
    with atomic_open(marker) as handle:
        json.dump({"key": key, "result": result}, handle, indent=2)
    return result
