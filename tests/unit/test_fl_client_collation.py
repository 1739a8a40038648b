"""The direct ``PaddedBatch`` build (speechbrain_fl/fl/clientapp/collation.py) is ``PaddedBatch(examples)``
field by field: the same ``__dict__`` (names, order), the same tensors (values, dtypes, shapes,
strides), the same behaviour of ``to``, ``iter``, ``batch[key]``, ``len``; and every input it does
not apply to goes to ``PaddedBatch``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from speechbrain.dataio.batch import PaddedBatch, PaddedData

from speechbrain_fl.fl.clientapp import collation
from speechbrain_fl.fl.clientapp.collation import TensorRows, stacked_padded_batch
from speechbrain_fl.fl.toy import _Examples


def _assert_same(got, expected):
    assert type(got) is PaddedBatch
    a, b = vars(got), vars(expected)
    assert list(a) == list(b)
    for name, value in b.items():
        other = a[name]
        assert type(other) is type(value), name
        if isinstance(value, PaddedData):
            for u, v in zip(other, value, strict=True):
                assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride()
                assert u.is_contiguous() == v.is_contiguous() and torch.equal(u, v)
                assert u.requires_grad == v.requires_grad
        elif isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other)
        else:
            assert other == value, name
    assert len(got) == len(expected) and got.batchsize == expected.batchsize
    for u, v in zip(got, expected, strict=True):  # __iter__
        assert type(u) is type(v)


def _rows(n, shapes, dtypes=None, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    dtypes = dtypes or {k: torch.float32 for k in shapes}
    return [
        {k: torch.randn(*s, generator=gen).to(dtypes[k]) for k, s in shapes.items()}
        for _ in range(n)
    ]


def test_direct_build_is_checked_at_import():
    assert collation._DIRECT  # SpeechBrain 1.1's PaddedBatch: the direct build applies


@pytest.mark.parametrize(
    "shapes",
    [
        {"x": (136,), "y": (1,)},  # fl_overhead's rows
        {"wav": (5, 3), "id_vec": (2,), "z": (1, 1, 4)},
        {"only": (7,)},
    ],
)
@pytest.mark.parametrize("n", [2, 3, 16])
def test_direct_build_is_padded_batch(shapes, n):
    examples = _rows(n, shapes)
    expected = PaddedBatch(examples)
    _assert_same(stacked_padded_batch(examples), expected)
    _assert_same(stacked_padded_batch(TensorRows(examples)), expected)
    # the batch moves and casts like SpeechBrain's
    moved, ref = stacked_padded_batch(examples).to(torch.float64), PaddedBatch(examples)
    _assert_same(moved, ref.to(torch.float64))
    key = next(iter(shapes))
    assert torch.equal(stacked_padded_batch(examples)[key].data, expected[key].data)
    with pytest.raises(KeyError):
        stacked_padded_batch(examples)["missing"]


def test_mixed_dtypes_and_integer_tensors():
    examples = _rows(4, {"a": (3,), "b": (2,)}, dtypes={"a": torch.int64, "b": torch.float64})
    _assert_same(stacked_padded_batch(examples), PaddedBatch(examples))
    examples[1]["b"] = examples[1]["b"].float()  # one example of another dtype: promoted alike
    _assert_same(stacked_padded_batch(examples), PaddedBatch(examples))


def test_strided_views_and_non_contiguous_rows():
    base = torch.arange(48.0).view(6, 8)
    examples = [{"x": base[i, ::2], "y": base[:, i]} for i in range(6)]  # strided views
    _assert_same(stacked_padded_batch(examples), PaddedBatch(examples))


@pytest.mark.parametrize(
    "examples",
    [
        [{"x": torch.ones(3)}, {"x": torch.ones(4)}],  # padding needed
        [{"x": torch.ones(3)}],  # one example: batch_pad_right's unsqueezed view
        [{"x": torch.ones(2), "id": "a"}, {"x": torch.ones(2), "id": "b"}],  # a string
        [{"w": np.ones(3, np.float32)}, {"w": np.zeros(3, np.float32)}],  # NumPy
        [{"n": 1, "x": torch.ones(2)}, {"n": 2, "x": torch.ones(2)}],  # ints
        [{"x": torch.ones(2)}, {"x": torch.nn.Parameter(torch.ones(2))}],  # a subclass
        [{"x": torch.ones(2, requires_grad=True)}, {"x": torch.ones(2)}],  # grad
    ],
)
def test_other_inputs_are_padded_batch(examples):
    _assert_same(stacked_padded_batch(examples), PaddedBatch(examples))


def test_zero_dim_values_fail_as_in_padded_batch():
    """SpeechBrain's batch_pad_right cannot pad 0-dim tensors (IndexError): neither can we."""
    examples = [{"x": torch.tensor(1.0)}, {"x": torch.tensor(2.0)}]
    with pytest.raises(IndexError):
        stacked_padded_batch(examples)
    with pytest.raises(IndexError):
        PaddedBatch(examples)


def test_reserved_and_missing_keys_go_to_padded_batch():
    examples = [{"batchsize": torch.ones(2)}, {"batchsize": torch.zeros(2)}]
    for batch in (examples, TensorRows(examples)):
        with pytest.raises(AttributeError):  # PaddedBatch's own error (a read-only property)
            stacked_padded_batch(batch)
    with pytest.raises(AttributeError):
        PaddedBatch(examples)
    for key in ("to", "_PaddedBatch__keys"):  # shadowing a method, or PaddedBatch's own list
        examples = [
            {key: torch.ones(2), "x": torch.ones(1)},
            {key: torch.zeros(2), "x": torch.ones(1)},
        ]
        for batch in (examples, TensorRows(examples)):
            assert vars(stacked_padded_batch(batch)).keys() == vars(PaddedBatch(examples)).keys()
    examples = [{"x": torch.ones(2)}, {"z": torch.ones(2)}]
    with pytest.raises(KeyError):
        stacked_padded_batch(examples)
    with pytest.raises(KeyError):
        PaddedBatch(examples)


def test_toy_rows_are_tensor_rows_only_when_promised():
    gen = torch.Generator().manual_seed(0)
    data = _Examples(torch.randn(8, 3, generator=gen), torch.randn(8, 1, generator=gen))
    batch = data.__getitems__([3, 1, 1, 7])
    assert type(batch) is TensorRows
    _assert_same(stacked_padded_batch(batch), PaddedBatch(list(batch)))
    data.y = torch.randn(8, generator=gen)  # 1-D targets: 0-dim rows, not promised
    assert type(data.__getitems__([0, 1])) is list
    data.y = torch.randn(8, 1, generator=gen).requires_grad_()
    assert type(data.__getitems__([0, 1])) is list
