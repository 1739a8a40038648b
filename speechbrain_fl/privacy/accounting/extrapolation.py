"""Extrapolation of a simulation's privacy to a deployment's cohort size and population."""

from __future__ import annotations

from ..budgets import check_clip
from .epsilon import compute_epsilon
from .registry import DEFAULT_ACCOUNTANT

__all__ = ["extrapolate_privacy"]


def extrapolate_privacy(
    *,
    noise_multiplier: float,
    clip: float,
    cohort_size: int,
    population: int,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> dict[str, float]:
    """What the same ``sigma`` gives at a deployment's cohort size and population.

    pfl-research's ``noise_cohort_size`` idea: a simulation with a few clients reports the noise
    std ``sigma C / n'`` on the mean and the epsilon at ``q' = n' / K'`` of a deployment with
    expected cohort ``n'`` out of ``K'`` clients. To *simulate* that deployment's
    signal-to-noise, add noise of std ``sigma C / n'`` to the simulated mean.

    Returns
    -------
    dict
        ``{"noise_multiplier", "clip", "cohort_size", "population", "sampling_rate", "rounds",
        "delta", "accountant", "noise_std", "epsilon"}``.

    Example
    -------
    >>> out = extrapolate_privacy(noise_multiplier=1.0, clip=1.0, cohort_size=1000,
    ...                           population=100000, rounds=100, delta=1e-6)
    >>> out["noise_std"], out["sampling_rate"]
    (0.001, 0.01)
    """
    clip = check_clip(clip)
    for key, val in (("cohort_size", cohort_size), ("population", population)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{key} must be a positive integer, got {val!r}")
    if cohort_size > population:
        raise ValueError(f"cohort_size {cohort_size} exceeds population {population}")
    q = cohort_size / population
    eps = compute_epsilon(
        sampling_rate=q,
        noise_multiplier=noise_multiplier,
        rounds=rounds,
        delta=delta,
        accountant=accountant,
    )
    return {
        "noise_multiplier": float(noise_multiplier),
        "clip": clip,
        "cohort_size": cohort_size,
        "population": population,
        "sampling_rate": q,
        "rounds": rounds,
        "delta": delta,
        "accountant": accountant,
        "noise_std": noise_multiplier * clip / cohort_size,
        "epsilon": eps,
    }
