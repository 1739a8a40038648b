"""The ``secure_aggregation`` settings of a run, checked (no Flower import: the config's job).

``secure_aggregation: secaggplus`` runs every round's training through Flower's SecAgg+
(:mod:`.secure_aggregation`): the server learns only the sum of the clients' clipped, encoded
updates. Options that need one client's update, or a statistic of it, are refused here with
the reason, since the server never holds one:

- no ``clip`` (``method: fedavg``): the integer encoding's range comes from the clip budgets;
- ``aggregation`` other than ``uniform``: a weighted or layer-wise rule needs each reply's
  weight or its set of tensors;
- ``max_update_norm``: the check reads each reply's norm;
- ``ema_signal: raw``: the raw EMA signal is the mean of the clients' reported pre-clip norms
  (the default ``noisy`` signal reads the released aggregate and is unchanged);
- ``record_norms``: the per-reply norm telemetry.

``secagg_num_shares`` and ``secagg_reconstruction_threshold`` are passed to Flower's
``SecAggPlusWorkflow`` as they are (a float is a share of the cohort, resp. of the shares).
The default threshold 0.7 (ours) is above one half, as SecAgg+ needs against a server that
would declare a live client dropped to learn its update, and tolerates the loss of 30% of a
client's neighbours.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REVEALED_METRICS", "SECURE_AGGREGATION", "check_secure_aggregation", "trust_model"]

SECURE_AGGREGATION = ("secaggplus",)
"""The values of ``secure_aggregation`` besides null (off)."""

REVEALED_METRICS = ("partition-id", "unreadable-utterances", "readable-utterances")
"""The reply metrics a client sends in plaintext under secure aggregation."""


def _share(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return 0.0 < value <= 1.0
    return isinstance(value, int) and value >= 2


def check_secure_aggregation(cfg: Any, bad) -> None:
    """Raise ``bad(key, why)`` for the first setting that secure aggregation cannot honour.

    Example
    -------
    >>> from speechbrain_fl.fl.config import FLConfig
    >>> try:
    ...     FLConfig(output_folder="o", secure_aggregation="secaggplus")
    ... except ValueError as err:
    ...     print(str(err)[:60])
    federated config: secure_aggregation='secaggplus' needs a cl
    """
    if cfg.secure_aggregation is None:
        return
    if cfg.secure_aggregation not in SECURE_AGGREGATION:
        raise bad("secure_aggregation", f"must be null (off) or one of {list(SECURE_AGGREGATION)}")
    blind = "the server never sees a single client's update under secure aggregation"
    if cfg.clip is None:
        raise bad(
            "secure_aggregation",
            "needs a clipping method and clip: the integer encoding's range is derived from the "
            "clip budgets",
        )
    if cfg.aggregation not in (None, "uniform"):
        raise bad("aggregation", f"must be uniform (sum / n) with secure_aggregation: {blind}")
    if cfg.max_update_norm is not None:
        raise bad("max_update_norm", f"reads each reply's norm; set it to null: {blind}")
    if cfg.ema_signal == "raw":
        raise bad(
            "ema_signal",
            "raw reads the clients' pre-clip norms, which are not sent under secure "
            "aggregation; use noisy (the released aggregate)",
        )
    if cfg.record_norms:
        raise bad("record_norms", f"is per-reply telemetry; set it to false: {blind}")
    if not _share(cfg.secagg_num_shares):
        raise bad("secagg_num_shares", "must be an integer >= 2 or a share of the cohort in (0, 1]")
    if not _share(cfg.secagg_reconstruction_threshold):
        raise bad(
            "secagg_reconstruction_threshold",
            "must be an integer >= 2 or a share of the shares in (0, 1]",
        )


def trust_model(config: Any) -> dict[str, Any]:
    """results.json's ``privacy.trust_model``: who sees what in a run with ``config``.

    Example
    -------
    >>> from speechbrain_fl.fl.config import FLConfig
    >>> trust_model(FLConfig(output_folder="o"))["name"]
    'central'
    """
    if config.secure_aggregation is None:
        return {
            "name": "central",
            "server_sees": "every client's clipped update",
            "clip_enforced_by": "the client, and again by the server on receipt",
            "noise_added_by": "the server, on the aggregate",
        }
    return {
        "name": "secure_aggregation",
        "protocol": config.secure_aggregation,
        "server_sees": "only the sum of the surviving clients' encoded updates, and each "
        f"client's {', '.join(REVEALED_METRICS)}",
        "clip_enforced_by": "the client only (its clip to the shrunk budgets and the encoding's "
        "range); the server cannot re-clip",
        "noise_added_by": "the server, after unmasking (trusted to add it)",
        "num_shares": config.secagg_num_shares,
        "reconstruction_threshold": config.secagg_reconstruction_threshold,
    }
