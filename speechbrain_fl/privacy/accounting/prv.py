"""Privacy random variable accounting: Opacus's ``PRVAccountant`` (Gopi et al. 2021).

Opacus is imported on first use: a non-private run never needs it.
"""

from __future__ import annotations

from .accountant import Accountant

__all__ = ["PRVAccountant"]


class PRVAccountant(Accountant):
    """``"prv"``: Opacus's ``PRVAccountant`` given the history ``[(sigma, q, T)]``."""

    name = "prv"
    opacus_mechanism = "prv"

    def epsilon(
        self, sampling_rate: float, noise_multiplier: float, rounds: int, delta: float
    ) -> float:
        """Epsilon of ``rounds`` steps from Opacus's PRV accountant."""
        from opacus.accountants import create_accountant

        acc = create_accountant(mechanism=self.opacus_mechanism)
        acc.history = [(float(noise_multiplier), float(sampling_rate), int(rounds))]
        return float(acc.get_epsilon(delta=delta))
