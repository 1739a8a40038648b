"""Small process-level helpers shared by the engine and the recipes (standard library only).

atomic     files and folders that appear whole or not at all; SIGTERM cleanup; stale sweep
run_lock   one run per output folder (``hold_run_lock``), released by the OS when a run dies
"""

from .atomic import atomic_folder, atomic_open, sigterm_as_exception, sweep_stale_temporaries
from .run_lock import LOCK_FILE, RunLockedError, hold_run_lock

__all__ = [
    "LOCK_FILE",
    "RunLockedError",
    "atomic_folder",
    "atomic_open",
    "hold_run_lock",
    "sigterm_as_exception",
    "sweep_stale_temporaries",
]
