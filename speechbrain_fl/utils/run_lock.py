"""TEMP stub for the gender branch: one run per output folder (rel's module replaces it).

``hold_run_lock(output_folder)`` takes an exclusive ``fcntl.flock`` on
``<output_folder>/.run.lock`` (released by the OS when the process dies), re-entrant within a
process; a second process gets :class:`RunLockedError` naming the folder and the holder's pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RunLockedError", "hold_run_lock"]

_HELD: dict[str, list] = {}
_GUARD = threading.Lock()


class RunLockedError(RuntimeError):
    """Another process holds the run lock of this output folder."""


@contextlib.contextmanager
def hold_run_lock(output_folder: str | os.PathLike) -> Iterator[Path]:
    folder = Path(output_folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder)
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            handle = None
        else:
            handle = open(folder / ".run.lock", "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                pid = handle.read().strip() or "?"
                handle.close()
                raise RunLockedError(
                    f"{folder} is in use by another run (pid {pid}); wait for it or use another "
                    "output_folder"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            _HELD[key] = [handle, 1]
    try:
        yield folder
    finally:
        with _GUARD:
            _HELD[key][1] -= 1
            if _HELD[key][1] == 0:
                held = _HELD.pop(key)[0]
                fcntl.flock(held, fcntl.LOCK_UN)
                held.close()
