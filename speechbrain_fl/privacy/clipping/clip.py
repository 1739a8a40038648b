"""Clip an update to its per-group budgets, with statistics (docs/design.md contract 3).

``clip_update`` implements the paper's Eq. 3 for a flat budget (one clip over the concatenated
update, Eq. 5) and its per-group generalisation ``Delta_l * min(1, C_l / ||Delta_l||)`` for a
budget dict (Eq. 9, 12-13). The client runs it on its own update and the server runs it again
on receipt, so one non-compliant client cannot break the sensitivity bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from speechbrain_fl.privacy.budgets import check_clip
from speechbrain_fl.privacy.clipping.norms import (
    _buffer_norms,
    _robust_norm64,
    _row_length,
    _tensor_norms,
)
from speechbrain_fl.privacy.clipping.packing import _shared_buffer
from speechbrain_fl.privacy.clipping.plan import _Plan, _plan
from speechbrain_fl.privacy.clipping.scaling import (
    _GroupScales,
    _margin,
    _scale_buffer,
    _scale_factors,
    _scale_foreach,
    _scale_rows,
)
from speechbrain_fl.privacy.layout import Layout, check_names

__all__ = ["ClipStats", "clip_update"]


@dataclass
class ClipStats:
    """Statistics of one :func:`clip_update` call.

    Attributes
    ----------
    group_norms : dict of str to float
        Pre-clip L2 norm per group.
    component_norms : dict of str to float
        Pre-clip L2 norm per component label.
    clipped : dict of str to bool
        Whether each group was scaled down (for a flat budget: whether the joint clip fired).
    component_clipped : dict of str to bool
        Whether any group of the component was scaled down.
    joint_norm : float
        Pre-clip L2 norm of the whole update.
    joint_norm_clipped : float
        L2 norm after clipping (computed from the factors in float64).
    clip_ratio : float
        ``joint_norm_clipped / joint_norm`` (1.0 for a zero update).
    """

    group_norms: dict[str, float]
    component_norms: dict[str, float]
    clipped: dict[str, bool]
    component_clipped: dict[str, bool]
    joint_norm: float
    joint_norm_clipped: float
    clip_ratio: float

    def to_dict(self) -> dict:
        """Plain-Python copy (JSON-serialisable)."""
        return asdict(self)


def clip_update(
    update: Mapping[str, torch.Tensor],
    budgets: float | Mapping[str, float],
    *,
    layout: Layout | None = None,
    inplace: bool = False,
) -> tuple[dict[str, torch.Tensor], ClipStats]:
    """Clip ``update`` to ``budgets`` (paper Eq. 3 and its per-group form).

    Arguments
    ---------
    update : mapping of str to Tensor
        Update keyed by *parameter* name. Never modified unless ``inplace``.
    budgets : float or mapping of str to float
        A float is a flat clip over the concatenation; a mapping gives ``C_l`` per *group* name
        (``>= 0``; a zero budget zeroes the group).
    layout : Layout, optional
        Group membership and component labels; without it every key is its own group in
        component ``"all"``.
    inplace : bool
        Scale the clipped groups' tensors in place (``torch._foreach_mul_``) instead of
        writing new ones. Only for callers that own ``update`` (the engine's client clipping its
        own fresh delta, the server re-clipping a decoded reply): it saves allocating and
        faulting in a second update-sized buffer, which dominates for large updates.

    Returns
    -------
    clipped : dict of str to Tensor
        Same keys and order as ``update``; unclipped groups are the caller's tensors.
    stats : ClipStats

    Notes
    -----
    Tensors in a floating dtype narrower than float32 (float16, bfloat16) are measured and
    scaled in float32 and cast back (:func:`_clip_narrow`): their own arithmetic (a float16 row
    norm, a scale factor rounded to bfloat16) is too coarse for the 2-ulp margin, and moved a
    clipped update up to 4% above ``C``.

    Notes
    -----
    Implementation notes (why hand-written: Opacus clips per-*sample* gradients inside an
    optimizer, not a federated update dict split into groups):

    - Norms are exact to ~1e-8 relative at any size (the budget bound then holds to 1e-6 relative
      up to 2^26 elements and beyond): tensors up to 2^15 elements get theirs from one
      ``torch._foreach_norm`` call (its float32 accumulation is accurate there), larger ones from
      row norms of 4,096 elements summed in float64 (a float32 accumulation over 2^24 elements is
      off by ~8e-4, and casting to float64 first costs ~20x). Group, component and joint sums of
      squares are Python floats (float64).
    - An update whose tensors are views of one buffer laid end to end (:func:`pack_update`; the
      server decodes replies that way) is measured with one row-norm and scaled with one multiply
      over the buffer: on one CPU thread the per-tensor kernels of ~100 separate tensors cost about
      as much as the arithmetic (``benchmarks/clipping.py``).
    - Separate tensors (a client's fresh delta) are measured in few calls, since at ~100k
      parameters each call's dispatch (several microseconds when its code is out of cache, as in a
      client's round between training steps) outweighs its arithmetic (:func:`_tensor_norms`: one
      ``_foreach_norm`` over the small tensors and the large ones' tails, one row norm per large
      tensor, their float64 sums batched; the same values bit for bit), and scaled with one
      ``_foreach_mul_`` by one Scalar where every clipped tensor takes the same factor (a flat
      clip), or one multiply over the buffer when they tile one.
    - What depends on the layout alone (parameter order, group and component indices) is computed
      once per :class:`Layout` object (or, without one, per tuple of names) and cached.
    - Groups inside their budget are returned as the caller's own tensor objects (no copy, values
      bit-identical); clipped groups are new tensors. The caller's tensors are never written; clone
      a returned tensor before modifying it in place.
    - The scale factor is shrunk by ``2 * eps`` of the tensor's dtype (e.g. ``2^-22`` relative in
      float32) so that rounding of the scale and of the product cannot push a clipped group above
      ``C_l``.
    - A group whose norm over- or underflows (``inf`` with finite values, e.g. entries ~1e30 in
      float32, or ``0`` with non-zero entries ~1e-30) is recomputed in float64 with rescaling, so
      huge and tiny updates are clipped correctly. A genuinely non-finite value raises
      ``ValueError`` naming the group.
    - float16 and bfloat16 tensors are measured and scaled in float32 and cast back, with the scale
      shrunk by a further ``2 * eps`` of the narrow dtype for the cast's rounding: a float16 row
      norm and a scale factor rounded to float16 are too coarse for the margin (measured: a float16
      update of entries ~1e4 clipped to 1.046 C). Below float16's normal range the cast's error is
      absolute; a clipped group that it would put above its budget is cast toward zero instead
      (:func:`_clip_narrow`).

    Example
    -------
    >>> upd = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.1])}
    >>> out, st = clip_update(upd, {"a": 1.0, "b": 1.0})
    >>> [round(v, 5) for v in out["a"].tolist()], out["b"] is upd["b"], st.group_norms["a"]
    ([0.6, 0.8], True, 5.0)
    >>> st.clipped, st.joint_norm_clipped <= 1.0 + 1.0
    ({'a': True, 'b': False}, True)
    """
    if any(getattr(t, "dtype", None) in NARROW_DTYPES for t in getattr(update, "values", list)()):
        return _clip_narrow(update, budgets, layout=layout, inplace=inplace)
    return _clip_update(update, budgets, layout=layout, inplace=inplace)


def _clip_narrow(
    update: Mapping[str, torch.Tensor],
    budgets: float | Mapping[str, float],
    *,
    layout: Layout | None,
    inplace: bool,
) -> tuple[dict[str, torch.Tensor], ClipStats]:
    """:func:`clip_update` for an update with float16/bfloat16 tensors: float32 arithmetic.

    The narrow tensors are copied to float32 (exactly), clipped there with the scale factor
    shrunk by a further ``2 * eps`` of the narrow dtype, and the clipped ones cast back. The
    cast rounds each element to nearest, a relative change of at most ``eps / 2`` in the
    dtype's normal range, which the extra margin covers: ``||round(f * m * u_l)|| <= C_l``.
    Groups inside their budget are returned as the caller's tensors, as in :func:`clip_update`.

    Below the normal range (float16 subnormals, under ~6.1e-5) the rounding error is absolute,
    up to half the smallest subnormal, and a clipped group of tiny entries could round to just
    above its budget (found by ``tests/unit/test_clip_dtypes.py``: 1.00008 ``C_l``). So each
    clipped group's cast result is measured in float64 against its budget (the joint norm
    against ``C`` for a flat clip), and where it is above, the narrow tensors of that group are
    cast again rounding toward zero (:func:`_toward_zero`: no element grows, so the norm is at
    most the float32 one, which is within the budget); every other cast stays round-to-nearest,
    the values as before.
    """
    narrow = {k for k, t in update.items() if t.dtype in NARROW_DTYPES}
    wide = {k: t.float() if k in narrow else t for k, t in update.items()}
    cast_margin = min(1.0 - 2.0 * torch.finfo(update[k].dtype).eps for k in narrow)
    clipped, stats = _clip_update(
        wide, budgets, layout=layout, inplace=inplace, cast_margin=cast_margin
    )
    plan = _plan(layout, update)
    group_of = dict(zip(plan.param_keys, plan.member_index, strict=True))
    out = dict(clipped)
    for k in narrow:
        if not stats.clipped[plan.group_names[group_of[k]]]:
            out[k] = update[k]
        elif inplace:
            out[k] = update[k].copy_(clipped[k])
        else:
            out[k] = clipped[k].to(update[k].dtype)
    for members in _over_budget(out, budgets, plan, stats, narrow):
        for k in members:
            if k in narrow:
                cast = _toward_zero(clipped[k], update[k].dtype)
                out[k] = update[k].copy_(cast) if inplace else cast
    return out, stats


def _norm64(tensors: list[torch.Tensor]) -> float:
    """L2 norm of the concatenation, squares summed in float64."""
    return math.sqrt(math.fsum(float(t.detach().double().square().sum()) for t in tensors))


def _over_budget(
    out: Mapping[str, torch.Tensor],
    budgets: float | Mapping[str, float],
    plan: _Plan,
    stats: ClipStats,
    narrow: set[str],
) -> list[list[str]]:
    """The parameter names of each clipped group (of the whole update, for a flat clip) whose
    cast values' float64 norm is above its budget (:func:`_clip_narrow`).

    Only groups whose rounding could reach the budget are measured: with ``||x|| <= C (1 - 2
    eps)``, round-to-nearest errors of at most ``eps/2 |x_i| + s/2`` (``s`` the smallest
    subnormal, ``tiny * eps``) give ``||round(x)|| <= C (1 - 1.5 eps) + sqrt(n) s / 2``, within
    ``C`` when ``C >= sqrt(n) tiny / 3``; a group with ``C >= sqrt(n) tiny`` of its narrow
    tensors (``n`` their elements; ``tiny`` 6.1e-5 for float16, 1.2e-38 for bfloat16) is skipped.
    """
    members: dict[int, list[str]] = {}
    if not isinstance(budgets, Mapping):
        fired = stats.joint_norm_clipped < stats.joint_norm
        groups = {0: list(plan.param_keys)} if fired else {}
        limits = {0: float(budgets)}
    else:
        for k, gi in zip(plan.param_keys, plan.member_index, strict=True):
            if stats.clipped[plan.group_names[gi]]:
                members.setdefault(gi, []).append(k)
        groups = members
        limits = {gi: float(budgets[plan.group_names[gi]]) for gi in members}
    bad = []
    for gi, keys in groups.items():
        small = [out[k] for k in keys if k in narrow]
        if not small:
            continue
        n = sum(t.numel() for t in small)
        tiny = max(torch.finfo(t.dtype).tiny for t in small)
        if limits[gi] >= math.sqrt(n) * tiny:
            continue  # rounding cannot reach the budget (docstring)
        if _norm64([out[k] for k in keys]) > limits[gi]:
            bad.append(keys)
    return bad


def _toward_zero(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (float32) cast to ``dtype``, each element rounded toward zero.

    Round to nearest, then, where that moved an element away from zero, one step of the
    narrow format back (its bits read as an integer, one less: sign-magnitude, so that is one
    unit in the last place toward zero, subnormals included).
    """
    cast = values.to(dtype)
    grew = cast.float().abs() > values.abs()
    if bool(grew.any()):
        bits = cast.view(torch.int16)
        bits[grew] -= 1
    return cast


#: Floating dtypes narrower than float32, clipped in float32 (:func:`_clip_narrow`).
NARROW_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _clip_update(
    update: Mapping[str, torch.Tensor],
    budgets: float | Mapping[str, float],
    *,
    layout: Layout | None,
    inplace: bool,
    cast_margin: float = 1.0,
) -> tuple[dict[str, torch.Tensor], ClipStats]:
    """The body of :func:`clip_update`; ``cast_margin`` further shrinks every scale factor.

    Four steps: per-tensor norms (:func:`_finite_norms`), per-group and joint norms and the
    scale factors ``min(1, C_l / ||Delta_l||)`` (:func:`_scale_factors`), one multiply of the
    clipped tensors (over the shared buffer where every tensor takes the same factor, a flat clip
    that fires: :func:`_scale_buffer`; else per row of it: :func:`_scale_rows`; else one foreach
    call: :func:`_scale_foreach`), the statistics (:func:`_clip_stats`).
    """
    if not isinstance(update, Mapping) or not update:
        raise ValueError("update must be a non-empty dict of parameter name -> tensor")
    plan = _plan(layout, update)
    if layout is not None and update.keys() != plan.key_set:
        check_names(update.keys(), layout.parameter_names, what="update")
    tensors, numels = _checked_tensors(update, plan)
    clip, blist = _checked_budgets(budgets, plan.group_names)
    buffer = _shared_buffer(tensors)
    rows = _row_length(numels) if buffer is not None else 0
    norms = _finite_norms(tensors, numels, plan, buffer=buffer, rows=rows)
    scales = _scale_factors(norms, plan, clip=clip, blist=blist)
    factors, gclipped = scales.factors, scales.clipped
    flat = clip is not None
    if flat:
        sel = list(range(len(tensors))) if gclipped[0] else []
    else:
        sel = [i for i, gi in enumerate(plan.member_index) if gclipped[gi]]
    clipped = dict(update)
    if sel:
        if buffer is not None and len(sel) == len(tensors) and (flat or len(set(factors)) == 1):
            _scale_buffer(
                clipped,
                buffer,
                tensors,
                plan.param_keys,
                factors[0] * _margin(buffer.dtype) * cast_margin,
                inplace=inplace,
            )
        elif rows:
            _scale_rows(
                clipped,
                tensors,
                numels,
                plan,
                sel=sel,
                scales=scales,
                buffer=buffer,
                rows=rows,
                margin=_margin(buffer.dtype) * cast_margin,
                inplace=inplace,
            )
        else:
            _scale_foreach(
                clipped,
                tensors,
                plan,
                sel=sel,
                scales=scales,
                flat=flat,
                cast_margin=cast_margin,
                inplace=inplace,
            )
    return clipped, _clip_stats(plan, scales)


def _checked_tensors(
    update: Mapping[str, torch.Tensor], plan: _Plan
) -> tuple[list[torch.Tensor], list[int]]:
    """The update's tensors in the plan's order and their sizes; ``ValueError`` naming the key
    of a value that is not a tensor, not floating point, or empty."""
    try:
        tensors = [update[p] for p in plan.param_keys]
        numels = [t.numel() for t in tensors]
        ok = 0 not in numels and all(map(torch.is_floating_point, tensors))
    except (AttributeError, TypeError):
        ok = False
    if not ok:
        for k, t in update.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"update[{k!r}] is a {type(t).__name__}, not a tensor")
            if not t.is_floating_point():
                raise ValueError(
                    f"update[{k!r}] has dtype {t.dtype}; a floating-point tensor is needed"
                )
            if t.numel() == 0:
                raise ValueError(f"update[{k!r}] is empty (zero elements)")
        numels = [t.numel() for t in tensors]
    return tensors, numels


def _checked_budgets(
    budgets: float | Mapping[str, float], group_names: Sequence[str]
) -> tuple[float | None, list[float] | None]:
    """``(C, None)`` for a flat clip, ``(None, [C_l per group])`` for a budget mapping.

    ``ValueError`` for a clip that is not a finite positive number, a mapping whose keys are
    not the group names, or a group budget that is not finite and >= 0.
    """
    if not isinstance(budgets, Mapping):
        return check_clip(budgets), None
    if budgets.keys() != set(group_names):
        check_names(budgets.keys(), group_names, what="budget")
    blist = [float(budgets[n]) for n in group_names]
    if not all(0.0 <= b < math.inf for b in blist):
        for n, b in zip(group_names, blist, strict=True):
            if not (math.isfinite(b) and b >= 0.0):
                raise ValueError(f"budget of group {n!r} must be finite and >= 0, got {b!r}")
    return None, blist


def _finite_norms(
    tensors: list[torch.Tensor],
    numels: list[int],
    plan: _Plan,
    *,
    buffer: torch.Tensor | None,
    rows: int,
) -> list[float]:
    """Per-tensor L2 norms: one pass over a shared buffer, else :func:`_tensor_norms`.

    A norm that is 0 or not finite is recomputed in float64 with rescaling
    (:func:`_robust_norm64`) when the tensor's values are finite (an over- or underflow);
    a NaN/Inf value raises ``ValueError`` naming the tensor and its group.
    """
    with torch.no_grad():
        norms = _buffer_norms(buffer, numels, rows) if rows else _tensor_norms(tensors, numels)
    if not all(0.0 < v < math.inf for v in norms):
        for i, v in enumerate(norms):
            if 0.0 < v < math.inf:
                continue
            t = tensors[i].detach()
            if not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"non-finite values (NaN/Inf) in update tensor {plan.param_keys[i]!r} of "
                    f"group {plan.group_names[plan.member_index[i]]!r}"
                )
            norms[i] = _robust_norm64([t])
    return norms


def _clip_stats(plan: _Plan, scales: _GroupScales) -> ClipStats:
    """The :class:`ClipStats` of one clip: group norms, component norms
    ``sqrt(sum_{l in c} ||Delta_l||^2)``, which clipped, the joint norm before and after."""
    group_names, joint, joint_clipped = plan.group_names, scales.joint, scales.joint_clipped
    comp_sq = [0.0] * len(plan.components)
    comp_clip = [False] * len(plan.components)
    for ci, sq, c in zip(plan.label_index, scales.sq, scales.clipped, strict=True):
        comp_sq[ci] += sq
        comp_clip[ci] = comp_clip[ci] or c
    return ClipStats(
        group_norms=dict(zip(group_names, scales.norms, strict=True)),
        component_norms={c: math.sqrt(v) for c, v in zip(plan.components, comp_sq, strict=True)},
        clipped=dict(zip(group_names, scales.clipped, strict=True)),
        component_clipped=dict(zip(plan.components, comp_clip, strict=True)),
        joint_norm=joint,
        joint_norm_clipped=joint_clipped,
        clip_ratio=joint_clipped / joint if joint > 0 else 1.0,
    )
