"""A client's batches: SpeechBrain's ``PaddedBatch``, built without its generic per-key loop
where every value is a tensor of one shape.

``PaddedBatch(examples)`` (SpeechBrain 1.1 ``speechbrain/dataio/batch.py``) walks every key:
``default_convert`` of the key's values (a recursive call per example), ``batch_pad_right``
(``pad_right_to``: a zero-width pad, i.e. a copy, per example, then ``torch.stack`` and
``torch.tensor`` of the relative lengths), ``PaddedData`` and ``setattr``. Where every value
of a key is a tensor of one shape (``ndim >= 1``), that is ``PaddedData(torch.stack(values),
torch.ones(len(values)))``: the padding pads nothing, every relative length is ``1.0``, and
``default_convert`` returns the same tensors. :func:`stacked_padded_batch` builds that
``PaddedBatch`` directly, attribute by attribute (the same ``__dict__``: keys, order, values,
dtypes, shapes, strides; tested against ``PaddedBatch(examples)``), and hands anything else to
``PaddedBatch`` with :func:`pad_right_stacked` (which still stacks the equal-shape keys).

A dataset that knows its examples are such rows (:class:`TensorRows`, e.g. the toy dataset's
rows of two tensors) returns its batch as a ``TensorRows`` list from ``__getitems__``, and the
per-value check is skipped: decided once by the dataset, not per example.
"""

from __future__ import annotations

from typing import Any

import torch
from speechbrain.dataio.batch import PaddedBatch, PaddedData
from speechbrain.utils.data_utils import batch_pad_right

__all__ = ["TensorRows", "pad_right_stacked", "stacked_padded_batch"]


class TensorRows(list):
    """A batch of examples (a ``list`` of dicts) whose dataset guarantees that every example
    has the same keys (``str``) and that the values under one key are ``torch.Tensor`` objects
    (not subclasses) of one shape with ``ndim >= 1``, not requiring grad.

    Anything that takes a list of examples takes it unchanged; :func:`stacked_padded_batch`
    then skips its per-value check.
    """

    __slots__ = ()


def pad_right_stacked(tensors: list[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """SpeechBrain's ``batch_pad_right`` with the no-padding case done as one ``torch.stack``.

    When every tensor has the same shape, ``batch_pad_right`` pads each by zero elements
    (``pad_right_to``: a copy per example) and stacks them, with relative lengths
    ``torch.tensor([1.0, ...])``; this returns ``torch.stack(tensors)`` and
    ``torch.ones(len(tensors))``, the same values, dtypes and shapes (tested), in one call
    instead of one per example. Any other input (different shapes, one tensor, padding
    keyword arguments, 0-dim tensors, for which ``batch_pad_right`` raises ``IndexError``)
    goes to ``batch_pad_right`` unchanged.

    Example
    -------
    >>> data, lengths = pad_right_stacked([torch.ones(2), torch.zeros(2)])
    >>> data.tolist(), lengths.tolist()
    ([[1.0, 1.0], [0.0, 0.0]], [1.0, 1.0])
    """
    if not kwargs and len(tensors) > 1:
        shape = tensors[0].shape
        if shape and all(isinstance(t, torch.Tensor) and t.shape == shape for t in tensors):
            return torch.stack(tensors), torch.ones(len(tensors))
    return batch_pad_right(tensors, **kwargs)


#: ``PaddedBatch``'s private attributes, name-mangled, in the order its ``__init__`` sets them.
_PRIVATE = tuple(
    f"_PaddedBatch__{n}" for n in ("length", "keys", "padded_keys", "device_prep_keys")
)
#: Keys that ``setattr`` on a ``PaddedBatch`` would not store as a plain instance attribute
#: (a class attribute such as the ``batchsize`` property, or a private name): ``PaddedBatch``.
_RESERVED = frozenset(dir(PaddedBatch)) | frozenset(_PRIVATE)


def _direct_build_matches() -> bool:
    """Whether this SpeechBrain's ``PaddedBatch`` of equal-shape tensors is exactly the object
    :func:`_build` makes (its ``__dict__``: names, order, values; checked once at import)."""
    examples = [
        {"a": torch.arange(3.0), "b": torch.ones(1, 2)},
        {"a": torch.zeros(3), "b": torch.ones(1, 2)},
    ]
    reference, built = vars(PaddedBatch(examples)), vars(_build(["a", "b"], examples))
    if list(reference) != list(built):
        return False
    for name, value in reference.items():
        other = built[name]
        if isinstance(value, PaddedData):
            if not isinstance(other, PaddedData) or not all(
                u.dtype == v.dtype and u.stride() == v.stride() and torch.equal(u, v)
                for u, v in zip(value, other, strict=True)
            ):
                return False
        elif value != other or type(value) is not type(other):
            return False
    return True


def _build(keys: list[str], examples: list[dict[str, torch.Tensor]]) -> PaddedBatch:
    """``PaddedBatch(examples)`` for equal-shape tensor values, attribute by attribute."""
    n = len(examples)
    batch = PaddedBatch.__new__(PaddedBatch)
    fields = batch.__dict__
    fields[_PRIVATE[0]] = n
    fields[_PRIVATE[1]] = keys
    fields[_PRIVATE[2]] = list(keys)
    fields[_PRIVATE[3]] = list(keys)
    for key in keys:
        fields[key] = PaddedData(torch.stack([e[key] for e in examples]), torch.ones(n))
    return batch


_DIRECT = _direct_build_matches()


def _stackable(keys: list[Any], examples: list[Any]) -> bool:
    """Whether every value under every key is a plain tensor (``ndim >= 1``, not requiring
    grad) of the first example's shape for that key, and every key a plain attribute name."""
    for key in keys:
        if type(key) is not str or key in _RESERVED:
            return False
        try:
            values = [e[key] for e in examples]
        except (KeyError, TypeError, IndexError):
            return False  # PaddedBatch raises its own error
        first = values[0]
        if type(first) is not torch.Tensor or first.ndim == 0:
            return False
        shape = first.shape
        for v in values:
            if type(v) is not torch.Tensor or v.shape != shape or v.requires_grad:
                return False
    return True


def stacked_padded_batch(examples: list[Any]) -> PaddedBatch:
    """``PaddedBatch(examples)``, built directly where every value is an equal-shape tensor.

    Where every key's values are plain tensors of one shape (checked per value, or guaranteed
    by a :class:`TensorRows` batch), the ``PaddedBatch`` is built attribute by attribute (module
    docstring); otherwise ``PaddedBatch(examples, padding_func=pad_right_stacked)``, with
    ``apply_default_convert=False`` where every value is already a tensor (``default_convert``
    then returns the same tensors). The same batch either way (tested).

    Example
    -------
    >>> batch = stacked_padded_batch([{"x": torch.ones(2)}, {"x": torch.zeros(2)}])
    >>> batch.x.data.tolist(), batch.x.lengths.tolist(), len(batch)
    ([[1.0, 1.0], [0.0, 0.0]], [1.0, 1.0], 2)
    """
    if _DIRECT and len(examples) > 1 and type(examples[0]) is dict:
        keys = list(examples[0])
        if type(examples) is TensorRows:
            if not any(type(k) is not str or k in _RESERVED for k in keys):
                return _build(keys, examples)
        elif keys and _stackable(keys, examples):
            return _build(keys, examples)
    tensors = all(isinstance(v, torch.Tensor) for example in examples for v in example.values())
    return PaddedBatch(examples, padding_func=pad_right_stacked, apply_default_convert=not tensors)
