"""Flower's ``.npy`` array format, written and read without re-deriving the header each time.

A Flower ``Array`` holds the bytes ``np.save`` writes: a header that depends only on the dtype
and the shape, then the raw data. :func:`encode` and :func:`decode` make that header once per
``(dtype, shape)`` and return what Flower's ``Array.from_torch_tensor`` and ``Array.numpy()``
return (byte for byte, tested); anything else goes through Flower's own methods.
"""

from __future__ import annotations

import functools
import io
import math
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

__all__ = ["decode", "decode_record", "encode", "encode_record"]


@functools.lru_cache(maxsize=1024)
def _header(descr: str, shape: tuple[int, ...]) -> bytes:
    """``np.save``'s header for a C-ordered array of dtype ``descr`` and ``shape``.

    ``np.save`` writes format 1.0 when the header fits its 2-byte length field, else 2.0
    (3.0 only for non-latin-1 field names, which a plain numeric dtype has none of); the same
    public writers are called here with the dictionary ``header_data_from_array_1_0`` makes.
    """
    d = {"descr": descr, "fortran_order": False, "shape": shape}
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, d)
    except ValueError:  # too long for format 1.0
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, d)
    return buffer.getvalue()


#: dtype kinds the cached header is used for (float, signed/unsigned int, bool).
_KINDS = "fiub"


def _fields_only() -> bool:
    """Whether Flower's ``Array(dtype=, shape=, stype=, data=)`` stores exactly its four fields
    and a set dirty flag (Flower 1.42: ``__setattr__`` marks the object dirty, nothing else),
    so that :func:`_array` may set them directly."""
    made = Array(dtype="float32", shape=(1,), stype=SType.NUMPY, data=b"x")
    return vars(made) == {
        "_is_dirty": True,
        "dtype": "float32",
        "shape": (1,),
        "stype": SType.NUMPY,
        "data": b"x",
    }


#: Flower's ``Array`` constructor checks its arguments through closures and sets each field
#: through ``__setattr__`` (``ArrayRecord(dict)`` builds every Array again). Where the constructor stores only the fields (checked once, above), the
#: Array is made with the same ``__dict__`` directly.
_DIRECT = _fields_only()


def _array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    """``Array(dtype=dtype, shape=shape, stype=SType.NUMPY, data=data)`` (same ``__dict__``)."""
    if not _DIRECT:
        return Array(dtype=dtype, shape=shape, stype=SType.NUMPY, data=data)
    array = Array.__new__(Array)
    array.__dict__.update(
        {"_is_dirty": True, "dtype": dtype, "shape": shape, "stype": SType.NUMPY, "data": data}
    )
    return array


def encode(tensor: torch.Tensor) -> Array:
    """``Array.from_torch_tensor(tensor)``, with the ``.npy`` header cached (same bytes).

    Notes
    -----
    A Flower :class:`flwr.app.Array` of ``stype`` ``numpy.ndarray`` holds the bytes ``np.save``
    writes: a header (magic, version, and the ``repr`` of ``{'descr', 'fortran_order', 'shape'}``
    padded to a multiple of 64 bytes) followed by the array's raw bytes. ``np.save`` formats that
    header and ``np.load`` parses it back with ``ast.literal_eval`` on every call, which for the
    small tensors of a reply costs more than copying their data. The header depends only on the
    dtype and the shape, so here it is made once per ``(dtype, shape)`` by ``np.save`` itself and
    reused:

    - :func:`encode` returns the very ``Array`` that ``Array.from_torch_tensor`` would (the same
      ``dtype``, ``shape``, ``stype`` and byte-identical ``data``, the same ``__dict__``, tested),
      for a C-contiguous array, with the data copied once (``header + tobytes()`` copies twice);
      anything else goes through Flower's own ``Array.from_numpy_ndarray``. The Array is made with
      the ``__dict__`` Flower's constructor gives it, without the constructor's argument checks,
      where the installed Flower's constructor stores exactly that (checked once at import;
      otherwise the constructor is called). :func:`encode_record` puts them into an empty
      ArrayRecord one by one, as ``ArrayRecord(tensors)`` does (an ``ArrayRecord({name: Array})``
      would build every Array a second time).
    - :func:`decode` returns what ``Array.numpy()`` (``np.load``) would, the same dtype, shape and
      values, when the bytes are exactly the cached header of the declared dtype and shape followed
      by that many bytes of data; any other bytes (another header, a wrong length, a corrupt or
      foreign payload) go through ``Array.numpy()``, so what it accepts and rejects is unchanged.
      The array it returns is a read-only view of the message's bytes. What it derives from the
      declared ``(dtype, shape)`` (the NumPy dtype, the header, the element count) is cached per
      pair too.
    - :func:`decode_record` is ``ArrayRecord.to_torch_state_dict()`` on :func:`decode`: writable
      tensors, one copy each (the server decodes the global arrays with it every round).

    Example
    -------
    >>> t = torch.arange(6.0).view(2, 3)
    >>> encode(t).data == Array.from_torch_tensor(t).data
    True
    """
    ndarray = tensor.detach().cpu().numpy()
    if not ndarray.flags.c_contiguous or ndarray.dtype.kind not in _KINDS:
        return Array.from_numpy_ndarray(ndarray)
    shape = ndarray.shape
    dtype = ndarray.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES.setdefault(dtype, str(dtype))
    # one copy of the data (``header + tobytes()`` would make two)
    data = b"".join((_header(dtype.str, shape), ndarray.data))
    return _array(name, shape, data)


#: ``str(dtype)`` per NumPy dtype (``Array.dtype``), made once.
_DTYPE_NAMES: dict[np.dtype, str] = {}


def encode_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``ArrayRecord(tensors)`` for a dict of torch tensors, each through :func:`encode`.

    The Arrays are put into an empty record in order, as ``ArrayRecord(tensors)`` does
    (``ArrayRecord({name: Array})`` would rebuild each Array from its fields); where Flower's
    ``__setitem__`` stores only the item and the dirty flag, they are stored directly (the same
    ``__dict__``, tested).
    """
    record = ArrayRecord()
    if _DIRECT_RECORD and all(type(name) is str for name in tensors):
        # what ``record[name] = array`` stores (its checks pass: str keys, Arrays)
        record.__dict__["_data"].update({name: encode(t) for name, t in tensors.items()})
        record.__dict__["_is_dirty"] = True
        return record
    for name, tensor in tensors.items():
        record[name] = encode(tensor)
    return record


def _record_fields_only() -> bool:
    """Whether ``record[name] = array`` on an empty ArrayRecord stores exactly the item in
    ``_data`` and a set ``_is_dirty`` flag (Flower 1.42: the key and value type checks, then
    the dirty flag and the item), so that :func:`encode_record` may set them directly."""
    array = _array("float32", (1,), b"x")
    made, direct = ArrayRecord(), ArrayRecord()
    made["w"] = array
    direct.__dict__["_data"].update({"w": array})
    direct.__dict__["_is_dirty"] = True
    return (
        list(vars(made)) == list(vars(direct))
        and all(vars(made)[k] == vars(direct)[k] for k in ("_data", "_is_dirty"))
        and vars(made)["_data"]["w"] is array
    )


#: ``ArrayRecord.__setitem__`` checks the key's and the value's type through two closures and
#: sets the dirty flag through a property. Where it stores only those (checked
#: once, above), :func:`encode_record` fills the record's dict directly.
_DIRECT_RECORD = _record_fields_only()


@functools.lru_cache(maxsize=1024)
def _layout(dtype: str, shape: tuple) -> tuple[np.dtype, tuple[int, ...], bytes, int] | None:
    """``(dtype, shape, header, count)`` of the ``.npy`` bytes of a C-ordered array of
    ``dtype`` and ``shape`` (an ``Array``'s declared fields), or ``None`` when the fast path of
    :func:`decode` does not apply (another dtype kind, a negative or non-integer size)."""
    try:
        descr = np.dtype(dtype)
        dims = tuple(int(n) for n in shape)
        if descr.kind not in _KINDS or any(n < 0 for n in dims):
            return None
        header = _header(descr.str, dims)
        count = math.prod(dims)
        return descr, dims, header, count
    except (TypeError, ValueError, OverflowError, MemoryError):
        return None  # not a dtype/shape this fast path knows: Flower's own decoding decides


def decode(array: Array) -> np.ndarray:
    """``array.numpy()``: a view of the data after a known header, else Flower's ``np.load``.

    Example
    -------
    >>> a = Array.from_torch_tensor(torch.ones(2, 2))
    >>> np.array_equal(decode(a), a.numpy()), decode(a).dtype
    (True, dtype('float32'))
    """
    if array.stype == SType.NUMPY and isinstance(array.data, bytes):
        try:
            layout = _layout(array.dtype, array.shape)
        except TypeError:  # an unhashable dtype or shape
            layout = None
        if layout is not None:
            dtype, shape, header, count = layout
            data = array.data
            if len(data) == len(header) + count * dtype.itemsize and data.startswith(header):
                view = np.frombuffer(data, dtype=dtype, count=count, offset=len(header))
                return view.reshape(shape)
    return array.numpy()


def decode_record(arrays: ArrayRecord) -> OrderedDict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()``: writable tensors of the same dtypes, shapes, values.

    One copy of each array (of the read-only view :func:`decode` returns; ``np.load``'s own
    result, already a fresh array, is used as it is), without ``np.load``'s header parsing.

    Example
    -------
    >>> record = encode_record({"w": torch.arange(4.0)})
    >>> decode_record(record)["w"].tolist() == record.to_torch_state_dict()["w"].tolist()
    True
    """
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, array in arrays.items():
        ndarray = decode(array)
        out[name] = torch.from_numpy(ndarray if ndarray.flags.writeable else ndarray.copy())
    return out
