"""Keep the objects that exist before a long run out of the cyclic garbage collector's scans.

After importing torch, SpeechBrain and Flower a process tracks millions of objects that never
become garbage, and each full collection walks them all: :func:`frozen_heap` freezes them for a
run, :func:`refreeze` what a client builds once, :func:`freeze_at_exit` the heap at exit
(why and what it costs, in :func:`frozen_heap`'s notes).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from collections.abc import Iterator

__all__ = ["freeze_at_exit", "frozen_heap", "refreeze"]

_DEPTH = [0]
_EXIT_FREEZE = [False]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the tracked objects for the duration of the block (see the module docstring).

    Notes
    -----
    Why: after importing torch, SpeechBrain and Flower a process holds millions of tracked objects,
    and each full (generation 2) collection walks all of them. The first round of a run allocates
    enough (``torch._dynamo``'s import at the first optimiser, the clients' Brains) to trigger
    several of them; none of those imported objects will ever become garbage. :func:`gc.freeze`
    (CPython >= 3.7) moves every object tracked so far into a permanent generation that collections
    skip; objects created afterwards are collected as usual, and reference counting frees
    everything, frozen or not, as before. :func:`frozen_heap` undoes it (:func:`gc.unfreeze`) when
    the run ends, so a cycle among pre-existing objects that became garbage during the run is
    collected by the next full collection after it.

    Objects a run builds once and keeps to its end (a client's Brain, loader and optimiser, built
    at its first message; ``torch._dynamo``, imported by the first optimiser) are frozen by
    :func:`refreeze` after they are built (the ClientApp calls it after a client's first round):
    without it a full collection lands inside the steady rounds. The price: cyclic garbage that is
    alive (not yet collected) at a freeze stays until the run ends; that is what the young
    generations held at that moment, once per client built, not a growth per round.

    Nothing in Python's, torch's or Flower's own run loops does this (Python documents
    :func:`gc.freeze` for pre-fork servers); it is a process-wide setting, so it is scoped to one
    run and nests (an inner :func:`frozen_heap` leaves the unfreeze to the outermost), and
    :func:`refreeze` does nothing outside one (a long-lived worker that evicts clients must be able
    to collect them).

    At the interpreter's exit the same heap costs once more: CPython's finalisation runs full
    collections while it clears the modules, ~1.0-1.3 s after importing torch, SpeechBrain and
    Flower and a first optimiser (``torch._dynamo``) on the development machine (a process that did
    only that and exited: 1.31 s from its last statement to its end; with :func:`gc.freeze` as its
    last statement 0.26 s; ``os._exit`` 0.09 s). :func:`freeze_at_exit` registers that freeze as an
    :mod:`atexit` handler, once per process (:func:`speechbrain_fl.fl.run_simulation` calls it). It
    runs after the program's last statement, when nothing but the exit is left: every :mod:`atexit`
    handler still runs (logging's flush and close, ``weakref.finalize`` callbacks such as
    ``tempfile``'s clean-up, Ray's shutdown), reference counting still frees every object whose
    count drops to zero while the modules are cleared; what is skipped is the collection of
    reference cycles still alive at exit, whose ``__del__`` methods CPython does not promise to run
    at exit anyway (Python's data model, ``object.__del__``). ``SB_FL_EXIT_GC=1`` in the
    environment keeps CPython's full collections at exit.

    Example
    -------
    >>> import gc
    >>> with frozen_heap():
    ...     gc.get_freeze_count() > 0
    True
    >>> gc.get_freeze_count()
    0
    """
    _DEPTH[0] += 1
    gc.freeze()
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            gc.unfreeze()


def refreeze() -> bool:
    """Inside a :func:`frozen_heap`, freeze the objects tracked since (O(1)); else nothing.

    Returns whether it froze.

    Example
    -------
    >>> import gc
    >>> refreeze()
    False
    >>> with frozen_heap():
    ...     keep = [[] for _ in range(3)]
    ...     before = gc.get_freeze_count()
    ...     refreeze() and gc.get_freeze_count() > before
    True
    """
    if _DEPTH[0] == 0:
        return False
    gc.freeze()
    return True


def freeze_at_exit() -> bool:
    """Register :func:`gc.freeze` to run at the interpreter's exit (once per process).

    See the module docstring for what it skips and why. Returns whether the handler is
    registered (False when ``SB_FL_EXIT_GC=1`` asks for CPython's collections at exit).

    Example
    -------
    >>> freeze_at_exit() == (os.environ.get("SB_FL_EXIT_GC") != "1")
    True
    """
    if os.environ.get("SB_FL_EXIT_GC") == "1":
        return False
    if not _EXIT_FREEZE[0]:
        atexit.register(gc.freeze)
        _EXIT_FREEZE[0] = True
    return True
