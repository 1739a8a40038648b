"""Identity in deployment (issue 21, item 6): one node per partition, one data owner once.

Before: two SuperNodes both declaring ``partition-id=0`` were accepted silently ("2 connected,
K=2"): partition 1 never trained, and in a private run one data owner counted as two clients.
"""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.privacy import Group, Layout

from .strategy_toys import ScriptedGrid, make_reply

LAYOUT = Layout([Group("w", "all", 2)])


def _zero_reply(node, partition, server_round, arrays):
    return {k: torch.zeros_like(v) for k, v in arrays.items()}, {"num-examples": 1}


def _strategy(tmp_path, **config):
    cfg = FLConfig(output_folder=str(tmp_path), **config)
    return DPFedAvg(config=cfg, layout=LAYOUT, population_size=2)


PRIVATE = {"noise_multiplier": 1.0, "clip": 1.0, "sampling_rate": 1.0, "noise_seed": 1}


def test_a_partition_claimed_twice_is_refused_and_counted_once(tmp_path, server_identity, caplog):
    grid = ScriptedGrid(_zero_reply, partitions={100: 0, 101: 0, 102: 1})
    strategy = _strategy(tmp_path, **PRIVATE, sampler_seed=3)
    with caplog.at_level(logging.WARNING):
        strategy.learn_node_order(grid, timeout=1.0)
    assert "node 101: refused, partition-id=0 is already claimed by node 100" in caplog.text
    arrays = ArrayRecord({"w": torch.zeros(2)})
    messages = list(strategy.configure_train(1, arrays, {}, grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [100, 102]  # q=1: all but 101
    assert strategy.population == 2  # the data owner of partition 0 counts once
    replies = grid.send_and_receive(messages)
    replies.append(make_reply(101, {"w": torch.ones(2)}, {"num-examples": 1, "partition-id": 0}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
    assert "node 101: refused (partition-id=0 is already claimed by node 100), reply dropped" in (
        caplog.text
    )
    assert strategy.last_report.num_replied == 2


def test_a_reply_claiming_another_partition_than_its_query_answer_is_dropped(
    tmp_path, server_identity, caplog
):
    grid = ScriptedGrid(_zero_reply, partitions={100: 0, 101: 1})
    strategy = _strategy(tmp_path)
    strategy.learn_node_order(grid, timeout=1.0)
    messages = list(strategy.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), {}, grid))
    replies = grid.send_and_receive(messages)
    replies[1] = make_reply(101, {"w": torch.ones(2)}, {"num-examples": 1, "partition-id": 0})
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
    assert "node 101: partition-id=0 differs from the partition-id=1 it answered" in caplog.text
    assert strategy.last_report.num_dropped == 1


def test_node_partitions_binds_authenticated_nodes_to_partitions(tmp_path, server_identity, caplog):
    """A declared binding: an unenrolled node, or one answering another partition, is refused."""
    grid = ScriptedGrid(_zero_reply, partitions={100: 0, 101: 1, 555: 1})
    strategy = _strategy(tmp_path, node_partitions={"100": 0, 101: 1})
    with caplog.at_level(logging.WARNING):
        strategy.learn_node_order(grid, timeout=1.0)
    assert "node 555: refused, its node id is not in node_partitions" in caplog.text
    messages = list(strategy.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), {}, grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [100, 101]
    liar = ScriptedGrid(_zero_reply, partitions={100: 1})
    strategy = _strategy(tmp_path, node_partitions={100: 0, 101: 1})
    with caplog.at_level(logging.WARNING):
        strategy.learn_node_order(liar, timeout=1.0)
    assert "node 100: refused, it answered partition-id=1, but node_partitions binds it" in (
        caplog.text
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({0: 1, 1: 1}, "binds partitions \\[1\\] to more than one node"),
        ({"a": 1}, "non-integer entry"),
        ([1, 2], "must be a mapping"),
        ({3: -1}, "negative partition"),
    ],
)
def test_node_partitions_is_checked(tmp_path, value, message):
    with pytest.raises(ValueError, match=f"federated config: node_partitions=.*{message}"):
        FLConfig(output_folder=str(tmp_path), node_partitions=value)
