"""DPFedAvg aggregation: re-clipping, noise exactly once, weighting, faults, client round.

Replies are real Flower Messages; client updates come from the real ClientApp round
(:func:`train_round`) on the toy SpeechBrain Brain, or are built by hand where a test needs a
non-compliant or broken client.
"""

import json
import logging
import math

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    RecordDict,
)

from speechbrain_fl.fl import DPFedAvg, FLConfig, RoundFailed, train_round
from speechbrain_fl.fl.toy import toy_client, toy_settings
from speechbrain_fl.privacy import Group, Layout

from .strategy_toys import GLOBAL, LAYOUT, make_reply, make_strategy, ones


@pytest.fixture(autouse=True)
def _server_identity(server_identity):
    """Every test here builds Messages as the ServerApp would."""


def _set_round(strategy, cohort, population):
    strategy.cohort, strategy.population = list(cohort), population


def test_dp_mean_divides_by_qk_not_the_realised_cohort(tmp_path):
    # q = 0.5 of K = 6 declared clients: n = qK = 3, while only 2 were sampled and replied
    q, k, clip = 0.5, 6, 1.0
    strategy = make_strategy(
        tmp_path, sampling_rate=q, noise_multiplier=1e-9, clip=clip, population_size=k
    )
    _set_round(strategy, [1, 2], k)
    big = {"model.weight": torch.full((1, 4), 10.0), "model.bias": torch.full((1,), 10.0)}
    small = {"model.weight": torch.full((1, 4), 0.1), "model.bias": torch.zeros(1)}
    replies = [make_reply(1, big, {"num-examples": 5}), make_reply(2, small, {"num-examples": 50})]
    arrays, _ = strategy.aggregate_train(1, replies)
    new = arrays.to_torch_state_dict()
    # the non-compliant reply is re-clipped to C; the sum is divided by qK = 3 (not by 2)
    norm_big = math.sqrt(5 * 100.0)
    for name in GLOBAL:
        expected = (big[name].double() * clip / norm_big + small[name].double()) / 3.0
        torch.testing.assert_close(new[name].double(), expected, rtol=0, atol=1e-6)
    assert strategy.accountant.rounds == 1


def test_noise_std_is_sigma_clip_over_qk(tmp_path):
    """One noise draw of std sigma C / (qK) per round, the formula written out here."""
    sigma, clip, q, k = 0.8, 1.5, 0.25, 8
    expected_std = sigma * clip / (q * k)  # 0.6
    layout = Layout([Group("w", "all", 400_000)])
    cfg = FLConfig(
        output_folder=str(tmp_path),
        sampling_rate=q,
        noise_multiplier=sigma,
        clip=clip,
        population_size=k,
    )
    strategy = DPFedAvg(config=cfg, layout=layout)
    params = {"w": torch.zeros(400_000)}
    draws = []
    for server_round in (1, 2):
        strategy.current_arrays = ArrayRecord({"w": params["w"].clone()})
        _set_round(strategy, [1], k)
        zero = make_reply(1, {"w": torch.zeros(400_000)}, {"num-examples": 1})
        arrays, _ = strategy.aggregate_train(server_round, [zero])
        new = arrays.to_torch_state_dict()["w"].double()
        draws.append(new - params["w"].double())
        params = {"w": new.float()}
    for noise in draws:  # 400k draws: the std estimate is within 0.3% (5 standard errors)
        assert float(noise.std()) == pytest.approx(expected_std, rel=0.006)
        assert abs(float(noise.mean())) < 5 * expected_std / math.sqrt(noise.numel())
    assert not torch.equal(draws[0], draws[1])  # a fresh draw each round
    assert strategy.last_report.noise_std == pytest.approx(expected_std, rel=1e-12)
    assert strategy.accountant.rounds == 2


def test_plugin_budget_method_is_accepted_and_gets_ema_state(tmp_path):
    """A method defined at run time (its class, named, and its allocator registered under that
    name) is a valid ``--method``, and an adaptive one (ema_base set) gets the server's EMA
    budgets, as the built-in EMA methods do."""
    from typing import ClassVar

    from speechbrain_fl.privacy import PFLDimEMA, get_budget_method, register_budget_method
    from speechbrain_fl.privacy.budgets import unregister_budget_method

    class DimEmaPlugin(PFLDimEMA):
        name: ClassVar[str] = "dim_ema_plugin_test"

    register_budget_method("dim_ema_plugin_test", ema_base="dim")(
        get_budget_method("pfl_dim_ema").allocate
    )
    try:
        assert (
            FLConfig.from_hparams(
                {
                    "output_folder": str(tmp_path),
                    "noise_multiplier": 0.5,
                    "method": DimEmaPlugin(clip=1.0, noise_multiplier=0.5),
                }
            ).method
            == DimEmaPlugin.name
        )
        hparams = {"output_folder": str(tmp_path), "method": "dim_ema_plugin_test", "clip": 1.0,
                   "noise_multiplier": 0.5, "sampling_rate": 1.0, "population_size": 2}  # fmt: skip
        cfg = FLConfig.from_hparams(hparams)
        strategy = DPFedAvg(config=cfg, layout=Layout([Group("a", "all", 4), Group("b", "x", 4)]))
        assert strategy.ema is not None and strategy.ema.base == "dim"
        static = FLConfig.from_hparams({**hparams, "method": "pfl_dim"})
        assert DPFedAvg(config=static, layout=strategy.layout).ema is None
    finally:
        unregister_budget_method("dim_ema_plugin_test")
    with pytest.raises(ValueError, match="dim_ema_plugin_test"):
        FLConfig.from_hparams(hparams)  # unregistered again: refused, naming the method


def test_ema_budgets_are_updated_by_the_strategy(tmp_path):
    """After the warm-up, the EMA budgets follow the released aggregate's group norms."""
    layout = Layout([Group("a", "all", 2000), Group("b", "all", 2000)])
    cfg = FLConfig(
        output_folder=str(tmp_path),
        sampling_rate=1.0,
        noise_multiplier=1e-3,
        clip=1.0,
        method="pfl_unif_ema",
        ema_warmup_rounds=2,
        ema_beta=0.5,
        population_size=2,
    )
    strategy = DPFedAvg(config=cfg, layout=layout)
    base = strategy.budgets()
    assert base["a"] == pytest.approx(base["b"])  # uniform base weights
    params = {"a": torch.zeros(2000), "b": torch.zeros(2000)}
    history = []
    for server_round in (1, 2, 3):
        strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in params.items()})
        _set_round(strategy, [1, 2], 2)
        # group a moves 20x more than group b
        delta = {"a": torch.full((2000,), 0.02), "b": torch.full((2000,), 0.001)}
        replies = [make_reply(n, delta, {"num-examples": 1}) for n in (1, 2)]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        params = arrays.to_torch_state_dict()
        history.append(strategy.budgets())
    assert strategy.ema.round == 3
    assert history[0] == pytest.approx(base)  # still in the warm-up after one observation
    assert history[-1]["a"] > 1.5 * history[-1]["b"]  # the budgets followed the norms
    total = math.sqrt(sum(v * v for v in history[-1].values()))
    assert total == pytest.approx(1.0, rel=1e-9)  # still a split of C


def test_weighted_mean_for_plain_fedavg(tmp_path):
    strategy = make_strategy(tmp_path)  # no noise, no clip -> num-examples weighting
    _set_round(strategy, [1, 2], 2)
    unit = ones()
    zeros = {k: torch.zeros_like(v) for k, v in GLOBAL.items()}
    replies = [make_reply(1, zeros, {"num-examples": 1}), make_reply(2, unit, {"num-examples": 3})]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert torch.allclose(arrays.to_torch_state_dict()["model.weight"], torch.full((1, 4), 0.75))
    assert strategy.accountant is None and strategy.last_report.noise_std is None


def test_private_run_rejects_weighted_rule(tmp_path):
    with pytest.raises(ValueError, match="dp_sensitivity_bounded"):
        make_strategy(tmp_path, noise_multiplier=1.0, clip=1.0, aggregation="weighted")


def test_faulty_replies_dropped_with_reason(tmp_path, caplog):
    strategy = make_strategy(tmp_path, min_clients=1)
    _set_round(strategy, [1, 2, 3, 4, 5, 6], 6)
    good = ones()
    nan = {"model.weight": torch.full((1, 4), float("nan")), "model.bias": torch.zeros(1)}
    wrong_name = {"model.weight": torch.zeros(1, 4), "other": torch.zeros(1)}
    wrong_shape = {"model.weight": torch.zeros(4), "model.bias": torch.zeros(1)}
    replies = [
        make_reply(1, good, {"num-examples": 2}),
        make_reply(2, error="ValueError: boom"),
        make_reply(3, nan, {"num-examples": 2}),
        make_reply(4, wrong_name, {"num-examples": 2}),
        make_reply(5, wrong_shape, {"num-examples": 2}),
    ]  # node 6 never replies (timeout)
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    text = caplog.text
    for expected in (
        "node 2: client error",
        "node 3: tensor 'model.weight' has non-finite",
        "node 4: wrong tensor names",
        "node 5: tensor 'model.weight' has shape",
        "node 6: no reply",
    ):
        assert expected in text
    assert strategy.last_report.num_replied == 1 and strategy.last_report.num_failed == 5
    assert torch.equal(arrays.to_torch_state_dict()["model.weight"], torch.ones(1, 4))


def test_too_few_replies_raise_round_failed(tmp_path):
    strategy = make_strategy(tmp_path, min_clients=2)
    _set_round(strategy, [1, 2], 2)
    good = ones()
    with pytest.raises(RoundFailed, match="1 valid replies.*min_clients=2"):
        strategy.aggregate_train(
            1, [make_reply(1, good, {"num-examples": 1}), make_reply(2, error="x")]
        )


def test_client_round_clips_with_sent_budgets_and_reports_stats():
    settings = toy_settings(overrides={"lr": 0.5})
    task = toy_client(
        Context(
            run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
        ),
        settings,
    )
    start = {n: p.detach().clone() for n, p in task.brain.modules.named_parameters()}
    budgets = {"model.weight": 0.03, "model.bias": 0.04}
    config = ConfigRecord(
        {
            "server-round": 1,
            "local-epochs": 1,
            "round-seed": 3,
            "clip-budgets": json.dumps(budgets),
            "clip-groups": json.dumps(list(LAYOUT.names)),
            "clip-components": json.dumps(list(LAYOUT.components)),
        }
    )
    content = RecordDict(
        {"arrays": ArrayRecord({k: v.clone() for k, v in start.items()}), "config": config}
    )
    out = train_round(task, content, partition_id=0)
    delta = out["arrays"].to_torch_state_dict()
    metrics = out["metrics"]
    assert delta["model.weight"].norm() <= 0.03 + 1e-6
    assert delta["model.bias"].norm() <= 0.04 + 1e-6
    assert metrics["num-examples"] == settings["examples_per_client"]
    assert metrics["train-loss"] > 0 and metrics["group-clipped"] == [1.0, 1.0]
    assert metrics["group-norms"][0] > 0.03 and metrics["clip-ratio"] < 1.0
    # the Brain is reset to the global parameters after the round
    for name, param in task.brain.modules.named_parameters():
        assert torch.equal(param.detach(), start[name])
    # same round seed -> same update (reproducible rounds)
    again = train_round(task, content, partition_id=0)["arrays"].to_torch_state_dict()
    assert torch.equal(again["model.weight"], delta["model.weight"])


def test_strategy_accounts_with_the_chosen_accountant(tmp_path):
    """accountant='prv' reaches the strategy's accountant (PRV < RDP at these settings)."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    eps = {}
    for name in ("rdp", "prv"):
        strategy = make_strategy(
            tmp_path,
            sampling_rate=0.5,
            noise_multiplier=2.0,
            clip=1.0,
            population_size=2,
            accountant=name,
        )
        _set_round(strategy, [1], 2)
        good = ones()
        _, metrics = strategy.aggregate_train(1, [make_reply(1, good, {"num-examples": 1})])
        eps[name] = strategy.epsilon()
        # the round's running figure is RDP's (round_accountant), named so, whatever the run's
        rdp = RDPAccountant()
        rdp.history = [(2.0, 0.5, 1)]
        assert metrics["epsilon-rdp"] == pytest.approx(rdp.get_epsilon(delta=1e-5), rel=1e-9)
        assert "epsilon" not in metrics and "epsilon-prv" not in metrics
    for name, cls in (("rdp", RDPAccountant), ("prv", PRVAccountant)):
        reference = cls()
        reference.history = [(2.0, 0.5, 1)]
        assert eps[name] == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9), name
    assert eps["prv"] < 0.95 * eps["rdp"]
