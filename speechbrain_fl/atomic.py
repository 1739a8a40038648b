"""Atomic writes: a file or a folder appears whole under its final name, or not at all.

Every result file, manifest, checkpoint and cached folder of the package is written through
these two helpers, so that a run killed mid-write (SIGKILL, out of memory, Ctrl-C) never leaves a
half-written file that a later run would read as complete. The content goes to a temporary name
in the same folder (same file system), is flushed and ``fsync``-ed, and is then moved over the
final name with ``os.replace``, which is atomic on POSIX and Windows. Written by hand because
neither the standard library nor SpeechBrain offers it (SpeechBrain's checkpointer writes its
``CKPT.yaml`` before the objects it describes).

Depends on the standard library only, so the torch-only privacy core may use it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "atomic_folder"]


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
