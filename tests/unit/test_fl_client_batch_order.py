"""Each client draws a fresh batch order every round (speechbrain_fl/fl/clientapp/train.py):
SpeechBrain's ``ReproducibleRandomSampler`` shuffles with ``seed + epoch`` and a round runs
epochs 1..E, so without a per-round seed a client would see the same order every round, and two
clients with as many examples one permutation. The order is still a function of the run's seed."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from speechbrain.dataio.batch import PaddedBatch

from speechbrain_fl.fl.clientapp.train import ClientTask, train_round
from speechbrain_fl.fl.params import trainable_state
from speechbrain_fl.fl.toy import ToyBrain


class _Recording(torch.utils.data.Dataset):
    """Examples ``{"x", "y"}`` that record the order they are read in."""

    def __init__(self, count: int):
        self.x = torch.arange(count * 4, dtype=torch.float32).reshape(count, 4) / count
        self.y = self.x.sum(dim=1, keepdim=True)
        self.read: list[int] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(int(i))
        return {"x": self.x[i], "y": self.y[i]}


def _client(count=12):
    torch.manual_seed(0)
    brain = ToyBrain(
        modules={"model": torch.nn.Linear(4, 1)},
        opt_class=lambda params: torch.optim.SGD(params, lr=0.01),
        run_opts={"device": "cpu", "noprogressbar": True},
    )
    kwargs = {"batch_size": 3, "shuffle": True, "collate_fn": PaddedBatch}
    return ClientTask(brain=brain, train_set=_Recording(count), train_loader_kwargs=kwargs)


def _order(client, *, server_round, partition_id, round_seed=None):
    """The indices ``client`` read in one round of two local epochs."""
    params = trainable_state(client.brain.modules)
    seed = 1000 + server_round if round_seed is None else round_seed
    config = {"round-seed": seed, "local-epochs": 2, "server-round": server_round}
    content = RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord(config)})
    client.train_set.read = []
    train_round(client, content, partition_id=partition_id)
    return list(client.train_set.read)


def test_two_rounds_of_one_client_see_different_orders():
    client = _client()
    first = _order(client, server_round=1, partition_id=2)
    second = _order(client, server_round=2, partition_id=2)
    assert sorted(first) == sorted(second) == sorted(list(range(12)) * 2)
    assert first != second


def test_two_clients_of_equal_size_see_different_orders():
    a = _order(_client(), server_round=1, partition_id=0)
    b = _order(_client(), server_round=1, partition_id=1)
    assert a != b


def test_the_epochs_of_a_round_differ():
    order = _order(_client(), server_round=1, partition_id=0)
    assert order[:12] != order[12:]


def test_same_seed_same_orders():
    client = _client()
    got = [_order(client, server_round=r, partition_id=3) for r in (1, 2, 3)]
    expected = [_order(_client(), server_round=r, partition_id=3) for r in (1, 2, 3)]
    assert got == expected
    other = _order(_client(), server_round=1, partition_id=3, round_seed=7)
    assert other != got[0]  # the round seed (from the run's seed) decides the order
