"""``secure_aggregation`` refuses what needs one client's update, and names the trust model."""

from __future__ import annotations

import pytest

from speechbrain_fl.fl.dp.disclosure import privacy_disclosure
from speechbrain_fl.fl.settings.config import FLConfig

BASE = {"output_folder": "o", "method": "flat", "clip": 1.0, "noise_multiplier": 1.0,
        "secure_aggregation": "secaggplus"}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"secure_aggregation": "secagg"}, "secure_aggregation"),
        ({"clip": None, "noise_multiplier": 0.0}, "secagg_clipping_range"),
        ({"secagg_clipping_range": 2.0}, "secagg_clipping_range"),
        ({"secure_aggregation": None, "secagg_clipping_range": 2.0}, "secagg_clipping_range"),
        ({"aggregation": "weighted", "noise_multiplier": 0.0}, "aggregation"),
        ({"aggregation": "fedavg_full", "noise_multiplier": 0.0}, "aggregation"),
        ({"max_update_norm": 3.0, "noise_multiplier": 0.0}, "max_update_norm"),
        ({"method": "pfl_dim_ema", "ema_signal": "raw"}, "ema_signal"),
        ({"secagg_num_shares": 1.5}, "secagg_num_shares"),
        ({"secagg_reconstruction_threshold": 0}, "secagg_reconstruction_threshold"),
    ],
)
def test_options_needing_individual_updates_are_refused(change, key):
    with pytest.raises(ValueError, match=f"federated config: {key}="):
        FLConfig(**{**BASE, **change})


def test_secure_runs_aggregate_uniformly_and_say_their_trust_model():
    cfg = FLConfig(**{**BASE, "noise_multiplier": 0.0})
    assert cfg.aggregation_rule_name == "uniform"  # a weight per reply would be revealed
    model = privacy_disclosure(FLConfig(**BASE))["trust_model"]
    assert model["name"] == "secure_aggregation" and model["protocol"] == "secaggplus"
    assert "only the sum" in model["server_sees"]
    assert "after unmasking" in model["noise_added_by"]
    central = privacy_disclosure(FLConfig(**{**BASE, "secure_aggregation": None}))
    assert central["trust_model"]["name"] == "central"
    assert "again by the server" in central["trust_model"]["clip_enforced_by"]


def test_layerwise_rules_and_unclipped_runs_with_a_box_are_accepted():
    from speechbrain_fl.fl.aggregate.layerwise import ServerMomentum, layerwise_rule

    for rule in (
        "layerwise",
        "layerwise_samples",
        ServerMomentum(layerwise_rule("uniform"), momentum=0.5),
    ):
        cfg = FLConfig(output_folder="o", secure_aggregation="secaggplus", aggregation=rule,
                       secagg_clipping_range=4.0)  # fmt: skip
        assert cfg.clip is None and cfg.secagg_clipping_range == 4.0
    model = privacy_disclosure(cfg)["trust_model"]
    assert "cut to [-4.0, 4.0]" in model["clip_enforced_by"]


def test_hparams_key_turns_it_on():
    cfg = FLConfig.from_hparams({**BASE, "number_of_rounds": 2, "secagg_num_shares": 5,
                                 "secagg_reconstruction_threshold": 3})  # fmt: skip
    assert (cfg.secure_aggregation, cfg.secagg_num_shares) == ("secaggplus", 5)


def test_a_resume_may_not_change_the_trust_model():
    from speechbrain_fl.fl.settings.resume import check_privacy_settings, privacy_settings
    from speechbrain_fl.privacy import Group, Layout

    layout = Layout([Group("w", "all", 3)])
    secure = privacy_settings(FLConfig(**BASE), population_size=4, layout=layout)
    central = privacy_settings(FLConfig(**{**BASE, "secure_aggregation": None}),
                               population_size=4, layout=layout)  # fmt: skip
    with pytest.raises(ValueError, match="change secure_aggregation from 'secaggplus' to None"):
        check_privacy_settings(central, secure, source="state")


def test_the_resolved_settings_line_names_the_trust_model():
    """Both engines log this line at start; under ``flwr run`` it is the disclosure a recipe
    without results.json leaves (the ServerApp's log)."""
    from speechbrain_fl.fl.task import resolved_settings

    line = resolved_settings(FLConfig(**BASE))
    assert "secure_aggregation='secaggplus'" in line
    assert line.endswith("trust_model='secure_aggregation'")
    central = resolved_settings(FLConfig(**{**BASE, "secure_aggregation": None}))
    assert "secure_aggregation=None" in central and central.endswith("trust_model='central'")
