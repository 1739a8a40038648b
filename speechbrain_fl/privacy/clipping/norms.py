"""Exact L2 norms of an update's tensors, for :func:`speechbrain_fl.privacy.clip_update`.

Why hand-written: ``torch.linalg.vector_norm`` and ``torch._foreach_norm`` accumulate float32
inputs in float32 along the whole tensor (relative error ~8e-4 at 2^24 elements), and casting to
float64 first costs ~20x. Here tensors up to :data:`FOREACH_MAX_NUMEL` elements take one
``torch._foreach_norm`` call; larger ones are cut into rows of :data:`CHUNK` elements whose
squared norms are summed in float64, ``||x||^2 = sum_r ||x_r||^2``, exact to ~1e-8 relative at
any size. An update packed into one buffer (:mod:`speechbrain_fl.privacy.clipping.packing`) is measured
with one row norm over the buffer (:func:`_buffer_norms`).
"""

from __future__ import annotations

import math

import torch


def _robust_norm64(tensors: list[torch.Tensor]) -> float:
    """Norm of the concatenation in float64 with max-abs rescaling (no over/underflow)."""
    scale = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in tensors)
    if scale == 0.0:
        return 0.0
    total = math.fsum(float(torch.sum((t.detach().double() / scale) ** 2)) for t in tensors)
    return scale * math.sqrt(total)


#: Tensors up to this many elements get their norm from one ``torch._foreach_norm`` call (its
#: float32 accumulation is accurate to ~4e-8 relative at this size, measured); larger ones are
#: cut into rows of :data:`CHUNK` elements whose norms are summed in float64 (our choice).
FOREACH_MAX_NUMEL = 2**15
CHUNK = 4096


def _chunked_norm(t: torch.Tensor) -> float:
    """L2 norm of a large tensor: row norms of ``CHUNK`` elements, squares summed in float64.

    ``torch._foreach_norm`` and ``torch.linalg.vector_norm`` accumulate float32 inputs in float32
    along the whole tensor (relative error ~8e-4 at 2^24 elements, ~6e-3 at 2^26); casting to
    float64 first costs ~20x. Rows of 4,096 elements keep each partial exact to ~1e-8 and read
    the tensor once, at the speed of the float32 norm.
    """
    flat = t.detach().reshape(-1)
    n = flat.numel()
    body = n - n % CHUNK
    sq = 0.0
    if body:
        rows = torch.linalg.vector_norm(flat[:body].view(-1, CHUNK), dim=1)
        sq = float(rows.to(torch.float64).square().sum())
    if body < n:
        sq += float(torch.linalg.vector_norm(flat[body:]).to(torch.float64)) ** 2
    return math.sqrt(sq)


class _Sizes:
    """How :func:`_tensor_norms` measures tensors of these sizes (cached per tuple of sizes).

    ``small``: indices of tensors up to :data:`FOREACH_MAX_NUMEL` elements; ``big``: the others,
    as ``(index, body, tail)`` with ``body`` the elements in whole rows of :data:`CHUNK` and
    ``tail`` whether elements are left after them; ``splits``: the row count of each big tensor.
    """

    def __init__(self, numels: tuple[int, ...]) -> None:
        self.small = tuple(i for i, n in enumerate(numels) if n <= FOREACH_MAX_NUMEL)
        self.big = tuple(
            (i, n - n % CHUNK, n % CHUNK != 0)
            for i, n in enumerate(numels)
            if n > FOREACH_MAX_NUMEL
        )
        self.splits = [body // CHUNK for _, body, _ in self.big]
        # position of each big tensor's tail norm among the foreach norms (after the small ones)
        tails, pos = [], len(self.small)
        for _, _, tail in self.big:
            tails.append(pos if tail else -1)
            pos += tail
        self.tails = tuple(tails)
        self.n_foreach = pos


_SIZES: dict[tuple[int, ...], _Sizes] = {}


def _tensor_norms(tensors: list[torch.Tensor], numels: list[int]) -> list[float]:
    """Per-tensor L2 norms as Python floats: ``torch._foreach_norm`` up to
    :data:`FOREACH_MAX_NUMEL` elements, :func:`_chunked_norm`'s arithmetic above.

    The same values as ``float(torch.linalg.vector_norm(t))`` for a small tensor and
    :func:`_chunked_norm` for a large one (bit for bit: ``tests/unit/test_fl_client_clip.py``)
    in fewer calls, which is what a clip of a ~100k-parameter update costs (each call's
    dispatch, several microseconds when its code is out of cache, outweighs its arithmetic): one
    ``torch._foreach_norm`` over the small tensors and the large ones' tails
    (``_foreach_norm`` of a tensor is ``linalg.vector_norm`` of it), one row norm per large
    tensor over a strided view (no reshape or slice), and for the large ones together one float64
    conversion and one squaring, one sum per tensor over its own segment (the same reduction,
    of the same length, as over a tensor of its own), one transfer to Python. Non-contiguous
    tensors, or tensors on several devices, are measured one by one as before.
    """
    key = tuple(numels)
    sizes = _SIZES.get(key)
    if sizes is None:
        if len(_SIZES) >= 256:
            _SIZES.clear()
        sizes = _SIZES[key] = _Sizes(key)
    if not sizes.big:
        norms_t = torch._foreach_norm(tensors)
        try:  # one transfer; float32 norms promote exactly to a float64 stack
            return torch.stack(norms_t).tolist()
        except RuntimeError:  # norms on several devices
            return [float(n) for n in norms_t]
    try:
        parts = [tensors[i] for i in sizes.small]
        row_norms = []
        for i, body, tail in sizes.big:
            t = tensors[i]
            if not t.is_contiguous():
                raise _PerTensor
            off = t.storage_offset()
            row_norms.append(
                torch.linalg.vector_norm(
                    t.detach().as_strided((body // CHUNK, CHUNK), (CHUNK, 1), off), dim=1
                )
            )
            if tail:
                parts.append(t.detach().as_strided((numels[i] - body,), (1,), off + body))
        first = len(parts)
        if first:
            small = torch._foreach_norm(parts)
            small_values = torch.stack(small).tolist()
        else:
            small_values = []
        if len(row_norms) == 1:
            sums = [row_norms[0].to(torch.float64).square().sum().item()]
        else:
            squares = torch.cat(row_norms).to(torch.float64).square()
            segs, start = [], 0
            for k in sizes.splits:
                segs.append(squares[start : start + k].sum())
                start += k
            sums = torch.stack(segs).tolist()
    except (_PerTensor, RuntimeError):  # non-contiguous, or several devices
        return [
            _chunked_norm(t) if n > FOREACH_MAX_NUMEL else float(torch.linalg.vector_norm(t))
            for t, n in zip(tensors, numels, strict=True)
        ]
    norms = [0.0] * len(tensors)
    for j, i in enumerate(sizes.small):
        norms[i] = small_values[j]
    for b, ((i, _, _), t) in enumerate(zip(sizes.big, sizes.tails, strict=True)):
        sq = sums[b]
        if t >= 0:
            sq += small_values[t] ** 2
        norms[i] = math.sqrt(sq)
    return norms


class _PerTensor(Exception):
    """Raised inside :func:`_tensor_norms` to measure tensor by tensor."""


def _row_length(numels: list[int]) -> int:
    """Largest divisor of every size that is at most :data:`CHUNK` (0 when below 64)."""
    g = 0
    for n in numels:
        g = math.gcd(g, n)
    if g <= CHUNK:
        return g if g >= 64 else 0
    for r in range(CHUNK, 63, -1):
        if g % r == 0:
            return r
    return 0


def _buffer_norms(buffer: torch.Tensor, numels: list[int], rows: int) -> list[float]:
    """Per-tensor L2 norms of consecutive segments of ``buffer`` (row norms, float64 sums)."""
    row_norms = torch.linalg.vector_norm(buffer.view(-1, rows), dim=1).to("cpu", torch.float64)
    index = torch.repeat_interleave(
        torch.arange(len(numels)), torch.tensor([n // rows for n in numels])
    )
    sq = torch.zeros(len(numels), dtype=torch.float64).index_add_(0, index, row_norms.square())
    return sq.sqrt().tolist()
