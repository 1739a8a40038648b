"""Value checks of :class:`~speechbrain_fl.fl.settings.config.FLConfig`: every key, before any work.

:func:`check_config` runs in ``FLConfig.__post_init__``, so a recipe that builds its config up
front refuses a bad value before corpus synthesis, features or pretraining. Each error names
the key and the value: ``federated config: delta=1.5 must be in (0, 1)``. Decisions (ours):

- integers must be integers (a YAML ``2.0`` for ``number_of_rounds`` is refused, ``True``
  too); real numbers may be any real number but not ``bool`` or a string (YAML 1.1 reads
  ``1e-5`` without a dot as a string: the message says so);
- ``delta`` in (0, 1); a private run whose declared population K is known and
  ``delta >= 1/K`` gets a warning: such a delta allows a mechanism that publishes one data
  owner's data outright, the usual advice is delta << 1/K;
- ``max_epsilon`` > 0 when given (``-1`` used to run 0 rounds and exit 0);
- ``max_update_norm`` only for non-private runs (the clip bounds a private run's updates);
- ``noise_cohort_size`` (M >= 1) and ``accounting_population`` (N >= M) both or neither, only
  in a private run, and not with ``audit_canaries`` (the audit tests this run's mechanism, the
  accountant then describes another one).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from speechbrain_fl.fl.settings.adaptive import check_adaptive_clipping
from speechbrain_fl.fl.settings.secagg import check_secure_aggregation
from speechbrain_fl.privacy import budget_methods
from speechbrain_fl.privacy.accounting import ACCOUNTANTS

__all__ = ["BACKENDS", "check_config", "check_delta_population"]

# Simulation backends of speechbrain_fl.fl.engines.run.run_simulation (see its module docstring).
BACKENDS = ("local", "ray")

logger = logging.getLogger(__name__)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_delta_population(delta: float, population: int | None) -> None:
    """Warn when ``delta >= 1/K`` for a known population K (a weak guarantee).

    Example
    -------
    >>> check_delta_population(1e-5, 100)  # fine: 1e-5 < 1/100
    """
    if population and delta >= 1.0 / population:
        logger.warning(
            "federated config: delta=%g >= 1/K = 1/%d: a delta this large permits leaking "
            "one data owner's data outright; choose delta well below 1/K",
            delta,
            population,
        )


def check_config(cfg: Any, *, hparams_keys: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming the first FLConfig key whose value is not allowed.

    Arguments
    ---------
    cfg : FLConfig
        The config to check.
    hparams_keys : mapping, optional
        Field -> the hparams key it is read from where the names differ (``num_rounds`` ->
        ``number_of_rounds``), so a message names the key the user wrote too.

    Example
    -------
    >>> from speechbrain_fl.fl.settings.config import FLConfig
    >>> try:
    ...     FLConfig(output_folder="o", max_epsilon=-1)
    ... except ValueError as err:
    ...     print(err)
    federated config: max_epsilon=-1 must be a number > 0 (or null for no limit)
    """

    def bad(key: str, why: str) -> ValueError:
        value = getattr(cfg, key)
        hint = ""
        if isinstance(value, str) and _looks_numeric(value):
            hint = " (a string: YAML reads 1e-5 as text; write 1.0e-5)"
        yaml_key = (hparams_keys or {}).get(key)  # the key the user wrote, e.g. number_of_rounds
        named = f" (hparams key: {yaml_key})" if yaml_key else ""
        return ValueError(f"federated config: {key}={value!r} {why}{hint}{named}")

    def integer(key: str, low: int, *, optional: bool = False) -> None:
        value = getattr(cfg, key)
        if value is None and optional:
            return
        if not _is_int(value) or value < low:
            raise bad(key, f"must be an integer >= {low}")

    def real(key: str, *, low: float, strict: bool, optional: bool = False, why: str = ""):
        value = getattr(cfg, key)
        if value is None and optional:
            return
        ok = _is_real(value) and math.isfinite(value) and (value > low if strict else value >= low)
        if not ok:
            raise bad(key, why or f"must be a finite number {'>' if strict else '>='} {low:g}")

    if not isinstance(cfg.output_folder, (str, os.PathLike)) or not str(cfg.output_folder):
        raise bad("output_folder", "must be a non-empty path")
    integer("num_rounds", 1)
    if not (_is_real(cfg.sampling_rate) and 0.0 < cfg.sampling_rate <= 1.0):
        raise bad("sampling_rate", "must be in (0, 1]")
    integer("min_clients", 1)
    integer("local_epochs", 1)
    real("noise_multiplier", low=0.0, strict=False, why="must be >= 0")
    real("clip", low=0.0, strict=True, optional=True, why="must be > 0")
    if cfg.noise_multiplier > 0 and cfg.clip is None:
        raise bad("clip", "is required when noise_multiplier > 0")
    if cfg.method not in budget_methods():
        raise bad("method", f"must be one of {list(budget_methods())}")
    if cfg.alpha is not None and not (_is_real(cfg.alpha) and 0.0 < cfg.alpha < 1.0):
        raise bad("alpha", "must be in (0, 1)")
    if cfg.clip is not None and cfg.method == "alpha_split" and cfg.alpha is None:
        raise bad("alpha", "is required by method alpha_split (the encoder's share)")
    if not (_is_real(cfg.ema_beta) and 0.0 < cfg.ema_beta <= 1.0):
        raise bad("ema_beta", "must be in (0, 1]")
    real("ema_gamma", low=0.0, strict=False)
    integer("ema_warmup_rounds", 0)
    if cfg.ema_signal not in ("noisy", "raw"):
        raise bad("ema_signal", "must be 'noisy' or 'raw'")
    if not (_is_real(cfg.delta) and 0.0 < cfg.delta < 1.0):
        raise bad("delta", "must be in (0, 1)")
    if cfg.accountant not in ACCOUNTANTS:
        raise bad("accountant", f"must be one of {list(ACCOUNTANTS)}")
    if cfg.round_accountant not in ACCOUNTANTS:
        raise bad("round_accountant", f"must be one of {list(ACCOUNTANTS)}")
    integer("audit_canaries", 0)
    if cfg.audit_canaries and cfg.noise_multiplier <= 0:
        raise bad("audit_canaries", "audits a private run: set noise_multiplier > 0 or 0 canaries")
    if cfg.audit_canaries == 1:
        raise bad("audit_canaries", "needs at least 2 (inserted and held-out canaries)")
    if cfg.max_epsilon is not None and not (_is_real(cfg.max_epsilon) and cfg.max_epsilon > 0):
        raise bad("max_epsilon", "must be a number > 0 (or null for no limit)")
    if cfg.aggregation is not None and not (
        isinstance(cfg.aggregation, str) or callable(cfg.aggregation)
    ):
        raise bad("aggregation", "must be a rule name or a callable")
    integer("eval_every", 0)
    real("round_timeout", low=0.0, strict=True, why="must be > 0")
    integer("max_retries", 0)
    for key in ("seed", "noise_seed", "sampler_seed"):
        if getattr(cfg, key) is not None and not _is_int(getattr(cfg, key)):
            raise bad(key, "must be an integer or null")
    integer("population_size", 1, optional=True)
    if cfg.backend not in BACKENDS:
        raise bad("backend", f"must be one of {list(BACKENDS)}")
    if not isinstance(cfg.record_norms, bool):
        raise bad("record_norms", "must be true or false")
    integer("max_num_examples", 1, optional=True)
    real("max_update_norm", low=0.0, strict=True, optional=True, why="must be > 0 (or null)")
    if cfg.max_update_norm is not None and cfg.noise_multiplier > 0:
        raise bad(
            "max_update_norm",
            "is for non-private runs: a private run's clip already bounds every update",
        )
    _simulated_deployment(cfg, bad, integer)
    if cfg.node_partitions is not None:
        cfg.node_partitions = _node_partitions(cfg.node_partitions, bad)
    check_secure_aggregation(cfg, bad)
    check_adaptive_clipping(cfg, bad)
    if cfg.noise_multiplier > 0:  # the simulated deployment's N when one is simulated
        check_delta_population(cfg.delta, cfg.accounting_population or cfg.population_size)


def _simulated_deployment(cfg: Any, bad, integer) -> None:
    """``noise_cohort_size`` M and ``accounting_population`` N: both or neither, 1 <= M <= N,
    in a private run without canaries."""
    integer("noise_cohort_size", 1, optional=True)
    integer("accounting_population", 1, optional=True)
    if (cfg.noise_cohort_size is None) != (cfg.accounting_population is None):
        key = "accounting_population" if cfg.noise_cohort_size is not None else "noise_cohort_size"
        raise bad(
            key,
            "must be set too: noise_cohort_size (the simulated cohort M) and "
            "accounting_population (its population N) go together, or neither",
        )
    if cfg.noise_cohort_size is None:
        return
    if cfg.accounting_population < cfg.noise_cohort_size:
        raise bad(
            "accounting_population",
            f"must be >= noise_cohort_size={cfg.noise_cohort_size} (q = M / N <= 1)",
        )
    if cfg.noise_multiplier <= 0 or cfg.clip is None:
        raise bad(
            "noise_cohort_size",
            "simulates the noise of a private deployment: it needs a clipping method and "
            "noise_multiplier > 0",
        )
    if cfg.audit_canaries:
        raise bad(
            "noise_cohort_size",
            "cannot be combined with audit_canaries: the audit tests this run's mechanism, "
            "while the accountant then gives the simulated deployment's epsilon",
        )


def _node_partitions(value: Any, bad) -> dict[int, int]:
    """``{node id: partition id}`` with integer keys and values, one node per partition."""
    if not isinstance(value, Mapping):
        raise bad("node_partitions", "must be a mapping of node id -> partition id")
    out: dict[int, int] = {}
    for node, partition in value.items():
        try:
            node_id, part = int(str(node)), int(str(partition))
        except ValueError:
            raise bad(
                "node_partitions", f"has a non-integer entry {node!r}: {partition!r}"
            ) from None
        if part < 0:
            raise bad("node_partitions", f"binds node {node_id} to a negative partition {part}")
        out[node_id] = part
    parts = sorted(out.values())
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        raise bad("node_partitions", f"binds partitions {twice} to more than one node")
    return out


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
