"""One run per output folder: an advisory lock the OS releases when the holder dies.

Two runs writing one output folder mix their outputs (the audit: a second identical private
command "resumed after round 202" while the first ran; both reported 400 accountant rounds
while ``rounds.csv`` held 598 noisy releases). :func:`hold_run_lock` takes an exclusive
``fcntl.flock`` on ``<output_folder>/.run.lock`` for the duration of a ``with`` block; a second
process that asks for it gets :class:`RunLockedError` at once, naming the folder and the
holder's pid and command, which the holder writes into the file.

Decisions:

- ``flock`` (not a pid file checked for liveness): the kernel drops the lock when the holding
  process exits, however it exits (SIGKILL, out of memory), so a killed run never leaves a
  stale lock; the file itself stays (an empty or old content is harmless).
- Re-entrant within one process: a recipe script holds the lock for the whole run and the
  engine's server loop (:func:`speechbrain_fl.fl.serverapp.main.run_server`) takes it again; the
  nested holds count, the lock is released when the outermost block exits.
- The descriptor is not inherited by programs the run starts (``os.open`` descriptors are
  non-inheritable), so a helper process cannot keep the lock alive after the run.
- POSIX only (``fcntl``); the recipes run on Linux and macOS.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from .atomic import sigterm_as_exception

__all__ = ["LOCK_FILE", "RunLockedError", "hold_run_lock"]

LOCK_FILE = ".run.lock"

_HELD: dict[str, list[int]] = {}  # resolved folder -> [descriptor, hold count]
_GUARD = threading.Lock()


class RunLockedError(RuntimeError):
    """Another process holds the run lock of this output folder."""


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 65536).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def hold_run_lock(output_folder: str | os.PathLike) -> Iterator[Path]:
    """Hold the run lock of ``output_folder`` (created if missing) for the ``with`` block.

    Arguments
    ---------
    output_folder : str or os.PathLike
        The run's output folder.

    Yields
    ------
    Path
        The resolved folder.

    Raises
    ------
    RunLockedError
        At once, when another process holds the lock: ``output folder <folder> is in use by
        another run (pid <pid>: <command>)``.

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> with hold_run_lock(tmp) as folder:
    ...     with hold_run_lock(tmp):  # re-entrant in one process
    ...         json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    True
    """
    folder = Path(output_folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder)
    with _GUARD:
        entry = _HELD.get(key)
        if entry is not None:
            entry[1] += 1
        else:
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise RunLockedError(
                    f"output folder {folder} is in use by another run (pid "
                    f"{holder.get('pid', '?')}: {holder.get('command', '?')}); wait for it to "
                    "finish, stop it, or use another output_folder"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            record = {"pid": os.getpid(), "command": " ".join([sys.executable, *sys.argv])}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
            _HELD[key] = entry = [fd, 1]
    try:
        with sigterm_as_exception():
            yield folder
    finally:
        with _GUARD:
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    os.ftruncate(entry[0], 0)
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])
