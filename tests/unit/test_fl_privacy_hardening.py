"""Privacy invariants of the server strategy (docs/design.md "Privacy invariants").

Secret cohort sampling, every Poisson draw released and accounted, nothing on disk from which
past noise or cohorts can be derived, a resume refusing changed privacy settings, a declared
population, one client unable to crash a round, and honest labels. Replies are real Flower
Messages; the resume refusals run the real :func:`run_server` on the toy task up to the point
where a round would start (a ``max_epsilon`` below one round's epsilon stops it there, so no
Grid is needed).
"""

import functools
import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig, RoundFailed
from speechbrain_fl.fl.dp.disclosure import OUTSIDE_GUARANTEE, privacy_disclosure
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.serverapp.state import STATE_FILE
from speechbrain_fl.fl.toy import toy_server, toy_settings
from speechbrain_fl.privacy import Group, Layout

from .strategy_toys import GLOBAL, LAYOUT, make_reply, make_strategy, ones


@pytest.fixture(autouse=True)
def _server_identity(server_identity):
    """Every test here builds Messages as the ServerApp would."""


PRIVATE = dict(sampling_rate=0.5, noise_multiplier=1.0, clip=1.0, population_size=4)


def _leaves(obj, path=""):
    """Every (path, value) of a nested dict/list state."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


# ----------------------------------------------------------------------------- 1. secret sampling
def test_private_cohorts_do_not_follow_the_public_seed(tmp_path, caplog):
    nodes = list(range(200))
    cfg = dict(PRIVATE, population_size=200, seed=1234)
    with caplog.at_level(logging.WARNING):
        a, b = make_strategy(tmp_path, **cfg), make_strategy(tmp_path, **cfg)
    assert not any("testing only" in r.getMessage() for r in caplog.records)
    # P(equal cohorts of 200 independent Bernoulli(0.5) draws) = 2^-200
    assert a.sampler.sample(nodes, draw=(1, 0)) != b.sampler.sample(nodes, draw=(1, 0))
    # the non-private run keeps the recipe seed: reproducible cohorts
    c, d = (
        make_strategy(tmp_path, sampling_rate=0.5, seed=7),
        make_strategy(tmp_path, sampling_rate=0.5, seed=7),
    )
    assert c.sampler.sample(nodes, draw=(1, 0)) == d.sampler.sample(nodes, draw=(1, 0))


def test_fixed_sampler_and_noise_seeds_warn_and_are_recorded(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        strategy = make_strategy(tmp_path, **PRIVATE, sampler_seed=3, noise_seed=4)
    text = caplog.text
    assert "sampler_seed=3" in text and "noise_seed=4" in text and "testing only" in text
    caveats = strategy.disclosure()["caveats"]
    assert any("sampler_seed" in c for c in caveats) and any("noise_seed" in c for c in caveats)
    again = make_strategy(tmp_path, **PRIVATE, sampler_seed=3, noise_seed=4)
    assert strategy.sampler.sample(range(50), draw=(2, 0)) == again.sampler.sample(
        range(50), draw=(2, 0)
    )
    assert make_strategy(tmp_path, **PRIVATE).disclosure()["caveats"] == []


# ----------------------------------------------------------------------------- 3. every draw
def test_private_empty_cohort_is_released_and_accounted(tmp_path):
    strategy = make_strategy(tmp_path, **PRIVATE, min_clients=2)
    strategy.cohort, strategy.population = [], 4
    arrays, metrics = strategy.aggregate_train(1, [])
    new = arrays.to_torch_state_dict()
    assert strategy.accountant.rounds == 1 and metrics["epsilon-rdp"] > 0
    # pure noise of std sigma C / (qK) = 0.5 on every parameter: not the unchanged model
    assert all(not torch.equal(new[k], GLOBAL[k]) for k in GLOBAL)
    assert strategy.last_report.num_replied == 0 and strategy.last_report.noise_std == 0.5


def test_private_round_below_min_clients_is_released_not_resampled(tmp_path, caplog):
    strategy = make_strategy(tmp_path, **PRIVATE, min_clients=3)
    strategy.cohort, strategy.population = [1, 2], 4
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, [make_reply(1, ones(), {"num-examples": 1})])
    assert strategy.accountant.rounds == 1
    assert "released" in caplog.text
    # a second draw for the same round would be a re-sample: refused in a private run
    strategy._draws[1] = 1
    with pytest.raises(RuntimeError, match="re-sampl"):
        strategy._next_draw(1)
    # a non-private run still fails the round so that it can be retried
    plain = make_strategy(tmp_path, min_clients=3)
    plain.cohort, plain.population = [1, 2], 2
    with pytest.raises(RoundFailed):
        plain.aggregate_train(1, [make_reply(1, ones(), {"num-examples": 1})])
    assert plain._next_draw(1) == (1, 0) and plain._next_draw(1) == (1, 1)


# ----------------------------------------------------------------------------- 4. no secret
def test_state_holds_nothing_that_regenerates_noise_or_cohorts(tmp_path):
    strategy = make_strategy(tmp_path, **PRIVATE)
    strategy.cohort, strategy.population = [1], 4
    strategy.aggregate_train(1, [make_reply(1, ones(), {"num-examples": 1})])
    state = strategy.state_dict()
    for path, value in _leaves(state):
        if path.startswith("/seed_rng"):
            continue  # the clients' training seeds (from the public recipe seed): no DP role
        low = path.lower()
        assert not any(word in low for word in ("sampler", "seed", "generator", "rng")), path
        assert not isinstance(value, torch.Tensor), path  # no generator state tensors
    assert "sampler" not in state and "seed" not in (state.get("noise") or {})
    # a resumed strategy continues the accountant but draws fresh noise
    resumed = make_strategy(tmp_path, **PRIVATE)
    resumed.load_state_dict(state, source="test state")
    assert resumed.accountant.rounds == 1
    x = {"w": torch.zeros(64)}
    assert not torch.equal(
        strategy.noise.add(x, expected_cohort_size=2, draw=2)["w"],
        resumed.noise.add(x, expected_cohort_size=2, draw=2)["w"],
    )


# ----------------------------------------------------------------------------- 2. resume refusals
def _toy(tmp_path, **changes):
    settings = toy_settings(
        overrides={
            "output_folder": str(tmp_path),
            "number_of_rounds": 3,
            "method": "flat",
            "sampling_rate": 0.5,
            "noise_multiplier": 1.0,
            "clip": 1.0,
            "max_epsilon": 1e-3,  # below one round: run_server stops before round 1
            **changes,
        }
    )
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    return functools.partial(toy_server, context, settings)


@pytest.mark.parametrize(
    "key,old,new",
    [
        ("clip", 1.0, 4.0),
        ("delta", 1e-5, 1e-6),
        ("sampling_rate", 0.5, 0.25),
        ("noise_multiplier", 1.0, 2.0),
        ("method", "flat", "pfl_dim"),
        ("population_size", 4, 8),
        ("ema_warmup_rounds", 3, 5),
        ("noise_cohort_size", 10, 20),
        ("accounting_population", 1000, 2000),
        ("noise_cohort_size", None, 10),
    ],
)
def test_resume_refuses_changed_privacy_settings(tmp_path, key, old, new):
    base = {
        "ema_warmup_rounds": {"method": "pfl_dim_ema"},
        "noise_cohort_size": {"accounting_population": 1000},
        "accounting_population": {"noise_cohort_size": 10},
    }.get(key, {})
    if key == "noise_cohort_size" and old is None:  # switching the simulation on: N with M
        base = {}
        old_extra, new_extra = {"accounting_population": None}, {"accounting_population": 1000}
        run_server(None, _toy(tmp_path, **{key: old}, **old_extra)())
        with pytest.raises(ValueError) as err:
            run_server(None, _toy(tmp_path, **{key: new}, **new_extra)())
        assert key in str(err.value) and "None" in str(err.value)
        return
    result = run_server(None, _toy(tmp_path, **base, **{key: old})())
    assert result.stopped_early and result.last_round == 0
    with pytest.raises(ValueError) as err:
        run_server(None, _toy(tmp_path, **base, **{key: new})())
    text = str(err.value)
    assert key in text and repr(old) in text and repr(new) in text
    assert str(tmp_path / STATE_FILE) in text
    run_server(None, _toy(tmp_path, **base, **{key: old})())  # unchanged: resumes


def test_resume_refuses_a_changed_layout(tmp_path):
    run_server(None, _toy(tmp_path)())
    task = _toy(tmp_path)()
    task.layout = Layout([Group("model.weight", "w", 4), Group("model.bias", "b", 1)])
    with pytest.raises(ValueError, match="layout"):
        run_server(None, task)


# ----------------------------------------------------------------------------- 9. population
def test_declared_population_sets_the_denominator(tmp_path):
    # K = 4 declared, only 2 nodes connected this round: n = qK = 2, not q * 2 = 1
    strategy = make_strategy(tmp_path, **dict(PRIVATE, noise_multiplier=1e-9))
    strategy.cohort, strategy.population = [1, 2], 2
    delta = ones()
    arrays, _ = strategy.aggregate_train(
        1, [make_reply(1, delta, {"num-examples": 1}), make_reply(2, delta, {"num-examples": 1})]
    )
    clipped = 1.0 / math.sqrt(5.0)  # each reply re-clipped to C = 1 over its 5 entries
    new = arrays.to_torch_state_dict()
    torch.testing.assert_close(
        new["model.bias"], torch.full((1,), 2 * clipped / 2.0), atol=1e-6, rtol=0
    )
    assert strategy.last_report.population == 4 and strategy.last_report.connected == 2


def test_population_warns_and_private_run_needs_one(tmp_path, caplog):
    strategy = make_strategy(tmp_path, **PRIVATE)
    with caplog.at_level(logging.WARNING):
        strategy.check_population(3)
    assert "population_size=4" in caplog.text and "3 nodes connected" in caplog.text
    with pytest.raises(ValueError, match="population_size"):
        make_strategy(tmp_path, **dict(PRIVATE, population_size=None))
    assert (
        DPFedAvg(
            config=FLConfig(output_folder=str(tmp_path), **dict(PRIVATE, population_size=None)),
            layout=LAYOUT,
            population_size=6,
        ).population_size
        == 6
    )


# ----------------------------------------------------------------------------- 7. robust replies
def _big_endian_reply(node):
    from flwr.app import Array

    arrays = ArrayRecord(
        {
            "model.weight": Array(np.zeros((1, 4), dtype=">f4")),
            "model.bias": Array(np.zeros(1, dtype=">f4")),
        }
    )
    out = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
    return Message(content, reply_to=out)


def _corrupt_reply(node):
    message = make_reply(node, ones(), {"num-examples": 1})
    array = next(iter(message.content.array_records.values()))["model.weight"]
    array.data = array.data[:-3]
    return message


def _bad_metric_reply(node, key, value):
    message = make_reply(node, ones(), {"num-examples": 1})
    metrics = next(iter(message.content.metric_records.values()))
    metrics._data[key] = value  # bypass Flower's type check, as a hostile client's bytes could
    return message


def test_malformed_replies_are_rejected_with_a_log_line(tmp_path, caplog):
    strategy = make_strategy(tmp_path, clip=1.0, min_clients=1)
    strategy.cohort, strategy.population = [1, 2, 3, 4, 5, 6, 7], 7
    replies = [
        make_reply(1, ones(), {"num-examples": 1}),
        _corrupt_reply(2),
        _big_endian_reply(3),
        _bad_metric_reply(4, "num-examples", [1.0, 2.0]),
        _bad_metric_reply(5, "train-loss", "0.5"),
        _bad_metric_reply(6, "group-norms", 3.0),
        _bad_metric_reply(7, "partition-id", [0, 1]),
    ]
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    for node in (2, 3, 4, 5, 6, 7):
        assert f"node {node}:" in caplog.text, node
    assert strategy.last_report.num_replied == 1 and strategy.last_report.num_failed == 6
    assert torch.isfinite(arrays.to_torch_state_dict()["model.weight"]).all()


def test_reply_taken_once_and_only_from_a_sampled_node(tmp_path, caplog):
    strategy = make_strategy(tmp_path, min_clients=1)
    strategy.cohort, strategy.population = [1], 3
    once = ones()
    twice = {k: 2 * v for k, v in once.items()}
    replies = [
        make_reply(1, once, {"num-examples": 1}),
        make_reply(1, twice, {"num-examples": 1}),  # a second reply of node 1
        make_reply(9, twice, {"num-examples": 1}),  # node 9 was not sampled
    ]
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert torch.equal(arrays.to_torch_state_dict()["model.weight"], torch.ones(1, 4))
    assert "node 1: a second reply" in caplog.text and "node 9: not sampled" in caplog.text
    assert strategy.last_report.num_replied == 1


def test_partition_id_of_a_query_reply_must_be_an_integer(tmp_path):
    from speechbrain_fl.fl.serverapp.node_order import partition_id_of

    assert partition_id_of(MetricRecord({"partition-id": 3})) == 3
    assert partition_id_of(MetricRecord({"partition-id": [3, 4]})) is None
    assert partition_id_of(MetricRecord({"partition-id": 2.5})) is None
    assert partition_id_of(MetricRecord({})) is None


# ----------------------------------------------------------------------------- 5/6. labels
def test_disclosure_labels_what_the_epsilon_does_not_cover(tmp_path):
    cfg = FLConfig(output_folder=str(tmp_path), **PRIVATE, method="pfl_dim_ema")
    out = privacy_disclosure(cfg)
    assert "add/remove" in out["guarantee"] and "joint" in out["guarantee"]
    assert out["ema_signal"] == {
        "signal": "noisy",
        "private": True,
        "note": out["ema_signal"]["note"],
    }
    assert "sub-vector" in out["epsilon_per_component_note"]
    assert set(OUTSIDE_GUARANTEE) <= set(out["outside_guarantee"])
    assert (
        "rounds.csv" in out["outside_guarantee"] and "group_norms.csv" in out["outside_guarantee"]
    )
    assert out["caveats"] == [] and out["epsilon_covers_everything"] is True
    raw = privacy_disclosure(
        FLConfig(output_folder=str(tmp_path), **PRIVATE, method="pfl_dim_ema", ema_signal="raw"),
        profile_rounds=2,
        alpha_from_profile=True,
    )
    assert raw["ema_signal"]["signal"] == "raw" and not raw["ema_signal"]["private"]
    assert "profile.json" in raw["outside_guarantee"]
    assert raw["epsilon_covers_everything"] is False
    assert len(raw["caveats"]) == 3 and any("profile" in c for c in raw["caveats"])
    assert any("alpha" in c for c in raw["caveats"]) and any("raw" in c for c in raw["caveats"])
    assert privacy_disclosure(FLConfig(output_folder=str(tmp_path)))["guarantee"] is None


def test_budgets_recorded_for_a_round_nobody_replied_to(tmp_path):
    """An empty private round still records its per-component budgets, so the privacy report's
    per-pool sigma_eff is the method's (alpha-split: sigma / sqrt(alpha)), not sigma."""
    lay = Layout([Group("e", "encoder", 4), Group("l", "llm", 4), Group("c", "connector", 2)])
    cfg = FLConfig(
        output_folder=str(tmp_path), noise_multiplier=0.1, clip=1.0, sampling_rate=0.5,
        method="alpha_split", alpha=0.05, noise_seed=0, sampler_seed=0,
    )  # fmt: skip
    strategy = DPFedAvg(config=cfg, layout=lay, population_size=4)
    strategy.current_arrays = ArrayRecord({g.name: torch.zeros(g.numel) for g in lay})
    strategy.cohort, strategy.population = [], 4
    strategy.aggregate_train(1, [])
    budgets = strategy.last_report.component_budgets
    assert budgets["encoder"] == pytest.approx(math.sqrt(0.05))
    assert math.hypot(budgets["llm"], budgets["connector"]) == pytest.approx(math.sqrt(0.95))
