"""The ``secure_aggregation`` settings of a run, checked (no Flower import: the config's job).

``secure_aggregation: secaggplus`` runs every round's training through Flower's SecAgg+
(:mod:`speechbrain_fl.fl.secagg.train_stage`); the options that need one client's update are
refused by :func:`check_secure_aggregation` (the list in its notes).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "REVEALED_METRICS",
    "SECURE_AGGREGATION",
    "check_secure_aggregation",
    "secure_weighting",
    "trust_model",
]

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


def secure_weighting(aggregation: Any) -> str | None:
    """The client weighting of a layer-wise rule, ``None`` for the uniform sum / n.

    Raises ``ValueError`` for a rule that secure aggregation cannot compute.

    Example
    -------
    >>> secure_weighting(None), secure_weighting("uniform"), secure_weighting("layerwise")
    (None, None, 'depth_aware')
    """
    if aggregation in (None, "uniform"):
        return None
    from speechbrain_fl.fl.aggregate.rules import (
        get_rule,  # the registry (torch); config checks need it only here
    )

    rule = get_rule(aggregation) if isinstance(aggregation, str) else aggregation
    weighting = getattr(rule, "weighting", None)
    if weighting is None or not getattr(rule, "accepts_partial", False):
        raise ValueError("must be uniform or a layer-wise rule")
    return weighting


def check_secure_aggregation(cfg: Any, bad) -> None:
    """Raise ``bad(key, why)`` for the first setting that secure aggregation cannot honour.

    Notes
    -----
    ``secure_aggregation: secaggplus`` runs every round's training through Flower's SecAgg+
    (:mod:`speechbrain_fl.fl.secagg.train_stage`): the server learns only the sum of the clients'
    clipped, encoded updates. Options that need one client's update, or a statistic of it, are
    refused here with the reason, since the server never holds one:

    - ``aggregation`` other than ``uniform`` or a layer-wise rule (``layerwise_<weighting>``, with
      or without server momentum): FedAvg's ``weighted`` mean and ``fedavg_full`` would need each
      reply's weight in the clear; a layer-wise rule gets its per-layer weights as a second masked
      vector (:func:`secure_weighting`);
    - the encoding's box: with a ``clip`` it is derived from the clip budgets (so
      ``secagg_clipping_range`` must stay null); without one (``method: fedavg``)
      ``secagg_clipping_range`` c is required, and every coordinate of an update is cut to [-c, c]
      (SecAgg+'s own clipping: the runs' only bound on a client's contribution);
    - ``max_update_norm``: the check reads each reply's norm;
    - ``ema_signal: raw``: the raw EMA signal is the mean of the clients' reported pre-clip norms
      (the default ``noisy`` signal reads the released aggregate and is unchanged).

    ``record_norms`` asks clients of a run *without* a clip for their norms; a secure run always
    clips, and its clients send no norms (:data:`REVEALED_METRICS`), so the key has no effect.

    ``secagg_num_shares`` and ``secagg_reconstruction_threshold`` are passed to Flower's
    ``SecAggPlusWorkflow`` as they are (a float is a share of the cohort, resp. of the shares). The
    default threshold 0.7 (ours) is above one half, as SecAgg+ needs against a server that would
    declare a live client dropped to learn its update, and tolerates the loss of 30% of a client's
    neighbours.

    Example
    -------
    >>> from speechbrain_fl.fl.settings.config import FLConfig
    >>> try:
    ...     FLConfig(output_folder="o", secure_aggregation="secaggplus")
    ... except ValueError as err:
    ...     print(str(err)[:75])
    federated config: secagg_clipping_range=None is required without a clip: th
    """
    if cfg.secure_aggregation is None:
        if cfg.secagg_clipping_range is not None:
            raise bad("secagg_clipping_range", "is used only with secure_aggregation")
        return
    if cfg.secure_aggregation not in SECURE_AGGREGATION:
        raise bad("secure_aggregation", f"must be null (off) or one of {list(SECURE_AGGREGATION)}")
    blind = "the server never sees a single client's update under secure aggregation"
    box = cfg.secagg_clipping_range
    if cfg.clip is None and box is None:
        raise bad(
            "secagg_clipping_range",
            "is required without a clip: the box [-c, c] every coordinate of an update is cut "
            "to before the integer encoding",
        )
    if cfg.clip is not None and box is not None:
        raise bad("secagg_clipping_range", "must be null with a clip: the box comes from it")
    if box is not None and not (isinstance(box, (int, float)) and box > 0):
        raise bad("secagg_clipping_range", "must be a number > 0")
    try:
        secure_weighting(cfg.aggregation)
    except ValueError as err:
        raise bad("aggregation", f"{err} with secure_aggregation: {blind}") from None
    if cfg.max_update_norm is not None:
        raise bad("max_update_norm", f"reads each reply's norm; set it to null: {blind}")
    if cfg.ema_signal == "raw":
        raise bad(
            "ema_signal",
            "raw reads the clients' pre-clip norms, which are not sent under secure "
            "aggregation; use noisy (the released aggregate)",
        )
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
    >>> from speechbrain_fl.fl.settings.config import FLConfig
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
        "range); the server cannot re-clip"
        if config.clip is not None
        else f"no clip: each coordinate is cut to [-{config.secagg_clipping_range}, "
        f"{config.secagg_clipping_range}] by the encoding",
        "noise_added_by": "the server, after unmasking (trusted to add it)",
        "num_shares": config.secagg_num_shares,
        "reconstruction_threshold": config.secagg_reconstruction_threshold,
    }
