"""Resumable server state, written atomically after every round.

The state holds the finished round, the global trainable tensors, the strategy's state (the
privacy settings a resume must keep, the generator of the clients' per-round training seeds, the
accountant, the EMA budgets) and the torch, numpy and Python RNG states of the server process.
It holds nothing from which past cohorts or noise could be derived (docs/design.md "Privacy
invariants" 1): the sampler's and the noise's seeds of a private run come from the OS and stay
in memory, so a resumed run draws fresh ones (a test-only fixed seed reproduces the same draws
from the round number alone, see :mod:`speechbrain_fl.fl.dp.sampling`). Rerunning the same command loads it and
continues from the next round; the telemetry files are cut back to that round (the "telemetry
position"), so a kill between writing a row and saving the state cannot duplicate rows.

Decision (hand-written, not ``speechbrain.utils.checkpoints.Checkpointer``): SpeechBrain's
Checkpointer writes ``CKPT.yaml`` into a fresh directory *before* the recoverables, and
``find_checkpoints`` accepts any directory with that file, so a SIGKILL during a save leaves a
checkpoint that looks complete. One file written to a temporary name, fsynced and renamed with
``os.replace`` (atomic on POSIX and Windows) cannot be seen half-written.

The commit is on every round's critical path, before anything of the round is released: the
state is serialised into memory and written with one ``O_DSYNC`` write
(:func:`~speechbrain_fl.utils.atomic.atomic_write_bytes`), the Python ``random`` state kept as
one ``uint32`` array (:func:`capture_rng_states`). The syncs and the rename stay: without them
a crash of the machine could resume from a state older than a released round, whose accountant
step would be lost. The write is not moved to a background thread: nothing of a round may be
released before it is committed (docs/design.md "Privacy invariants").
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speechbrain_fl.utils.atomic import atomic_write_bytes

__all__ = ["atomic_torch_save", "capture_rng_states", "load_state", "restore_rng_states"]

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
    # one O_DSYNC write, the rename, then the folder's sync: durable when this returns
    atomic_write_bytes(path, buffer.getbuffer(), durable=True)


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
