"""Resumable server state, written atomically after every round.

The state holds the finished round, the global trainable tensors, the strategy's state (the
privacy settings a resume must keep, the generator of the clients' per-round training seeds, the
accountant, the EMA budgets) and the torch, numpy and Python RNG states of the server process.
It holds nothing from which past cohorts or noise could be derived (docs/design.md "Privacy
invariants" 1): the sampler's and the noise's seeds of a private run come from the OS and stay
in memory, so a resumed run draws fresh ones (a test-only fixed seed reproduces the same draws
from the round number alone, see :mod:`.sampling`). Rerunning the same command loads it and
continues from the next round; the telemetry files are cut back to that round (the "telemetry
position"), so a kill between writing a row and saving the state cannot duplicate rows.

Decision (hand-written, not ``speechbrain.utils.checkpoints.Checkpointer``): SpeechBrain's
Checkpointer writes ``CKPT.yaml`` into a fresh directory *before* the recoverables, and
``find_checkpoints`` accepts any directory with that file, so a SIGKILL during a save leaves a
checkpoint that looks complete. One file written to a temporary name, fsynced and renamed with
``os.replace`` (atomic on POSIX and Windows) cannot be seen half-written.

Cost per round: the state is serialised into memory in the calling thread (``torch.save``
into the file object makes one Python-level write per zip record and header, ~0.3 ms more for a
small model, the same bytes) and the Python ``random`` state, a tuple of 625 ints that the
pickler visits one by one (~0.15 ms), is kept as one ``uint32`` array
(:func:`capture_rng_states`). The write, the ``fsync`` and the rename (~1 ms for the 0.4 MB
state of ``benchmarks/fl_overhead.py``; they release the GIL) run in :class:`StateWriter`'s
thread while the server prepares the next round; the server waits for them before anything of
the round is released (its rows, its log line, the next round's messages: docs/design.md
"Privacy invariants" 5). The ``fsync`` and the rename stay: without them a crash of the
machine could resume from a state older than a released round, whose accountant step would be
lost. A process that dies while a write is in flight leaves the previous round's state (and a
temporary that the next start removes) and nothing of the round being written: a rerun redoes
that round.
"""

from __future__ import annotations

import io
import os
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speechbrain_fl.utils.atomic import (
    atomic_open,
    commit_temporary,
    discard_temporary,
    open_temporary,
    write_all,
)

__all__ = [
    "StateWriter",
    "atomic_torch_save",
    "capture_rng_states",
    "load_state",
    "restore_rng_states",
]

STATE_FILE = "server_state.pt"


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file and ``os.replace``.

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> atomic_torch_save({"round": 1}, tmp / "s.pt")
    >>> torch.load(tmp / "s.pt")["round"]
    1
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # into memory: one write below instead of one per record
    with atomic_open(path, "wb") as handle:
        handle.write(buffer.getbuffer())


def _write_started(started: threading.Event, fd: int, data: memoryview) -> None:
    """The writer thread's job: signal that it runs, then one GIL-free ``O_DSYNC`` write."""
    started.set()
    write_all(fd, data)


class StateWriter:
    """Commit states one at a time, the write running while the caller goes on.

    :meth:`submit` serialises the state with ``torch.save`` into memory at once (the snapshot:
    what the caller changes afterwards never reaches the file), opens a temporary beside
    ``path`` and hands the bytes to one worker thread, which writes them in one ``O_DSYNC``
    system call (write + ``fdatasync``, the GIL released:
    :func:`~speechbrain_fl.utils.atomic.open_temporary`). :meth:`wait` joins that write and
    renames the temporary over ``path`` (``os.replace``), so the file on disk is always a
    whole state, the last committed or the one before; a failed write raises
    ``RuntimeError`` naming the file (the temporary removed). :meth:`close` waits and stops
    the thread.

    Decision (ours): only the system call runs in the thread. A thread that also opened,
    closed and renamed would need the GIL between those calls, and a main thread running
    Python keeps it for the interpreter's switch interval (5 ms, longer than the window), so
    the write would start only when the caller blocks in :meth:`wait` (measured: no gain).
    :meth:`submit` waits until the thread has started (~20 us) so the write runs at once. The
    serialisation buffer is kept and reused (no fresh 0.4 MB to fault in every round).

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> writer = StateWriter()
    >>> state = {"round": 1}
    >>> writer.submit(state, tmp / "s.pt")
    >>> state["round"] = 2  # after submit: not in the file
    >>> writer.wait()
    >>> torch.load(tmp / "s.pt")["round"]
    1
    >>> writer.close()
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._buffer = io.BytesIO()
        self._view: memoryview | None = None
        self._fd: int | None = None
        self._tmp: Path | None = None
        self._path: Path | None = None

    def submit(self, obj: Any, path: str | os.PathLike) -> None:
        """Wait for the previous commit, serialise ``obj`` and start writing it to ``path``."""
        self.wait()
        self._buffer.seek(0)
        torch.save(obj, self._buffer)  # into memory: one write instead of one per record
        self._view = self._buffer.getbuffer()[: self._buffer.tell()]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-commit")
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._fd, self._tmp = open_temporary(self._path)
        started = threading.Event()
        self._future = self._executor.submit(_write_started, started, self._fd, self._view)
        started.wait()

    def wait(self) -> None:
        """Block until the last submitted state is committed; raise if its write failed."""
        future, self._future = self._future, None
        if future is None:
            return
        fd, tmp, self._fd, self._tmp = self._fd, self._tmp, None, None
        try:
            error = future.exception()
            if error is None:
                try:
                    commit_temporary(fd, tmp, self._path)
                    fd = None
                except OSError as err:
                    fd, error = None, err
        finally:
            self._view.release()
            self._view = None
        if error is not None:
            discard_temporary(fd, tmp)
            raise RuntimeError(f"cannot write the server state {self._path}: {error}") from error

    def close(self) -> None:
        """:meth:`wait`, then stop the thread (also when the wait raises)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def load_state(path: str | os.PathLike) -> dict[str, Any] | None:
    """Return the saved state, or ``None`` when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a corrupt file must not be silently ignored
        raise RuntimeError(
            f"cannot read the server state {path}: {err}; delete it to restart"
        ) from err


def capture_rng_states() -> dict[str, Any]:
    """Return the torch, numpy-global and Python RNG states of this process.

    The Python state ``(version, words, gauss)`` is returned with its 625 words as one
    ``uint32`` array (each word is below 2**32): the same state, pickled as one object.
    """
    version, words, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": (version, np.array(words, dtype=np.uint32), gauss),
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_states` returned (or its tuple form, of earlier states).

    Example
    -------
    >>> states = capture_rng_states()
    >>> before = random.random()
    >>> restore_rng_states(states)
    >>> random.random() == before
    True
    """
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    version, words, gauss = states["python"]
    if isinstance(words, np.ndarray):
        words = tuple(words.tolist())
    random.setstate((version, words, gauss))
