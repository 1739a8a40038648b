"""A bad reply among good ones: the same drop, the same log line, the same aggregate.

Each case is checked, DP and not, against a round made of the good replies only
(``torch.equal``) and against the reason the decoding's finiteness check gives, including a
reply that also breaks a metric or a claim (the tensor is named first).
"""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.fl.npy_codec import encode_record
from speechbrain_fl.fl.serverapp.replies import ReplyRejected, parse_train_reply
from speechbrain_fl.privacy import Group, Layout

SHAPES = {"a.weight": (40, 30), "a.bias": (40,), "b.weight": (3, 40)}
LAYOUT = Layout([Group(n, "all", int(torch.Size(s).numel())) for n, s in SHAPES.items()])
GOOD = {"num-examples": 8, "train-loss": 0.5}


@pytest.fixture(autouse=True)
def _server_identity(server_identity):
    """Messages are made as in a ServerApp (tests/unit/conftest.py)."""


def _delta(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {n: (0.05 * torch.randn(s, generator=gen)).to(dtype) for n, s in SHAPES.items()}


def _reply(node, delta, metrics):
    out = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    content = RecordDict({"arrays": encode_record(delta), "metrics": MetricRecord(metrics)})
    reply = Message(content, reply_to=out)
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


def _poisoned(value, name="a.bias", dtype=torch.float32):
    delta = _delta(9, dtype)
    delta[name].view(-1)[3] = value
    return delta


BAD = {
    "NaN": (_poisoned(float("nan")), GOOD, "tensor 'a.bias' has non-finite values"),
    "inf": (_poisoned(float("inf"), "b.weight"), GOOD, "tensor 'b.weight' has non-finite values"),
    "-inf in the first tensor": (
        _poisoned(-float("inf"), "a.weight"),
        GOOD,
        "tensor 'a.weight' has non-finite values",
    ),
    "wrong shape": (
        {**_delta(9), "a.bias": torch.zeros(41)},
        GOOD,
        "tensor 'a.bias' has shape (41,), expected (40,)",
    ),
    "NaN and a bad metric": (
        _poisoned(float("nan")),
        {**GOOD, "train-loss": [1.0]},
        "tensor 'a.bias' has non-finite values",
    ),
    "NaN and a bad claim": (
        _poisoned(float("nan")),
        {**GOOD, "num-examples": 2.5},
        "tensor 'a.bias' has non-finite values",
    ),
    "float64 inf beyond the model's float32": (
        _poisoned(float("inf"), dtype=torch.float64),
        GOOD,
        "tensor 'a.bias' has non-finite values",
    ),
    "a bad metric only": (_delta(9), {**GOOD, "train-loss": [1.0]}, "metric 'train-loss'"),
    # node 99 answered partition-id 5 to the server's query (below)
    "NaN and another partition-id": (
        _poisoned(float("nan")),
        {**GOOD, "partition-id": 6},
        "tensor 'a.bias' has non-finite values",
    ),
    "another partition-id only": (
        _delta(9),
        {**GOOD, "partition-id": 6},
        "partition-id=6 differs from the partition-id=5",
    ),
}


def _strategy(tmp_path, private):
    settings = (
        {"noise_multiplier": 1.0, "clip": 0.1, "noise_seed": 3, "sampler_seed": 1}
        if private
        else {}
    )
    cfg = FLConfig(output_folder=str(tmp_path), population_size=10, sampling_rate=0.4, **settings)
    strategy = DPFedAvg(config=cfg, layout=LAYOUT)
    strategy.node_order = {10: 0, 11: 1, 12: 2, 99: 5}  # the partition-ids of the query
    strategy.current_arrays = ArrayRecord({n: torch.zeros(s) for n, s in SHAPES.items()})
    return strategy


def _aggregate(strategy, replies, nodes):
    strategy.cohort, strategy.population = list(nodes), 10
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict()


@pytest.mark.parametrize("private", [False, True], ids=["no DP", "DP"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_reply_is_dropped_as_before(tmp_path, caplog, private, case):
    delta, metrics, reason = BAD[case]
    good = [_reply(10 + i, _delta(i), {**GOOD, "partition-id": i}) for i in range(3)]
    bad = _reply(99, delta, {"partition-id": 5, **metrics})
    with caplog.at_level(logging.WARNING):
        got = _aggregate(_strategy(tmp_path / "a", private), [good[1], bad, good[0], good[2]],
                         [10, 11, 12, 99])  # fmt: skip
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].startswith(f"round 1: dropped node 99: {reason}")
    if "partition-id" not in reason:  # the decoding's own reason (what the round logged before)
        with pytest.raises(ReplyRejected) as rejected:
            parse_train_reply(bad, expected_shapes=SHAPES)
        assert dropped == [f"round 1: dropped {rejected.value.args[0]}"]
    expected = _aggregate(_strategy(tmp_path / "b", private), good, [10, 11, 12, 99])
    assert list(got) == list(expected)
    assert all(torch.equal(got[n], expected[n]) for n in got)
