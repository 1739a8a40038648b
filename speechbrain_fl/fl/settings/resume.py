"""The privacy settings a resumed run must keep, and the check that names a changed one.

A server state records the settings its rounds were noised, clipped and accounted with
(:func:`privacy_settings`); a resume with another value of any of them is refused with an
error naming the key, both values and the state file (:func:`check_privacy_settings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from speechbrain_fl.privacy import Layout

__all__ = ["PRIVACY_KEYS", "check_privacy_settings", "privacy_settings"]

#: FLConfig fields a resumed run must not change (the privacy settings of its earlier rounds).
PRIVACY_KEYS = (
    "noise_multiplier",
    "clip",
    "delta",
    "sampling_rate",
    "accountant",
    "method",
    "alpha",
    "ema_beta",
    "ema_gamma",
    "ema_warmup_rounds",
    "ema_signal",
    "noise_cohort_size",
    "accounting_population",
    "secure_aggregation",  # the trust model the run's disclosure names for all its rounds
    "clip_quantile",
    "clip_quantile_lr",
    "clip_count_stddev",
)


def layout_rows(layout: Layout) -> list[list[Any]]:
    """The layout as rows ``[name, component, numel, members]`` (what a state records)."""
    return [[g.name, g.component, g.numel, list(g.parameter_names)] for g in layout]


def layout_difference(old: list, new: list) -> str:
    """The first difference of two :func:`layout_rows`, in words."""
    if len(old) != len(new):
        return f"{len(old)} groups -> {len(new)} groups"
    for a, b in zip(old, new, strict=True):
        if list(a) != list(b):
            return f"group {list(a)} -> {list(b)} (name, component, numel, members)"
    return "same groups"


def privacy_settings(config: Any, *, population_size: int | None, layout: Layout) -> dict:
    """The settings a resumed run must keep: C, delta, q, sigma, method, layout, K.

    Example
    -------
    >>> from speechbrain_fl.fl.settings.config import FLConfig
    >>> from speechbrain_fl.privacy import Group
    >>> s = privacy_settings(FLConfig(output_folder="o"), population_size=4,
    ...                      layout=Layout([Group("w", "all", 3)]))
    >>> s["method"], s["population_size"], s["aggregation"]
    ('flat', 4, 'weighted')
    """
    settings = {key: getattr(config, key) for key in PRIVACY_KEYS}
    if getattr(config, "clip_quantile", None) is None:  # a fixed clip: states without the keys
        for key in ("clip_quantile", "clip_quantile_lr", "clip_count_stddev"):
            settings.pop(key)
    settings["aggregation"] = config.aggregation_rule_name
    settings["population_size"] = population_size
    settings["layout"] = layout_rows(layout)
    return settings


def check_privacy_settings(
    current: Mapping[str, Any], saved: Mapping[str, Any] | None, *, source: str
) -> None:
    """Raise ``ValueError`` naming the first privacy setting that differs from ``saved``."""
    if saved is None:
        raise ValueError(
            f"{source} records no privacy settings (written by an earlier version, which "
            "also stored the noise seed): it cannot be resumed safely; delete it to restart"
        )
    for key, new in current.items():
        old = saved.get(key)
        if old == new:
            continue
        if key == "layout":
            raise ValueError(
                f"{source}: resuming would change the layout ({layout_difference(old, new)})"
                "; the earlier rounds were clipped and accounted with the old one. Restore "
                "it, or start a new run in another output_folder"
            )
        raise ValueError(
            f"{source}: resuming would change {key} from {old!r} to {new!r}; the earlier "
            "rounds were noised and accounted with the old value. Restore it, or start a "
            "new run in another output_folder"
        )
