"""The server's aggregate on packed replies: the reference formula, bit for bit.

``aggregate_train`` decodes each reply into one buffer (:mod:`speechbrain_fl.fl.serverapp.replies`), sums
the buffers block by block (:func:`speechbrain_fl.fl.aggregate.rules._packed_sum`), adds the noise
and applies the update in NumPy passes. Each test recomputes the round independently with the
allocating torch formulas, term by term in the sorted reply order, and asks ``torch.equal``:
``theta + (sum_i u_i.double() * w_i [+ noise])``, rounded once to the parameter dtype.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.fl.aggregate.rules import BLOCK, _weighted_sum
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.npy_codec import encode_record
from speechbrain_fl.fl.serverapp.replies import parse_train_reply
from speechbrain_fl.privacy import GaussianNoise, Group, Layout, clip_update

# more elements than one block, and not a multiple of it
SHAPES = {"a.weight": (300, 250), "a.bias": (300,), "b.weight": (7, 300), "b.bias": (7,)}
LAYOUT = Layout([Group(n, "all", int(torch.Size(s).numel())) for n, s in SHAPES.items()])


@pytest.fixture(autouse=True)
def _server_identity(server_identity):
    """Messages are made as in a ServerApp (tests/unit/conftest.py)."""


def _tensors(seed, scale=0.01, shapes=None):
    gen = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=gen) for n, s in (shapes or SHAPES).items()}


def _reply(node, delta, partition, examples=8):
    out = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    metrics = {"num-examples": examples, "partition-id": partition, "train-loss": 0.5}
    content = RecordDict({"arrays": encode_record(delta), "metrics": MetricRecord(metrics)})
    reply = Message(content, reply_to=out)
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


def _reference_sum(deltas, weights):
    total = {}
    for delta, w in zip(deltas, weights, strict=True):
        for name, t in delta.items():
            term = t.to(torch.float64) * w
            total[name] = term if name not in total else total[name] + term
    return total


def test_packed_sum_is_the_allocating_formula_across_blocks():
    assert sum(torch.Size(s).numel() for s in SHAPES.values()) > 2 * BLOCK
    expected_shapes = {n: tuple(s) for n, s in SHAPES.items()}
    updates = [
        parse_train_reply(_reply(10 + i, _tensors(i), i), expected_shapes=expected_shapes)
        for i in range(5)
    ]
    for weights in ([0.2] * 5, [0.1, 0.7, 1 / 3, 2.5, 1e-7]):
        got = _weighted_sum(updates, weights)
        expected = _reference_sum([u.delta for u in updates], weights)
        assert list(got) == list(SHAPES)
        for name in SHAPES:
            assert got[name].dtype == torch.float64 and torch.equal(got[name], expected[name])
        # the packed path ran: the aggregate's tensors are views of one float64 buffer
        assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    # one update not packed (separate tensors, e.g. a canary): the per-tensor path, same sums
    loose = ClientUpdate(99, {n: t.clone() for n, t in _tensors(7).items()})
    got = _weighted_sum([*updates, loose], [0.3] * 6)
    expected = _reference_sum([u.delta for u in updates] + [loose.delta], [0.3] * 6)
    assert all(torch.equal(got[n], expected[n]) for n in SHAPES)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == len(SHAPES)


def _strategy(tmp_path, layout=LAYOUT, **config):
    cfg = FLConfig(output_folder=str(tmp_path), population_size=10, **config)
    strategy = DPFedAvg(config=cfg, layout=layout)
    return strategy


def _round(strategy, deltas, global_params):
    strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in global_params.items()})
    nodes = [500 + i for i in range(len(deltas))]
    strategy.cohort = list(nodes)
    # replies arrive out of order; the strategy sums them sorted by partition-id
    replies = [_reply(n, d, i) for i, (n, d) in enumerate(zip(nodes, deltas, strict=True))][::-1]
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict()


# a float64 model keeps the float64 sum's last bits (a float32 one rounds most of them away)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aggregate_train_without_dp_is_the_reference(tmp_path, dtype):
    theta = {k: v.to(dtype) for k, v in _tensors(100, scale=1.0).items()}
    deltas = [_tensors(i) for i in range(5)]
    got = _round(_strategy(tmp_path, sampling_rate=1.0), deltas, theta)
    total = _reference_sum(deltas, [1 / 5] * 5)  # uniform over the replies
    for name, value in theta.items():
        expected = (value.to(torch.float64) + total[name]).to(value.dtype)
        assert torch.equal(got[name], expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aggregate_train_with_dp_is_the_reference(tmp_path, dtype):
    theta = {k: v.to(dtype) for k, v in _tensors(100, scale=1.0).items()}
    deltas = [_tensors(i, scale=0.05) for i in range(4)]  # norms above C: re-clipped
    settings = {"noise_multiplier": 1.0, "clip": 0.1, "noise_seed": 3, "sampler_seed": 1}
    strategy = _strategy(tmp_path, sampling_rate=0.3, **settings)
    n = strategy.expected_cohort_size()  # q K = 3: 1/n is not a power of two
    got = _round(strategy, deltas, theta)
    clipped = [clip_update({n: t.clone() for n, t in d.items()}, 0.1)[0] for d in deltas]
    total = _reference_sum(clipped, [1 / n] * 4)
    noisy = GaussianNoise(noise_multiplier=1.0, clip=0.1, seed=3).add(
        total, expected_cohort_size=n, draw=1
    )
    for name, value in theta.items():
        expected = (value.to(torch.float64) + noisy[name].to(torch.float64)).to(value.dtype)
        assert torch.equal(got[name], expected), name


def test_reply_buffers_are_reused_only_once_nothing_refers_to_them():
    from speechbrain_fl.fl.serverapp.replies import BufferPool

    pool = BufferPool()
    expected_shapes = {n: tuple(s) for n, s in SHAPES.items()}

    def parse(i):
        reply = _reply(10 + i, _tensors(i), i)
        return parse_train_reply(reply, expected_shapes=expected_shapes, pool=pool)

    def pointer(update):
        return update.delta["a.weight"].untyped_storage().data_ptr()

    first = parse(0)
    kept = {n: t.clone() for n, t in first.delta.items()}
    second = parse(1)  # ``first`` is alive: its buffer is not handed out again
    assert pointer(second) != pointer(first)
    assert all(torch.equal(first.delta[n], kept[n]) for n in SHAPES)
    old = pointer(first)
    del first
    third = parse(2)  # now free: the same memory, this reply's values
    assert pointer(third) == old
    assert all(torch.equal(third.delta[n], _tensors(2)[n]) for n in SHAPES)
    # a pool that may keep nothing still decodes (a new buffer each time)
    small = BufferPool(max_bytes=0)
    reply = _reply(1, _tensors(5), 0)
    update = parse_train_reply(reply, expected_shapes=expected_shapes, pool=small)
    assert all(torch.equal(update.delta[n], _tensors(5)[n]) for n in SHAPES)


def test_pooled_decoding_is_the_unpooled_one_for_every_wire_dtype():
    from speechbrain_fl.fl.serverapp.replies import BufferPool

    pool = BufferPool()
    expected_shapes = {n: tuple(s) for n, s in SHAPES.items()}
    for dtype in (torch.float16, torch.float32, torch.float64):
        reply = _reply(1, {n: t.to(dtype) for n, t in _tensors(3).items()}, 0)
        plain = parse_train_reply(reply, expected_shapes=expected_shapes)
        pooled = parse_train_reply(reply, expected_shapes=expected_shapes, pool=pool)
        for name in SHAPES:
            assert pooled.delta[name].dtype == plain.delta[name].dtype
            assert torch.equal(pooled.delta[name], plain.delta[name])


@pytest.mark.parametrize("private", [False, True])
def test_a_scalar_parameter_is_updated_as_the_reference(tmp_path, private):
    shapes = {"w": (3, 2), "scale": ()}  # a 0-d parameter (NumPy sums it into a scalar)
    layout = Layout([Group(n, "all", int(torch.Size(s).numel())) for n, s in shapes.items()])
    theta = _tensors(100, scale=1.0, shapes=shapes)
    deltas = [_tensors(i, scale=0.05, shapes=shapes) for i in range(3)]
    settings = {"noise_multiplier": 1.0, "clip": 0.1, "noise_seed": 3, "sampler_seed": 1}
    strategy = _strategy(
        tmp_path,
        layout=layout,
        sampling_rate=0.3 if private else 1.0,
        **(settings if private else {}),
    )
    got = _round(strategy, deltas, theta)
    if private:
        deltas = [clip_update({n: t.clone() for n, t in d.items()}, 0.1)[0] for d in deltas]
    n = strategy.expected_cohort_size() if private else 3.0
    total = _reference_sum(deltas, [1 / n] * 3)
    if private:
        total = GaussianNoise(noise_multiplier=1.0, clip=0.1, seed=3).add(
            total, expected_cohort_size=n, draw=1
        )
    for name, value in theta.items():
        expected = (value.to(torch.float64) + total[name].to(torch.float64)).to(value.dtype)
        assert got[name].shape == value.shape and torch.equal(got[name], expected), name
