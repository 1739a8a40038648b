"""Summaries over repeated runs (seeds) of the Private-Gender studies: mean, spread, paired
differences with a t-interval.

The DP noise and the Poisson sampling come from the OS and a teacher moves by about +-0.1
between runs, so a claim "A beats B" is read from the paired differences d_s = A_s - B_s over
seeds s = 1..n (A and B from the same seed: same split of labels, same initialisation):

    mean d = (1/n) sum_s d_s,   CI95 = mean d +- t_{n-1, 0.975} * sd(d) / sqrt(n),

sd with n - 1 in the denominator. The claim holds when the interval lies above 0.

Example
-------
>>> paired([0.8, 0.7, 0.9], [0.6, 0.6, 0.7])["mean"]
0.1667
>>> paired([0.8, 0.7, 0.9], [0.6, 0.6, 0.7])["ci"][0] > 0
True

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import math

__all__ = ["paired", "spread"]


def _t975(dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, dof))


def spread(values) -> dict:
    """``{"n", "mean", "sd", "min", "max"}`` of ``values`` (sd with n - 1; 0 for one value)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("spread of no values")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {
        "n": n,
        "mean": round(mean, 4),
        "sd": round(sd, 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def paired(a, b) -> dict:
    """Paired difference ``a - b`` over seeds: mean, sd, 95% t-interval, wins (module docstring).

    ``ValueError`` unless ``a`` and ``b`` have the same length >= 2.
    """
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(
            f"paired needs two equal-length lists of >= 2 values, got {len(a)}, {len(b)}"
        )
    d = [x - y for x, y in zip(a, b, strict=True)]
    s = spread(d)
    half = _t975(len(d) - 1) * s["sd"] / math.sqrt(len(d))
    return {
        "n": len(d),
        "mean": s["mean"],
        "sd": s["sd"],
        "ci": [round(s["mean"] - half, 4), round(s["mean"] + half, 4)],
        "wins": sum(x > 0 for x in d),
        "differences": [round(x, 4) for x in d],
    }
