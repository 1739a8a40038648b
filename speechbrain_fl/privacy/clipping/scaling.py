"""Scale factors of a clip and the multiplies that apply them.

Per group ``l`` the factor is ``f_l = min(1, C_l / ||Delta_l||)`` (a flat clip: one factor
``min(1, C / ||Delta||)`` for every group), applied as ``u_i <- u_i * f_{g(i)} * m`` with the
margin ``m = 1 - 2 eps`` of the tensor's dtype, so the rounding of the factor and of the product
cannot push a clipped group above ``C_l``. The multiply is one call over a shared buffer
(:func:`_scale_buffer`, :func:`_scale_rows`) or one ``torch._foreach_mul`` (:func:`_scale_foreach`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from speechbrain_fl.privacy.clipping.plan import _Plan


def _margin(dtype: torch.dtype) -> float:
    return _MARGINS.get(dtype) or _MARGINS.setdefault(dtype, 1.0 - 2.0 * torch.finfo(dtype).eps)


_MARGINS: dict[torch.dtype, float] = {}


def _scale_buffer(
    clipped: dict[str, torch.Tensor],
    buffer: torch.Tensor,
    tensors: list[torch.Tensor],
    keys: Sequence[str],
    scale: float,
    *,
    inplace: bool,
) -> None:
    """Multiply every tensor of ``buffer`` (:func:`packed_buffer`) by ``scale`` in one call.

    Elementwise, the products of ``torch._foreach_mul(tensors, scale)``: the float ``scale``
    rounds to the buffer's dtype once either way. In place, the caller's tensors (views of
    ``buffer``) now hold them; else ``clipped`` gets views of one new buffer.
    """
    with torch.no_grad():
        if inplace:
            buffer.mul_(scale)
            return
        scaled = buffer * scale
    offset = 0
    for key, t in zip(keys, tensors, strict=True):
        n = t.numel()
        clipped[key] = scaled[offset : offset + n].view(t.shape)
        offset += n


class _GroupScales(NamedTuple):
    """Per group: the scale factor, whether it clipped, ``||Delta_l||^2`` and ``||Delta_l||``;
    the joint norm before and after clipping."""

    factors: list[float]
    clipped: list[bool]
    sq: list[float]
    norms: list[float]
    joint: float
    joint_clipped: float


def _scale_factors(
    norms: list[float], plan: _Plan, *, clip: float | None, blist: list[float] | None
) -> _GroupScales:
    """Per-group scale factors from the per-tensor norms.

    Group sums of squares ``||Delta_l||^2`` are Python floats (float64; ~1e30 norms do not
    overflow). A flat clip ``C`` scales every group by ``min(1, C / ||Delta||)`` of the joint
    norm (Eq. 3); budgets ``C_l`` scale each group by ``min(1, C_l / ||Delta_l||)`` (Eq. 9).
    """
    n_groups = len(plan.group_names)
    if plan.one_per_group:
        gsq = [v * v for v in norms]
    else:
        gsq = [0.0] * n_groups
        for v, gi in zip(norms, plan.member_index, strict=True):
            gsq[gi] += v * v
    gnorm = [math.sqrt(s) for s in gsq]
    joint = math.sqrt(math.fsum(gsq))
    if clip is not None:
        fires = joint > clip
        factor = clip / joint if fires else 1.0
        return _GroupScales(
            [factor] * n_groups, [fires] * n_groups, gsq, gnorm, joint, joint * factor
        )
    gclipped = [g > b for g, b in zip(gnorm, blist, strict=True)]
    factors = [b / g if c else 1.0 for g, b, c in zip(gnorm, blist, gclipped, strict=True)]
    joint_clipped = math.sqrt(math.fsum((f * g) ** 2 for f, g in zip(factors, gnorm, strict=True)))
    return _GroupScales(factors, gclipped, gsq, gnorm, joint, joint_clipped)


def _scale_rows(
    clipped: dict[str, torch.Tensor],
    tensors: list[torch.Tensor],
    numels: list[int],
    plan: _Plan,
    *,
    sel: list[int],
    scales: _GroupScales,
    buffer: torch.Tensor,
    rows: int,
    margin: float,
    inplace: bool,
) -> None:
    """One multiply over the shared buffer's ``(-1, rows)`` view, each row by its tensor's factor.

    ``u_i <- u_i * f_{g(i)} * margin`` for the selected tensors, 1 for the others; in place the
    caller's views hold the products, else ``clipped`` gets views of one new buffer for the
    clipped groups' tensors.
    """
    member, factors = plan.member_index, scales.factors
    scale = torch.ones(len(tensors), dtype=torch.float64)
    for i in sel:
        scale[i] = factors[member[i]] * margin
    per_row = torch.repeat_interleave(
        scale.to(buffer.dtype), torch.tensor([n // rows for n in numels])
    ).to(buffer.device)[:, None]
    with torch.no_grad():
        grid = buffer.view(-1, rows)
        if inplace:
            grid.mul_(per_row)
        else:
            scaled = (grid * per_row).view(-1)
            offset, keys = 0, plan.param_keys
            for i, n in enumerate(numels):
                if scales.clipped[member[i]]:
                    clipped[keys[i]] = scaled[offset : offset + n].view(tensors[i].shape)
                offset += n


def _scale_foreach(
    clipped: dict[str, torch.Tensor],
    tensors: list[torch.Tensor],
    plan: _Plan,
    *,
    sel: list[int],
    scales: _GroupScales,
    flat: bool,
    cast_margin: float,
    inplace: bool,
) -> None:
    """One ``torch._foreach_mul(_)`` over the selected tensors, ``u_i * f_{g(i)} * m_i``.

    ``m_i`` is the margin of the tensor's dtype (times ``cast_margin``); where every selected
    tensor takes the same scale, it is passed as one Scalar (the same products, a cheaper call
    than a list).
    """
    member, factors = plan.member_index, scales.factors
    selected = [tensors[i] for i in sel] if len(sel) < len(tensors) else tensors
    dtypes = {t.dtype for t in selected}
    if len(dtypes) == 1:
        margin = _margin(dtypes.pop()) * cast_margin
        products = [factors[member[i]] * margin for i in sel]
    else:
        products = [factors[member[i]] * _margin(tensors[i].dtype) * cast_margin for i in sel]
    if flat or len(set(products)) == 1:
        products = products[0]
    with torch.no_grad():
        if inplace:
            torch._foreach_mul_(selected, products)
        else:
            outs = torch._foreach_mul(selected, products)
            keys = plan.param_keys
            for i, out in zip(sel, outs, strict=True):
                clipped[keys[i]] = out
