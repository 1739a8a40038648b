"""A client's reply is what SpeechBrain and Flower would make of the round, byte for byte
(speechbrain_fl/fl/clientapp/train.py:train_round, npy_codec.encode_record, params.load_trainable):
the reference below trains with ``brain.fit`` on SpeechBrain's own ``PaddedBatch``
loader, loads with ``param.copy_``, subtracts, clips with a copy (``inplace=False``) and wraps
the result in ``ArrayRecord(delta)`` and ``MetricRecord(metrics)``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import speechbrain as sb
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from speechbrain.dataio.batch import PaddedBatch

from speechbrain_fl.fl import npy_codec
from speechbrain_fl.fl.clientapp.train import _client_metrics, _record_stage_end, train_round
from speechbrain_fl.fl.params import load_trainable, trainable_state
from speechbrain_fl.fl.toy import toy_client, toy_settings
from speechbrain_fl.privacy import clip_update


def _client(pid=1):
    context = Context(
        run_id=0, node_id=0, node_config={"partition-id": pid}, state=RecordDict(), run_config={}
    )
    return toy_client(context, toy_settings())


def _config(names, server_round, clip):
    config = {"round-seed": 7 * server_round, "local-epochs": 2, "server-round": server_round}
    if clip is not None:
        config["clip-budgets"] = json.dumps(clip)
        config["clip-groups"] = json.dumps(names)
        config["clip-components"] = json.dumps(["all"] * len(names))
    return config


def _reference(global_params, config, pid=1):
    """The round as SpeechBrain's fit and Flower's records make it (a fresh client)."""
    client = _client(pid)
    brain = client.brain
    with torch.no_grad():
        for name, param in brain.modules.named_parameters():
            param.copy_(global_params[name])
    torch.manual_seed(int(config["round-seed"]) + pid)
    loader = brain.make_dataloader(
        client.train_set, stage=sb.Stage.TRAIN, **client.train_loader_kwargs
    )
    assert loader.collate_fn is PaddedBatch
    # the round's order: the sampler's seed mixed with the round seed and the partition
    sampler = brain.train_sampler
    entropy = [sampler.seed, int(config["round-seed"]), pid]
    sampler.seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
    with _record_stage_end(brain) as records:
        brain.fit(range(1, int(config["local-epochs"]) + 1), loader, progressbar=False)
    params = dict(brain.modules.named_parameters())
    delta = {n: params[n].detach() - v for n, v in global_params.items()}
    metrics = {"num-examples": len(client.train_set), "train-loss": records[-1][1]}
    if "clip-budgets" in config:
        delta, stats = clip_update(delta, json.loads(config["clip-budgets"]), inplace=False)
        groups = json.loads(config["clip-groups"])
        metrics.update(_client_metrics(stats, groups, json.loads(config["clip-components"])))
    return ArrayRecord(delta), MetricRecord(metrics)


@pytest.mark.parametrize("clip", [None, 0.02, 1e300])
def test_reply_is_speechbrains_round_in_flowers_records(clip):
    client = _client()
    global_params = trainable_state(client.brain.modules)
    names = list(global_params)
    for server_round in (1, 2, 3):
        config = _config(names, server_round, clip)
        content = RecordDict({"arrays": ArrayRecord(global_params), "config": ConfigRecord(config)})
        reply = train_round(client, content, partition_id=1)
        arrays, metrics = _reference(global_params, config)
        assert list(reply["arrays"]) == list(arrays)
        for name in arrays:
            assert vars(reply["arrays"][name]) == vars(arrays[name]), name
        assert reply["arrays"].object_id == arrays.object_id  # what a Grid sends
        assert dict(reply["metrics"]) == dict(metrics)
        assert reply["metrics"].object_id == metrics.object_id
        if clip == 0.02:
            assert 0 < reply["metrics"]["clip-ratio"] < 1  # the clip was at work
        # the model is back at the round's global parameters
        for name, param in client.brain.modules.named_parameters():
            assert torch.equal(param, global_params[name])
        delta = reply["arrays"].to_torch_state_dict()
        global_params = {k: v + delta[k] for k, v in global_params.items()}


def test_the_model_is_reset_when_the_round_fails():
    client = _client()
    global_params = trainable_state(client.brain.modules)
    names = list(global_params)
    config = _config(names, 1, 0.1)
    config["clip-components"] = "not json"
    content = RecordDict({"arrays": ArrayRecord(global_params), "config": ConfigRecord(config)})
    with pytest.raises(json.JSONDecodeError):
        train_round(client, content, partition_id=1)
    for name, param in client.brain.modules.named_parameters():
        assert torch.equal(param, global_params[name])


@pytest.mark.parametrize("direct", [True, False])
def test_encode_record_is_array_record(monkeypatch, direct):
    assert npy_codec._DIRECT_RECORD  # Flower 1.42: the record is filled directly
    monkeypatch.setattr(npy_codec, "_DIRECT_RECORD", direct)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(5, 3, generator=gen),
        "b": torch.randn(3, generator=gen).double(),
        "i": torch.arange(4),
        "t": torch.randn(3, 2, generator=gen).t(),  # Flower's own encoder
    }
    ours, flowers = npy_codec.encode_record(tensors), ArrayRecord(tensors)
    assert list(vars(ours)) == list(vars(flowers))
    assert list(ours) == list(flowers)
    assert all(vars(ours[k]) == vars(flowers[k]) for k in tensors)
    assert ours.object_id == flowers.object_id
    with pytest.raises(TypeError):  # Flower's own key check
        npy_codec.encode_record({1: torch.ones(2)})


def test_load_trainable_one_call_is_the_copies():
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = {n: torch.randn(p.shape, generator=gen) for n, p in net.named_parameters()}
    load_trainable(net, state)
    assert all(torch.equal(p, state[n]) for n, p in net.named_parameters())
    wide = {n: v.double() * 3 for n, v in state.items()}  # converted, as param.copy_(v.to())
    load_trainable(net, wide)
    assert all(torch.equal(p, wide[n].float()) for n, p in net.named_parameters())
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    bad = dict(state, **{"1.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"1.bias: shape \(3,\) != \(2,\)"):
        load_trainable(net, bad)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())  # nothing copied
    with pytest.raises(ValueError, match="unexpected"):
        load_trainable(net, {"2.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing \['0.bias'\]"):
        load_trainable(net, {k: v for k, v in state.items() if k != "0.bias"}, strict=True)
