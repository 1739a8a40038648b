"""One run per output folder: the lock a recipe's run entry holds for the whole run.

Two runs writing one output folder would interleave their rounds and, for a private run,
release more noisy aggregates than either accounts for. :func:`run_lock` holds
``speechbrain_fl.utils.run_lock.hold_run_lock(output_folder)`` (an OS lock released when the
process dies; re-entrant within a process; a second holder gets ``RunLockedError`` naming the
folder and the holder's pid) around a run.

The lock module is imported lazily: it belongs to the engine's reliability work and may be
absent from a branch that predates it, in which case the run goes on unlocked with one warning.
TODO: drop the fallback once ``speechbrain_fl/utils/run_lock.py`` is merged.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["run_lock"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def run_lock(output_folder: str | os.PathLike) -> Iterator[None]:
    """Hold the run lock of ``output_folder`` for the ``with`` block (see the module docstring).

    Example
    -------
    >>> import tempfile
    >>> with run_lock(tempfile.mkdtemp()):
    ...     pass
    """
    hold_run_lock = None
    try:
        from speechbrain_fl.utils.run_lock import hold_run_lock
    except ModuleNotFoundError as err:
        if err.name not in ("speechbrain_fl.utils", "speechbrain_fl.utils.run_lock"):
            raise
    if hold_run_lock is None:  # TODO: remove with the fallback (see the module docstring)
        logger.warning("speechbrain_fl.utils.run_lock is missing: %s runs unlocked", output_folder)
        yield
        return
    with hold_run_lock(output_folder):
        yield
