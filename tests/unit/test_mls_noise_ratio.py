"""recipes/MLS/train_fl.py ``noise_vs_update``: the noise norm per round against the update norm."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from speechbrain_fl.privacy import Group, Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "MLS"))
import train_fl  # noqa: E402

LAYOUT = Layout([Group("e", "encoder", 300), Group("c", "connector", 100)])


def _report(joint, group_norms=None):
    return SimpleNamespace(
        joint_norm_mean=joint,
        group_norms=group_norms or {},
        component_norms={"encoder": 0.2, "connector": 0.4},
    )


def test_private_run_ratio():
    out = train_fl.noise_vs_update(
        [_report(0.4), _report(0.6, {"e": 0.1, "c": 0.3})], LAYOUT,
        noise_multiplier=0.5, clip=2.0, expected_cohort_size=10.0,
    )  # fmt: skip
    noise = 0.5 * 2.0 / 10.0 * math.sqrt(400)
    assert out["noise_norm"] == pytest.approx(noise)
    assert out["mean_update_norm"] == pytest.approx(0.5)
    assert out["ratio"] == pytest.approx(noise / 0.5)
    assert out["sigma_source"] == "this run" and out["trainable_values"] == 400
    assert out["norm_profile"]["per_matrix_mean_norm"] == {"encoder": 0.1, "connector": 0.3}
    # alpha-split's pools: the connector counts with the LLM
    assert out["norm_profile"]["llm_encoder_ratio"] == pytest.approx(3.0)


def test_fedavg_reports_the_paper_sigma_and_survives_missing_norms():
    out = train_fl.noise_vs_update(
        [_report(0.5)], LAYOUT, noise_multiplier=0.0, clip=None, expected_cohort_size=38.4
    )
    assert out["sigma"] == train_fl.PAPER_SIGMA and out["sigma_source"].startswith("paper")
    assert out["noise_norm"] == pytest.approx(0.1 / 38.4 * 20)
    assert out["norm_profile"] is None  # no group norms recorded
    empty = train_fl.noise_vs_update(
        [_report(None)], LAYOUT, noise_multiplier=0.1, clip=1.0, expected_cohort_size=9.6
    )
    assert empty["mean_update_norm"] is None and empty["ratio"] is None
    train_fl._log_noise_ratio(empty)  # says "no client norms recorded", no error


def test_large_encoder_update_is_reported_not_refused():
    """An encoder update norm with 2 x norm >= C (alpha >= 1 for alpha: auto) still gives the
    diagnosis: norm_profile records why no alpha fits instead of raising mid-report."""
    report = _report(2.0, {"e": 0.9, "c": 0.3})
    report.component_norms = {"encoder": 1.9, "connector": 0.5}
    out = train_fl.noise_vs_update(
        [report], LAYOUT, noise_multiplier=0.1, clip=1.0, expected_cohort_size=38.4
    )
    assert out["norm_profile"]["llm_encoder_ratio"] == pytest.approx(0.3 / 0.9)
    assert out["ratio"] == pytest.approx(0.1 / 38.4 * 20 / 2.0)
