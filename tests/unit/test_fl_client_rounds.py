"""Per-round client bookkeeping kept across rounds changes no reply: the parameter index
(speechbrain_fl/fl/params.py:ParameterIndex) follows every change of the module's structure,
and a client reused over rounds replies bit for bit what a freshly built client replies."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from speechbrain_fl.fl.clientapp.train import train_round
from speechbrain_fl.fl.params import ParameterIndex, trainable_parameters, trainable_state
from speechbrain_fl.fl.toy import toy_client, toy_settings


def _check(index, net):
    trainable, params = index.get()
    expected = trainable_parameters(net)
    assert list(trainable) == list(expected)
    assert all(trainable[k] is expected[k] for k in expected)
    assert [id(p) for p in params] == [id(p) for p in net.parameters()]
    return trainable


def test_parameter_index_follows_the_structure():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    index = ParameterIndex(net)
    first = _check(index, net)
    assert index.get()[0] is first  # unchanged: not listed again
    changes = [
        lambda: net[0].bias.requires_grad_(False),  # frozen
        lambda: net[0].bias.requires_grad_(True),  # unfrozen
        lambda: setattr(net[2], "weight", torch.nn.Parameter(torch.zeros(2, 4))),  # replaced
        lambda: net.append(torch.nn.Linear(2, 1)),  # a submodule added
        lambda: net.__setitem__(1, torch.nn.Tanh()),  # a submodule replaced
        lambda: setattr(net[1], "scale", torch.nn.Parameter(torch.ones(1))),  # parameter added
        lambda: net[0].register_parameter("bias", None),  # parameter removed
        lambda: net.__delitem__(3),  # a submodule removed
    ]
    for change in changes:
        before = index.get()[0]
        change()
        after = _check(index, net)
        assert after is not before
        assert index.get()[0] is after


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
}


def _client(opt):
    context = Context(
        run_id=0, node_id=0, node_config={"partition-id": 1}, state=RecordDict(), run_config={}
    )
    client = toy_client(context, toy_settings())
    client.brain.opt_class = OPTIMIZERS[opt]
    return client


def _content(params, server_round, dp):
    config = {"round-seed": 3 * server_round, "local-epochs": 2, "server-round": server_round}
    if dp:
        names = sorted(params)
        config["clip-budgets"] = json.dumps(0.05)  # small: the clip is at work
        config["clip-groups"] = json.dumps(names)
        config["clip-components"] = json.dumps(["all"] * len(names))
    return RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord(config)})


@pytest.mark.parametrize("dp", [False, True])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_reused_client_replies_what_a_fresh_client_replies(opt, dp):
    reused = _client(opt)
    params = trainable_state(reused.brain.modules)
    clipped = []
    for server_round in (1, 2, 3):
        content = _content(params, server_round, dp)
        got = train_round(reused, content, partition_id=1)
        expected = train_round(_client(opt), content, partition_id=1)
        a, b = got["arrays"].to_torch_state_dict(), expected["arrays"].to_torch_state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert dict(got["metrics"]) == dict(expected["metrics"])
        if dp:
            clipped.append(got["metrics"]["clip-ratio"])
        # the reused model is back at this round's global parameters
        assert all(torch.equal(p, params[n]) for n, p in reused._index.get()[0].items())
        params = {k: v + a[k] for k, v in params.items()}
    assert reused._index is not None and reused.brain.optimizer is not None
    if dp:
        assert all(0 < c < 1 for c in clipped)  # the clip scaled every update
