"""FLConfig refuses every bad value with a message naming the key and the value.

Before: ``delta`` was never checked (``delta: 1.5`` or ``0`` reached the accountant), and MLS
``max_epsilon: -1`` ran 0 rounds and exited 0.
"""

from __future__ import annotations

import logging

import pytest

from speechbrain_fl.fl import FLConfig

BASE = {"output_folder": "out"}
PRIVATE = {"noise_multiplier": 1.0, "clip": 1.0}

# (field, bad value, extra fields, expected message)
CASES = [
    ("delta", 0.0, PRIVATE, "delta=0.0 must be in \\(0, 1\\)"),
    ("delta", 1.5, PRIVATE, "delta=1.5 must be in \\(0, 1\\)"),
    ("delta", "1e-5", PRIVATE, "delta='1e-5' must be in \\(0, 1\\) \\(a string: YAML reads"),
    ("max_epsilon", -1, PRIVATE, "max_epsilon=-1 must be a number > 0"),
    ("max_epsilon", 0, PRIVATE, "max_epsilon=0 must be a number > 0"),
    ("num_rounds", 0, {}, "num_rounds=0 must be an integer >= 1"),
    ("num_rounds", 2.5, {}, "num_rounds=2.5 must be an integer >= 1"),
    ("num_rounds", True, {}, "num_rounds=True must be an integer >= 1"),
    ("sampling_rate", 0.0, {}, "sampling_rate=0.0 must be in \\(0, 1\\]"),
    ("sampling_rate", 1.2, {}, "sampling_rate=1.2 must be in \\(0, 1\\]"),
    ("min_clients", 0, {}, "min_clients=0 must be an integer >= 1"),
    ("local_epochs", 0, {}, "local_epochs=0 must be an integer >= 1"),
    ("noise_multiplier", -1.0, {"clip": 1.0}, "noise_multiplier=-1.0 must be >= 0"),
    ("noise_multiplier", float("nan"), {"clip": 1.0}, "noise_multiplier=nan must be >= 0"),
    ("clip", -2.0, {}, "clip=-2.0 must be > 0"),
    ("clip", float("inf"), {}, "clip=inf must be > 0"),
    ("method", "pfl_foo", {}, "method='pfl_foo' must be one of"),
    ("alpha", 1.5, {}, "alpha=1.5 must be in \\(0, 1\\)"),
    ("alpha", None, {"clip": 1.0, "method": "alpha_split"}, "alpha=None is required"),
    ("ema_beta", 0.0, {}, "ema_beta=0.0 must be in \\(0, 1\\]"),
    ("ema_gamma", -1.0, {}, "ema_gamma=-1.0 must be a finite number >= 0"),
    ("ema_warmup_rounds", -1, {}, "ema_warmup_rounds=-1 must be an integer >= 0"),
    ("ema_signal", "loud", {}, "ema_signal='loud' must be 'noisy' or 'raw'"),
    ("accountant", "gdp", {}, "accountant='gdp' must be one of \\['pld', 'rdp', 'prv'\\]"),
    ("round_accountant", "gdp", {}, "round_accountant='gdp' must be one of \\['pld', 'rdp'"),
    ("audit_canaries", -1, PRIVATE, "audit_canaries=-1 must be an integer >= 0"),
    ("audit_canaries", 1, PRIVATE, "audit_canaries=1 needs at least 2"),
    ("audit_canaries", 8, {"clip": 1.0}, "audit_canaries=8 audits a private run"),
    ("aggregation", 3, {}, "aggregation=3 must be a rule name or a callable"),
    ("eval_every", -1, {}, "eval_every=-1 must be an integer >= 0"),
    ("round_timeout", 0, {}, "round_timeout=0 must be > 0"),
    ("max_retries", -1, {}, "max_retries=-1 must be an integer >= 0"),
    ("seed", 1.5, {}, "seed=1.5 must be an integer or null"),
    ("noise_seed", "x", {}, "noise_seed='x' must be an integer or null"),
    ("sampler_seed", 0.5, {}, "sampler_seed=0.5 must be an integer or null"),
    ("population_size", 0, {}, "population_size=0 must be an integer >= 1"),
    ("backend", "mpi", {}, "backend='mpi' must be one of \\['local', 'ray'\\]"),
    ("record_norms", "yes", {}, "record_norms='yes' must be true or false"),
    ("max_num_examples", 0, {}, "max_num_examples=0 must be an integer >= 1"),
    ("max_update_norm", -1.0, {}, "max_update_norm=-1.0 must be > 0"),
    ("output_folder", "", {}, "output_folder='' must be a non-empty path"),
    ("secure_aggregation", "secagg", PRIVATE, "secure_aggregation='secagg' must be null"),
    ("secagg_num_shares", 0.0, {**PRIVATE, "secure_aggregation": "secaggplus"},
     "secagg_num_shares=0.0 must be an integer >= 2"),
    ("secagg_reconstruction_threshold", 1, {**PRIVATE, "secure_aggregation": "secaggplus"},
     "secagg_reconstruction_threshold=1 must be an integer >= 2"),
    ("secagg_clipping_range", -1.0, {"secure_aggregation": "secaggplus"},
     "secagg_clipping_range=-1.0 must be a number > 0"),
    ("noise_cohort_size", 0, {**PRIVATE, "accounting_population": 10},
     "noise_cohort_size=0 must be an integer >= 1"),
    ("noise_cohort_size", 2.5, {**PRIVATE, "accounting_population": 10},
     "noise_cohort_size=2.5 must be an integer >= 1"),
    ("noise_cohort_size", None, {**PRIVATE, "accounting_population": 10},
     "noise_cohort_size=None must be set too"),
    ("noise_cohort_size", 10, {"clip": 1.0, "accounting_population": 100},
     "noise_cohort_size=10 simulates the noise of a private deployment: it needs a clipping "
     "method and noise_multiplier > 0"),
    ("noise_cohort_size", 10, {**PRIVATE, "accounting_population": 100, "audit_canaries": 8},
     "noise_cohort_size=10 cannot be combined with audit_canaries"),
    ("accounting_population", 0, {**PRIVATE, "noise_cohort_size": 1},
     "accounting_population=0 must be an integer >= 1"),
    ("accounting_population", None, {**PRIVATE, "noise_cohort_size": 10},
     "accounting_population=None must be set too"),
    ("accounting_population", 50, {**PRIVATE, "noise_cohort_size": 100},
     "accounting_population=50 must be >= noise_cohort_size=100 \\(q = M / N <= 1\\)"),
    ("clip_quantile", 1.0, PRIVATE, "clip_quantile=1.0 must be in \\(0, 1\\)"),
    ("clip_quantile", 0.5, {"clip": 1.0}, "clip_quantile=0.5 adapts the clip of a private run"),
    ("clip_quantile", 0.5, {**PRIVATE, "method": "pfl_dim"},
     "clip_quantile=0.5 supports methods \\['flat', 'alpha_split'\\], not 'pfl_dim'"),
    ("clip_quantile", 0.5, {**PRIVATE, "audit_canaries": 4},
     "clip_quantile=0.5 cannot be combined with audit_canaries"),
    ("clip_quantile", 0.5, {**PRIVATE, "secure_aggregation": "secaggplus",
                            "aggregation": "layerwise"},
     "clip_quantile=0.5 under secure aggregation needs the uniform rule"),
    ("clip_quantile_lr", 0.0, {}, "clip_quantile_lr=0.0 must be a number > 0"),
    ("clip_count_stddev", -1.0, {}, "clip_count_stddev=-1.0 must be a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value", "extra", "message"), CASES, ids=[c[0] for c in CASES])
def test_every_bad_value_is_refused_naming_key_and_value(key, value, extra, message):
    with pytest.raises(ValueError, match=f"^federated config: {message}"):
        FLConfig(**{**BASE, **extra, key: value})


def test_every_field_has_a_bad_value_case():
    import dataclasses

    checked = {c[0] for c in CASES}
    assert {f.name for f in dataclasses.fields(FLConfig)} - checked <= {"node_partitions"}


def test_mls_max_epsilon_minus_one_is_refused_by_from_hparams():
    hparams = {"output_folder": "o", "method": "flat", "clip": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="max_epsilon=-1 must be a number > 0"):
        FLConfig.from_hparams({**hparams, "max_epsilon": -1})


def test_delta_at_least_one_over_the_population_warns(caplog):
    with caplog.at_level(logging.WARNING):
        FLConfig(**BASE, **PRIVATE, delta=0.1, population_size=20)
    assert "delta=0.1 >= 1/K = 1/20" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        FLConfig(**BASE, **PRIVATE, delta=1e-5, population_size=20)
    assert "1/K" not in caplog.text


def test_simulated_deployment_from_hparams(caplog):
    """The YAML keys reach the config; a DP method file's canaries are dropped with a warning
    (the audit tests this run's mechanism), a fedavg file with the keys is refused by name."""
    hparams = {"output_folder": "o", "method": "flat", "clip": 1.0, "noise_multiplier": 1.0,
               "noise_cohort_size": 1000, "accounting_population": 100000}  # fmt: skip
    with caplog.at_level(logging.WARNING):
        cfg = FLConfig.from_hparams({**hparams, "audit_canaries": 128})
    assert (cfg.noise_cohort_size, cfg.accounting_population) == (1000, 100000)
    assert cfg.accounting_sampling_rate == 0.01 and cfg.audit_canaries == 0
    assert "audit_canaries: 128 is ignored with noise_cohort_size: 1000" in caplog.text
    with pytest.raises(ValueError, match="noise_cohort_size=1000 simulates the noise of a priv"):
        FLConfig.from_hparams({**hparams, "method": "fedavg", "noise_multiplier": 0.0})
    plain = FLConfig.from_hparams({**hparams, "noise_cohort_size": None,
                                   "accounting_population": None})  # fmt: skip
    assert plain.accounting_sampling_rate == plain.sampling_rate and not plain.simulated_deployment
