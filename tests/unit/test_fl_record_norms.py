"""A run without clipping (FedAvg) still records its clients' update norms (``record_norms``).

The strategy sends the layout's group and component names without budgets; the client measures
its update's norms, clips nothing (the update is bit-identical to a round that measured
nothing), and the strategy averages the norms into the round report (Fig. 2 for every run).
"""

import json

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from speechbrain_fl.fl import DPFedAvg, FLConfig, train_round
from speechbrain_fl.fl.toy import toy_client, toy_settings
from speechbrain_fl.privacy import Group, Layout

LAYOUT = Layout([Group("model.weight", "all", 4), Group("model.bias", "all", 1)])


@pytest.fixture(autouse=True)
def _server_identity():
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _task():
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    return toy_client(context, toy_settings(overrides={"lr": 0.5}))


def _round(task, extra):
    start = {n: p.detach().clone() for n, p in task.brain.modules.named_parameters()}
    config = ConfigRecord({"server-round": 1, "local-epochs": 1, "round-seed": 3, **extra})
    content = RecordDict({"arrays": ArrayRecord(start), "config": config})
    return train_round(task, content, partition_id=0)


def test_client_measures_norms_without_clipping():
    task = _task()
    plain = _round(task, {})
    measured = _round(
        task,
        {
            "clip-groups": json.dumps(list(LAYOUT.names)),
            "clip-components": json.dumps(list(LAYOUT.components)),
        },
    )
    a, b = plain["arrays"].to_torch_state_dict(), measured["arrays"].to_torch_state_dict()
    for name in a:
        assert torch.equal(a[name], b[name])  # nothing clipped
    assert "group-norms" not in plain["metrics"]
    norms = measured["metrics"]["group-norms"]
    assert norms[0] == pytest.approx(float(a["model.weight"].norm()), rel=1e-6)
    assert norms[1] == pytest.approx(float(a["model.bias"].norm()), rel=1e-6)
    assert measured["metrics"]["group-clipped"] == [0.0, 0.0]
    assert measured["metrics"]["clip-ratio"] == 1.0


def _reply(node, delta, metrics):
    out = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    content = RecordDict({"arrays": ArrayRecord(delta), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=out)


@pytest.mark.parametrize("record", [True, False])
def test_fedavg_strategy_records_norms_only_when_asked(tmp_path, record):
    strategy = DPFedAvg(
        config=FLConfig(output_folder=str(tmp_path), record_norms=record), layout=LAYOUT
    )
    zeros = {"model.weight": torch.zeros(1, 4), "model.bias": torch.zeros(1)}
    strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in zeros.items()})
    strategy.cohort, strategy.population = [1, 2], 2
    ones = {k: torch.ones_like(v) for k, v in zeros.items()}
    stats = {"group-clipped": [0.0, 0.0], "component-norms": [0.0], "joint-norm": 0.0}
    replies = [
        _reply(1, zeros, {"num-examples": 1, "group-norms": [0.0, 0.0], **stats}),
        _reply(2, ones, {"num-examples": 3, "group-norms": [2.0, 1.0], **stats}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    # FedAvg's weighted mean is unchanged by the measuring
    assert torch.allclose(arrays.to_torch_state_dict()["model.weight"], torch.full((1, 4), 0.75))
    report = strategy.last_report
    if record:
        assert report.group_norms == {"model.weight": 1.0, "model.bias": 0.5}
        assert report.group_budgets == {} and report.component_budgets == {}
    else:
        assert report.group_norms == {}
