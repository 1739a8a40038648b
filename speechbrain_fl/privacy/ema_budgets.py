"""EMA statistics of per-group update norms for the adaptive budget allocators (Eq. 10-11).

``nu_l <- (1 - beta) * nu_l + beta * observed_l`` once per round, ``w_l`` proportional to
``nu_l^gamma * w_l^base`` normalised to sum 1, and the budgets ``C_l = C * sqrt(w_l)``
(:mod:`speechbrain_fl.privacy.budgets`). The EMA starts at ``nu_l = 0`` (Eq. 10 taken
literally): since the weights are normalised, the zero start rescales every ``nu_l`` by the same
``1 - (1 - beta)^t`` and so acts as a bias-corrected EMA.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping

from .layout import Layout, check_names

__all__ = ["SIGNALS", "EMABudgetState"]

logger = logging.getLogger(__name__)

#: What the EMA budgets are adapted from; the same words as the YAML key ``ema_signal`` and
#: ``FLConfig.ema_signal`` (``speechbrain_fl/fl/settings/config.py``).
SIGNALS = ("noisy", "raw")


def _base_weights(layout: Layout, base: str) -> dict[str, float]:
    """Normalised base weights: ``p_l / sum p`` (dim) or ``1 / H`` (uniform)."""
    if base == "dim":
        total = layout.total_numel
        return {g.name: g.numel / total for g in layout}
    if base == "uniform":
        return {g.name: 1.0 / len(layout) for g in layout}
    raise ValueError(f"unknown base allocation {base!r}; expected 'dim' or 'uniform'")


class EMABudgetState:
    """EMA statistics of per-group update norms for the adaptive allocators (Eq. 10-11).

    ``nu_l <- (1 - beta) * nu_l + beta * observed_l`` once per round;
    ``w_l ∝ nu_l^gamma * w_l^base`` normalised to sum 1; ``C_l = C * sqrt(w_l)``. The weights
    stay at ``w^base`` until ``warmup_rounds`` observations have been recorded.

    Arguments
    ---------
    layout : Layout
        The groups.
    base : str
        ``"dim"`` (PFL-Dim+EMA) or ``"uniform"`` (PFL-Unif+EMA) base weights.
    beta : float
        EMA rate in (0, 1]; higher adapts faster (paper: 0.2).
    gamma : float
        Exponent on the smoothed norms, >= 0 (paper: 0.75).
    warmup_rounds : int
        Rounds with weights frozen at ``w^base`` (paper: 3).
    floor : float
        Fraction in [0, 1) of ``w^base`` mixed into the adapted weights,
        ``w = (1 - floor) w^adapt + floor w^base``; 0 (the paper) lets a group whose signal is
        zero get a zero budget, which with the noisy-aggregate signal can keep it at zero.
    signal : str
        What ``observed`` will be: ``"noisy"`` (default: per-group norms of the released noisy
        aggregate, e.g. :func:`~speechbrain_fl.privacy.noisy_norm_signal`; post-processing, no
        extra privacy cost) or ``"raw"`` (the paper's mean raw client norms; *outside* the DP
        guarantee, warns).

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> lay = Layout([Group("a", "encoder", 1), Group("b", "llm", 3)])
    >>> st = EMABudgetState(lay, base="dim", warmup_rounds=0)
    >>> st.update({"a": 1.0, "b": 1.0})
    >>> {k: round(v, 4) for k, v in st.weights().items()}
    {'a': 0.25, 'b': 0.75}
    """

    def __init__(
        self,
        layout: Layout,
        *,
        base: str = "dim",
        beta: float = 0.2,
        gamma: float = 0.75,
        warmup_rounds: int = 3,
        floor: float = 0.0,
        signal: str = "noisy",
    ):
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must lie in (0, 1], got {beta!r}")
        if not (math.isfinite(gamma) and gamma >= 0.0):
            raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
        if (
            isinstance(warmup_rounds, bool)
            or not isinstance(warmup_rounds, int)
            or warmup_rounds < 0
        ):
            raise ValueError(f"warmup_rounds must be an integer >= 0, got {warmup_rounds!r}")
        if not 0.0 <= floor < 1.0:
            raise ValueError(f"floor must lie in [0, 1), got {floor!r}")
        if signal not in SIGNALS:
            raise ValueError(f"unknown signal {signal!r}; expected one of {SIGNALS}")
        if signal == "raw":
            msg = (
                "EMA budgets adapted from raw client norms (the paper's variant) use private "
                "statistics that are NOT covered by the DP guarantee; use the noisy-aggregate "
                "signal for a budget adaptation that is pure post-processing"
            )
            logger.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)
        self.layout = layout
        self.base = base
        self.base_weights = _base_weights(layout, base)
        self.beta, self.gamma = float(beta), float(gamma)
        self.warmup_rounds, self.floor, self.signal = warmup_rounds, float(floor), signal
        self.nu = {name: 0.0 for name in layout.names}
        self.round = 0

    def update(self, observed: Mapping[str, float]) -> None:
        """Fold one round's per-group norms into the EMA (Eq. 10).

        Arguments
        ---------
        observed : mapping of str to float
            Finite, non-negative norm per group name (all groups of the layout).
        """
        check_names(observed.keys(), self.layout.names, what="EMA observation")
        for name, value in observed.items():
            value = float(value)
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"EMA observation for group {name!r} must be finite and >= 0, got {value!r}"
                )
        b = self.beta
        self.nu = {k: (1.0 - b) * v + b * float(observed[k]) for k, v in self.nu.items()}
        self.round += 1

    def weights(self) -> dict[str, float]:
        """Current allocation weights ``w_l`` (sum to 1; Eq. 11)."""
        if self.round < self.warmup_rounds:
            return dict(self.base_weights)
        raw = {k: (self.nu[k] ** self.gamma) * self.base_weights[k] for k in self.nu}
        total = math.fsum(raw.values())
        if total <= 0.0 or not math.isfinite(total):
            return dict(self.base_weights)
        f = self.floor
        return {k: (1.0 - f) * v / total + f * self.base_weights[k] for k, v in raw.items()}

    def state_dict(self) -> dict:
        """Plain-Python state for checkpointing."""
        return {
            "round": self.round,
            "nu": dict(self.nu),
            "base": self.base,
            "beta": self.beta,
            "gamma": self.gamma,
            "warmup_rounds": self.warmup_rounds,
            "floor": self.floor,
            "signal": self.signal,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output; the group names must match the layout."""
        check_names(state["nu"].keys(), self.layout.names, what="EMA state")
        self.base = state["base"]
        self.base_weights = _base_weights(self.layout, self.base)
        self.beta, self.gamma = float(state["beta"]), float(state["gamma"])
        self.warmup_rounds, self.floor = int(state["warmup_rounds"]), float(state["floor"])
        self.signal = state["signal"]
        self.nu = {k: float(state["nu"][k]) for k in self.layout.names}
        self.round = int(state["round"])
