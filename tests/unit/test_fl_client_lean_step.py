"""The lean fp32 step (speechbrain_fl/fl/lean_step.py) against SpeechBrain's own
``Brain.fit_batch``: parameters and losses bit for bit over several rounds, the same hook calls,
SpeechBrain's non-finite patience, and SpeechBrain's ``fit_batch`` wherever the lean one does not
apply (the client's training path)."""

from __future__ import annotations

import math

import pytest
import speechbrain as sb
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from speechbrain_fl.fl import client_optimizer
from speechbrain_fl.fl import lean_step as lean_step_module
from speechbrain_fl.fl import local_fit as local_fit_module
from speechbrain_fl.fl.client import train_round
from speechbrain_fl.fl.lean_step import lean_fit_batch_applies
from speechbrain_fl.fl.params import trainable_state
from speechbrain_fl.fl.toy import ToyBrain, toy_client, toy_settings

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
}


class Recording(ToyBrain):
    """Records every hook SpeechBrain's fit_batch calls, with its arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def on_fit_batch_start(self, batch, should_step):
        self.calls.append(("start", self.step, should_step))

    def on_fit_batch_end(self, batch, outputs, loss, should_step):
        self.calls.append(("end", self.step, loss.item(), outputs.sum().item(), should_step))

    def on_stage_end(self, stage, stage_loss, epoch=None):
        self.calls.append(("stage_end", epoch, float(stage_loss), self.optimizer_step))


class OwnObjectives(Recording):
    """A Brain overriding compute_objectives (Huber loss plus a weight penalty)."""

    def compute_objectives(self, predictions, batch, stage):
        penalty = sum((p**2).sum() for p in self.modules.parameters())
        return torch.nn.functional.huber_loss(predictions, batch.y.data) + 1e-3 * penalty


def _client(cls=Recording, opt="adam", max_grad_norm=math.inf, **run_opts):
    context = Context(
        run_id=0, node_id=0, node_config={"partition-id": 2}, state=RecordDict(), run_config={}
    )
    client = toy_client(context, toy_settings())
    old = client.brain
    torch.manual_seed(0)
    client.brain = cls(
        modules={"model": torch.nn.Linear(4, 1)},
        opt_class=OPTIMIZERS[opt],
        run_opts={"device": "cpu", "noprogressbar": True, "max_grad_norm": max_grad_norm}
        | run_opts,
    )
    assert old.checkpointer is None
    return client


def _rounds(client, rounds=3):
    """Replies of ``rounds`` rounds from moving global parameters (2 local epochs each)."""
    params = trainable_state(client.brain.modules)
    out = []
    for server_round in range(1, rounds + 1):
        config = {"round-seed": 5 * server_round, "local-epochs": 2, "server-round": server_round}
        content = RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord(config)})
        reply = train_round(client, content, partition_id=2)
        delta = reply["arrays"].to_torch_state_dict()
        out.append((delta, float(reply["metrics"]["train-loss"])))
        params = {k: v + 0.5 * delta[k] for k, v in params.items()}
    return out


def _speechbrains(monkeypatch, client):
    """Replies with SpeechBrain's own fit_batch and optimizers_step (Brain.fit, no skips)."""
    with monkeypatch.context() as patch:
        patch.setattr(lean_step_module, "FIT_BATCH_RELEASES", ("no such release",))
        patch.setattr(client_optimizer, "_OPTIMIZERS_STEP_RELEASES", ("no such release",))
        assert not lean_fit_batch_applies(client.brain)
        client.lean_fit = False
        return _rounds(client)


def _same(got, expected):
    for (delta_a, loss_a), (delta_b, loss_b) in zip(got, expected, strict=True):
        assert loss_a == loss_b
        assert delta_a.keys() == delta_b.keys()
        assert all(torch.equal(delta_a[k], delta_b[k]) for k in delta_a)


@pytest.mark.parametrize("cls", [Recording, OwnObjectives])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("max_grad_norm", [math.inf, 0.05, 5.0])
def test_lean_step_equals_speechbrains_fit_batch(monkeypatch, cls, opt, max_grad_norm):
    reference = _client(cls, opt, max_grad_norm)
    expected = _speechbrains(monkeypatch, reference)
    steps = []
    real = lean_step_module.lean_fit_batch

    def counting(brain, batch):
        steps.append(brain.step)
        return real(brain, batch)

    monkeypatch.setattr(local_fit_module, "lean_fit_batch", counting)
    lean = _client(cls, opt, max_grad_norm)
    assert lean_fit_batch_applies(lean.brain)
    got = _rounds(lean)
    _same(got, expected)
    assert lean.brain.calls == reference.brain.calls  # hooks, arguments, order, losses
    assert len(steps) == 3 * 2 * 4  # rounds x epochs x batches, every one lean
    assert lean.brain.optimizer_step == reference.brain.optimizer_step == 3 * 2 * 4
    if max_grad_norm == 0.05:  # the bound was reached: clipping is at work in both
        assert not _same_as_unclipped(monkeypatch, cls, opt, expected)


def _same_as_unclipped(monkeypatch, cls, opt, expected):
    try:
        _same(_speechbrains(monkeypatch, _client(cls, opt, math.inf)), expected)
    except AssertionError:
        return False
    return True


def test_an_optimizer_step_limit_and_finite_check_of_its_own(monkeypatch):
    """A Brain's own check_loss_isfinite runs every step; optimizer_step_limit is kept."""

    class OwnCheck(Recording):
        def check_loss_isfinite(self, loss):
            self.calls.append(("check", loss.item()))
            super().check_loss_isfinite(loss)

    reference = _client(OwnCheck, "sgd")
    reference.brain.optimizer_step_limit = 10
    expected = _speechbrains(monkeypatch, reference)
    lean = _client(OwnCheck, "sgd")
    lean.brain.optimizer_step_limit = 10
    _same(_rounds(lean), expected)
    assert lean.brain.calls == reference.brain.calls
    assert sum(c[0] == "check" for c in lean.brain.calls) == 10


class SometimesNaN(Recording):
    """The loss value is NaN at the listed calls (0-based, counted over rounds); its gradient
    stays the loss's, so the parameters stay finite and training goes on."""

    nan_at = (1, 2, 9)

    def compute_objectives(self, predictions, batch, stage):
        loss = super().compute_objectives(predictions, batch, stage)
        count = getattr(self, "_count", 0)
        self._count = count + 1
        if count in self.nan_at:
            return loss + (torch.tensor(float("nan")) - loss).detach()
        return loss


def _nonfinite_run(monkeypatch, lean, patience):
    client = _client(SometimesNaN, "sgd", nonfinite_patience=patience)
    if not lean:
        return _speechbrains(monkeypatch, client), client
    assert lean_fit_batch_applies(client.brain)
    return _rounds(client), client


def test_nonfinite_patience_as_speechbrains(monkeypatch, caplog):
    # patience 5: the NaN steps are counted, warned about, and training goes on
    with caplog.at_level("WARNING"):
        expected, reference = _nonfinite_run(monkeypatch, False, 5)
    warnings = caplog.text.count("Patience not yet exhausted")
    caplog.clear()
    with caplog.at_level("WARNING"):
        got, lean = _nonfinite_run(monkeypatch, True, 5)
    assert caplog.text.count("Patience not yet exhausted") == warnings == 3
    assert lean.brain.nonfinite_count == reference.brain.nonfinite_count
    assert repr(lean.brain.calls) == repr(reference.brain.calls)  # NaN losses included
    _same(got, expected)  # SpeechBrain's running average leaves the NaN losses out, in both
    # patience 1: the second NaN of an epoch exhausts it, in both
    for lean_path in (False, True):
        with pytest.raises(ValueError, match="patience is exhausted"):
            _nonfinite_run(monkeypatch, lean_path, 1)


def test_fallbacks_run_speechbrains_fit_batch(monkeypatch):
    """An own fit_batch, AMP (bf16 on CPU), grad accumulation 2, DDP-like modules: no lean step."""

    def no_lean(brain, batch):
        raise AssertionError("the lean step ran where it does not apply")

    monkeypatch.setattr(local_fit_module, "lean_fit_batch", no_lean)
    speechbrains = []
    real = sb.Brain.fit_batch

    def counting(self, batch):
        speechbrains.append(self.step)
        return real(self, batch)

    monkeypatch.setattr(sb.Brain, "fit_batch", counting)

    own = []

    class OwnFitBatch(Recording):
        def fit_batch(self, batch):
            own.append(self.step)
            return sb.Brain.fit_batch(self, batch)

    cases = {
        "own fit_batch": _client(OwnFitBatch),
        "bf16": _client(precision="bf16"),
        "accumulation 2": _client(grad_accumulation_factor=2),
    }
    ddp = _client()
    ddp.brain.modules.model.require_backward_grad_sync = True  # what DDP wrapping adds
    cases["DDP-like"] = ddp
    for name, client in cases.items():
        assert not lean_fit_batch_applies(client.brain), name
        speechbrains.clear()
        _rounds(client, rounds=1)
        assert speechbrains == [1, 2, 3, 4] * 2, name  # SpeechBrain's, every step
    assert own == [1, 2, 3, 4] * 2
    accumulated = cases["accumulation 2"].brain
    assert accumulated.optimizer_step == 4  # every second step stepped: SpeechBrain's semantics


def test_an_instance_level_fit_batch_or_optimizers_step_is_kept():
    client = _client()
    assert lean_fit_batch_applies(client.brain)
    for name in ("fit_batch", "optimizers_step"):
        setattr(client.brain, name, getattr(client.brain, name))
        assert not lean_fit_batch_applies(client.brain), name
        delattr(client.brain, name)
    assert lean_fit_batch_applies(client.brain)


def test_epoch_start_zero_grad_runs_when_a_gradient_is_there(monkeypatch):
    """The per-epoch zero_grad is left out only where it does nothing: a gradient left by a
    hook is zeroed as by Brain.fit (else the first step would add it)."""

    class LeavesGradients(Recording):
        def on_stage_start(self, stage, epoch=None):
            for p in self.modules.parameters():
                p.grad = torch.ones_like(p)

    expected = _speechbrains(monkeypatch, _client(LeavesGradients, "sgd"))
    _same(_rounds(_client(LeavesGradients, "sgd")), expected)
    with pytest.raises(AssertionError):  # the comparison sees a skipped zero_grad
        monkeypatch.setattr(local_fit_module, "_zero_grad", lambda brain, set_to_none: None)
        _same(_rounds(_client(LeavesGradients, "sgd")), expected)


def test_a_brain_needing_brain_fit_steps_lean_inside_it(monkeypatch):
    """A Brain with its own on_fit_start (SUPERB's) runs Brain.fit; its steps are the lean
    ones, bit for bit SpeechBrain's, and its fit_batch is the class's again afterwards."""

    class OwnFitStart(Recording):
        def on_fit_start(self):
            self.calls.append(("fit_start", self.optimizer_step))
            super().on_fit_start()

    expected = _speechbrains(monkeypatch, reference := _client(OwnFitStart))
    steps = []
    real = lean_step_module.lean_fit_batch
    monkeypatch.setattr(
        local_fit_module, "lean_fit_batch", lambda b, x: (steps.append(b.step), real(b, x))[1]
    )
    lean = _client(OwnFitStart)
    assert not local_fit_module.lean_fit_applies(lean.brain) and lean_fit_batch_applies(lean.brain)
    _same(_rounds(lean), expected)
    assert lean.brain.calls == reference.brain.calls
    assert len(steps) == 3 * 2 * 4 and "fit_batch" not in lean.brain.__dict__
