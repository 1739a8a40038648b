"""The client's clip in fewer calls: bit-identical to the arithmetic it replaces.

:func:`speechbrain_fl.privacy.clip_update` measures separate tensors with one
``torch._foreach_norm`` over the small ones and the large ones' tails, one row norm per large
tensor and the float64 sums batched (:func:`speechbrain_fl.privacy.clipping.norms._tensor_norms`),
and scales with one Scalar (or one multiply over a packed buffer) where every clipped tensor
takes the same factor. Each test below compares it with the arithmetic it replaces, written out
per tensor (:func:`_reference_clip`: ``float(linalg.vector_norm(t))`` up to 2^15 elements, else
row norms of 4,096 elements whose squares are summed in float64, per-tensor products with the
factor shrunk by the dtype's margin): norms, flags, ratio and every clipped tensor bit for bit,
for random layouts (one tensor or two per group, several components), flat and per-group
budgets that fire or not, float32, float64, bfloat16 and float16, packed and separate tensors,
in place or not, and zero updates.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from speechbrain_fl.privacy import Group, Layout, clip_update
from speechbrain_fl.privacy.clipping import clip as C
from speechbrain_fl.privacy.clipping import norms as N
from speechbrain_fl.privacy.clipping import packing as P

SIZES = (1, 3, 64, 255, 4096, 4097, 8192, 32768, 32769, 34816, 65536, 70001)
COMPONENTS = ("encoder", "connector", "llm")


def _reference_norm(t: torch.Tensor) -> float:
    """The per-tensor norm: float32 (or the tensor's dtype) norm, rows above 2^15 elements."""
    t = t.detach()
    if t.numel() <= N.FOREACH_MAX_NUMEL:
        norm = float(torch.linalg.vector_norm(t))
    else:
        flat = t.reshape(-1)
        body = flat.numel() - flat.numel() % N.CHUNK
        rows = torch.linalg.vector_norm(flat[:body].view(-1, N.CHUNK), dim=1)
        sq = float(rows.to(torch.float64).square().sum())
        if body < flat.numel():
            sq += float(torch.linalg.vector_norm(flat[body:]).to(torch.float64)) ** 2
        norm = math.sqrt(sq)
    if not 0.0 < norm < math.inf:
        norm = N._robust_norm64([t])
    return norm


def _reference_clip(update, budgets, layout):
    """The clip written out tensor by tensor: ``(clipped, stats as a dict)``."""
    if layout is None:
        members = [[k] for k in update]
        names, labels = list(update), ["all"] * len(update)
    else:
        members = [list(g.parameter_names) for g in layout]
        names, labels = list(layout.names), [g.component for g in layout]
    narrow = [t.dtype for t in update.values() if t.dtype in C.NARROW_DTYPES]
    cast = min((1.0 - 2.0 * torch.finfo(d).eps for d in narrow), default=1.0)
    wide = {k: t.float() if t.dtype in C.NARROW_DTYPES else t for k, t in update.items()}
    keys = [k for group in members for k in group]
    tensors = [wide[k] for k in keys]
    buffer = P.packed_buffer(tensors) if len(tensors) > 1 else None
    rows = N._row_length([t.numel() for t in tensors]) if buffer is not None else 0
    if rows:  # a packed update: the buffer's row norms (that path is unchanged)
        norms = dict(
            zip(keys, N._buffer_norms(buffer, [t.numel() for t in tensors], rows), strict=True)
        )
    else:
        norms = {k: _reference_norm(wide[k]) for k in keys}
    gsq = [sum(norms[k] ** 2 for k in group) for group in members]
    gnorm = [math.sqrt(s) for s in gsq]
    joint = math.sqrt(math.fsum(gsq))
    if isinstance(budgets, float):
        fires = joint > budgets
        factors = [budgets / joint if fires else 1.0] * len(names)
        flags = [fires] * len(names)
        joint_clipped = joint * factors[0]
    else:
        blist = [budgets[n] for n in names]
        flags = [g > b for g, b in zip(gnorm, blist, strict=True)]
        factors = [b / g if f else 1.0 for g, b, f in zip(gnorm, blist, flags, strict=True)]
        joint_clipped = math.sqrt(
            math.fsum((f * g) ** 2 for f, g in zip(factors, gnorm, strict=True))
        )
    clipped = dict(update)
    for group, factor, flag in zip(members, factors, flags, strict=True):
        for k in group:
            if flag:
                scale = factor * (1.0 - 2.0 * torch.finfo(wide[k].dtype).eps) * cast
                clipped[k] = (wide[k] * scale).to(update[k].dtype)
    comp_sq, comp_clip = {}, {}
    for label, sq, flag in zip(labels, gsq, flags, strict=True):
        comp_sq[label] = comp_sq.get(label, 0.0) + sq
        comp_clip[label] = comp_clip.get(label, False) or flag
    stats = {
        "group_norms": dict(zip(names, gnorm, strict=True)),
        "component_norms": {c: math.sqrt(v) for c, v in comp_sq.items()},
        "clipped": dict(zip(names, flags, strict=True)),
        "component_clipped": comp_clip,
        "joint_norm": joint,
        "joint_norm_clipped": joint_clipped,
        "clip_ratio": joint_clipped / joint if joint > 0 else 1.0,
    }
    return clipped, stats


def _case(rng: random.Random):
    """A random update, layout and budgets (flat or per group, firing or not)."""
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16])
    n = rng.randint(1, 6)
    shapes = []
    for _ in range(n):
        size = rng.choice(SIZES)
        shapes.append((4, size // 4) if size % 4 == 0 and rng.random() < 0.5 else (size,))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    scale = 10 ** rng.uniform(-3, 1)
    zero = rng.random() < 0.08
    update = {
        f"p{i}": (torch.zeros(s) if zero else torch.randn(s, generator=gen) * scale).to(dtype)
        for i, s in enumerate(shapes)
    }
    if not zero and rng.random() < 0.2:
        update["p0"] = torch.zeros_like(update["p0"])
    if rng.random() < 0.4:
        update = P.pack_update(update)
    layout = None
    if rng.random() < 0.5:
        groups, keys, i = [], list(update), 0
        while i < len(keys):
            part = keys[i : i + rng.randint(1, 2)]
            numel = sum(update[k].numel() for k in part)
            groups.append(Group(f"g{i}", COMPONENTS[i % 3], numel, members=tuple(part)))
            i += len(part)
        layout = Layout(groups)
    names = list(layout.names) if layout is not None else list(update)
    kind = rng.choice(["flat", "uniform", "dim", "zero", "loose"])
    clip = rng.choice([1e-3, 0.1, 1.0, 1e3])
    if kind == "flat":
        budgets = clip
    elif kind == "uniform":
        budgets = {g: clip / math.sqrt(len(names)) for g in names}
    elif kind == "dim":
        if layout is not None:
            sizes = {g.name: g.numel for g in layout}
        else:
            sizes = {g: update[g].numel() for g in names}
        total = sum(sizes.values())
        budgets = {g: clip * math.sqrt(sizes[g] / total) for g in names}
    elif kind == "zero":
        budgets = {g: 0.0 if j == 0 else clip for j, g in enumerate(names)}
    else:
        budgets = {g: 1e30 for g in names}
    return update, budgets, layout


def _copy(update):
    """A copy with the same structure (packed stays packed)."""
    tensors = list(update.values())
    if len(tensors) > 1 and P.packed_buffer(tensors) is not None:
        return P.pack_update(update)
    return {k: v.clone() for k, v in update.items()}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("inplace", [False, True])
def test_clip_matches_the_per_tensor_arithmetic(seed, inplace):
    rng = random.Random(seed)
    for _ in range(40):
        update, budgets, layout = _case(rng)
        expected, stats = _reference_clip(_copy(update), budgets, layout)
        given = _copy(update)
        out, got = clip_update(given, budgets, layout=layout, inplace=inplace)
        assert got.to_dict() == stats
        assert list(out) == list(update)
        for k, t in out.items():
            assert t.dtype == update[k].dtype and t.shape == update[k].shape
            assert torch.equal(t, expected[k]), k
            if not stats["clipped"][_group_of(k, layout)]:
                assert t is given[k]  # inside its budget: the caller's own tensor
        for k, t in given.items():  # untouched, or holding the clipped values in place
            assert torch.equal(t, out[k] if inplace else update[k])


def _group_of(key, layout):
    if layout is None:
        return key
    return next(g.name for g in layout if key in g.parameter_names)


def test_tensor_norms_bit_for_bit_on_mixed_sizes():
    """One ``_foreach_norm`` call, the rows and batched sums equal the per-tensor norms,
    for float32 and float64, contiguous and not, in one call and with zeros."""
    gen = torch.Generator().manual_seed(0)
    for sizes in [(34816, 256, 65536, 256, 256, 1), (70001,), (32769, 4097), (3, 40000, 5)]:
        for dtype in (torch.float32, torch.float64):
            tensors = [torch.randn(n, generator=gen, dtype=dtype) for n in sizes]
            tensors[-1] = torch.zeros_like(tensors[-1])
            got = N._tensor_norms(tensors, [t.numel() for t in tensors])
            want = [_reference_norm(t) if t.any() else 0.0 for t in tensors]
            assert got == want
    wide = torch.randn(300, 400, generator=gen)  # a transposed (non-contiguous) large tensor
    tensors = [wide.t(), torch.randn(10, generator=gen)]
    assert N._tensor_norms(tensors, [120000, 10]) == [_reference_norm(t) for t in tensors]


def test_fl_overhead_update_clipped_as_before():
    """The benchmark's client update (an MLP 136-256-256-1 delta, flat C = 0.1)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(256, 136), (256,), (256, 256), (256,), (1, 256), (1,)]
    update = {f"t{i}": torch.randn(s, generator=gen) * 0.01 for i, s in enumerate(shapes)}
    for budget in (0.1, 1e300):
        expected, stats = _reference_clip(_copy(update), budget, None)
        out, got = clip_update(_copy(update), budget, inplace=True)
        assert got.to_dict() == stats
        assert all(torch.equal(out[k], expected[k]) for k in update)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_subnormal_groups_stay_within_budget(dtype):
    """Tiny float16 entries (subnormal after clipping) round by an absolute error: a group that
    round-to-nearest would put above its budget is cast toward zero instead; every other group
    keeps the round-to-nearest values (the reference's)."""
    rng = random.Random(1)
    fixed = 0
    for trial in range(300):
        gen = torch.Generator().manual_seed(trial)
        sizes = [rng.choice([1, 2, 3, 5, 64]) for _ in range(rng.randint(1, 4))]
        update = {
            f"p{i}": (torch.randn(n, generator=gen) * 10 ** rng.uniform(-6, -3)).to(dtype)
            for i, n in enumerate(sizes)
        }
        budgets = {k: 10 ** rng.uniform(-8, -5) for k in update}
        out, stats = clip_update(_copy(update), budgets)
        expected, ref_stats = _reference_clip(_copy(update), budgets, None)
        assert stats.to_dict() == ref_stats
        for k, t in out.items():
            norm = float(t.double().norm())
            assert norm <= budgets[k], (trial, k, norm / budgets[k])
            if not torch.equal(t, expected[k]):
                fixed += 1
                assert float(expected[k].double().norm()) > budgets[k]  # only where needed
                assert bool((t.float().abs() <= expected[k].float().abs()).all())
    if dtype is torch.float16:
        assert fixed > 0  # the case occurs in this sample (else the test tests nothing)
