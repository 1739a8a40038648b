"""No reply can end a run; layer-wise replies are checked against what the server knows.

Each case below ended a run or was trusted before: a layer-wise run
with one client replying ``exit-depth=0`` stopped in round 1 (ValueError), likewise a missing
or list-valued ``exit-depth``, ``num-examples=1e308`` and a float64 delta of 1e300
(FloatingPointError); ``num-examples=1e9`` or ``exit-depth=1e9`` were accepted, a depth-3
client could send layer-12 tensors, and a float32 delta of 3e38 became the global model.
"""

from __future__ import annotations

import csv
import logging
import re

import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.fl.aggregate.round_report import AggregateFailed
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_server, toy_settings
from speechbrain_fl.privacy import Group, Layout

from .strategy_toys import ScriptedGrid, make_reply
from .test_layerwise_aggregation import ALL, BELOW, _head, _layer

EXITS = (3, 6, 9, 12)
DEPTH_NAMES = {e: {BELOW, *(_layer(k) for k in range(1, e + 1)), _head(e)} for e in EXITS}


def _names(depth):
    return sorted(DEPTH_NAMES[depth])


def _layerwise(tmp_path, partition_sizes=None, **config):
    layout = Layout([Group(p, "all", 2) for p in ALL])
    strategy = DPFedAvg(
        config=FLConfig(output_folder=str(tmp_path), aggregation="layerwise", **config),
        layout=layout,
        depth_names=DEPTH_NAMES,
        partition_sizes=partition_sizes,
    )
    strategy.current_arrays = ArrayRecord({p: torch.zeros(2) for p in ALL})
    return strategy


def _reply(node, depth_names, value, metrics):
    return make_reply(node, {p: torch.full((2,), float(value)) for p in depth_names}, metrics)


HONEST = [
    (1, 3, {"num-examples": 10, "exit-depth": 3, "partition-id": 0}),
    (2, 6, {"num-examples": 10, "exit-depth": 6, "partition-id": 1}),
]
HOSTILE = {
    "exit-depth=0": (_names(3), {"num-examples": 10, "exit-depth": 0}, "exit-depth=0"),
    "no exit-depth": (_names(3), {"num-examples": 10}, "no 'exit-depth'"),
    "list exit-depth": (_names(3), {"num-examples": 10, "exit-depth": [3]}, "exit-depth"),
    "exit-depth=1e9": (_names(3), {"num-examples": 10, "exit-depth": 1e9}, "not one of the"),
    "exit-depth=4.5": (_names(3), {"num-examples": 10, "exit-depth": 4.5}, "integer"),
    "exit-depth=-3": (_names(3), {"num-examples": 10, "exit-depth": -3}, "integer in 1"),
    "num-examples=1e308": (_names(3), {"num-examples": 1e308, "exit-depth": 3}, "1..2\\*\\*53"),
    "num-examples=2.5": (_names(3), {"num-examples": 2.5, "exit-depth": 3}, "integer"),
    "depth 3 sends layer 12": (
        _names(3) + [_layer(12), _head(12)],
        {"num-examples": 10, "exit-depth": 3},
        "above that depth",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_layerwise_reply_is_dropped_and_the_round_goes_on(
    tmp_path, server_identity, caplog, case
):
    names, metrics, reason = HOSTILE[case]
    strategy = _layerwise(tmp_path)
    strategy.cohort, strategy.population = [1, 2, 3], 3
    replies = [_reply(n, _names(d), 1.0, m) for n, d, m in HONEST]
    replies.append(_reply(3, names, -1000.0, {"partition-id": 2, **metrics}))
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    report = strategy.last_report
    assert (report.num_replied, report.num_dropped, report.num_failed) == (2, 1, 1)
    dropped = [r.getMessage() for r in caplog.records if "node 3:" in r.getMessage()]
    assert len(dropped) == 1, dropped
    assert pytest.approx(1.0) == arrays.to_torch_state_dict()[_layer(1)][0].item()
    assert re.search(reason, dropped[0]), dropped[0]


def test_num_examples_bounded_by_the_partition_size(tmp_path, server_identity, caplog):
    """Simulation: the server knows each partition's size (the audit: 1e9 made layer 1 -1000)."""
    strategy = _layerwise(tmp_path, partition_sizes=[10, 10, 50])
    strategy.cohort, strategy.population = [1, 2, 3], 3
    replies = [_reply(n, _names(d), 1.0, m) for n, d, m in HONEST]
    replies.append(
        _reply(3, _names(3), -1000.0, {"num-examples": 1e9, "exit-depth": 3, "partition-id": 2})
    )
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert "node 3: num-examples=1e+09 exceeds the 50 examples of partition 2" in caplog.text
    assert arrays.to_torch_state_dict()[_layer(1)][0].item() == pytest.approx(1.0)
    # within its size the same client counts with its weight
    strategy.current_arrays = ArrayRecord({p: torch.zeros(2) for p in ALL})
    fair = _reply(3, _names(3), -1000.0, {"num-examples": 50, "exit-depth": 3, "partition-id": 2})
    arrays, _ = strategy.aggregate_train(2, [*replies[:2], fair])
    assert strategy.last_report.num_dropped == 0


def test_depth_without_known_exits_is_bounded(tmp_path, server_identity, caplog):
    """A model without declared exits: depth-aware weights n_i L_i must stay finite."""
    layout = Layout([Group(p, "all", 2) for p in ALL])
    strategy = DPFedAvg(
        config=FLConfig(output_folder=str(tmp_path), aggregation="layerwise"), layout=layout
    )
    strategy.current_arrays = ArrayRecord({p: torch.zeros(2) for p in ALL})
    strategy.cohort, strategy.population = [1, 2, 3], 3
    replies = [_reply(n, _names(d), 1.0, m) for n, d, m in HONEST]
    replies.append(_reply(3, _names(3), -1000.0, {"num-examples": 2**53, "exit-depth": 1e300}))
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert "node 3: exit-depth=1e+300 must be an integer in 1..2**53" in caplog.text
    assert arrays.to_torch_state_dict()[_layer(1)][0].item() == pytest.approx(1.0)


def test_num_examples_bounded_by_the_declared_maximum(tmp_path, server_identity, caplog):
    """Deployment: ``max_num_examples`` (an FLConfig key) bounds what a node may declare."""
    strategy = _layerwise(tmp_path, max_num_examples=100)
    strategy.cohort, strategy.population = [1, 2, 3], 3
    replies = [_reply(n, _names(d), 1.0, m) for n, d, m in HONEST]
    replies.append(_reply(3, _names(3), -1000.0, {"num-examples": 1e9, "exit-depth": 3}))
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
    assert "max_num_examples=100" in caplog.text and strategy.last_report.num_dropped == 1


def _fedavg(tmp_path, dtype=torch.float32, **config):
    layout = Layout([Group("w", "all", 2)])
    strategy = DPFedAvg(config=FLConfig(output_folder=str(tmp_path), **config), layout=layout)
    strategy.current_arrays = ArrayRecord({"w": torch.zeros(2, dtype=dtype)})
    strategy.cohort, strategy.population = [1, 2], 2
    return strategy


def test_a_float64_delta_beyond_the_models_range_is_dropped(tmp_path, server_identity, caplog):
    strategy = _fedavg(tmp_path)
    replies = [
        make_reply(1, {"w": torch.ones(2)}, {"num-examples": 1}),
        make_reply(2, {"w": torch.full((2,), 1e300, dtype=torch.float64)}, {"num-examples": 1}),
    ]
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert "node 2: tensor 'w' has values up to 1e+300, beyond the range" in caplog.text
    assert arrays.to_torch_state_dict()["w"].tolist() == [1.0, 1.0]


def test_a_non_finite_aggregate_fails_the_round_not_the_run(tmp_path, server_identity):
    """float64 model at 1e308 plus a (finite) 1e308 delta: the sum overflows."""
    strategy = _fedavg(tmp_path, dtype=torch.float64)
    strategy.current_arrays = ArrayRecord({"w": torch.full((2,), 1e308, dtype=torch.float64)})
    big = {"w": torch.full((2,), 1e308, dtype=torch.float64)}
    with pytest.raises(AggregateFailed, match="non-finite"):
        strategy.aggregate_train(1, [make_reply(1, big, {"num-examples": 1})])
    assert strategy.last_report.round_failed


def test_update_norm_bound_guards_fedavg(tmp_path, server_identity, caplog):
    """The audit's float32 delta of 3e38: off by default (accepted), dropped with the bound."""
    absurd = {"w": torch.full((2,), 3e38)}
    strategy = _fedavg(tmp_path)
    arrays, _ = strategy.aggregate_train(1, [make_reply(1, absurd, {"num-examples": 1})])
    assert arrays.to_torch_state_dict()["w"][0].item() == pytest.approx(3e38)
    strategy = _fedavg(tmp_path, max_update_norm=100.0)
    replies = [
        make_reply(1, absurd, {"num-examples": 1}),
        make_reply(2, {"w": torch.ones(2)}, {"num-examples": 1}),
    ]
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert "node 1: update norm 4.243e+38 exceeds max_update_norm=100" in caplog.text
    assert arrays.to_torch_state_dict()["w"].tolist() == [1.0, 1.0]


def test_update_norm_bound_is_refused_for_a_private_run(tmp_path):
    with pytest.raises(ValueError, match="max_update_norm=1.0 is for non-private runs"):
        FLConfig(output_folder=str(tmp_path), noise_multiplier=1.0, clip=1.0, max_update_norm=1.0)


# ----------------------------------------------------------------------------- whole runs
def _toy_task(tmp_path, **settings):
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    overrides = {"output_folder": str(tmp_path), "num_partitions": 3, "seed": 1, **settings}
    return toy_server(context, toy_settings(overrides=overrides))


def _rows(folder):
    with open(folder / "rounds.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_hostile_replies_every_round_do_not_end_the_run(tmp_path, server_identity):
    """num-examples=1e308 from one node and a float64 delta of 1e300 from another, every round."""

    def reply(node, partition, server_round, arrays):
        delta = {k: torch.zeros_like(v) for k, v in arrays.items()}
        if partition == 1:
            return delta, {"num-examples": 1e308}
        if partition == 2:
            return {
                k: torch.full(v.shape, 1e300, dtype=torch.float64) for k, v in arrays.items()
            }, {"num-examples": 4}
        return delta, {"num-examples": 4}

    task = _toy_task(tmp_path, number_of_rounds=3)
    result = run_server(ScriptedGrid(reply), task)
    assert result.last_round == 3
    rows = _rows(tmp_path)
    assert [r["dropped_replies"] for r in rows] == ["", "2", "2", "2"]
    assert [r["num_replied"] for r in rows[1:]] == ["1", "1", "1"]


def test_an_overflowing_model_fails_rounds_and_the_run_goes_on(tmp_path, server_identity, caplog):
    """One node sends 3e38 each round: the float32 model overflows from round 3 on."""

    def reply(node, partition, server_round, arrays):
        value = 3e38 if partition == 0 else 0.0
        return {k: torch.full_like(v, value) for k, v in arrays.items()}, {"num-examples": 4}

    task = _toy_task(tmp_path, number_of_rounds=4, num_partitions=1)
    with caplog.at_level(logging.WARNING):
        result = run_server(ScriptedGrid(reply, num_nodes=1), task)
    assert result.last_round == 4
    for failed in (2, 3, 4):
        assert f"round {failed} is recorded as failed" in caplog.text
    assert "round 1 is recorded" not in caplog.text
    assert all(torch.isfinite(v).all() for v in result.params.values())


def test_a_round_with_only_bad_replies_fails_and_the_run_goes_on(tmp_path, server_identity, caplog):
    """The measured case end to end: the only client replies ``num-examples=1e308`` each round."""

    def reply(node, partition, server_round, arrays):
        return {k: torch.zeros_like(v) for k, v in arrays.items()}, {"num-examples": 1e308}

    task = _toy_task(tmp_path, number_of_rounds=3, num_partitions=1, max_retries=1)
    with caplog.at_level(logging.WARNING):
        result = run_server(ScriptedGrid(reply, num_nodes=1), task)
    assert result.last_round == 3
    assert "round 1 is recorded as failed (after 1 retries)" in caplog.text
    rows = _rows(tmp_path)
    assert [r["num_replied"] for r in rows[1:]] == ["0", "0", "0"]
    assert [r["dropped_replies"] for r in rows[1:]] == ["1", "1", "1"]


def test_min_clients_above_the_connected_nodes_still_stops_the_run(tmp_path, server_identity):
    """A configuration no round can meet is an error, not a bad reply."""
    task = _toy_task(tmp_path, number_of_rounds=2, num_partitions=1, min_clients=2)
    with pytest.raises(RuntimeError, match="only 1 nodes are connected. Lower min_clients"):
        run_server(ScriptedGrid(lambda *a: ({}, {}), num_nodes=1), task)
