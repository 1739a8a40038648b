"""Re-export of :mod:`speechbrain_fl.utils.atomic` (the module's former place)."""

from speechbrain_fl.utils.atomic import atomic_folder, atomic_open, sweep_stale_temporaries

__all__ = ["atomic_folder", "atomic_open", "sweep_stale_temporaries"]
