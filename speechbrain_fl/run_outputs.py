"""The columns of ``rounds.csv`` (docs/api.md "Run outputs"), shared by writer and readers.

:mod:`speechbrain_fl.fl.telemetry` writes the file and :mod:`speechbrain_fl.plots` reads it;
both take the column contract from here, so neither imports the other's dependencies (Flower,
matplotlib).
"""

#: Per-round columns that are not evaluation metrics, in file order.
ROUND_COLUMNS = (
    "round",
    "cohort_size",
    "num_replied",
    "num_failed",
    "epsilon",
    "joint_norm_mean",
    "clip_rate",
    "mean_clip_ratio",
    "noise_std",
)
#: Per-component column kinds; the column of component ``L`` is ``f"{kind}_{L}"``.
COMPONENT_COLUMN_KINDS = ("norm", "clip_rate", "budget")
COMPONENT_PREFIXES = tuple(f"{kind}_" for kind in COMPONENT_COLUMN_KINDS)
