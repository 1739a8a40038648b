"""Atomic writes: a file or a folder appears whole under its final name, or not at all.

Every result file, manifest, checkpoint and cached folder of the package is written through
these two helpers, so that a run killed mid-write (SIGKILL, out of memory, Ctrl-C) never leaves a
half-written file that a later run would read as complete. The content goes to a temporary name
in the same folder (same file system), is flushed and ``fsync``-ed, and is then moved over the
final name with ``os.replace``, which is atomic on POSIX and Windows. Written by hand because
neither the standard library nor SpeechBrain offers it (SpeechBrain's checkpointer writes its
``CKPT.yaml`` before the objects it describes).

A SIGTERM (``kill``, a scheduler's time limit) would end the process without running any
``finally`` block and leave the temporary behind (the audit found a 535 MB ``.cv_synth.*.tmp``
folder). While one of the helpers is open in the main thread and SIGTERM has its default
action, SIGTERM is turned into :class:`Terminated` (a ``SystemExit`` with code 143, what the
default action reports), so the temporary is removed and the process still ends.
:func:`sweep_stale_temporaries` removes what a SIGKILL left (a run calls it on its output
folder at start, holding the folder's run lock, so no live writer owns what it removes).

Depends on the standard library only, so the torch-only privacy core may use it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = [
    "Terminated",
    "atomic_folder",
    "atomic_open",
    "atomic_write_bytes",
    "fsync_folder",
    "sigterm_as_exception",
    "sweep_stale_temporaries",
]

logger = logging.getLogger(__name__)

#: Names of the temporaries below: ``.<final name>.<8 characters of tempfile>.tmp``.
TEMPORARY_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


class Terminated(SystemExit):
    """SIGTERM received while an atomic write was open (exit code 143 = 128 + SIGTERM)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` in the main thread for the duration of the block.

    Only when SIGTERM has its default action (a handler someone else installed, e.g. Flower's,
    is left alone) and only in the main thread (where Python runs signal handlers); otherwise a
    no-op. Nested uses keep the outermost handler.

    Example
    -------
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> with sigterm_as_exception():
    ...     signal.getsignal(signal.SIGTERM) in (_raise_terminated, before)
    True
    >>> signal.getsignal(signal.SIGTERM) is before
    True
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sweep_stale_temporaries(folder: str | os.PathLike, *, recursive: bool = True) -> list[Path]:
    """Remove the temporaries of :func:`atomic_open` / :func:`atomic_folder` under ``folder``.

    Call it only while no other process writes there (holding the folder's run lock,
    :func:`speechbrain_fl.utils.run_lock.hold_run_lock`): a live writer's temporary looks the
    same. Returns the removed paths (one log line each).

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> _ = (tmp / ".server_state.pt.ab12cd34.tmp").write_bytes(b"half")
    >>> [p.name for p in sweep_stale_temporaries(tmp)]
    ['.server_state.pt.ab12cd34.tmp']
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    candidates = folder.rglob(".*.tmp") if recursive else folder.glob(".*.tmp")
    removed = []
    for path in sorted(candidates):
        if not TEMPORARY_NAME.match(path.name) or not path.exists():
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        logger.info("removed %s, a temporary left by a killed run", path)
        removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike, mode: str = "w", *, encoding: str | None = None, newline=None
) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit it replaces ``path`` atomically.

    Arguments
    ---------
    path : str or os.PathLike
        The final file name. Its parent folder is created if missing.
    mode : str
        ``"w"`` (text, UTF-8 unless ``encoding`` says otherwise) or ``"wb"`` (binary).
    encoding, newline
        As for :func:`open`, text mode only.

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> with atomic_open(tmp / "a.txt") as handle:
    ...     _ = handle.write("whole")
    >>> (tmp / "a.txt").read_text()
    'whole'
    >>> try:
    ...     with atomic_open(tmp / "a.txt") as handle:
    ...         _ = handle.write("half")
    ...         raise RuntimeError("killed")
    ... except RuntimeError:
    ...     pass
    >>> (tmp / "a.txt").read_text(), sorted(p.name for p in tmp.iterdir())
    ('whole', ['a.txt'])
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_as_exception():
        yield from _atomic_open(path, mode, encoding=encoding, newline=newline)


def _atomic_open(path: Path, mode: str, *, encoding: str | None, newline) -> Iterator[IO]:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode == "wb":
            handle = os.fdopen(fd, "wb")
        else:
            handle = os.fdopen(fd, "w", encoding=encoding or "utf-8", newline=newline)
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_folder(folder: str | os.PathLike) -> None:
    """``fsync`` the folder ``folder`` itself: its entries (a rename into it) reach the disk.

    A file's own ``fsync`` (or an ``O_DSYNC`` write) makes its data durable, not the directory
    entry a later ``os.replace`` creates: after a crash of the machine the folder may still
    show the old file. POSIX only (a folder cannot be opened for ``fsync`` on Windows, where
    this does nothing).
    """
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data, *, durable: bool = False) -> None:
    """Write ``data`` (bytes or a buffer) to ``path`` atomically, as :func:`atomic_open` does.

    The temporary (``.<name>.<8 hex characters>.tmp`` beside ``path``, the names
    :func:`sweep_stale_temporaries` removes) is opened with ``O_DSYNC`` where the platform has
    it: each ``os.write`` returns once the data and the metadata needed to read it back (the
    size, the blocks) are on disk, ``write`` + ``fdatasync`` in one system call and without a
    Python file object. Elsewhere the data is written and
    ``fsync``-ed. Then ``os.replace``. On any error (SIGTERM too, inside
    :func:`sigterm_as_exception`) the temporary is removed and ``path`` is left as it was. The
    parent folder is created if missing. ``durable=True`` also syncs the folder after the
    rename (:func:`fsync_folder`): when the call returns, a crash of the machine leaves the
    new contents, not the old ones (what a commit before a release needs).

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> atomic_write_bytes(tmp / "state.pt", b"whole")
    >>> (tmp / "state.pt").read_bytes(), sorted(p.name for p in tmp.iterdir())
    (b'whole', ['state.pt'])
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dsync = getattr(os, "O_DSYNC", 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | dsync
    with sigterm_as_exception():
        while True:
            tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o666)
                break
            except FileExistsError:
                continue
        try:
            try:
                view = memoryview(data).cast("B")
                while view:  # a write may be short
                    view = view[os.write(fd, view) :]
                if not dsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if durable:
            fsync_folder(path.parent)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; on a clean exit it becomes ``path``.

    An existing ``path`` is replaced (removed just before the move). On an exception the
    temporary folder is removed and ``path`` is left as it was.

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> with atomic_folder(tmp / "model") as folder:
    ...     _ = (folder / "config.json").write_text("{}")
    >>> sorted(p.name for p in (tmp / "model").iterdir())
    ['config.json']
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_as_exception():
        yield from _atomic_folder(path)


def _atomic_folder(path: Path) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
