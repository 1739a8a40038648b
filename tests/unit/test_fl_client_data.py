"""The client's data path keeps SpeechBrain's batches: the toy dataset's batched
``__getitems__`` and the collation without ``default_convert`` give the same batches, in the
same order, for the same seed, as a plain ``__getitem__`` dataset with SpeechBrain's
``PaddedBatch`` (speechbrain_fl/fl/toy.py, speechbrain_fl/fl/clientapp/train.py)."""

from __future__ import annotations

import numpy as np
import speechbrain as sb
import torch
from flwr.app import Context, RecordDict
from speechbrain.dataio.batch import PaddedBatch

from speechbrain_fl.fl.clientapp.train import _stacked_padded_batch, _train_loader
from speechbrain_fl.fl.toy import _Examples, toy_client, toy_settings


class _PlainExamples(torch.utils.data.Dataset):
    """The toy dataset as it was: indexing per example, no batched protocol."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _batches(brain, loader, seed, epochs=3):
    out = []
    for epoch in range(1, epochs + 1):
        torch.default_generator.manual_seed(seed)
        if brain.train_sampler is not None:
            brain.train_sampler.set_epoch(epoch)
        out.append(list(loader))
    return out


def _assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for epoch_a, epoch_b in zip(got, expected, strict=True):
        assert len(epoch_a) == len(epoch_b) > 1
        for a, b in zip(epoch_a, epoch_b, strict=True):
            for key in ("x", "y"):
                for part in ("data", "lengths"):
                    ta, tb = getattr(a[key], part), getattr(b[key], part)
                    assert ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb)


def _client(pid=0):
    context = Context(
        run_id=0, node_id=0, node_config={"partition-id": pid}, state=RecordDict(), run_config={}
    )
    return toy_client(context, toy_settings())


def test_client_loader_gives_speechbrains_batches():
    client = _client(1)
    train = client.train_set
    loader = _train_loader(client)
    assert isinstance(train, _Examples) and loader.collate_fn.collate is _stacked_padded_batch
    got = _batches(client.brain, loader, seed=3)
    reference = _client(1).brain
    plain = reference.make_dataloader(
        _PlainExamples(train.x, train.y), stage=sb.Stage.TRAIN, **client.train_loader_kwargs
    )
    assert plain.collate_fn is PaddedBatch
    expected = _batches(reference, plain, seed=3)
    _assert_same_batches(got, expected)
    assert not all(  # shuffled, and differently per epoch: the comparison sees the order
        torch.equal(a.x.data, b.x.data) for a, b in zip(got[0], got[1], strict=True)
    )


def test_getitems_is_getitem():
    gen = torch.Generator().manual_seed(0)
    data = _Examples(torch.randn(9, 3, generator=gen), torch.randn(9, 1, generator=gen))
    indices = [4, 0, 8, 8, -1, 2]
    batched = data.__getitems__(indices)
    for i, example in zip(indices, batched, strict=True):
        assert example.keys() == {"x", "y"}
        assert torch.equal(example["x"], data.x[i]) and torch.equal(example["y"], data.y[i])
        view = data.x[i]  # the same view: storage, offset, strides
        assert example["x"].data_ptr() == view.data_ptr()
        assert example["x"].stride() == view.stride()
    data.y = torch.zeros(9, 1)  # a reassigned tensor is what the examples then hold
    assert torch.equal(data[3]["y"], torch.zeros(1)) and len(data) == 9


def test_stacked_collation_keeps_default_convert_for_other_values():
    """Examples with NumPy arrays, strings, ints: PaddedBatch's default_convert still runs."""
    examples = [
        {"id": "a", "wav": np.arange(3, dtype=np.float32), "n": 1, "x": torch.ones(2)},
        {"id": "b", "wav": np.arange(5, dtype=np.float32), "n": 2, "x": torch.zeros(2)},
    ]
    got, expected = _stacked_padded_batch(examples), PaddedBatch(examples)
    assert got.id == expected.id == ["a", "b"]
    assert torch.equal(got.n, expected.n)
    for key in ("wav", "x"):
        assert torch.equal(getattr(got, key).data, getattr(expected, key).data)
        assert torch.equal(getattr(got, key).lengths, getattr(expected, key).lengths)
    tensors = [{"x": torch.randn(3), "y": torch.randn(1)} for _ in range(4)]
    got, expected = _stacked_padded_batch(tensors), PaddedBatch(tensors)
    for key in ("x", "y"):
        assert torch.equal(getattr(got, key).data, getattr(expected, key).data)
        assert torch.equal(getattr(got, key).lengths, getattr(expected, key).lengths)
