"""The joint epsilon is the guarantee: pinned against the accountant and the pools' figures.

Under alpha-split (pool budgets below C) the epsilon of the privacy report, and of the
engine's report built from the strategy's own round budgets, is the accountant's at
(q, sigma, T), and strictly above the encoder pool's per-component figure: a report that put
the smallest per-component epsilon in its place fails here. A resume of a clipped non-private
run with another C is refused, like a private one.
"""

import logging

import pytest
import torch
from flwr.app import ArrayRecord

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.privacy import Group, Layout, compute_budgets, compute_epsilon
from speechbrain_fl.privacy.accounting import privacy_report
from speechbrain_fl.privacy.budgets import component_budgets

LAYOUT = Layout(
    [Group("enc.w", "encoder", 600), Group("con.w", "connector", 100), Group("llm.w", "llm", 300)]
)
Q, SIGMA, T, DELTA = 0.3, 0.9, 5, 1e-5


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.7])
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_joint_epsilon_is_the_accountants_and_above_every_pool(alpha, accountant):
    budgets = compute_budgets(LAYOUT, method="alpha_split", clip=1.0, alpha=alpha)
    rounds = [dict(component_budgets(LAYOUT, budgets))] * T
    rep = privacy_report(
        LAYOUT, rounds, noise_multiplier=SIGMA, clip=1.0, sampling_rate=Q, rounds=T,
        delta=DELTA, accountant=accountant,
    )  # fmt: skip
    joint = compute_epsilon(
        sampling_rate=Q, noise_multiplier=SIGMA, rounds=T, delta=DELTA, accountant=accountant
    )
    assert rep["epsilon"] == joint and rep["accountant"] == accountant
    assert rep["sigma_eff"]["encoder"] == pytest.approx(SIGMA / alpha**0.5)
    assert rep["sigma_eff"]["llm"] == pytest.approx(SIGMA / (1 - alpha) ** 0.5)
    # every pool's budget is below C, so every per-component figure is below the joint one
    assert all(eps < joint for eps in rep["epsilon_per_component"].values())
    assert rep["epsilon"] > min(rep["epsilon_per_component"].values())
    assert rep["epsilon_rdp"] == compute_epsilon(
        sampling_rate=Q, noise_multiplier=SIGMA, rounds=T, delta=DELTA, accountant="rdp"
    )


def test_engine_report_from_the_strategys_budgets_is_the_accountants(caplog):
    caplog.set_level(logging.ERROR)
    cfg = FLConfig(
        output_folder="unused", sampling_rate=Q, noise_multiplier=SIGMA, clip=1.0,
        method="alpha_split", alpha=0.1, population_size=10, delta=DELTA,
    )  # fmt: skip
    strategy = DPFedAvg(config=cfg, layout=LAYOUT)
    params = {g.name: torch.zeros(g.numel) for g in LAYOUT}
    round_budgets = []
    for server_round in range(1, T + 1):  # no client replies: every draw is still a release
        strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in params.items()})
        strategy.cohort, strategy.population = [], 10
        arrays, metrics = strategy.aggregate_train(server_round, [])
        params = arrays.to_torch_state_dict()
        round_budgets.append(dict(strategy.last_report.component_budgets))
    rep = privacy_report(
        LAYOUT, round_budgets, noise_multiplier=SIGMA, clip=1.0, sampling_rate=Q,
        rounds=strategy.accountant.rounds, delta=DELTA, accountant=cfg.accountant,
    )  # fmt: skip
    assert strategy.accountant.rounds == T and cfg.accountant == "pld"
    assert rep["epsilon"] == strategy.epsilon()
    # the per-round metric is the running RDP figure (round_accountant), an upper bound
    assert metrics["epsilon-rdp"] == rep["epsilon_rdp"] >= rep["epsilon"]
    assert rep["epsilon"] == compute_epsilon(
        sampling_rate=Q, noise_multiplier=SIGMA, rounds=T, delta=DELTA
    )
    assert rep["epsilon"] > rep["epsilon_per_component"]["encoder"]
    assert rep["sigma_eff"]["encoder"] == pytest.approx(SIGMA / 0.1**0.5)


@pytest.mark.parametrize("sigma", [0.0, 0.9])
def test_resume_with_another_clip_is_refused(sigma):
    """A clipped run with noise 0 is non-private, but its earlier rounds were clipped at C."""

    def strategy(clip):
        cfg = FLConfig(
            output_folder="unused", sampling_rate=Q, noise_multiplier=sigma, clip=clip,
            method="flat", population_size=10,
        )  # fmt: skip
        return DPFedAvg(config=cfg, layout=LAYOUT)

    saved = strategy(1.0).state_dict()
    strategy(1.0).load_state_dict(saved)  # the same C resumes
    with pytest.raises(ValueError, match="would change clip from 1.0 to 2.0"):
        strategy(2.0).load_state_dict(saved, source="server_state.pt")
