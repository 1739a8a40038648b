"""The local backend's message copy and process-state restore (fl/engines/local_grid.py).

A client that edits its message must not change what the server or the next client sees; a
client that draws from or reseeds the process RNGs, or changes torch's thread count, must leave
the server's streams as they were.
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from speechbrain_fl.fl.engines.local_grid import LocalGrid
from speechbrain_fl.fl.npy_codec import encode_record

TENSORS = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}


def _content() -> RecordDict:
    config = ConfigRecord(
        {
            "server-round": 3,
            "lr": 0.5,
            "groups": json.dumps(["w", "b"]),
            "ids": [1, 2, 3],
            "blob": b"\x00\x01",
            "flag": True,
        }  # fmt: skip
    )
    return RecordDict({"arrays": encode_record(TENSORS), "config": config})


def _mutating_app(seen: list) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg, context):
        arrays, config = msg.content["arrays"], msg.content["config"]
        seen.append((dict(config), {k: a.data for k, a in arrays.items()}, list(config["ids"])))
        arrays["w"].data = b"tampered"  # the Array object itself
        arrays["w"].shape = (0,)
        del arrays["b"]
        config["lr"] = 99.0
        config["ids"].append(4)  # a list inside the ConfigRecord
        msg.content["extra"] = MetricRecord({"x": 1.0})
        msg.metadata.group_id = "changed"
        return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=msg)

    return app


def test_a_client_that_mutates_its_message_changes_nothing_the_server_or_the_next_sees():
    seen: list = []
    grid = LocalGrid(_mutating_app(seen), num_nodes=3)
    with grid.identity():
        content = _content()
        shared_arrays = content["arrays"]  # the strategy's current_arrays is this object
        before = {k: (a.data, a.shape) for k, a in shared_arrays.items()}
        messages = [Message(content, n, "train", group_id="3") for n in grid.get_node_ids()]
        replies = grid.send_and_receive(messages)
    assert len(replies) == 3 and not any(r.has_error() for r in replies)
    assert all(s == seen[0] for s in seen)  # every client saw the server's message
    assert seen[0][0]["lr"] == 0.5 and seen[0][2] == [1, 2, 3]
    assert set(seen[0][1]) == {"w", "b"}
    assert {k: (a.data, a.shape) for k, a in shared_arrays.items()} == before
    assert content["config"]["lr"] == 0.5 and content["config"]["ids"] == [1, 2, 3]
    assert set(content) == {"arrays", "config"}
    assert all(m.metadata.group_id == "3" for m in messages)


def _rng_app(seen: list) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg, context):
        seen.append((torch.rand(2), np.random.random(2), random.random()))
        torch.manual_seed(int(context.node_config["partition-id"]))
        np.random.seed(7)
        random.seed(7)
        np.random.standard_normal(3)  # leaves NumPy's cached Gaussian set
        torch.set_num_threads(1)
        if int(context.node_config["partition-id"]) == 1:
            raise RuntimeError("boom")
        return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=msg)

    return app


def test_clients_start_from_the_server_rng_states_and_leave_them_unchanged():
    seen: list = []
    grid = LocalGrid(_rng_app(seen), num_nodes=3)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    np.random.standard_normal(1)  # a cached Gaussian on the server side too
    with grid.identity():
        messages = [Message(RecordDict(), n, "train") for n in grid.get_node_ids()]
        states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        replies = grid.send_and_receive(messages)
        after = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    assert torch.equal(states[0], after[0])
    assert all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(states[1], after[1], strict=True)
    )
    assert states[2] == after[2] and torch.get_num_threads() == threads
    # every client's first draws are the server's next ones (the state it called with)
    expected = (torch.rand(2), np.random.random(2), random.random())
    for draws in seen:
        assert torch.equal(draws[0], expected[0]) and np.array_equal(draws[1], expected[1])
        assert draws[2] == expected[2]
    errors = [r for r in replies if r.has_error()]  # the raising client is an error reply
    assert len(replies) == 3 and len(errors) == 1
    assert errors[0].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "boom" in errors[0].error.reason


def test_a_client_changing_run_config_is_an_error_reply():
    app = ClientApp()

    @app.train()
    def train(msg, context):
        context.run_config["lr"] = 1.0
        return Message(RecordDict(), reply_to=msg)

    grid = LocalGrid(app, num_nodes=1)
    with grid.identity():
        (reply,) = grid.send_and_receive([Message(RecordDict(), n, "train") for n in grid.contexts])
    assert reply.has_error() and "run_config" in reply.error.reason


def test_process_state_falls_back_to_numpys_own_state_form(monkeypatch):
    from speechbrain_fl.fl.engines.local_grid import _ProcessState

    np.random.seed(3)
    expected = np.random.random(4)
    np.random.seed(3)
    saved = _ProcessState()
    original = np.random.set_state

    def strict(state):  # a NumPy that accepts only an ndarray key
        if not isinstance(state[1], np.ndarray):
            raise TypeError("key must be an ndarray")
        original(state)

    monkeypatch.setattr(np.random, "set_state", strict)
    for _ in range(2):
        np.random.seed(99)
        saved.restore()
        assert np.array_equal(np.random.random(4), expected)
    assert saved._numpy_fast is None
