"""Per-component privacy: the effective noise multiplier and epsilon of each component.

A component whose clipped contribution is bounded by its budget ``C_L`` sees the same noise
``sigma C`` as a mechanism with multiplier ``sigma_eff = sigma C / C_L`` (paper Section IV-A4;
e.g. ``sigma / sqrt(alpha)`` for the alpha-split encoder), so its sub-vector alone is released
with the epsilon of ``(sigma_eff, q, T)``. The joint guarantee is always the one of
``(sigma, q, T)``. :func:`effective_noise_multiplier` is the one place that formula lives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..budgets import check_clip, component_budgets
from ..layout import Layout
from .checks import check_mechanism
from .epsilon import compute_epsilon
from .registry import DEFAULT_ACCOUNTANT

__all__ = ["component_privacy", "effective_noise_multiplier", "effective_noise_multipliers"]


def effective_noise_multiplier(*, noise_multiplier: float, clip: float, budget: float) -> float:
    """``sigma_eff = sigma * C / C_P`` of a sub-vector whose clipped norm is at most ``C_P``.

    The noise ``N(0, (sigma C)^2 I)`` added to the sum covers every coordinate, so a part of the
    update with sensitivity ``C_P <= C`` is released like a Gaussian mechanism with multiplier
    ``sigma C / C_P`` (paper Section IV-A4); e.g. ``sigma / sqrt(alpha)`` for the alpha-split
    encoder pool (docs/design.md contract 2). A part with no budget is never released: ``inf``.

    Example
    -------
    >>> round(effective_noise_multiplier(noise_multiplier=0.1, clip=1.0, budget=0.05**0.5), 4)
    0.4472
    """
    return noise_multiplier * clip / budget if budget > 0 else math.inf


def effective_noise_multipliers(
    layout: Layout, budgets: float | Mapping[str, float], *, clip: float, noise_multiplier: float
) -> dict[str, float]:
    """Per-component effective noise multiplier ``sigma * C / C_L`` (paper Section IV-A4).

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> from speechbrain_fl.privacy.budgets import compute_budgets
    >>> lay = Layout([Group("e", "encoder", 8), Group("l", "llm", 8)])
    >>> b = compute_budgets(lay, method="alpha_split", clip=1.0, alpha=0.05)
    >>> {k: round(v, 3) for k, v in effective_noise_multipliers(
    ...     lay, b, clip=1.0, noise_multiplier=0.1).items()}
    {'encoder': 0.447, 'llm': 0.103}
    """
    clip = check_clip(clip)
    check_mechanism(noise_multiplier=noise_multiplier)
    return {
        label: effective_noise_multiplier(noise_multiplier=noise_multiplier, clip=clip, budget=cb)
        for label, cb in component_budgets(layout, budgets).items()
    }


def component_privacy(
    layout: Layout,
    budgets: float | Mapping[str, float],
    *,
    clip: float,
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> dict[str, dict[str, float]]:
    """Budget, effective sigma and epsilon of each component label.

    The component epsilon is the one of the same mechanism run with ``sigma_eff``: what an
    observer learns about that component's sub-vector alone. It is *not* a replacement for the
    joint epsilon (:func:`compute_epsilon` with ``sigma``), which covers the whole update.

    Returns
    -------
    dict of str to dict
        ``{label: {"budget", "sigma_eff", "epsilon"}}``.
    """
    out = {}
    budgets_c = component_budgets(layout, budgets)
    sig = effective_noise_multipliers(layout, budgets, clip=clip, noise_multiplier=noise_multiplier)
    for label, cb in budgets_c.items():
        eps = (
            0.0
            if math.isinf(sig[label])
            else compute_epsilon(
                sampling_rate=sampling_rate,
                noise_multiplier=sig[label],
                rounds=rounds,
                delta=delta,
                accountant=accountant,
                warn=False,
            )
        )
        out[label] = {"budget": cb, "sigma_eff": sig[label], "epsilon": eps}
    return out
