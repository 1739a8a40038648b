"""A client round steps with SpeechBrain's own ``Brain.optimizers_step``: its per-step
``clip_grad_norm_`` to ``max_grad_norm`` every step, a Brain's own ``optimizers_step`` kept."""

from __future__ import annotations

import math

import pytest
import speechbrain as sb
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from speechbrain_fl.fl.clientapp.train import train_round
from speechbrain_fl.fl.params import trainable_state
from speechbrain_fl.fl.toy import toy_client, toy_settings


def _client(max_grad_norm: float, adam: bool = True):
    context = Context(
        run_id=0, node_id=0, node_config={"partition-id": 1}, state=RecordDict(), run_config={}
    )
    client = toy_client(context, toy_settings())
    if adam:
        client.brain.opt_class = lambda params: torch.optim.Adam(params, lr=0.05)
    client.brain.max_grad_norm = max_grad_norm
    return client


def _rounds(client):
    start = trainable_state(client.brain.modules)
    out = []
    for server_round, params in ((1, start), (2, {k: v + 0.1 for k, v in start.items()})):
        config = {"round-seed": 7 * server_round, "local-epochs": 2, "server-round": server_round}
        content = RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord(config)})
        reply = train_round(client, content, partition_id=1)
        out.append((reply["arrays"].to_torch_state_dict(), float(reply["metrics"]["train-loss"])))
    return out


@pytest.fixture
def clip_calls(monkeypatch):
    """Count SpeechBrain's per-step ``torch.nn.utils.clip_grad_norm_`` calls."""
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def counting(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("max_norm"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", counting)
    return calls


@pytest.mark.parametrize("adam", [True, False])
def test_an_infinite_bound_steps_alike_every_round(clip_calls, adam):
    """``max_grad_norm: inf``: SpeechBrain's clip runs (a multiplication by 1); a second client
    replies the same, bit for bit."""
    expected = _rounds(_client(math.inf, adam))
    calls = len(clip_calls)
    assert calls == 2 * 2 * 4 and all(math.isinf(c) for c in clip_calls)
    client = _client(math.inf, adam)
    got = _rounds(client)
    assert len(clip_calls) == 2 * calls
    for (update_a, loss_a), (update_b, loss_b) in zip(got, expected, strict=True):
        assert loss_a == loss_b
        assert all(torch.equal(update_a[k], update_b[k]) for k in update_a)
    assert client.brain.optimizer_step == 2 * 2 * 4  # rounds x epochs x batches, counted


def test_a_finite_bound_still_clips_every_step(clip_calls):
    _rounds(_client(0.01))
    assert clip_calls == [0.01] * (2 * 2 * 4)


def test_a_brain_with_its_own_optimizers_step_keeps_it(clip_calls):
    own = []

    class Own(type(_client(math.inf).brain)):
        def optimizers_step(self):
            own.append(self.step)
            sb.Brain.optimizers_step(self)

    client = _client(math.inf)
    client.brain.__class__ = Own
    _rounds(client)
    assert len(own) == len(clip_calls) == 2 * 2 * 4
