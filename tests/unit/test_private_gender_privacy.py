"""The Private-Gender privacy report: joint epsilon of every release, speaker-level figures."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "Private-Gender"))

from gender_report import history_epsilon, joint_privacy, speaker_level  # noqa: E402

ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)


def _by_hand_epsilon(rdp: np.ndarray, delta: float) -> float:
    """RDP -> (epsilon, delta) (Balle et al. 2020, Thm 21), written out."""
    eps = rdp - (math.log(delta) + np.log(ORDERS)) / (ORDERS - 1) + np.log((ORDERS - 1) / ORDERS)
    return float(np.nanmin(eps))


def test_joint_epsilon_is_the_rdp_sum_of_gaussian_mechanisms():
    """q = 1: each step is the Gaussian mechanism, RDP alpha / (2 sigma^2); releases add."""
    teacher = {"name": "teacher", "history": [[2.0, 1.0, 10]]}
    direct = {"name": "DP-direct", "history": [[3.0, 1.0, 5]]}
    rdp = 10 * ORDERS / (2 * 2.0**2) + 5 * ORDERS / (2 * 3.0**2)
    joint = joint_privacy([teacher, direct], delta=1e-5, accountant="rdp")
    assert joint["epsilon"] == pytest.approx(_by_hand_epsilon(rdp, 1e-5), rel=1e-9)
    alone = joint_privacy([teacher], delta=1e-5, accountant="rdp")["epsilon"]
    assert alone == pytest.approx(_by_hand_epsilon(10 * ORDERS / 8.0, 1e-5), rel=1e-9)
    assert joint["epsilon"] > alone
    assert [r["name"] for r in joint["releases"]] == ["teacher", "DP-direct"]


def test_joint_epsilon_of_the_default_pair_is_that_of_twice_the_steps():
    """Teacher and DP-direct at the recipe default (q 0.25, sigma 6.72, 40 steps each)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    pair = [{"name": n, "history": [[6.72, 0.25, 40]]} for n in ("teacher", "DP-direct")]
    joint = joint_privacy(pair, delta=1e-5, accountant="rdp")["epsilon"]
    rdp = 2 * compute_rdp(q=0.25, noise_multiplier=6.72, steps=40, orders=ORDERS)
    assert joint == pytest.approx(_by_hand_epsilon(rdp, 1e-5), rel=1e-9)
    single = joint_privacy(pair[:1], delta=1e-5, accountant="rdp")["epsilon"]
    assert round(single, 2) == 0.99 and round(joint, 2) == 1.43  # the figures


def test_pld_joint_epsilon_is_the_exact_gaussian_mechanism_at_q_1():
    """Known value: at q = 1, T steps of sigma compose to the Gaussian mechanism of
    ``mu = sqrt(sum_r T_r / sigma_r^2)`` (mu-GDP), whose exact epsilon is analytic (Balle and
    Wang 2018). The PLD's pessimistic grid may round up, by at most ~1e-3 here."""
    from speechbrain_fl.privacy.audit import gaussian_mechanism_epsilon

    teacher = {"name": "teacher", "history": [[2.0, 1.0, 2]]}
    direct = {"name": "DP-direct", "history": [[2.0, 1.0, 2]]}
    exact = gaussian_mechanism_epsilon(1.0, delta=1e-5)  # mu = sqrt(4 / 4) = 1: 4.38
    joint = joint_privacy([teacher, direct], delta=1e-5, accountant="pld")
    assert exact <= joint["epsilon"] <= exact + 1e-3
    assert joint["accountant"] == "pld" and joint["epsilon_rdp"] > joint["epsilon"]
    alone = joint_privacy([teacher], delta=1e-5, accountant="pld")["epsilon"]
    assert gaussian_mechanism_epsilon(2**-0.5, delta=1e-5) <= alone < joint["epsilon"]


def test_pld_joint_epsilon_of_the_default_pair_against_rdp_prv_and_the_engine():
    """The default calibration (q 0.25, sigma 6.15625, 40 steps; PLD 0.995): the recipe's
    PLD equals accounting.compute_epsilon's for one release; PLD <= PRV <= RDP, with PLD within
    2% of PRV (two numerical methods for the same curve) and RDP at most 15% above PLD."""
    from speechbrain_fl.privacy.accounting import compute_epsilon

    hist = [(6.15625, 0.25, 40)]
    pld = history_epsilon(hist, delta=1e-5, accountant="pld")
    assert pld == pytest.approx(
        compute_epsilon(sampling_rate=0.25, noise_multiplier=6.15625, rounds=40, delta=1e-5,
                        accountant="pld"), rel=1e-9)  # fmt: skip
    assert round(pld, 3) == 0.995
    for h in (hist, hist * 2):  # one release; teacher + DP-direct
        pld = history_epsilon(h, delta=1e-5, accountant="pld")
        prv = history_epsilon(h, delta=1e-5, accountant="prv")
        rdp = history_epsilon(h, delta=1e-5, accountant="rdp")
        assert pld <= rdp <= 1.15 * pld and abs(prv - pld) <= 0.02 * pld
    pair = [{"name": n, "history": [list(hist[0])]} for n in ("teacher", "DP-direct")]
    joint = joint_privacy(pair, delta=1e-5, accountant="pld")
    assert joint["epsilon"] == pytest.approx(history_epsilon(hist * 2, delta=1e-5,
                                                             accountant="pld"))  # fmt: skip
    assert joint["epsilon_rdp"] == pytest.approx(
        history_epsilon(hist * 2, delta=1e-5, accountant="rdp"))  # fmt: skip


def test_joint_privacy_refuses_nothing_to_compose():
    with pytest.raises(ValueError, match="no release"):
        joint_privacy([], delta=1e-5, accountant="rdp")


def test_speaker_level_group_privacy():
    one = speaker_level(epsilon=0.9, delta=1e-5, max_clips=1)
    assert one["epsilon"] == 0.9 and one["delta"] == pytest.approx(1e-5)
    three = speaker_level(epsilon=0.5, delta=1e-6, max_clips=3)
    assert three["epsilon"] == 1.5 and three["delta"] == pytest.approx(3 * math.exp(1.0) * 1e-6)
    uncapped = speaker_level(epsilon=0.5, delta=1e-6, max_clips=None)
    assert uncapped["epsilon"] is None and "clip-level only" in uncapped["note"]


def test_cap_clips_per_speaker_keeps_at_most_k_per_speaker():
    from gender_data import cap_clips_per_speaker

    rows = [{"spk_id": s, "ID": str(i)} for i, s in enumerate("aaaabbc")]
    kept = cap_clips_per_speaker(rows, max_clips=2, seed=3)
    per = {s: sum(r["spk_id"] == s for r in kept) for s in "abc"}
    assert per == {"a": 2, "b": 2, "c": 1}
    assert [r["ID"] for r in kept] == sorted((r["ID"] for r in kept), key=int)  # order kept
    assert kept == cap_clips_per_speaker(rows, max_clips=2, seed=3)  # deterministic
