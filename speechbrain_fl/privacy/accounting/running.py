"""The running (epsilon, delta) of a run: rounds counted, epsilon on demand, checkpointable."""

from __future__ import annotations

from collections.abc import Mapping

from .checks import LARGE_EPSILON, check_mechanism, warn_large
from .epsilon import compute_epsilon
from .registry import DEFAULT_ACCOUNTANT

__all__ = ["PrivacyAccountant"]


class PrivacyAccountant:
    """Running (epsilon, delta) of a run with fixed ``(q, sigma)``; checkpointable.

    Arguments
    ---------
    sampling_rate : float
        Client sampling rate ``q``.
    noise_multiplier : float
        ``sigma``.
    delta : float
        Target delta.
    accountant : str
        ``"pld"`` (default), ``"rdp"`` or ``"prv"``.

    Example
    -------
    >>> acc = PrivacyAccountant(sampling_rate=0.04, noise_multiplier=1.5, delta=1e-5,
    ...                         accountant="rdp")
    >>> acc.step(2250)
    >>> acc.rounds, round(acc.epsilon(), 6)
    (2250, 7.329111)
    """

    def __init__(
        self,
        *,
        sampling_rate: float,
        noise_multiplier: float,
        delta: float,
        accountant: str = DEFAULT_ACCOUNTANT,
    ):
        check_mechanism(
            sampling_rate=sampling_rate,
            noise_multiplier=noise_multiplier,
            delta=delta,
            accountant=accountant,
        )
        self.sampling_rate = float(sampling_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.accountant = accountant
        self.rounds = 0
        self._warned_large = False

    def step(self, n: int = 1) -> None:
        """Record ``n`` more rounds."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        self.rounds += n

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon spent so far (warns above 10).

        ``accountant`` evaluates the same mechanism and rounds with another accountant (e.g.
        ``"rdp"`` for a cheap running figure, see :meth:`max_rounds`); default this one's.
        """
        return self.epsilon_after(0, accountant=accountant)

    def epsilon_after(self, extra_rounds: int, *, accountant: str | None = None) -> float:
        """Epsilon after ``extra_rounds`` more rounds (for planning).

        Warns the first time a figure of this accountant exceeds 10 (a run asks after every
        round; one warning, naming the rounds at which it was first exceeded, says it).
        """
        rounds = self.rounds + int(extra_rounds)
        eps = compute_epsilon(
            sampling_rate=self.sampling_rate,
            noise_multiplier=self.noise_multiplier,
            rounds=rounds,
            delta=self.delta,
            accountant=self.accountant if accountant is None else accountant,
            warn=False,
        )
        if eps > LARGE_EPSILON and not self._warned_large:
            self._warned_large = True
            warn_large(eps, f"q={self.sampling_rate}, sigma={self.noise_multiplier}, T={rounds}")
        return eps

    def max_rounds(self, max_epsilon: float, *, limit: int) -> int:
        """The most rounds in total, at most ``limit``, whose epsilon is at most ``max_epsilon``.

        ``T* = max {T in [rounds, limit] : eps(T) <= max_epsilon}`` with this accountant's
        ``eps``, found by bisection on ``T`` (``1 + ceil(log2(limit - rounds))`` evaluations, once
        per run, instead of one look-ahead epsilon every round); the current ``rounds`` count as
        reached (what is spent is spent). Bisection needs ``eps`` non-decreasing in ``T``: one
        more composed release never lowers the privacy loss (post-processing: the first ``T``
        outputs are a function of the first ``T + 1``), and the discretised PLD, a dominating
        pair of distributions itself, keeps that (checked on a grid in
        ``tests/unit/test_accounting_round_figure.py``). A round ``r`` may then start iff
        ``rounds + 1 <= T*``, which is ``epsilon_after(1) <= max_epsilon``, the per-round rule,
        evaluated once.

        Example
        -------
        >>> acc = PrivacyAccountant(sampling_rate=0.5, noise_multiplier=2.0, delta=1e-5)
        >>> last = acc.max_rounds(3.0, limit=100)
        >>> last, acc.epsilon_after(last) <= 3.0 < acc.epsilon_after(last + 1)
        (5, True)
        """
        if not (isinstance(limit, int) and limit >= 0):
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")

        def within(total: int) -> bool:
            eps = compute_epsilon(
                sampling_rate=self.sampling_rate,
                noise_multiplier=self.noise_multiplier,
                rounds=total,
                delta=self.delta,
                accountant=self.accountant,
                warn=False,  # probes, not releases
            )
            return eps <= max_epsilon

        low, high = self.rounds, max(limit, self.rounds)
        if high == low or within(high):
            return high
        while high - low > 1:  # invariant: low is reached or within, high is not within
            mid = (low + high) // 2
            if within(mid):
                low = mid
            else:
                high = mid
        return low

    def state_dict(self) -> dict:
        return {
            "sampling_rate": self.sampling_rate,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "accountant": self.accountant,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore; refuses a state recorded with a different mechanism (q, sigma, accountant)."""
        for key in ("sampling_rate", "noise_multiplier", "accountant"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"accountant state has {key}={state[key]!r} but this run uses "
                    f"{getattr(self, key)!r}; the recorded rounds would be mis-accounted"
                )
        self.delta = float(state["delta"])
        self.rounds = int(state["rounds"])
