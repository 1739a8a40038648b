"""Privacy loss distribution accounting with Google's ``dp-accounting`` (the default).

The PLD of ``T`` Poisson-subsampled Gaussian steps (``PLDAccountant``; Koskela et al. 2020,
Doroshenko et al. 2022), composed by FFT with pessimistic discretisation (interval
:data:`PLD_DISCRETIZATION`, wider in proportion above an RDP epsilon of 2: :func:`pld_interval`),
so the epsilon it reports is an upper bound on the exact one and the tightest of the accountants
here. ``dp_accounting`` is imported on first use: a non-private run never needs it.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings

from .accountant import Accountant
from .rdp import rdp_epsilon

__all__ = ["PLD_COARSE_ABOVE", "PLD_DISCRETIZATION", "PLDAccountant", "pld_interval"]

#: The package's logger: every accounting warning is logged under one name.
logger = logging.getLogger(__package__)

#: Width of the PLD's privacy-loss grid (dp-accounting's default): epsilon is pessimistic, i.e.
#: rounded up, by at most about this much per composition (our tests bound it at q=1).
PLD_DISCRETIZATION = 1e-4
#: RDP epsilon above which the PLD grid widens in proportion (see :func:`pld_interval`).
PLD_COARSE_ABOVE = 2.0


@functools.lru_cache(maxsize=64)
def _pld_one_step(sampling_rate: float, noise_multiplier: float, interval: float):
    """The PLD of one Poisson-subsampled Gaussian step, as ``PLDAccountant`` builds it (cached).

    Building it is most of an epsilon's cost (the ``T``-fold self-composition and the epsilon
    search are the rest), and it
    depends on ``(q, sigma, interval)`` only, not on the number of rounds, so a run that asks
    for epsilon after every round builds it once. The PLD object is not modified by
    ``self_compose``/``compose``, which return new ones.
    """
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution as _pld_module

    return _pld_module.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=interval,
        sampling_prob=sampling_rate,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


def pld_interval(eps_rdp: float) -> float:
    """The width of the PLD's privacy-loss grid for a mechanism whose RDP epsilon is ``eps_rdp``.

    ``h = PLD_DISCRETIZATION * 2^ceil(log2(eps_rdp / PLD_COARSE_ABOVE))`` above
    :data:`PLD_COARSE_ABOVE` (2), dp-accounting's default 1e-4 at or below it. Decision (ours):
    building the one-step PLD evaluates the privacy loss at every grid point in Python (~200,000
    points at ``q=0.5, sigma=1``: 0.4-0.5 s of a 5 s benchmark run), and the loss's range, so
    the number of points, grows with epsilon; widening the grid with epsilon keeps that cost
    about constant, and rounding the factor up to a power of two lets neighbouring ``T`` (the
    ``max_epsilon`` bisection, a sigma search) share one cached one-step PLD. The
    discretisation is pessimistic at any width, so the epsilon stays an upper bound, only a
    looser one; against the 1e-4 grid (``tests/unit/test_accounting_pld_grid.py`` checks a grid
    of settings to 1e-4 relative): ``q=0.5, sigma=1, T=10`` 10.45993 both; ``q=0.05, sigma=1,
    T=1000`` +1.3e-5 relative; ``q=0.15, sigma=0.1, T=8`` (MLS) 338.137 both: below the digits a
    figure is printed with, at ~0.05-0.15 s instead of 0.3-0.6 s.

    Example
    -------
    >>> pld_interval(1.0), pld_interval(8.0), pld_interval(9.0)
    (0.0001, 0.0004, 0.0008)
    """
    ratio = float(eps_rdp) / PLD_COARSE_ABOVE
    if not ratio > 1.0:  # also nan
        return PLD_DISCRETIZATION
    return PLD_DISCRETIZATION * 2.0 ** math.ceil(math.log2(ratio))


class PLDAccountant(Accountant):
    """``"pld"``: dp-accounting's PLD of ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)``.

    The adjacency is add/remove (``NeighboringRelation.ADD_OR_REMOVE_ONE``), the adjacency of
    the guarantee; the grid's width is :func:`pld_interval` of the RDP figure of the same
    mechanism.

    Example
    -------
    >>> round(PLDAccountant().epsilon(0.04, 1.5, 2250, 1e-5), 2)
    6.77
    """

    name = "pld"

    def epsilon(
        self, sampling_rate: float, noise_multiplier: float, rounds: int, delta: float
    ) -> float:
        """Epsilon of ``rounds`` steps; the RDP figure, with a warning, if the PLD fails.

        The PLD cannot be computed when the noise multiplier is so small that its grid does not
        fit in memory; the RDP figure is an upper bound too.
        """
        from dp_accounting.pld import privacy_loss_distribution as _pld_module

        sampling_rate, noise_multiplier = float(sampling_rate), float(noise_multiplier)
        rounds = int(rounds)
        eps_rdp = rdp_epsilon(sampling_rate, noise_multiplier, rounds, delta)
        interval = pld_interval(eps_rdp)
        try:
            # PLDAccountant.compose(SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)) then
            # get_epsilon(delta), with its one-step PLD built once per (q, sigma, interval): the
            # same objects and calls, so the same float (tests/unit/test_fl_speed.py)
            pld = _pld_module.identity(value_discretization_interval=interval).compose(
                _pld_one_step(sampling_rate, noise_multiplier, interval).self_compose(rounds)
            )
            return float(pld.get_epsilon_for_delta(delta))
        except (ValueError, MemoryError, OverflowError) as err:
            msg = (
                f"PLD accountant failed at q={sampling_rate}, sigma={noise_multiplier}, "
                f"T={rounds} ({type(err).__name__}); reporting the RDP upper bound {eps_rdp:.4g}"
            )
            logger.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=4)
            return eps_rdp
