"""The interface every (epsilon, delta) accountant implements.

An accountant answers one question: the epsilon, at a given delta, of ``T`` compositions of the
Poisson-subsampled Gaussian mechanism with sampling rate ``q`` and noise multiplier ``sigma``
under add/remove adjacency. It holds no state (the running count of rounds is
:class:`~speechbrain_fl.privacy.accounting.running.PrivacyAccountant`'s), so the figures can be
cached per ``(q, sigma, T, delta)`` one level up
(:func:`~speechbrain_fl.privacy.accounting.epsilon.compute_epsilon`).
"""

from __future__ import annotations

import abc

__all__ = ["Accountant"]


class Accountant(abc.ABC):
    """An (epsilon, delta) accountant of the sampled Gaussian mechanism.

    Attributes
    ----------
    name : str
        The name a configuration selects it by (``accountant: <name>``).
    opacus_mechanism : str or None
        The mechanism name Opacus's ``create_accountant`` and ``get_noise_multiplier`` know this
        accountant by, ``None`` for one Opacus does not have; a DP-SGD path that accounts with
        Opacus's ``PrivacyEngine`` can use it directly, and the sigma search
        (:func:`~speechbrain_fl.privacy.accounting.calibration.noise_multiplier_for_epsilon`)
        calls Opacus's own search for it.
    """

    name: str
    opacus_mechanism: str | None = None

    @abc.abstractmethod
    def epsilon(
        self, sampling_rate: float, noise_multiplier: float, rounds: int, delta: float
    ) -> float:
        """Epsilon at ``delta`` of ``rounds`` >= 1 steps with ``q`` in (0, 1] and ``sigma`` > 0.

        The callers have checked the arguments and handled ``T = 0`` (epsilon 0) and
        ``sigma = 0`` (epsilon ``inf``).
        """
