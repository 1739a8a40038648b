"""The per-round epsilon from RDP, the guarantee from the PLD (the DP round's cost).

A round's running figure (rounds.csv, train_log.txt, the progress line, the strategy's metrics)
comes from ``round_accountant`` (RDP by default); the reported epsilon (results.json,
``ServerResult.epsilon``, the disclosure) and the ``max_epsilon`` stop come from ``accountant``
(PLD by default), exactly as when every round asked the PLD. Checked here: the bisection's stop
round equals the per-round rule's; the PLD is non-decreasing in T (what the bisection needs)
and below RDP on the grid; a toy run reports the same final PLD figure, labels its per-round
figures, and stops exactly where the PLD says, not earlier where the looser RDP would.
"""

from __future__ import annotations

import csv
import functools
import json

import pytest

from speechbrain_fl.fl import FLTask, run_simulation
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings
from speechbrain_fl.privacy.accounting import PrivacyAccountant, compute_epsilon

DELTA = 1e-5
GRID = [(0.5, 1.0), (1.0, 0.8), (0.1, 0.6), (0.04, 1.5)]


def _eps(q, sigma, rounds, accountant="pld"):
    return compute_epsilon(
        sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=DELTA,
        accountant=accountant, warn=False,
    )  # fmt: skip


@pytest.mark.parametrize(("q", "sigma"), GRID)
def test_pld_is_monotone_in_rounds_and_below_rdp(q, sigma):
    pld = [_eps(q, sigma, t) for t in range(1, 13)]
    rdp = [_eps(q, sigma, t, "rdp") for t in range(1, 13)]
    assert pld == sorted(pld)  # the bisection of max_rounds relies on it
    assert all(p <= r for p, r in zip(pld, rdp, strict=True))  # RDP: the looser upper bound


@pytest.mark.parametrize(("q", "sigma"), GRID)
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.71, 1.5])
@pytest.mark.parametrize("spent", [0, 3])
def test_max_rounds_stops_where_the_per_round_rule_stops(q, sigma, fraction, spent):
    limit = 12
    target = max(1e-3, fraction * _eps(q, sigma, limit))
    acc = PrivacyAccountant(sampling_rate=q, noise_multiplier=sigma, delta=DELTA)
    acc.step(spent)
    rule = PrivacyAccountant(sampling_rate=q, noise_multiplier=sigma, delta=DELTA)
    rule.step(spent)
    while rule.rounds < limit and rule.epsilon_after(1) <= target:  # the old per-round check
        rule.step(1)
    got = acc.max_rounds(target, limit=limit)
    assert got == rule.rounds
    if got > spent:
        assert _eps(q, sigma, got) <= target  # the PLD epsilon never passes max_epsilon


def test_max_rounds_refuses_a_bad_limit():
    acc = PrivacyAccountant(sampling_rate=0.5, noise_multiplier=1.0, delta=DELTA)
    with pytest.raises(ValueError, match="limit must be an integer >= 0, got -1"):
        acc.max_rounds(1.0, limit=-1)


def _run(tmp_path, **overrides):
    settings = toy_settings(
        overrides={
            "num_partitions": 2, "number_of_rounds": 5, "eval_every": 0, "method": "flat",
            "clip": 0.5, "noise_multiplier": 0.8, "sampling_rate": 1.0, "noise_seed": 1,
            "sampler_seed": 2, "output_folder": str(tmp_path), **overrides,
        }
    )  # fmt: skip
    task = FLTask(
        build_client=functools.partial(toy_client, settings=settings),
        build_server=functools.partial(toy_server, settings=settings),
        num_partitions=2,
    )
    return run_simulation(task, backend="local")


def _rows(folder):
    with open(folder / "rounds.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_run_reports_the_pld_and_labels_its_rdp_round_figures(tmp_path, caplog):
    caplog.set_level("INFO")
    result = _run(tmp_path, number_of_rounds=3)
    assert result.epsilon == _eps(1.0, 0.8, 3)  # the final figure: the PLD's, as before
    assert result.privacy["epsilon"] == result.epsilon and result.privacy["accountant"] == "pld"
    rows = _rows(tmp_path)
    assert [float(r["epsilon"]) for r in rows[1:]] == [_eps(1.0, 0.8, t, "rdp") for t in (1, 2, 3)]
    lines = (tmp_path / "train_log.txt").read_text().splitlines()
    assert all("epsilon_rdp: " in line for line in lines[1:]) and "epsilon: " not in lines[1]
    progress = [m for m in caplog.messages if m.startswith("round ") and "eps (rdp)" in m]
    assert len(progress) == 3
    final = [m for m in caplog.messages if m.startswith("privacy: epsilon (pld)")]
    assert final and f"{result.epsilon:.4f}" in final[0]


def test_round_accountant_pld_gives_the_pld_every_round(tmp_path):
    result = _run(tmp_path, number_of_rounds=2, round_accountant="pld")
    assert [float(r["epsilon"]) for r in _rows(tmp_path)[1:]] == [_eps(1.0, 0.8, t) for t in (1, 2)]
    assert "epsilon_pld: " in (tmp_path / "train_log.txt").read_text()
    assert result.epsilon == _eps(1.0, 0.8, 2)


def test_max_epsilon_stop_follows_the_pld_not_the_looser_rdp(tmp_path):
    pld3, rdp3, pld4 = _eps(1.0, 0.8, 3), _eps(1.0, 0.8, 3, "rdp"), _eps(1.0, 0.8, 4)
    target = (pld3 + min(rdp3, pld4)) / 2  # RDP would stop before round 3, the PLD before 4
    assert pld3 < target < rdp3
    result = _run(tmp_path, max_epsilon=target)
    assert result.stopped_early and result.last_round == 3
    assert result.epsilon == pld3 <= target
    saved = json.dumps(result.privacy)
    assert json.loads(saved)["epsilon"] == pld3
