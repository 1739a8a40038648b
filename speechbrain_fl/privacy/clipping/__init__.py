"""Clipping an update to its per-group budgets (:func:`.clip.clip_update`), with the
norms, scale factors and packed buffers it uses.
"""

from .clip import ClipStats, clip_update

__all__ = ["ClipStats", "clip_update"]
