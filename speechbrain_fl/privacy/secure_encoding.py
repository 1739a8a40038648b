"""The integer encoding of a clipped update under secure aggregation, and its sensitivity bound.

Under secure aggregation (Flower's SecAgg+, :mod:`speechbrain_fl.fl.secagg.train_stage`) the
server never sees a client's update, so it cannot re-clip it: the client's own clip and the
encoding must carry the bound. The encoding is SecAgg+'s quantiser
(``flwr.common.secure_aggregation.quantization``): each coordinate x is clipped to the box
[-c, c] and mapped to an integer of [0, T] by stochastic rounding of (x + c) T / (2c); the
server decodes the unmasked integer sum s of m clients as s 2c / T - m c.

Sensitivity bound (stated and tested in ``tests/unit/test_secagg_encoding.py``)
-----------------------------------------------------------------------------
Let Delta = 2c / T be the quantisation step. Stochastic rounding moves a coordinate by less
than one step, |q(x) - x| < Delta, whatever the random draw, so a group of p_l coordinates moves
by less than sqrt(p_l) Delta in L2. The client therefore clips group l to the shrunk budget

    C_l' = C_l - sqrt(p_l) Delta                                   (:func:`shrunk_budgets`)

and the decoded update satisfies ||q(u_l)|| <= ||u_l|| + sqrt(p_l) Delta <= C_l. For the
Euclidean-tight allocators (flat, per-layer, EMA, alpha-split) sqrt(sum_l C_l^2) = C, so the
joint L2 norm of every decoded update is at most C: the sensitivity the Gaussian noise is
calibrated to (docs/api.md, contract 2). The box never cuts a compliant update (a clipped
group has every coordinate within C_l' < c). A flat budget is one group of P = sum_l p_l
coordinates: C' = C - sqrt(P) Delta.

Our choices of the box and the range are in :func:`encoding_box`'s notes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .layout import Layout

__all__ = [
    "MODULUS_BITS",
    "encoding_box",
    "quantization_range",
    "quantization_step",
    "rounding_margin",
    "shrunk_budgets",
]

MODULUS_BITS = 32
"""SecAgg+ masks and sums in Z_{2^32} (``SecAggPlusWorkflow``'s default ``modulus_range``)."""
_MAX_RANGE_BITS = 24


def quantization_range(cohort_size: int) -> int:
    """The quantisation range T for a cohort of ``cohort_size`` clients.

    T = min(2^24, 2^floor(log2(2^32 / (m + 1)))): a sum of m values in [0, T] and of m weight
    factors T stays below the modulus 2^32.

    Example
    -------
    >>> quantization_range(2), quantization_range(1000) == 2**22
    (16777216, True)
    """
    if cohort_size < 1:
        raise ValueError(f"cohort_size must be >= 1, got {cohort_size}")
    bits = min(_MAX_RANGE_BITS, int(math.floor(math.log2(2**MODULUS_BITS / (cohort_size + 1)))))
    if bits < 8:
        raise ValueError(
            f"a cohort of {cohort_size} clients leaves fewer than 8 bits per coordinate in "
            f"SecAgg+'s 2^{MODULUS_BITS} field; lower sampling_rate"
        )
    return 2**bits


def encoding_box(budgets: float | Mapping[str, float]) -> float:
    """The box half-width c: the largest group budget (``C`` for a flat budget).

    Notes
    -----
    Choices (ours) -------------- - The box half-width c is the largest group budget of the round,
    max_l C_l (C for ``flat``): no compliant coordinate is cut and the step is the smallest that is
    safe for every group. - T is the largest power of two with (m + 1) T <= 2^32 (capped at 2^24):
    SecAgg+ sums in Z_{2^32}, each client contributes at most T per coordinate plus its weight
    factor T, and a sum of m clients must not wrap (:func:`quantization_range`). With m = 100
    clients T = 2^25 is capped to 2^24, Delta = 2c / 2^24 ~ 1.2e-7 c; a group of a million
    coordinates loses ~1.2e-4 c of its budget. - A non-compliant client (one that skips its clip)
    is bounded only by the box: each coordinate within [-c, c], a joint norm up to c sqrt(P). The
    DP guarantee under secure aggregation assumes clients that run the published client code
    (docs/privacy.md, "Trust models").

    Example
    -------
    >>> encoding_box(2.0), encoding_box({"a": 0.6, "b": 0.8})
    (2.0, 0.8)
    """
    if isinstance(budgets, Mapping):
        return float(max(budgets.values()))
    return float(budgets)


def quantization_step(box: float, target_range: int) -> float:
    """Delta = 2c / T, the width of one quantisation step.

    Example
    -------
    >>> quantization_step(1.0, 2**20) == 2**-19
    True
    """
    return 2.0 * float(box) / int(target_range)


def rounding_margin(numel: int, step: float) -> float:
    """sqrt(p) Delta: the most stochastic rounding can move p coordinates in L2.

    Example
    -------
    >>> rounding_margin(4, 0.5)
    1.0
    """
    return math.sqrt(int(numel)) * float(step)


def shrunk_budgets(
    budgets: float | Mapping[str, float],
    *,
    layout: Layout,
    target_range: int,
) -> tuple[float | dict[str, float], float]:
    """The budgets a client clips to before the encoding, and the box c to encode with.

    C_l' = C_l - sqrt(p_l) Delta with Delta = 2c / T and c = max_l C_l (module docstring), so
    the decoded update's group norms stay within C_l.

    Arguments
    ---------
    budgets : float or mapping of str to float
        The round's budgets: C (flat) or C_l per group of ``layout``.
    layout : Layout
        The trainable groups (their sizes p_l).
    target_range : int
        T (:func:`quantization_range`).

    Returns
    -------
    (budgets', c)
        The shrunk budgets in the same form, and the box half-width.

    Example
    -------
    >>> from speechbrain_fl.privacy import Group, Layout
    >>> lay = Layout([Group("a", "encoder", 100), Group("b", "llm", 4)])
    >>> shrunk, box = shrunk_budgets(1.0, layout=lay, target_range=2**10)
    >>> box, round(1.0 - shrunk, 6) == round(math.sqrt(104) * 2 / 2**10, 6)
    (1.0, True)
    """
    box = encoding_box(budgets)
    step = quantization_step(box, target_range)
    if not isinstance(budgets, Mapping):
        out: float | dict[str, float] = float(budgets) - rounding_margin(layout.total_numel, step)
        low = {"(flat)": out}
    else:
        sizes = {g.name: g.numel for g in layout}
        missing = sorted(set(budgets) - set(sizes))
        if missing:
            raise KeyError(f"budgets name groups {missing[:5]} that the layout does not have")
        out = {k: float(v) - rounding_margin(sizes[k], step) for k, v in budgets.items()}
        low = out
    bad = {k: v for k, v in low.items() if not v > 0.0}
    if bad:
        raise ValueError(
            f"secure aggregation: the quantisation step {step:.3g} (box {box:.3g}, range "
            f"{target_range}) leaves no budget for groups {sorted(bad)[:5]}: their budgets are "
            "too small for their size; use fewer, larger groups or a smaller cohort"
        )
    return out, box
