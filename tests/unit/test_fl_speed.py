"""Speed cuts keep results: the accountant's cached epsilon equals Opacus's (computed once per
distinct value); every client round starts from a fresh optimiser (SpeechBrain's
``init_optimizers``, called by ``Brain.fit``); the direct PaddedBatch build equals SpeechBrain's;
the server's in-place weighted sum equals the allocating formula."""

import pytest
from opacus.accountants import RDPAccountant

from speechbrain_fl.privacy import accounting
from speechbrain_fl.privacy.accounting import PrivacyAccountant, compute_epsilon


@pytest.mark.parametrize(
    ("q", "sigma", "rounds"), [(0.5, 1.0, 10), (0.04, 1.5, 2250), (1.0, 0.7, 3), (0.01, 3.0, 1)]
)
def test_cached_rdp_epsilon_equals_opacus(q, sigma, rounds):
    opacus = RDPAccountant()
    opacus.history = [(sigma, q, rounds)]
    expected = opacus.get_epsilon(delta=1e-5)
    got = compute_epsilon(
        sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=1e-5, accountant="rdp"
    )
    assert got == expected  # the same arithmetic, not an approximation


def test_epsilon_computed_once_per_round():
    accounting._epsilon.cache_clear()
    accounting._rdp_per_step.cache_clear()
    acc = PrivacyAccountant(sampling_rate=0.3, noise_multiplier=1.1, delta=1e-6, accountant="rdp")
    values = []
    for _ in range(5):
        acc.step(1)
        values += [acc.epsilon(), acc.epsilon(), acc.epsilon_after(1)]
    info = accounting._epsilon.cache_info()
    assert info.misses == 6  # rounds 1..5 and the look-ahead to 6
    assert accounting._rdp_per_step.cache_info().misses == 1
    assert values == sorted(values) and values[-2] > values[0] > 0


def test_prv_accountant_not_cached_wrongly():
    a = compute_epsilon(
        sampling_rate=0.5, noise_multiplier=1.0, rounds=10, delta=1e-5, accountant="prv"
    )
    b = compute_epsilon(
        sampling_rate=0.5, noise_multiplier=1.0, rounds=10, delta=1e-5, accountant="rdp"
    )
    assert a != b and abs(a - b) / b < 0.2  # PRV and RDP: different bounds, same ballpark


def _pld_accountant_epsilon(q, sigma, rounds, delta, interval):
    """dp-accounting's PLDAccountant on the event the guarantee composes (no cache)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=interval,
    )
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc.compose(dp_accounting.SelfComposedDpEvent(step, rounds))
    return float(acc.get_epsilon(delta))


def test_cached_pld_epsilon_equals_the_accountant_and_builds_one_step_once():
    accounting._epsilon.cache_clear()
    accounting._pld_one_step.cache_clear()
    q, sigma, delta = 0.5, 2.0, 1e-5
    got = [
        compute_epsilon(sampling_rate=q, noise_multiplier=sigma, rounds=t, delta=delta)
        for t in (1, 2, 3)
    ]
    intervals = [  # the grid compute_epsilon picks for each T (accounting.pld_interval)
        accounting.pld_interval(
            compute_epsilon(
                sampling_rate=q, noise_multiplier=sigma, rounds=t, delta=delta, accountant="rdp"
            )
        )
        for t in (1, 2, 3)
    ]
    expected = [
        _pld_accountant_epsilon(q, sigma, t, delta, h)
        for t, h in zip((1, 2, 3), intervals, strict=True)
    ]
    assert got == expected  # the same objects and calls: the same floats
    # one build per distinct grid, not per round (T = 1 on the default grid, 2 and 3 wider)
    assert accounting._pld_one_step.cache_info().misses == len(set(intervals))
    assert got == sorted(got) and got[0] > 0


# --- the client's steady state: optimiser and DataLoader reused, nothing carried between rounds


def _adam_client(pid: int = 0):
    """A toy client with a stateful optimiser (Adam moments, step counts)."""
    import torch

    from speechbrain_fl.fl.toy import toy_client, toy_settings

    client = toy_client(_context(pid), toy_settings())
    client.brain.opt_class = lambda params: torch.optim.Adam(params, lr=0.05)
    return client


def _context(pid: int):
    from flwr.app import Context, RecordDict

    return Context(
        run_id=0, node_id=0, node_config={"partition-id": pid}, state=RecordDict(), run_config={}
    )


def _message(params, server_round: int):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    config = {"round-seed": 11 * server_round, "local-epochs": 2, "server-round": server_round}
    return RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord(config)})


def _update(reply):
    return reply["arrays"].to_torch_state_dict()


def test_round_update_does_not_depend_on_the_previous_rounds_optimiser_state():
    import torch

    from speechbrain_fl.fl.clientapp.train import train_round
    from speechbrain_fl.fl.params import trainable_state

    fresh, used = _adam_client(), _adam_client()
    start = trainable_state(used.brain.modules)
    other = {k: v + 0.3 for k, v in start.items()}
    train_round(used, _message(other, 1), partition_id=0)  # round r elsewhere in weight space
    optimizer = used.brain.optimizer
    assert optimizer.state  # Adam moments were built in round r
    loader = used._loader[0]
    second = _update(train_round(used, _message(start, 2), partition_id=0))
    assert used.brain.optimizer is not optimizer and used._loader[0] is loader  # loader reused
    expected = _update(train_round(fresh, _message(start, 2), partition_id=0))
    for name, value in expected.items():
        assert torch.equal(second[name], value), name  # round r+1 as from a fresh optimiser


def test_hyperparameters_changed_during_a_round_are_put_back():
    import torch

    from speechbrain_fl.fl.clientapp.train import train_round
    from speechbrain_fl.fl.params import trainable_state

    client = _adam_client()
    start = trainable_state(client.brain.modules)
    train_round(client, _message(start, 1), partition_id=0)
    client.brain.optimizer.param_groups[0]["lr"] = 123.0  # e.g. a scheduler inside a round
    client.brain.optimizer.param_groups[0]["betas"] = (0.1, 0.2)
    again = _update(train_round(client, _message(start, 2), partition_id=0))
    assert client.brain.optimizer.param_groups[0]["lr"] == 0.05
    expected = _update(train_round(_adam_client(), _message(start, 2), partition_id=0))
    assert all(torch.equal(again[k], v) for k, v in expected.items())


def test_an_overridden_init_optimizers_runs_every_round():
    import torch

    from speechbrain_fl.fl.clientapp.train import train_round
    from speechbrain_fl.fl.params import trainable_state
    from speechbrain_fl.fl.toy import ToyBrain

    calls = []

    class RoundLR(ToyBrain):
        def init_optimizers(self):
            calls.append(self.fl_round)
            self.optimizer = torch.optim.SGD(self.modules.parameters(), lr=0.1 / self.fl_round)
            self.optimizers_dict = {"opt_class": self.optimizer}

    client = _adam_client()
    client.brain.__class__ = RoundLR
    start = trainable_state(client.brain.modules)
    for server_round in (1, 2, 3):
        train_round(client, _message(start, server_round), partition_id=0)
    assert calls == [1, 2, 3]


# --- the client round's Brain.fit, recorded


def _recording_client(calls: list):
    """An Adam toy client (2 local epochs, SpeechBrain's shuffling sampler) recording hooks."""
    import speechbrain as sb

    from speechbrain_fl.fl.toy import ToyBrain

    class Recording(ToyBrain):
        def on_stage_start(self, stage, epoch=None):
            calls.append(("start", stage, epoch))

        def on_stage_end(self, stage, stage_loss, epoch=None):
            calls.append(("end", stage, epoch, float(stage_loss)))

        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            calls.append(("batch", float(loss), should_step))

    client = _adam_client()
    client.brain.__class__ = Recording
    assert isinstance(client.brain, sb.Brain)
    return client


def _two_rounds(client):
    from speechbrain_fl.fl.clientapp.train import train_round
    from speechbrain_fl.fl.params import trainable_state

    start = trainable_state(client.brain.modules)
    first = train_round(client, _message(start, 1), partition_id=3)
    moved = {k: v + 0.1 for k, v in start.items()}
    second = train_round(client, _message(moved, 2), partition_id=3)
    return [(_update(r), float(r["metrics"]["train-loss"])) for r in (first, second)]


def _assert_same(a, b):
    import torch

    for (update_a, loss_a), (update_b, loss_b) in zip(a, b, strict=True):
        assert loss_a == loss_b
        assert all(torch.equal(update_a[k], update_b[k]) for k in update_a)


def test_an_own_on_fit_start_runs_every_round():
    from speechbrain_fl.fl.clientapp.train import train_round
    from speechbrain_fl.fl.params import trainable_state
    from speechbrain_fl.fl.toy import ToyBrain

    starts = []

    class OwnFitStart(ToyBrain):
        def on_fit_start(self):
            starts.append(1)
            super().on_fit_start()

    client = _adam_client()
    client.brain.__class__ = OwnFitStart
    start = trainable_state(client.brain.modules)
    for server_round in (1, 2):
        train_round(client, _message(start, server_round), partition_id=0)
    assert starts == [1, 1]  # its on_fit_start ran every round, through Brain.fit


def test_in_place_weighted_sum_is_the_allocating_formula():
    """speechbrain_fl/fl/aggregate/rules.py:_weighted_sum accumulates in place, same roundings."""
    import torch

    from speechbrain_fl.fl.aggregate.rules import _weighted_sum
    from speechbrain_fl.fl.aggregate.update import ClientUpdate

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.float32, torch.float64):
        updates = [
            ClientUpdate(i, {"a": torch.randn(7, 5, generator=gen).to(dtype), "b": torch.randn(3)})
            for i in range(9)
        ]
        updates[4].delta.pop("b")  # a partial update
        weights = torch.rand(9, generator=gen).tolist()
        expected: dict = {}
        for update, weight in zip(updates, weights, strict=True):
            for name, tensor in update.delta.items():
                term = tensor.to(torch.float64) * weight
                expected[name] = expected[name] + term if name in expected else term
        got = _weighted_sum(updates, weights)
        assert all(torch.equal(got[k], expected[k]) for k in expected), dtype
        assert updates[0].delta["a"].dtype == dtype  # the inputs are not modified


# --- exact collation and reply encoding (client.pad_right_stacked, fl/npy_codec.py)


def test_pad_right_stacked_is_batch_pad_right():
    import torch
    from speechbrain.utils.data_utils import batch_pad_right

    from speechbrain_fl.fl.clientapp.collation import pad_right_stacked

    gen = torch.Generator().manual_seed(0)
    cases = [
        [torch.randn(3, 5, generator=gen) for _ in range(4)],  # one shape: stacked
        [torch.randint(0, 9, (7,), generator=gen) for _ in range(3)],  # integer labels
        [torch.randn(n, 2, generator=gen) for n in (3, 5, 4)],  # padded: batch_pad_right's
        [torch.randn(2, generator=gen)],  # one tensor: batch_pad_right's view
    ]
    for tensors in cases:
        data, lengths = pad_right_stacked(tensors)
        ref_data, ref_lengths = batch_pad_right(tensors)
        assert data.dtype == ref_data.dtype and torch.equal(data, ref_data)
        assert lengths.dtype == ref_lengths.dtype and torch.equal(lengths, ref_lengths)
    data, _ = pad_right_stacked(cases[2], value=-1.0)  # keyword arguments: batch_pad_right
    assert torch.equal(data, batch_pad_right(cases[2], value=-1.0)[0])


def test_fast_collation_equals_the_plain_speechbrain_path():
    """Updates bit for bit: the direct PaddedBatch build against SpeechBrain's PaddedBatch."""
    import speechbrain as sb

    from speechbrain_fl.fl.clientapp.train import _stacked_padded_batch

    old = _recording_client(old_calls := [])
    old.fast_collate = False
    new = _recording_client(new_calls := [])
    expected = _two_rounds(old)
    got = _two_rounds(new)
    _assert_same(got, expected)
    assert new_calls == old_calls
    assert new._loader[0].collate_fn.collate is _stacked_padded_batch
    assert old._loader[0].collate_fn.collate is sb.dataio.batch.PaddedBatch


def test_npy_codec_is_flowers_format():
    import numpy as np
    import pytest
    import torch
    from flwr.app import Array

    from speechbrain_fl.fl.npy_codec import decode, encode

    tensors = [
        torch.randn(3, 4),
        torch.tensor(2.0),
        torch.zeros(0, 3),
        torch.randn(2, 3, dtype=torch.float64),
        torch.randn(4).half(),
        torch.arange(5),
        torch.randn(3, 4).t(),  # not C-contiguous: Flower's own encoder
    ]
    for t in tensors:
        ours, flowers = encode(t), Array.from_torch_tensor(t)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (
            flowers.dtype,
            flowers.shape,
            flowers.stype,
            flowers.data,
        )
        got, ref = decode(flowers), flowers.numpy()
        assert got.dtype == ref.dtype and got.shape == ref.shape and np.array_equal(got, ref)
    good = Array.from_torch_tensor(torch.ones(4))
    lying = Array(dtype="float32", shape=(2,), stype=good.stype, data=good.data)
    assert decode(lying).shape == (4,)  # the bytes decide, as np.load does
    truncated = Array(dtype="float32", shape=(4,), stype=good.stype, data=good.data[:-3])
    with pytest.raises(ValueError):  # np.load's error, not a silent short array
        decode(truncated)
    swapped = Array.from_numpy_ndarray(np.ones(3, dtype=">f4"))
    assert not decode(swapped).dtype.isnative  # the reply check then rejects it


# --- the benchmarks' own checks (benchmarks/gpu_check.py, benchmarks/recipe_tax.py)


def _benchmark(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_refuses_without_cuda(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _benchmark("gpu_check").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_recipe_tax_on_the_toy_task(tmp_path, capsys):
    import json

    out = tmp_path / "tax.json"
    code = _benchmark("recipe_tax").main(
        ["--recipe", "toy", "--rounds", "3", "--repeats", "1", "--json", str(out)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    engine_rounds = result["engine"][0]["rounds"]
    plain_rounds = result["plain"][0]["rounds"]
    assert [r["updates"] for r in engine_rounds] == [8, 8, 8]  # q = 1: every client each round
    assert [r["updates"] for r in plain_rounds] == [8, 8, 8]
    assert all(sorted(r["cohort"]) == list(range(8)) for r in engine_rounds)  # plain reuses them
    assert result["tax"] > 0 and all(r["training"] > 0 for r in engine_rounds)
    parts = sum(result["parts_ms"].values())
    assert abs(parts - result["steady_ms"]["engine"]) < 1e-6 * max(parts, 1.0)
    assert "federated stage (engine, local backend)" in capsys.readouterr().out
