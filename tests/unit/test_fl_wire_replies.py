"""The server's reply path with fewer copies: the same tensors, checks and aggregates.

``parse_train_reply`` decodes a reply into views of one writable buffer (the one copy of the
reply's bytes), checks finiteness once over it, and names the first bad tensor as before;
``decode_record`` is ``to_torch_state_dict``; the weighted sum's NumPy pass has the roundings
of the allocating formula ``total + u.to(float64) * w``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from speechbrain_fl.fl.aggregate.rules import _weighted_sum, uniform_mean
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.engines.local_grid import LocalGrid
from speechbrain_fl.fl.npy_codec import decode_record, encode_record
from speechbrain_fl.fl.serverapp.replies import ReplyRejected, parse_train_reply

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}


def _reply(tensors, metrics=None):
    from flwr.clientapp import ClientApp

    grid = LocalGrid(ClientApp(), num_nodes=1)
    with grid.identity():
        query = Message(RecordDict(), next(iter(grid.contexts)), "train")
        query.metadata.__dict__["_message_id"] = "m"
        content = RecordDict(
            {
                "arrays": encode_record(tensors),
                "metrics": MetricRecord(metrics or {"num-examples": 3}),
            }
        )
        return Message(content, reply_to=query)


def _tensors(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_parsed_reply_is_flowers_decoding_in_one_writable_buffer(dtype):
    sent = _tensors(dtype)
    reply = _reply(sent)
    data = {k: a.data for k, a in reply.content["arrays"].items()}
    update = parse_train_reply(reply, expected_shapes=SHAPES)
    reference = reply.content["arrays"].to_torch_state_dict()  # Flower's np.load
    wide = torch.float32 if dtype == torch.float16 else dtype
    assert list(update.delta) == list(SHAPES)  # the parameter order
    for name, tensor in update.delta.items():
        assert tensor.dtype == wide and tensor.shape == SHAPES[name]
        assert torch.equal(tensor, reference[name].to(wide))  # float16 widened exactly
    storages = {t.untyped_storage().data_ptr() for t in update.delta.values()}
    assert len(storages) == 1  # views of one buffer (the re-clip scales it in place)
    for tensor in update.delta.values():
        tensor.mul_(0.5)  # writable, and a copy: the reply's bytes are not touched
    assert {k: a.data for k, a in reply.content["arrays"].items()} == data


def test_non_finite_names_the_first_bad_tensor_in_parameter_order():
    for mixed in (False, True):
        sent = _tensors()
        if mixed:
            sent["w"] = sent["w"].double()  # mixed dtypes: one array each, checked one by one
        sent["b"][1] = float("nan")
        sent["s"] = torch.tensor(float("inf"))
        with pytest.raises(ReplyRejected, match="tensor 'b' has non-finite values"):
            parse_train_reply(_reply(sent), expected_shapes=SHAPES)
    big = _tensors(torch.float16)
    big["w"][0, 0] = 60000.0  # finite in float16 and after widening
    update = parse_train_reply(_reply(big), expected_shapes=SHAPES)
    assert float(update.delta["w"][0, 0]) == 60000.0


def test_the_records_are_read_as_flowers_properties_would():
    reply = _reply(_tensors())
    reply.content["more"] = MetricRecord({"x": 1.0})  # a second MetricRecord
    with pytest.raises(ReplyRejected, match=r"got \['arrays'\] and \['metrics', 'more'\]"):
        parse_train_reply(reply, expected_shapes=SHAPES)


def test_decode_record_is_to_torch_state_dict():
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5),
        "c": torch.randn(2, dtype=torch.float64),
        "d": torch.randn(3, 2).t(),  # not contiguous: Flower's own encoding and decoding
    }
    record = encode_record(tensors)
    assert [a.data for a in record.values()] == [
        a.data for a in ArrayRecord(tensors).values()
    ]  # byte for byte Flower's
    got, expected = decode_record(record), record.to_torch_state_dict()
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name])
        got[name].add_(1)  # writable, and not the message's bytes
    assert torch.equal(decode_record(record)["a"], expected["a"])


def test_weighted_sum_numpy_and_torch_paths_are_the_allocating_formula():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=gen)
    cases = [
        [base.t().contiguous() * (i + 1) for i in range(5)],
        [(base * (i + 1)).t() for i in range(5)],  # strided views (NumPy path)
        [(base * (i + 1)).to(torch.bfloat16) for i in range(5)],  # torch path
    ]
    for tensors in cases:
        for weights in ([0.1, 0.7, 1 / 3, 2.5, 1e-7], [np.float64(0.3)] * 5, [1, 2, 3, 4, 5]):
            updates = [ClientUpdate(i, {"x": t}) for i, t in enumerate(tensors)]
            expected = None
            for t, w in zip(tensors, weights, strict=True):
                term = t.to(torch.float64) * w
                expected = term if expected is None else expected + term
            got = _weighted_sum(updates, weights)["x"]
            assert got.dtype == torch.float64 and torch.equal(got, expected)
    ups = [ClientUpdate(0, {"x": base}), ClientUpdate(1, {"x": -base})]
    assert torch.equal(uniform_mean(ups, expected_cohort_size=3.0)["x"], torch.zeros(6, 5).double())


@pytest.mark.parametrize("direct", [True, False])
def test_encoded_arrays_are_flowers_objects(monkeypatch, direct):
    import speechbrain_fl.fl.npy_codec as codec

    assert codec._DIRECT  # Flower 1.42's Array stores its four fields: made directly
    monkeypatch.setattr(codec, "_DIRECT", direct)
    tensors = {
        "a": torch.randn(3, 4),
        "s": torch.tensor(2.0),
        "e": torch.zeros(0, 3),
        "h": torch.randn(4).half(),
        "i": torch.arange(5),
        "t": torch.randn(3, 4).t(),  # not contiguous: Flower's own encoder
    }
    ours, flowers = encode_record(tensors), ArrayRecord(tensors)
    assert list(ours) == list(flowers)
    for name in tensors:
        assert vars(ours[name]) == vars(flowers[name]), name
        assert ours[name].object_id == flowers[name].object_id  # what a Grid would send
