"""The noise multiplier that reaches a target epsilon (calibration of ``sigma``)."""

from __future__ import annotations

import math

from .checks import check_mechanism, warn_large
from .epsilon import _epsilon
from .registry import DEFAULT_ACCOUNTANT, create_accountant

__all__ = ["noise_multiplier_for_epsilon"]


def noise_multiplier_for_epsilon(
    *,
    sampling_rate: float,
    target_epsilon: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest ``sigma`` (to the bisection tolerance) reaching ``target_epsilon`` after ``rounds``.

    Bisection on ``sigma`` until the epsilon is within ``epsilon_tolerance`` *below* the target
    (the returned sigma always meets it). The accountants Opacus has (``"rdp"``, ``"prv"``) use
    Opacus's :func:`~opacus.accountants.utils.get_noise_multiplier`; ``"pld"`` the same search
    on :func:`~speechbrain_fl.privacy.accounting.epsilon.compute_epsilon`'s figures, so the sigma
    a run derives and the epsilon it reports come from one accountant.

    Example
    -------
    >>> round(noise_multiplier_for_epsilon(sampling_rate=0.04, target_epsilon=8.0,
    ...                                    rounds=2000, delta=1e-5, accountant="rdp"), 4)
    1.3562
    """
    check_mechanism(sampling_rate=sampling_rate, rounds=rounds, delta=delta, accountant=accountant)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    if rounds == 0:
        return 0.0
    warn_large(target_epsilon, "target")
    mechanism = create_accountant(accountant).opacus_mechanism
    if mechanism is None:
        return _bisect_noise_multiplier(
            sampling_rate=sampling_rate,
            target_epsilon=target_epsilon,
            rounds=rounds,
            delta=delta,
            accountant=accountant,
            epsilon_tolerance=epsilon_tolerance,
        )
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sampling_rate,
            steps=rounds,
            accountant=mechanism,
            epsilon_tolerance=epsilon_tolerance,
        )
    )


def _bisect_noise_multiplier(
    *,
    sampling_rate: float,
    target_epsilon: float,
    rounds: int,
    delta: float,
    accountant: str,
    epsilon_tolerance: float,
) -> float:
    """Bisection of :func:`noise_multiplier_for_epsilon` on the accountant's epsilon.

    Epsilon decreases in ``sigma``: doubling ``sigma`` from 1 brackets the target (up to 1e6),
    then the bracket ``[low, high]`` halves until ``eps(high)`` lies in
    ``[target - tolerance, target]`` or the bracket is narrower than 1e-9.
    """

    def eps(sigma: float) -> float:
        return _epsilon(sampling_rate, sigma, rounds, delta, accountant)

    low, high = 0.0, 1.0
    while eps(high) > target_epsilon:
        low, high = high, 2.0 * high
        if high > 1e6:
            raise ValueError(
                f"no sigma below 1e6 reaches epsilon {target_epsilon} at q={sampling_rate}, "
                f"T={rounds}, delta={delta}"
            )
    while True:
        value = eps(high)
        if target_epsilon - epsilon_tolerance <= value <= target_epsilon:
            return high
        mid = (low + high) / 2.0
        if high - low < 1e-9:
            return high
        if eps(mid) > target_epsilon:
            low = mid
        else:
            high = mid
