"""Choosing alpha-split's alpha from observed component norms (alpha-split paper, Section IV-A3)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .budgets import ALPHA_SPLIT_POOLS, check_clip

__all__ = ["select_alpha"]


def select_alpha(
    component_norms: Mapping[str, float],
    *,
    clip: float,
    kappa: float = 2.0,
    encoder_components: Sequence[str] = ALPHA_SPLIT_POOLS[0][1],
) -> float:
    """Choose alpha so the encoder pool budget is ``kappa`` times the observed encoder norm.

    Solves ``C * sqrt(alpha) = kappa * ||Delta theta_E||`` (paper Section IV-A3: the encoder
    clip is ~2x the observed encoder delta-norm), ``||Delta theta_E||`` being the L2 norm over
    ``encoder_components`` (squares of the given component norms summed). With the dim inner
    allocator and equal-size encoder groups this is the same as the paper's per-layer criterion
    ``C_l^enc ~= kappa * (per-layer norm)``: with the paper's per-layer norm 0.013 over 64
    groups it gives alpha = (2 * 0.013 * 8)^2 ~= 0.043, close to the chosen 0.05.

    Privacy cost: the norms are a statistic of the training data. They must come from a
    *public or proxy* corpus (or a model/data that is not the private training set); then alpha
    is data-independent and the (epsilon, delta) of the run is unchanged. If they come from a
    non-DP warm-up on the private clients, that warm-up leaks information that the run's
    accountant does NOT cover; it would have to be privatised and accounted separately.

    Arguments
    ---------
    component_norms : mapping of str to float
        Mean observed update norm per component label (on public/proxy data).
    clip : float
        Total budget ``C``.
    kappa : float
        Target ratio of encoder pool budget to observed encoder norm (default 2).
    encoder_components : sequence of str
        Labels forming the encoder pool (default: the first pool of :data:`ALPHA_SPLIT_POOLS`).

    Returns
    -------
    float
        ``alpha = (kappa * ||Delta theta_E|| / C)^2``, strictly inside (0, 1).

    Example
    -------
    >>> round(select_alpha({"encoder": 0.104, "llm": 3.0}, clip=1.0), 4)
    0.0433
    """
    clip = check_clip(clip)
    if not (math.isfinite(kappa) and kappa > 0):
        raise ValueError(f"kappa must be a finite positive number, got {kappa!r}")
    missing = [c for c in encoder_components if c not in component_norms]
    if missing:
        raise ValueError(f"component_norms lacks encoder component(s) {missing}")
    for c in encoder_components:
        v = component_norms[c]
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"observed norm of component {c!r} must be finite and >= 0, got {v!r}")
    enc = math.sqrt(math.fsum(component_norms[c] ** 2 for c in encoder_components))
    if enc == 0.0:
        raise ValueError("the observed encoder norm is zero; alpha cannot be chosen from it")
    alpha = (kappa * enc / clip) ** 2
    if alpha >= 1.0:
        raise ValueError(
            f"kappa * encoder norm ({kappa} * {enc:.4g}) reaches the total clip {clip}: "
            f"alpha would be {alpha:.4g} >= 1; use a larger clip or a smaller kappa"
        )
    return alpha
