"""One run per output folder: the lock a recipe's run entry holds for the whole run.

Two runs writing one output folder would interleave their rounds and, for a private run,
release more noisy aggregates than either accounts for. :func:`run_lock` is
:func:`speechbrain_fl.utils.run_lock.hold_run_lock`: an OS lock (``flock``) on
``<output_folder>/.run.lock``, released when the process dies, re-entrant within a process (the
engine's ``run_server`` takes it again); a second process gets ``RunLockedError`` naming the
folder and the holder's pid.

Example
-------
>>> import tempfile
>>> with run_lock(tempfile.mkdtemp()):
...     pass
"""

from __future__ import annotations

from speechbrain_fl.utils.run_lock import RunLockedError
from speechbrain_fl.utils.run_lock import hold_run_lock as run_lock

__all__ = ["RunLockedError", "run_lock"]
