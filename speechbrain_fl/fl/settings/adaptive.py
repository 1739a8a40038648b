"""Checks of the adaptive-clipping keys (``clip_quantile``, ``clip_quantile_lr``,
``clip_count_stddev``), run by :func:`speechbrain_fl.fl.settings.checks.check_config`.

Adaptive clipping (:mod:`speechbrain_fl.fl.dp.adaptive`) needs a private run of a method with
pools (``flat``, ``alpha_split``); it is refused with the canary audit (whose canaries are
calibrated to a fixed clip) and with a layer-wise rule under secure aggregation (whose summed
vector has no place for the bits).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_adaptive_clipping"]

ADAPTIVE_METHODS = ("flat", "alpha_split")


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_adaptive_clipping(cfg: Any, bad) -> None:
    """Raise ``bad(key, why)`` for the first adaptive-clipping key that cannot run.

    Example
    -------
    >>> from speechbrain_fl.fl.settings.config import FLConfig
    >>> try:
    ...     FLConfig(output_folder="o", clip=1.0, noise_multiplier=1.0, clip_quantile=1.5)
    ... except ValueError as err:
    ...     print(err)
    federated config: clip_quantile=1.5 must be in (0, 1) (the target unclipped fraction) or null
    """
    if not (_real(cfg.clip_quantile_lr) and cfg.clip_quantile_lr > 0):
        raise bad("clip_quantile_lr", "must be a number > 0")
    if cfg.clip_count_stddev is not None and not (
        _real(cfg.clip_count_stddev) and cfg.clip_count_stddev > 0
    ):
        raise bad("clip_count_stddev", "must be a number > 0 (or null for n / 20)")
    if cfg.clip_quantile is None:
        return
    if not (_real(cfg.clip_quantile) and 0.0 < cfg.clip_quantile < 1.0):
        raise bad("clip_quantile", "must be in (0, 1) (the target unclipped fraction) or null")
    if not cfg.noise_multiplier > 0 or cfg.clip is None:
        raise bad(
            "clip_quantile",
            "adapts the clip of a private run: it needs a clipping method and "
            "noise_multiplier > 0 (the count of bits is noised and accounted with the update)",
        )
    if cfg.method not in ADAPTIVE_METHODS:
        raise bad("clip_quantile", f"supports methods {list(ADAPTIVE_METHODS)}, not {cfg.method!r}")
    if cfg.audit_canaries:
        raise bad("clip_quantile", "cannot be combined with audit_canaries (fixed-clip canaries)")
    if cfg.secure_aggregation and cfg.aggregation not in (None, "uniform"):
        raise bad(
            "clip_quantile",
            "under secure aggregation needs the uniform rule (the bits are summed with the update)",
        )
