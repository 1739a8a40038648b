"""Argument checks and the large-epsilon warning shared by the accounting functions."""

from __future__ import annotations

import logging
import math
import warnings

from .registry import ACCOUNTANTS

__all__ = ["LARGE_EPSILON", "check_mechanism", "warn_large"]

#: The package's logger: every accounting warning is logged under one name.
logger = logging.getLogger(__package__)

#: Epsilon above which a guarantee is reported as weak (a warning, not an error).
LARGE_EPSILON = 10.0


def check_mechanism(
    *, sampling_rate=None, noise_multiplier=None, rounds=None, delta=None, accountant=None
) -> None:
    """Raise ``ValueError`` naming the argument of ``(q, sigma, T, delta, accountant)`` at fault.

    ``q`` in (0, 1], ``sigma`` finite and >= 0, ``T`` an integer >= 0, ``delta`` in (0, 1) and
    ``accountant`` one of :data:`~speechbrain_fl.privacy.accounting.registry.ACCOUNTANTS`;
    arguments left ``None`` are not checked.
    """
    if sampling_rate is not None and not (0.0 < sampling_rate <= 1.0):
        raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate!r}")
    if noise_multiplier is not None and not (
        math.isfinite(noise_multiplier) and noise_multiplier >= 0
    ):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    if rounds is not None and (
        isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0
    ):
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    if delta is not None and not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if accountant is not None and accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; expected one of {ACCOUNTANTS}")


def warn_large(epsilon: float, what: str) -> None:
    """Log and ``warnings.warn`` (at the caller's caller) if ``epsilon`` > :data:`LARGE_EPSILON`."""
    if epsilon > LARGE_EPSILON:
        msg = f"{what}: epsilon = {epsilon:.4g} exceeds {LARGE_EPSILON:g}; the DP guarantee is weak"
        logger.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)
