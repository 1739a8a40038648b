"""Updates laid out in one buffer, so a norm or a scaling is one operation over it.

Why hand-written: torch has no call that recognises tensors that are contiguous views of one
storage laid end to end. The server decodes a reply that way (:mod:`speechbrain_fl.fl.serverapp.replies`)
and a client may pack its delta with :func:`pack_update`; :func:`speechbrain_fl.privacy.clip_update`
then measures and scales the whole update with one call each (on one CPU thread the per-tensor
kernels of ~100 separate tensors cost about as much as the arithmetic, ``benchmarks/clipping.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["pack_update", "packed_buffer"]


def packed_buffer(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor that ``tensors`` tile back to back, in order, or ``None``.

    The reply decoder (:mod:`speechbrain_fl.fl.serverapp.replies`) and :func:`pack_update` give an
    update's tensors as contiguous views of one storage, back to back in order; a norm, a
    scaling or a weighted sum can then run once over that buffer instead of once per tensor
    (torch has no call that recognises such views, hence this one).

    ``tensors`` tile it when they share a dtype, a device and a storage, each is contiguous and
    each starts where the one before it ends; the result is a view of that storage from the
    first tensor's offset over all their elements (no copy), without autograd history.

    Example
    -------
    >>> buffer = torch.arange(6.0)
    >>> packed_buffer([buffer[:2], buffer[2:].view(2, 2)]).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    >>> packed_buffer([buffer[:2], buffer[3:]]) is None
    True
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    start = offset = first.storage_offset()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    return first.detach().new_empty(0).set_(first.untyped_storage(), start, (offset - start,))


def _shared_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer that two or more ``tensors`` tile back to back, in order, or ``None``.

    True when they are contiguous views of one storage laid end to end (what
    :func:`pack_update` returns, and how the server decodes a reply:
    :func:`packed_buffer`): the norms and the scaling then run as
    one operation each over the whole buffer instead of one per tensor. Separate tensors (a
    client's fresh delta) are told apart by the second one's address alone (the tensors are
    non-empty here).
    """
    if len(tensors) < 2:
        return None
    a, b = tensors[0], tensors[1]
    if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
        return None
    return packed_buffer(tensors)


def pack_update(update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy ``update`` into one contiguous buffer; return views of it under the same names.

    :func:`clip_update` recognises such an update and measures and scales it with one operation
    each (single-thread CPU: the per-tensor kernels of ~100 separate tensors cost about as much
    as the arithmetic itself, see ``benchmarks/clipping.py``).

    Example
    -------
    >>> packed = pack_update({"a": torch.ones(2), "b": torch.zeros(3)})
    >>> packed["b"].storage_offset(), packed["a"].untyped_storage().data_ptr() == (
    ...     packed["b"].untyped_storage().data_ptr())
    (2, True)
    """
    tensors = list(update.values())
    dtype = tensors[0].dtype
    if any(t.dtype != dtype or t.device != tensors[0].device for t in tensors):
        return dict(update)
    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    out, offset = {}, 0
    for name, t in update.items():
        view = buffer[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        out[name] = view
        offset += t.numel()
    return out
