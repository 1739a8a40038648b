"""Layer-wise partial aggregation: the hand-computed example, weightings, fedavg_full, engine path.

Clients A (L=3, n=100), B (L=6, n=50), C (L=9, n=200) on a 12-layer model with exits
{3, 6, 9, 12}. depth_aware weights a_i = n_i L_i = 300, 300, 1800:
layers 1-3 -> 300/2400, 300/2400, 1800/2400 = 0.125, 0.125, 0.75; layers 4-6 -> 300/2100 = 1/7
and 6/7; layers 7-9 -> C alone; layers 10-12 unchanged; each head from its own client.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.fl.aggregate.layerwise import ServerMomentum, rule_name
from speechbrain_fl.fl.aggregate.rules import get_rule
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.serverapp.replies import ReplyRejected, parse_train_reply
from speechbrain_fl.privacy import Group, Layout

from .strategy_toys import make_reply

BELOW = "model.backbone.feature_projection.projection.weight"


def _layer(k):
    return f"model.backbone.encoder.layers.{k - 1}.fc.weight"


def _head(e):
    return f"model.heads.{e}.linear.weight"


ALL = [BELOW] + [_layer(k) for k in range(1, 13)] + [_head(e) for e in (3, 6, 9, 12)]
# each client's delta is its own constant, so the aggregate exposes the weights
VALUE = {"A": 1.0, "B": 10.0, "C": 100.0}
CLIENTS = {"A": (3, 100), "B": (6, 50), "C": (9, 200)}


def _updates():
    out = []
    for node, (name, (depth, n)) in enumerate(CLIENTS.items()):
        names = [BELOW] + [_layer(k) for k in range(1, depth + 1)] + [_head(depth)]
        delta = {p: torch.full((2,), VALUE[name]) for p in names}
        out.append(ClientUpdate(node, delta, {"num-examples": n, "exit-depth": depth}))
    return out


def _mix(weights):
    return sum(VALUE[c] * w for c, w in weights.items())


def _check(agg, expected):
    for name, value in expected.items():
        if value is None:
            assert name not in agg, f"{name} should stay unchanged"
        else:
            assert agg[name].tolist() == pytest.approx([value] * 2, rel=1e-12), name


def test_hand_computed_depth_aware():
    agg = get_rule("layerwise")(_updates(), expected_cohort_size=3)
    low = _mix({"A": 0.125, "B": 0.125, "C": 0.75})
    expected = {BELOW: low}
    expected.update({_layer(k): low for k in (1, 2, 3)})
    expected.update({_layer(k): _mix({"B": 1 / 7, "C": 6 / 7}) for k in (4, 5, 6)})
    expected.update({_layer(k): VALUE["C"] for k in (7, 8, 9)})
    expected.update({_layer(k): None for k in (10, 11, 12)})
    expected.update({_head(3): VALUE["A"], _head(6): VALUE["B"], _head(9): VALUE["C"]})
    expected[_head(12)] = None
    _check(agg, expected)


def test_samples_and_uniform_weightings():
    samples = get_rule(rule_name("layerwise", "samples"))(_updates(), expected_cohort_size=3)
    _check(samples, {_layer(1): _mix({"A": 100 / 350, "B": 50 / 350, "C": 200 / 350})})
    _check(samples, {_layer(5): _mix({"B": 50 / 250, "C": 200 / 250}), _layer(11): None})
    uniform = get_rule(rule_name("layerwise", "uniform"))(_updates(), expected_cohort_size=3)
    _check(uniform, {_layer(2): _mix({"A": 1 / 3, "B": 1 / 3, "C": 1 / 3})})
    _check(uniform, {_layer(6): _mix({"B": 0.5, "C": 0.5}), _head(6): VALUE["B"]})


def test_fedavg_full_dilutes_with_unchanged_copies():
    agg = get_rule("fedavg_full")(_updates(), expected_cohort_size=3)
    # n-weighted over all 350 examples; a client that did not train a tensor returns it unchanged
    _check(agg, {_layer(1): _mix({"A": 100 / 350, "B": 50 / 350, "C": 200 / 350})})
    _check(agg, {_layer(5): _mix({"B": 50 / 350, "C": 200 / 350})})
    _check(agg, {_layer(8): VALUE["C"] * 200 / 350, _layer(12): None})
    _check(agg, {_head(3): VALUE["A"] * 100 / 350, _head(6): VALUE["B"] * 50 / 350})


def test_depth_aware_needs_the_depth_metric():
    update = ClientUpdate(7, {BELOW: torch.ones(2)}, {"num-examples": 3})
    with pytest.raises(ValueError, match="node 7.*exit-depth"):
        get_rule("layerwise")([update], expected_cohort_size=1)


def test_rule_name_errors():
    with pytest.raises(ValueError, match="aggregation"):
        rule_name("median", "samples")
    with pytest.raises(ValueError, match="weighting"):
        rule_name("layerwise", "size")


def test_server_momentum_accumulates_per_parameter():
    # beta 0.5, eta 2: steps 2*1, 2*(0.5*1 + 1), ... for a tensor trained every round; a tensor
    # absent from a round's aggregate does not move and keeps its buffer
    momentum = ServerMomentum(get_rule("layerwise"), momentum=0.5, server_lr=2.0)
    deep = _updates()
    shallow = [deep[0]]  # client A alone: layers 1-3 and head 3 only
    first = momentum(deep, expected_cohort_size=3)
    second = momentum(shallow, expected_cohort_size=1)
    third = momentum(deep, expected_cohort_size=3)
    low = _mix({"A": 0.125, "B": 0.125, "C": 0.75})
    _check(first, {_layer(1): 2 * low, _layer(8): 2 * VALUE["C"], _layer(11): None})
    _check(second, {_layer(1): 2 * (0.5 * low + VALUE["A"]), _layer(8): None})
    _check(third, {_layer(1): 2 * (0.5 * (0.5 * low + VALUE["A"]) + low)})
    _check(third, {_layer(8): 2 * (0.5 * VALUE["C"] + VALUE["C"])})  # buffer kept in round 2
    assert momentum.accepts_partial and not momentum.dp_sensitivity_bounded


def test_server_momentum_zero_is_the_rule():
    plain = get_rule("fedavg_full")(_updates(), expected_cohort_size=3)
    wrapped = ServerMomentum(get_rule("fedavg_full"), momentum=0.0)
    for _ in range(2):
        out = wrapped(_updates(), expected_cohort_size=3)
        assert set(out) == set(plain)
        for name in plain:
            assert torch.equal(out[name], plain[name].to(torch.float64)), name


@pytest.mark.parametrize(
    "kwargs", [{"momentum": 1.0}, {"momentum": -0.1}, {"momentum": 0.9, "server_lr": 0.0}]
)
def test_server_momentum_bad_values(kwargs):
    with pytest.raises(ValueError, match="server_momentum|server_lr"):
        ServerMomentum(get_rule("layerwise"), **kwargs)


# ----------------------------------------------------------------------------- engine path
def test_partial_replies_through_the_strategy(tmp_path, server_identity):
    layout = Layout([Group(p, "all", 2) for p in ALL])
    strategy = DPFedAvg(
        config=FLConfig(output_folder=str(tmp_path), aggregation="layerwise"), layout=layout
    )
    strategy.current_arrays = ArrayRecord({p: torch.zeros(2) for p in ALL})
    strategy.cohort, strategy.population = [0, 1, 2], 3
    replies = [make_reply(u.node_id, dict(u.delta), u.metrics) for u in _updates()]
    arrays, _ = strategy.aggregate_train(1, replies)
    new = arrays.to_torch_state_dict()
    assert new[_layer(1)].tolist() == pytest.approx([_mix({"A": 0.125, "B": 0.125, "C": 0.75})] * 2)
    assert new[_layer(12)].tolist() == [0.0, 0.0]  # nobody trained it: global value kept
    assert strategy.last_report.num_failed == 0


def test_replies_partial_only_when_allowed(server_identity):
    shapes = {p: (2,) for p in ALL}
    reply = make_reply(4, {BELOW: torch.zeros(2)}, {"num-examples": 1})
    with pytest.raises(ReplyRejected, match="missing"):
        parse_train_reply(reply, expected_shapes=shapes)
    assert set(parse_train_reply(reply, expected_shapes=shapes, allow_partial=True).delta) == {
        BELOW
    }
    extra = make_reply(4, {"not.a.param": torch.zeros(2)}, {"num-examples": 1})
    with pytest.raises(ReplyRejected, match="unexpected"):
        parse_train_reply(extra, expected_shapes=shapes, allow_partial=True)


@pytest.mark.parametrize("name", ["layerwise", "layerwise_samples", "fedavg_full", "momentum"])
def test_private_run_with_partial_aggregation_is_refused(tmp_path, name):
    rule = ServerMomentum(get_rule("layerwise"), momentum=0.9) if name == "momentum" else name
    cfg = FLConfig(output_folder=str(tmp_path), aggregation=rule, noise_multiplier=1.0, clip=1.0)
    with pytest.raises(ValueError, match="sensitivity does not hold|does not hold"):
        DPFedAvg(config=cfg, layout=Layout([Group(BELOW, "all", 2)]))


def test_client_partial_reply_carries_only_trained_tensors():
    from flwr.app import ConfigRecord, Context

    from speechbrain_fl.fl import train_round
    from speechbrain_fl.fl.toy import toy_client

    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    task = toy_client(context)
    task.partial = lambda brain: (["model.weight"], {"exit-depth": 3})
    params = {n: p.detach().clone() for n, p in task.brain.modules.named_parameters()}
    content = RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord({"round-seed": 1})})
    out = train_round(task, content)
    assert set(out["arrays"].keys()) == {"model.weight"}
    assert out["metrics"]["exit-depth"] == 3
