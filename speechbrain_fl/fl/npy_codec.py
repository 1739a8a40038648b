"""Flower's ``.npy`` array format, written and read without re-deriving the header each time.

A Flower :class:`flwr.app.Array` of ``stype`` ``numpy.ndarray`` holds the bytes ``np.save``
writes: a header (magic, version, and the ``repr`` of ``{'descr', 'fortran_order', 'shape'}``
padded to a multiple of 64 bytes) followed by the array's raw bytes. ``np.save`` formats that
header and ``np.load`` parses it back with ``ast.literal_eval`` on every call, which for the
small tensors of a reply costs more than copying their data (measured: ~50 us a tensor each way
on one CPU thread). The header depends only on the dtype and the shape, so here it is made once
per ``(dtype, shape)`` by ``np.save`` itself and reused:

- :func:`encode` returns the very ``Array`` that ``Array.from_torch_tensor`` would (the same
  ``dtype``, ``shape``, ``stype`` and byte-identical ``data``, tested), for a C-contiguous
  array; anything else goes through Flower's own ``Array.from_numpy_ndarray``.
- :func:`decode` returns what ``Array.numpy()`` (``np.load``) would, the same dtype, shape
  and values, when the bytes are exactly the cached header of the declared dtype and shape
  followed by that many bytes of data; any other bytes (another header, a wrong length, a
  corrupt or foreign payload) go through ``Array.numpy()``, so what it accepts and rejects is
  unchanged. The array it returns is a read-only view of the message's bytes.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

__all__ = ["decode", "encode", "encode_record"]


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


def encode(tensor: torch.Tensor) -> Array:
    """``Array.from_torch_tensor(tensor)``, with the ``.npy`` header cached (same bytes).

    Example
    -------
    >>> t = torch.arange(6.0).view(2, 3)
    >>> encode(t).data == Array.from_torch_tensor(t).data
    True
    """
    ndarray = tensor.detach().cpu().numpy()
    if not ndarray.flags.c_contiguous or ndarray.dtype.kind not in _KINDS:
        return Array.from_numpy_ndarray(ndarray)
    dtype, shape = str(ndarray.dtype), tuple(ndarray.shape)
    return Array(
        dtype=dtype,
        shape=shape,
        stype=SType.NUMPY,
        data=_header(ndarray.dtype.str, shape) + ndarray.tobytes(),
    )


def encode_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``ArrayRecord(tensors)`` for a dict of torch tensors, each through :func:`encode`."""
    return ArrayRecord({name: encode(t) for name, t in tensors.items()})


def decode(array: Array) -> np.ndarray:
    """``array.numpy()``: a view of the data after a known header, else Flower's ``np.load``.

    Example
    -------
    >>> a = Array.from_torch_tensor(torch.ones(2, 2))
    >>> np.array_equal(decode(a), a.numpy()), decode(a).dtype
    (True, dtype('float32'))
    """
    try:
        if array.stype == SType.NUMPY and isinstance(array.data, bytes):
            dtype = np.dtype(array.dtype)
            shape = tuple(int(n) for n in array.shape)
            if dtype.kind in _KINDS and all(n >= 0 for n in shape):
                header = _header(dtype.str, shape)
                count = int(np.prod(shape, dtype=np.int64))
                data = array.data
                if len(data) == len(header) + count * dtype.itemsize and data.startswith(header):
                    return np.frombuffer(
                        data, dtype=dtype, count=count, offset=len(header)
                    ).reshape(shape)
    except (TypeError, ValueError, OverflowError, MemoryError):
        pass  # not a dtype/shape this fast path knows: Flower's own decoding below decides
    return array.numpy()
