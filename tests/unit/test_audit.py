"""The canary audit: its statistics against independent figures, and the engine's mechanism.

The broken-mechanism tests drive the real server path (:meth:`DPFedAvg.aggregate_train`:
Poisson draw of the canaries, server re-clip, the DP rule, the noise) with canaries only, for
every clipping method: on the real code the audit stays below the accountant's epsilon; with the
noise halved (or, for non-compliant canaries, the server re-clip removed) the one-shot estimate
exceeds it. The canaries' directions and split come from the OS, so the figures vary from run
to run; the settings leave wide margins (q = 0.5, sigma = 1.5, 4 rounds, 2000 canaries, PLD
epsilon 3.74; 40 runs of PFL-Uniform, min/median/max): one-shot on the real code
1.95/2.48/3.09, with the noise at 0.5x 4.22/4.69/5.07 and at 0.4x 5.10/5.46/5.99; the provable
lower bound 0.64/0.91/1.47 (sd 0.18), 1.42/1.74/2.54 at 0.5x and 1.67/1.99/2.41 at 0.4x. The
power check (the lower bound rises with the broken noise) uses 0.4x: at 0.5x the two lower
bounds' tails overlap (one CI run drew 1.36 against 1.39, about a 1-in-1000 event per method);
at 0.4x their difference sits about four standard deviations above zero.
"""

import json
import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from scipy import stats

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.fl.dp import canaries as canaries_module
from speechbrain_fl.fl.dp.disclosure import format_disclosure, privacy_disclosure
from speechbrain_fl.fl.serverapp import strategy_replies as reply_module
from speechbrain_fl.privacy import METHODS, CanarySet, Group, Layout, compute_epsilon
from speechbrain_fl.privacy.audit import (
    audit_summary,
    gaussian_mechanism_epsilon,
    gaussian_pair_epsilon,
    one_run_lower_bound,
    one_run_p_value,
    one_shot_epsilon,
    plot_audit_cosines,
)


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("mu", [0.25, 0.5, 1.0, 2.0])
def test_gaussian_mechanism_epsilon_is_the_pld_of_one_full_batch_step(mu):
    # two independent computations: the mu-GDP curve here, dp-accounting's PLD there
    pld = compute_epsilon(sampling_rate=1.0, noise_multiplier=1 / mu, rounds=1, delta=1e-5)
    ours = gaussian_mechanism_epsilon(mu, delta=1e-5)
    assert ours <= pld <= ours + 0.01 * max(1.0, ours)
    assert gaussian_pair_epsilon(mu, 1.0, 0.0, 1.0, delta=1e-5) == pytest.approx(ours, abs=1e-4)


def test_one_shot_fits_the_shift_of_two_gaussians():
    rng = np.random.default_rng(0)
    est = one_shot_epsilon(rng.normal(0.5, 1, 20000), rng.normal(0, 1, 20000), delta=1e-5)
    assert est == pytest.approx(gaussian_mechanism_epsilon(0.5, delta=1e-5), rel=0.05)
    assert one_shot_epsilon([0.0, 0.1], [0.5, 0.6], delta=1e-5) == 0.0  # no positive shift
    assert one_shot_epsilon([1.0], [0.0, 0.1], delta=1e-5) is None


def test_one_run_p_value_is_the_binomial_tail_without_delta():
    for r, v in ((10, 7), (100, 60), (200, 200)):
        assert one_run_p_value(m=r, r=r, v=v, epsilon=0.0, delta=0.0) == pytest.approx(
            stats.binom.sf(v - 1, r, 0.5)
        )
    p = [one_run_p_value(m=500, r=100, v=80, epsilon=e, delta=1e-5) for e in (0, 0.5, 1, 2)]
    assert p == sorted(p)  # more epsilon, less surprising
    # with delta > 0 the 2 m delta term sets a floor (Steinke et al., Thm. 3)
    assert p[0] < 1e-3 and one_run_p_value(m=500, r=100, v=80, epsilon=0, delta=0) < 1e-8
    with pytest.raises(ValueError, match="v <= r <= m"):
        one_run_p_value(m=5, r=10, v=3, epsilon=0.0, delta=0.0)


def test_one_run_lower_bound_holds_for_randomized_response():
    """A mechanism that is exactly eps0-DP per canary (randomised response on membership):
    the 95% lower bound may exceed eps0 in at most ~5% of runs."""
    eps0, m, trials = 1.0, 1000, 40
    rng = np.random.default_rng(1)
    above, bounds = 0, []
    for _ in range(trials):
        member = rng.random(m) < 0.5
        truthful = rng.random(m) < math.exp(eps0) / (1 + math.exp(eps0))
        answer = np.where(truthful, member, ~member)
        scores = answer + 1e-3 * rng.random(m)  # ties broken at random
        bound = one_run_lower_bound(scores, member, delta=0.0)["epsilon"]
        bounds.append(bound)
        above += bound > eps0
    assert above <= 6
    assert np.median(bounds) > 0.5  # and it has power: close to eps0


def test_canaries_are_unit_directions_at_the_budgets():
    layout = Layout([Group("a", "encoder", 30), Group("b", "llm", 20)])
    canaries = CanarySet(6, {"a": (5, 6), "b": (20,)})
    assert canaries.seeded_from_os
    u = canaries.update(2, {"a": 0.6, "b": 0.8}, layout=layout)
    assert float(u["a"].norm()) == pytest.approx(0.6, rel=1e-6)
    assert float(u["b"].norm()) == pytest.approx(0.8, rel=1e-6)
    d = canaries.direction(2)
    cos = canaries.cosines({k: 3.0 * v for k, v in d.items()})
    assert cos[2] == pytest.approx(1.0, abs=1e-6) and np.abs(np.delete(cos, 2)).max() < 0.9
    with pytest.raises(ValueError, match=">= 2"):
        CanarySet(1, {"a": (3,)})


# ----------------------------------------------------------------------------- the engine
LAYOUT = Layout(
    [Group("enc", "encoder", 4000), Group("con", "connector", 1000), Group("llm", "llm", 3000)]
)
Q, SIGMA, ROUNDS, CANARIES, K = 0.5, 1.5, 4, 2000, 20


def run_canaries_only(method, *, noise_scale=1.0, canaries=CANARIES):
    """ROUNDS private rounds of DPFedAvg with no replying client, only the audit's canaries."""
    cfg = FLConfig(
        output_folder="unused",
        sampling_rate=Q,
        noise_multiplier=SIGMA,
        clip=1.0,
        method=method,
        alpha=0.3 if method == "alpha_split" else None,
        population_size=K,
        audit_canaries=canaries,
        delta=1e-5,
    )
    strategy = DPFedAvg(config=cfg, layout=LAYOUT)
    strategy.noise.noise_multiplier *= noise_scale  # a deliberately mis-scaled noise
    params = {g.name: torch.zeros(g.numel) for g in LAYOUT}
    for server_round in range(1, ROUNDS + 1):
        strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in params.items()})
        strategy.cohort, strategy.population = [], K
        arrays, _ = strategy.aggregate_train(server_round, [])
        params = arrays.to_torch_state_dict()
    assert strategy.accountant.rounds == ROUNDS and strategy.audit.rounds == ROUNDS
    return strategy, strategy.audit_report(params)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)  # a private round with no reply logs a warning each time


@pytest.mark.parametrize("method", METHODS)
def test_audit_stays_below_the_accountant_and_catches_a_cut_noise(method):
    accountant = compute_epsilon(sampling_rate=Q, noise_multiplier=SIGMA, rounds=ROUNDS, delta=1e-5)
    _, (honest, cos, member) = run_canaries_only(method)
    assert honest["accountant_epsilon"] == pytest.approx(accountant)
    assert honest["epsilon_one_shot"] < accountant
    assert honest["epsilon_lower_bound"] <= accountant  # provable, at 95%
    assert not honest["exceeds_accountant"]
    assert honest["insertions"] > 0 and len(cos) == CANARIES and member.sum() > 0
    _, (broken, _, _) = run_canaries_only(method, noise_scale=0.4)
    assert broken["epsilon_one_shot"] > accountant and broken["exceeds_accountant"]
    assert broken["epsilon_lower_bound"] > honest["epsilon_lower_bound"]


@pytest.mark.parametrize("method", ["flat", "alpha_split"])
def test_audit_catches_a_removed_server_reclip(method, monkeypatch):
    """Canaries that do not clip (4x the bound) are harmless while the server re-clips them."""
    real_update = CanarySet.update

    def non_compliant(self, index, budgets, *, layout=None):
        return {k: 4.0 * v for k, v in real_update(self, index, budgets, layout=layout).items()}

    monkeypatch.setattr(CanarySet, "update", non_compliant)
    accountant = compute_epsilon(sampling_rate=Q, noise_multiplier=SIGMA, rounds=ROUNDS, delta=1e-5)
    _, (reclipped, _, _) = run_canaries_only(method)
    assert reclipped["epsilon_one_shot"] < accountant

    def no_clip(update, budgets, **kw):
        return update, None

    monkeypatch.setattr(reply_module, "clip_update", no_clip)  # replies
    monkeypatch.setattr(canaries_module, "clip_update", no_clip)  # canary replies
    _, (unclipped, _, _) = run_canaries_only(method)
    assert unclipped["epsilon_one_shot"] > accountant
    # the provable bound rises too, but with 2000 canaries and delta = 1e-5 its 2 m delta term
    # caps it near 3 (measured 2.5-2.7), below this accountant's 3.74
    assert unclipped["epsilon_lower_bound"] > reclipped["epsilon_lower_bound"]


def test_canaries_leave_the_real_clients_mechanism_and_state_alone():
    strategy, (summary, _, _) = run_canaries_only("flat", canaries=50)
    # the noise is calibrated to n = qK real clients, the accountant steps once per round
    assert strategy.noise.std(strategy.expected_cohort_size()) == pytest.approx(SIGMA / (Q * K))
    assert summary["expected_cohort_size"] == Q * K
    # nothing of the canaries (seeds, directions, split) goes into the saved state
    state = json.dumps(strategy.state_dict(), default=str)
    assert "canar" not in state and "audit" not in state
    assert "cosine" not in json.dumps(summary) or set(summary["cosine_mean"]) == {
        "inserted",
        "held_out",
    }


def test_audit_in_the_disclosure_and_the_plot(tmp_path):
    _, (summary, cos, member) = run_canaries_only("flat", canaries=200)
    cfg = FLConfig(
        output_folder="o",
        sampling_rate=Q,
        noise_multiplier=SIGMA,
        clip=1.0,
        population_size=K,
        audit_canaries=200,
    )
    disclosure = privacy_disclosure(cfg)
    assert disclosure["audit_note"].startswith("the audit inserts canary clients")
    text = format_disclosure({**disclosure, "audit": summary})
    assert "Audit (200 canaries" in text and "canaries are not users" in text.lower()
    assert f"{summary['epsilon_one_shot']:.3g}" in text
    png = plot_audit_cosines(cos, member, summary, tmp_path / "plots" / "audit_cosines.png")
    assert png.stat().st_size > 1000


def test_audit_summary_of_no_signal_reports_zero_bound():
    rng = np.random.default_rng(3)
    member = rng.random(400) < 0.5
    out = audit_summary(rng.normal(0, 1, 400), member, delta=1e-5, accountant_epsilon=1.0, rounds=3)
    assert out["epsilon_lower_bound"] < 0.5 and out["inserted"] == int(member.sum())


def test_a_non_private_hparams_file_ignores_audit_canaries(caplog):
    base = {"output_folder": "o", "method": "flat", "clip": 1.0, "audit_canaries": 64}
    with caplog.at_level(logging.WARNING):
        cfg = FLConfig.from_hparams({**base, "noise_multiplier": 0})
    assert cfg.audit_canaries == 0 and "audit_canaries: 64 is ignored" in caplog.text
    assert FLConfig.from_hparams({**base, "noise_multiplier": 1.0}).audit_canaries == 64
