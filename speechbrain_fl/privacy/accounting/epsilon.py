"""Epsilon of ``T`` rounds of the sampled Gaussian mechanism, cached per distinct figure."""

from __future__ import annotations

import functools
import math

from .checks import check_mechanism, warn_large
from .registry import DEFAULT_ACCOUNTANT, create_accountant

__all__ = ["compute_epsilon"]


@functools.lru_cache(maxsize=4096)
def _epsilon(sampling_rate, noise_multiplier, rounds, delta, accountant) -> float:
    """The accountant's epsilon of ``rounds`` steps of one ``(q, sigma)``, cached per process.

    A pure function of hashable arguments; the server asks for the same value several times a
    round (telemetry, the ``max_epsilon`` check, the strategy's metrics), so each distinct value
    is computed once. ``T = 0`` costs nothing (epsilon 0) and ``sigma = 0`` releases the update
    in the clear (epsilon ``inf``); any other figure is the named accountant's
    (:func:`~speechbrain_fl.privacy.accounting.registry.create_accountant`).
    """
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return create_accountant(accountant).epsilon(sampling_rate, noise_multiplier, rounds, delta)


def compute_epsilon(
    *,
    sampling_rate: float,
    noise_multiplier: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    warn: bool = True,
) -> float:
    """Epsilon after ``rounds`` of the sampled Gaussian mechanism (Opacus accountant).

    Arguments
    ---------
    sampling_rate : float
        Client sampling rate ``q`` in (0, 1].
    noise_multiplier : float
        ``sigma`` >= 0 (0 gives ``inf``).
    rounds : int
        Number of rounds ``T`` >= 0.
    delta : float
        Target delta in (0, 1).
    accountant : str
        ``"pld"`` (default; dp-accounting's ``PLDAccountant``), ``"rdp"`` (Opacus
        ``RDPAccountant``, Mironov et al. 2019 + Balle et al. 2020 conversion) or ``"prv"``
        (Opacus ``PRVAccountant``, Gopi et al. 2021).
    warn : bool
        Warn (logging and ``warnings``) when epsilon exceeds 10.

    Returns
    -------
    float

    Example
    -------
    >>> round(compute_epsilon(sampling_rate=0.04, noise_multiplier=1.5, rounds=2250,
    ...                       delta=1e-5, accountant="rdp"), 6)
    7.329111
    >>> round(compute_epsilon(sampling_rate=0.04, noise_multiplier=1.5, rounds=2250,
    ...                       delta=1e-5), 2)
    6.77
    """
    check_mechanism(
        sampling_rate=sampling_rate,
        noise_multiplier=noise_multiplier,
        rounds=rounds,
        delta=delta,
        accountant=accountant,
    )
    eps = _epsilon(sampling_rate, noise_multiplier, rounds, delta, accountant)
    if warn:
        warn_large(eps, f"q={sampling_rate}, sigma={noise_multiplier}, T={rounds}")
    return eps
