"""Learning-rate schedules over federated rounds (a recipe's ``lr_schedule`` object).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import math

__all__ = ["RoundCosineLR"]


class RoundCosineLR:
    """Cosine decay of the peak ``lr`` over the federated rounds, down to a floor.

    lr_t = lr * (m + (1 - m) * (1 + cos(pi (t - 1) / T)) / 2) for round t of T, with
    m = ``lr_min_ratio``. m = 0 is the paper's cosine decay (Sec. II-D); the floor m > 0 is ours
    (with few rounds a cosine to ~0 leaves the last rounds almost idle), m = 1 a constant lr.

    Arguments
    ---------
    lr : float
        The peak learning rate (round 1).
    lr_min_ratio : float
        The floor m, a share of ``lr`` in [0, 1].

    Example
    -------
    >>> schedule = RoundCosineLR(lr=1.0, lr_min_ratio=0.5)
    >>> schedule(1, 10)
    1.0
    >>> round(schedule(6, 10), 3)
    0.75
    """

    def __init__(self, lr: float, lr_min_ratio: float = 0.0):
        if not 0.0 <= float(lr_min_ratio) <= 1.0:
            raise ValueError(f"lr_min_ratio: {lr_min_ratio!r} must be in [0, 1]")
        self.lr, self.lr_min_ratio = lr, lr_min_ratio

    def __call__(self, round_number: int, num_rounds: int) -> float:
        """The learning rate of round ``round_number`` (1-based) of ``num_rounds``."""
        total = max(1, num_rounds)
        cosine = 0.5 * (1.0 + math.cos(math.pi * (round_number - 1) / total))
        return self.lr * (self.lr_min_ratio + (1.0 - self.lr_min_ratio) * cosine)
