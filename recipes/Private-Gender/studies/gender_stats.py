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

**Several claims** (:func:`holm`): the Holm step-down correction of m p-values: sorted
p_(1) <= ... <= p_(m), adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)); a claim holds
after the correction when its adjusted p is below alpha (family-wise error <= alpha).

**Test sample against training** (:func:`balanced_accuracy_difference_sd`,
:func:`variance_split`). Over seeds the paired difference d_s varies with the training (DP noise,
sampling, initialisation, labelled subset) and with the finite test sample the two models are
scored on. Within a seed the test part is estimated by the bootstrap: test records resampled
with replacement B times, d recomputed each time, its sd s_s. Then, with V = sd(d)^2 over
seeds, the test sample's share is mean_s(s_s^2) / V and the training's the rest,
V - mean_s(s_s^2) (clipped at 0).

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

__all__ = [
    "balanced_accuracy_difference_sd",
    "collapsed",
    "exact_mcnemar",
    "holm",
    "paired",
    "seeds_for_power",
    "spread",
    "variance_split",
]


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


def holm(pvalues) -> list[float]:
    """Holm-adjusted p-values, in the order given (module docstring).

    >>> holm([0.01, 0.04, 0.03])
    [0.03, 0.06, 0.06]
    """
    p = [float(x) for x in pvalues]
    order = sorted(range(len(p)), key=lambda i: p[i])
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = round(running, 4)
    return adjusted


def _balanced_accuracy(weights, labels, correct, num_classes: int):
    """Balanced accuracy of each row of record ``weights`` (B x n) at once."""
    import numpy as np

    recalls = []
    for c in range(num_classes):
        mask = labels == c
        total = weights[:, mask].sum(axis=1)
        recalls.append(np.where(total > 0, (weights[:, mask] * correct[mask]).sum(axis=1), 0.0)
                       / np.maximum(total, 1))  # fmt: skip
    return np.mean(recalls, axis=0)


def balanced_accuracy_difference_sd(
    labels, pred_a, pred_b, *, num_classes: int, resamples: int = 1000, seed: int = 0,
    subset: int | None = None,
) -> float:  # fmt: skip
    """Bootstrap sd of balanced accuracy(a) - balanced accuracy(b) over the test records.

    Each resample draws the records with replacement (multinomial counts, ``resamples`` times,
    generator seeded from ``seed``); ``subset``: first keep a fixed random subset of that many
    records (the sd a smaller test set would have). Records are speakers here (one clip each).

    >>> labels, a = [0, 0, 1, 1, 2, 2] * 50, [0, 0, 1, 1, 2, 2] * 50
    >>> balanced_accuracy_difference_sd(labels, a, a, num_classes=3)
    0.0
    """
    import numpy as np

    y, a, b = (np.asarray(v, dtype=int) for v in (labels, pred_a, pred_b))
    if not len(y) == len(a) == len(b) or len(y) == 0:
        raise ValueError(f"labels and predictions differ in length: {len(y)}, {len(a)}, {len(b)}")
    rng = np.random.default_rng(seed)
    if subset is not None and subset < len(y):
        keep = rng.permutation(len(y))[:subset]
        y, a, b = y[keep], a[keep], b[keep]
    weights = rng.multinomial(len(y), np.full(len(y), 1.0 / len(y)), size=resamples)
    diff = _balanced_accuracy(weights, y, (a == y).astype(float), num_classes) - (
        _balanced_accuracy(weights, y, (b == y).astype(float), num_classes)
    )
    return round(float(np.std(diff, ddof=1)), 4)


def variance_split(differences, test_sds) -> dict:
    """The across-seed variance of ``differences`` split into the test sample's part (mean of
    the squared per-seed bootstrap sds ``test_sds``) and the training's (module docstring).

    >>> variance_split([0.1, 0.3, 0.2, 0.4], [0.05, 0.05, 0.05, 0.05])["test_share"]
    0.15
    """
    d, s = [float(x) for x in differences], [float(x) for x in test_sds]
    if len(d) != len(s) or len(d) < 2:
        raise ValueError(f"variance_split needs equal lengths >= 2, got {len(d)}, {len(s)}")
    total = spread(d)["sd"] ** 2
    test = sum(x * x for x in s) / len(s)
    return {
        "sd_total": round(math.sqrt(total), 4),
        "sd_test": round(math.sqrt(test), 4),
        "sd_training": round(math.sqrt(max(total - test, 0.0)), 4),
        "test_share": round(test / total, 4) if total > 0 else None,
    }
