"""Summaries over repeated runs (seeds) of the Private-Gender studies: mean, spread, paired
differences with a t-interval.

The DP noise and the Poisson sampling come from the OS and a teacher moves by about +-0.1
between runs, so a claim "A beats B" is read from the paired differences d_s = A_s - B_s over
seeds s = 1..n (A and B from the same seed: same split of labels, same initialisation):

    mean d = (1/n) sum_s d_s,   CI95 = mean d +- t_{n-1, 0.975} * sd(d) / sqrt(n),

sd with n - 1 in the denominator. The claim holds when the interval lies above 0.

**Seeds for a given power** (:func:`seeds_for_power`). With the effect size estimated from
the seeds at hand, d_hat = mean d / sd(d), the interval of n seeds lies above 0 with
probability

    power(n) = P( T'_{n-1}(d_hat sqrt(n)) > t_{n-1, 1 - alpha/2} ),

T'_{k}(lambda) the noncentral t with k degrees of freedom and noncentrality lambda (the paired
t-test, two-sided level alpha, read in the claimed direction). The smallest n >= 2 with
power(n) >= the target is the estimate. It is a plug-in figure: d_hat from five seeds is itself
uncertain, so the estimate is a planning number, not a guarantee.

**Collapse** (:func:`collapsed`): a model whose predicted majority share (MajPred) is at least
0.9 or whose recall of some class is 0, the failure the recipe's stabilisers aim at. Two models
collapsing over the same seeds are compared by the exact McNemar test (:func:`exact_mcnemar`):
over the b seeds where only A collapses and the c where only B does, the two-sided binomial
p-value of b against Binomial(b + c, 1/2).

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

__all__ = ["collapsed", "exact_mcnemar", "paired", "seeds_for_power", "spread"]


def _t975(dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, dof))


def _p_two_sided(d: list[float]) -> float:
    """Two-sided p-value of the paired t-test of mean d = 0 (scipy's ``ttest_rel``)."""
    from scipy.stats import t

    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return round(float(2 * t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1)), 4)


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
        "p": _p_two_sided(d),
        "wins": sum(x > 0 for x in d),
        "differences": [round(x, 4) for x in d],
    }


def seeds_for_power(
    differences, *, power: float = 0.8, alpha: float = 0.05, max_seeds: int = 1000
) -> int | None:
    """Smallest number of seeds whose paired 95% interval lies above 0 with probability
    ``power``, at the effect size of ``differences`` (module docstring); ``None`` when the mean
    difference is <= 0 or more than ``max_seeds`` would be needed.

    >>> seeds_for_power([0.27, 0.06, 0.22, 0.13, -0.02])
    9
    """
    from scipy.stats import nct, t

    d = [float(x) for x in differences]
    if len(d) < 2:
        raise ValueError(f"seeds_for_power needs >= 2 differences, got {len(d)}")
    s = spread(d)
    if s["mean"] <= 0:
        return None
    if s["sd"] == 0:
        return 2
    effect = s["mean"] / s["sd"]
    for n in range(2, max_seeds + 1):
        critical = t.ppf(1 - alpha / 2, n - 1)
        if nct.sf(critical, n - 1, effect * math.sqrt(n)) >= power:
            return n
    return None


def collapsed(majpred: float, recalls, *, majority_share: float = 0.9) -> bool:
    """Whether a model collapsed: MajPred >= ``majority_share`` or a class recall of 0.

    >>> collapsed(0.95, [1.0, 0.2, 0.1]), collapsed(0.6, [0.9, 0.0]), collapsed(0.7, [0.9, 0.8])
    (True, True, False)
    """
    return float(majpred) >= majority_share or any(float(r) == 0.0 for r in recalls)


def exact_mcnemar(a_flags, b_flags) -> dict:
    """Exact McNemar test of paired yes/no outcomes (module docstring).

    >>> exact_mcnemar([1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0])
    {'n': 6, 'a': 5, 'b': 0, 'only_a': 5, 'only_b': 0, 'p': 0.0625}
    """
    from scipy.stats import binomtest

    a, b = [bool(x) for x in a_flags], [bool(x) for x in b_flags]
    if len(a) != len(b):
        raise ValueError(f"exact_mcnemar needs equal lengths, got {len(a)}, {len(b)}")
    only_a = sum(x and not y for x, y in zip(a, b, strict=True))
    only_b = sum(y and not x for x, y in zip(a, b, strict=True))
    p = 1.0 if only_a + only_b == 0 else binomtest(only_a, only_a + only_b, 0.5).pvalue
    return {"n": len(a), "a": sum(a), "b": sum(b), "only_a": only_a, "only_b": only_b,
            "p": round(float(p), 4)}  # fmt: skip
