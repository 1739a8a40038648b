"""Empirical privacy audit: canaries in the same run -> an epsilon estimate and a lower bound.

An accountant's epsilon is an *upper* bound that holds if the code does what the analysis
assumes (every update clipped to ``C``, noise ``N(0, (sigma C)^2)`` on the sum, Poisson
sampling). An audit measures what a run actually leaks about inserted canaries, so a bug in
clipping, noise or sampling shows up as an audited epsilon *above* the accountant's.

Canaries (Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, ICLR 2024, "One-shot empirical
privacy estimation for federated learning", arXiv 2302.03098): ``m`` canary clients, each a
fixed random direction ``d_i`` (uniform on the unit sphere of the trainable parameters); a canary
that is *inserted* joins the run like a client (sampled each round with the run's Poisson rate
``q``) and contributes ``C d_i``, an update at the clip bound (the worst case the bound
allows); a *held-out* canary is never inserted. Each canary is inserted independently with
probability 1/2 (half in expectation), from OS randomness kept in memory only: the split, the
directions and their seeds are never written to disk (docs/design.md "Privacy invariants" 1).

From the final model delta ``Delta`` (final minus initial trainable parameters), each canary's
score is the cosine ``cos(Delta, d_i)``. Two figures come out:

- :func:`one_shot_epsilon` (Andrew et al., Sec. 3): fit a Gaussian to the inserted canaries'
  cosines and one to the held-out ones; the estimate is the epsilon at ``delta`` of the
  mechanism that outputs one draw from either Gaussian (pooled variance by default, see there).
  An *estimate*, not a bound: it can fall on either side of the true epsilon by sampling error.
- :func:`one_run_lower_bound` (Steinke, Nasr, Jagielski, NeurIPS 2023, "Privacy auditing with
  one (1) training run", Thm. 3 and its p-value): guess "inserted" for the highest scores and
  "held out" for the lowest, abstain on the rest; if the run were (epsilon, delta)-DP, the
  number of correct guesses would be dominated by ``Binomial(r, e^eps / (1 + e^eps))`` plus a
  ``delta`` term; the largest epsilon that this rejects at level ``1 - confidence`` is a
  *provable* lower bound on the run's true epsilon, with that confidence.

What the audit shows and what it does not: both figures concern an adversary who sees only the
final model (the accountant's guarantee also covers every round's release, so a correct run's
audit is expected to sit well below the accountant's epsilon), for this run's threat model
(client-level, add/remove). A lower bound far below the accountant's epsilon does not prove the
accountant tight, and no audit proves the implementation correct; an audited epsilon above the
accountant's does prove a bug (at the stated confidence). Canaries are not users: they change
the model a little (``m/2 * q`` canaries of norm ``C`` in an expected cohort of ``n``) and the
accountant's epsilon for the real clients is unchanged (the noise is calibrated to ``n = qK``,
real clients only).

Decisions (ours): cosine scores; a pooled variance in the one-shot fit; the guess counts ``r`` tried by the lower bound are a fixed grid
of fractions of ``m`` with a Bonferroni correction over the grid; the Gaussian fits use the
sample mean and standard deviation.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import optimize, stats

__all__ = [
    "AUDIT_NOTE",
    "CanarySet",
    "audit_summary",
    "gaussian_mechanism_epsilon",
    "gaussian_pair_epsilon",
    "one_run_lower_bound",
    "one_run_p_value",
    "one_shot_epsilon",
    "plot_audit_cosines",
]

AUDIT_NOTE = (
    "the audit inserts canary clients (random directions at the clip bound, each inserted with "
    "probability 1/2 and then sampled like a client) and scores them by the cosine of the "
    "final model delta; epsilon_one_shot is an estimate (Andrew et al. 2024), "
    "epsilon_lower_bound a provable lower bound at the stated confidence (Steinke et al. 2023), "
    "both for an adversary who sees the final model only. An audited figure above the "
    "accountant's epsilon means a bug in clipping, noise or sampling; one below it does not "
    "prove the implementation correct or the accountant tight. Canaries are not users: the "
    "accountant's epsilon covers the real clients and is unchanged by them"
)
#: Fractions of the canaries the lower bound guesses on (Bonferroni-corrected over the grid).
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


# ----------------------------------------------------------------------------- canaries
class CanarySet:
    """``m`` canary directions over named tensors, each inserted with probability 1/2.

    Directions are regenerated from per-canary seeds on demand (``m`` full-size vectors are
    never held), normalised over all tensors together: ``sum_k ||d_i[k]||^2 = 1``.

    Arguments
    ---------
    num_canaries : int
        ``m`` >= 2.
    shapes : mapping of str to tuple
        The trainable tensors' names and shapes (the update's keys).
    seed : int, optional
        ``None`` (default): directions and split from the OS (:mod:`secrets`), in memory only.
        An integer is for tests (reproducible canaries, predictable split).

    Example
    -------
    >>> canaries = CanarySet(8, {"w": (3, 4), "b": (4,)}, seed=0)
    >>> d = canaries.direction(0)
    >>> round(float(sum((v ** 2).sum() for v in d.values())), 6)
    1.0
    >>> len(canaries.inserted) + len(canaries.held_out)
    8
    >>> u = canaries.update(0, 2.0)
    >>> round(float(sum((v ** 2).sum() for v in u.values())) ** 0.5, 6)
    2.0
    """

    def __init__(
        self, num_canaries: int, shapes: Mapping[str, Sequence[int]], *, seed: int | None = None
    ) -> None:
        if isinstance(num_canaries, bool) or not isinstance(num_canaries, int):
            raise ValueError(f"num_canaries must be an integer >= 2, got {num_canaries!r}")
        if num_canaries < 2:
            raise ValueError(f"num_canaries must be >= 2, got {num_canaries}")
        if not shapes:
            raise ValueError("shapes is empty: the canaries need the trainable tensors")
        self.num_canaries = num_canaries
        self.shapes = {k: tuple(int(s) for s in v) for k, v in shapes.items()}
        self.seeded_from_os = seed is None
        entropy = secrets.randbits(128) if seed is None else int(seed)
        rng = np.random.default_rng(np.random.SeedSequence(entropy))
        self._seeds = [int(s) for s in rng.integers(0, 2**62, size=num_canaries)]
        self.is_inserted = rng.random(num_canaries) < 0.5

    @property
    def inserted(self) -> list[int]:
        """Indices of the inserted canaries."""
        return [int(i) for i in np.flatnonzero(self.is_inserted)]

    @property
    def held_out(self) -> list[int]:
        """Indices of the held-out canaries (never inserted)."""
        return [int(i) for i in np.flatnonzero(~self.is_inserted)]

    def direction(self, index: int) -> dict[str, torch.Tensor]:
        """Unit direction ``d_i`` (float32 tensors keyed like the update)."""
        gen = torch.Generator().manual_seed(self._seeds[index])
        parts = {k: torch.randn(shape, generator=gen) for k, shape in self.shapes.items()}
        norm = math.sqrt(math.fsum(float((v.double() ** 2).sum()) for v in parts.values()))
        return {k: v / norm for k, v in parts.items()}

    def update(
        self, index: int, budgets: float | Mapping[str, float], *, layout=None
    ) -> dict[str, torch.Tensor]:
        """The canary's update at the clip bound: ``C d_i``, or per group ``C_l d_l / ||d_l||``.

        With a flat budget ``C`` the update is ``C d_i`` (norm ``C``). With per-group budgets
        (a mapping and the run's :class:`~speechbrain_fl.privacy.layout.Layout`) every group's
        part of ``d_i`` is scaled to its budget ``C_l``, so the joint norm is
        ``sqrt(sum_l C_l^2) = C``: each group at its bound, the worst case the budgets allow.
        """
        d = self.direction(index)
        if not isinstance(budgets, Mapping):
            return {k: float(budgets) * v for k, v in d.items()}
        if layout is None:
            raise ValueError("per-group budgets need the layout (group -> tensor names)")
        out = {}
        for group in layout:
            names = group.parameter_names
            norm = math.sqrt(math.fsum(float((d[n].double() ** 2).sum()) for n in names))
            scale = float(budgets[group.name]) / norm if norm > 0 else 0.0
            out.update({n: scale * d[n] for n in names})
        return out

    def cosines(self, delta: Mapping[str, torch.Tensor]) -> np.ndarray:
        """``cos(Delta, d_i)`` of every canary (0 for a zero ``Delta``)."""
        missing = sorted(set(self.shapes) - set(delta))
        if missing:
            raise ValueError(f"delta lacks the tensors {missing[:3]} the canaries span")
        flat = {k: delta[k].detach().to(torch.float64).reshape(-1) for k in self.shapes}
        norm = math.sqrt(math.fsum(float((v**2).sum()) for v in flat.values()))
        if norm == 0:
            return np.zeros(self.num_canaries)
        out = np.empty(self.num_canaries)
        for i in range(self.num_canaries):
            d = self.direction(i)
            out[i] = math.fsum(
                float(torch.dot(flat[k], d[k].to(torch.float64).reshape(-1))) for k in flat
            )
        return out / norm


# ----------------------------------------------------------------------------- one-shot
def _delta_of_pair(eps: float, mu_p, s_p, mu_q, s_q) -> float:
    """``int max(0, p(x) - e^eps q(x)) dx`` for Gaussians p, q (numerically, on a fine grid)."""
    lo = min(mu_p - 12 * s_p, mu_q - 12 * s_q)
    hi = max(mu_p + 12 * s_p, mu_q + 12 * s_q)
    x = np.linspace(lo, hi, 40001)
    logp = stats.norm.logpdf(x, mu_p, s_p)
    logq = stats.norm.logpdf(x, mu_q, s_q)
    gap = np.clip(np.exp(logp) - np.exp(eps + logq), 0.0, None)
    return float(np.trapezoid(gap, x))


def _smallest_epsilon(excess, *, cap: float, xtol: float) -> float:
    """The smallest eps >= 0 with ``excess(eps) <= 0`` for a decreasing ``excess`` (the delta of
    a privacy curve at eps, minus the target delta): 0 when already met at 0, ``inf`` when not
    met below ``cap``, else the root bracketed by doubling and found by Brent's method."""
    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2.0
        if high > cap:
            return math.inf
    return float(optimize.brentq(excess, 0.0, high, xtol=xtol))


def gaussian_pair_epsilon(
    mean_in: float, std_in: float, mean_out: float, std_out: float, *, delta: float
) -> float:
    """Epsilon at ``delta`` of a mechanism that outputs one draw of ``N(mean_in, std_in^2)`` or
    ``N(mean_out, std_out^2)``: the smallest eps with ``max(delta_{P,Q}(eps), delta_{Q,P}(eps))
    <= delta``, ``delta_{P,Q}(eps) = int max(0, p - e^eps q)`` (the hockey-stick divergence).

    For equal stds it is the Gaussian mechanism with ``mu = |mean_in - mean_out| / std``.

    Example
    -------
    >>> round(gaussian_pair_epsilon(1.0, 1.0, 0.0, 1.0, delta=1e-5), 2)
    4.38
    """
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if not (std_in > 0 and std_out > 0):
        raise ValueError(f"the stds must be > 0, got {std_in!r} and {std_out!r}")

    def excess(eps: float) -> float:
        return (
            max(
                _delta_of_pair(eps, mean_in, std_in, mean_out, std_out),
                _delta_of_pair(eps, mean_out, std_out, mean_in, std_in),
            )
            - delta
        )

    return _smallest_epsilon(excess, cap=1e3, xtol=1e-6)


def gaussian_mechanism_epsilon(mu: float, *, delta: float) -> float:
    """Epsilon at ``delta`` of ``N(mu, 1)`` against ``N(0, 1)`` (mu-GDP; Balle and Wang 2018):
    the root of ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta``.

    Example
    -------
    >>> round(gaussian_mechanism_epsilon(1.0, delta=1e-5), 2)
    4.38
    """
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    mu = abs(float(mu))
    if mu == 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf

    def excess(eps: float) -> float:
        return (
            stats.norm.cdf(-eps / mu + mu / 2)
            - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
            - delta
        )

    return _smallest_epsilon(excess, cap=1e4, xtol=1e-9)


def one_shot_epsilon(
    inserted: Sequence[float],
    held_out: Sequence[float],
    *,
    delta: float,
    equal_variance: bool = True,
):
    """Andrew et al. (2024) one-shot estimate from the two sets of canary cosines.

    Fits a Gaussian to the inserted canaries' cosines and one to the held-out ones and returns
    the epsilon at ``delta`` of telling one draw of either apart. With ``equal_variance``
    (default, our choice) both fits share the pooled standard deviation ``s``, so the estimate is
    the Gaussian mechanism's epsilon at ``mu = (mean_in - mean_out) / s``
    (:func:`gaussian_mechanism_epsilon`): with a few hundred canaries a separately fitted
    variance is dominated by sampling error, and at ``delta = 1e-5`` the tails of two Gaussians
    of different widths inflate epsilon (we measured 3.2 against an exact 2.0 with 500 + 500
    canaries). ``equal_variance=False`` fits both (:func:`gaussian_pair_epsilon`). Returns
    ``None`` when either set has fewer than 2 values, and 0 when the inserted mean is not above
    the held-out one.

    Example
    -------
    >>> rng = np.random.default_rng(0)
    >>> est = one_shot_epsilon(rng.normal(1, 1, 4000), rng.normal(0, 1, 4000), delta=1e-5)
    >>> 4.0 < est < 4.8
    True
    """
    a, b = np.asarray(inserted, float), np.asarray(held_out, float)
    if a.size < 2 or b.size < 2:
        return None
    gap = float(a.mean() - b.mean())
    if gap <= 0:
        return 0.0
    var_a, var_b = float(a.var(ddof=1)), float(b.var(ddof=1))
    if equal_variance:
        pooled = math.sqrt(((a.size - 1) * var_a + (b.size - 1) * var_b) / (a.size + b.size - 2))
        return gaussian_mechanism_epsilon(gap / pooled if pooled > 0 else math.inf, delta=delta)
    tiny = 1e-12 * max(1.0, abs(float(a.mean())), abs(float(b.mean())))
    return gaussian_pair_epsilon(
        float(a.mean()),
        max(math.sqrt(var_a), tiny),
        float(b.mean()),
        max(math.sqrt(var_b), tiny),
        delta=delta,
    )


# ----------------------------------------------------------------------------- one-run bound
def one_run_p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Steinke et al. (2023, Thm. 3) p-value of ``>= v`` correct guesses out of ``r``.

    Under the null hypothesis that the run is (epsilon, delta)-DP with respect to each of ``m``
    canaries included independently with probability 1/2:
    ``P[W >= v] <= P[Bin(r, p) >= v] + 2 m delta * max_{1<=i<=v} P[v-i <= Bin(r, p) < v] / i``,
    ``p = e^eps / (1 + e^eps)``.

    Example
    -------
    >>> round(one_run_p_value(m=100, r=100, v=80, epsilon=0.0, delta=0.0), 6)
    0.0
    >>> 0.4 < one_run_p_value(m=100, r=100, v=50, epsilon=0.0, delta=0.0) < 0.6
    True
    """
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))
    if delta == 0 or v == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)  # P[Bin = v-1], P[= v-2], ...
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def one_run_lower_bound(
    scores: Sequence[float],
    inserted: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    fractions: Sequence[float] = GUESS_FRACTIONS,
) -> dict[str, float]:
    """Provable epsilon lower bound from one run (Steinke et al. 2023), at ``confidence``.

    For each fraction ``f`` of the ``m`` canaries, guess "inserted" for the ``ceil(f m / 2)``
    highest scores and "held out" for as many lowest ones (abstain on the rest); count the
    correct guesses ``v`` of ``r``, and find the largest epsilon whose p-value
    (:func:`one_run_p_value`) stays below ``(1 - confidence) / len(fractions)`` (Bonferroni).
    The bound is the largest over the grid.

    Returns
    -------
    dict
        ``epsilon`` (0 when nothing is rejected), ``confidence``, ``guesses`` and ``correct``
        of the fraction that gave it.

    Example
    -------
    >>> rng = np.random.default_rng(0)
    >>> member = rng.random(2000) < 0.5
    >>> scores = rng.normal(0, 1, 2000) + 3.0 * member
    >>> out = one_run_lower_bound(scores, member, delta=1e-5)
    >>> 1.0 < out["epsilon"] < 6.0
    True
    """
    s = np.asarray(scores, float)
    member = np.asarray(inserted, bool)
    if s.shape != member.shape or s.ndim != 1:
        raise ValueError("scores and inserted must be 1-D and of the same length")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    m = s.size
    level = (1.0 - confidence) / len(fractions)
    order = np.argsort(-s, kind="stable")
    best = {"epsilon": 0.0, "confidence": confidence, "guesses": 0, "correct": 0}
    for frac in fractions:
        k = min(m // 2, max(1, math.ceil(frac * m / 2)))
        top, bottom = order[:k], order[m - k :]
        r = 2 * k
        v = int(member[top].sum() + (~member[bottom]).sum())

        def rejected(eps: float, r=r, v=v) -> bool:
            return one_run_p_value(m=m, r=r, v=v, epsilon=eps, delta=delta) < level

        if not rejected(0.0):
            continue
        low, high = 0.0, 1.0
        while rejected(high) and high < 100:
            low, high = high, 2 * high
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if rejected(mid) else (low, mid)
        if low > best["epsilon"]:
            best = {"epsilon": low, "confidence": confidence, "guesses": r, "correct": v}
    return best


# ----------------------------------------------------------------------------- report, plot
def audit_summary(
    cosines: Sequence[float],
    is_inserted: Sequence[bool],
    *,
    delta: float,
    accountant_epsilon: float,
    rounds: int,
    confidence: float = 0.95,
    insertions: int | None = None,
) -> dict[str, Any]:
    """The audit's figures for results.json's privacy block.

    Only summary statistics are returned: no canary's cosine or membership (the split stays in
    memory; :func:`plot_audit_cosines` draws the two distributions from memory).

    Arguments
    ---------
    cosines : sequence of float
        :meth:`CanarySet.cosines` of the final model delta of the rounds the audit covers.
    is_inserted : sequence of bool
        :attr:`CanarySet.is_inserted`.
    delta : float
        The run's delta.
    accountant_epsilon : float
        The accountant's epsilon for the same rounds (printed beside the audit).
    rounds : int
        Rounds the audit covers.
    confidence : float
        Of the lower bound.
    insertions : int, optional
        Total canary insertions over the rounds (its utility cost).

    Returns
    -------
    dict
        ``canaries``, ``inserted``, ``held_out``, ``rounds``, ``insertions``,
        ``epsilon_one_shot``, ``epsilon_lower_bound``, ``confidence``, ``accountant_epsilon``,
        ``exceeds_accountant`` (either audited figure above it), ``cosine_mean`` and
        ``cosine_std`` (``{"inserted", "held_out"}``) and ``note``.

    Example
    -------
    >>> rng = np.random.default_rng(1)
    >>> member = rng.random(400) < 0.5
    >>> out = audit_summary(rng.normal(0, 1, 400) + member, member, delta=1e-5,
    ...                     accountant_epsilon=6.0, rounds=1)
    >>> out["exceeds_accountant"], out["epsilon_lower_bound"] < out["epsilon_one_shot"]
    (False, True)
    """
    cos = np.asarray(cosines, float)
    member = np.asarray(is_inserted, bool)
    est = one_shot_epsilon(cos[member], cos[~member], delta=delta)
    bound = one_run_lower_bound(cos, member, delta=delta, confidence=confidence)
    audited = [x for x in (est, bound["epsilon"]) if x is not None]
    return {
        "canaries": int(member.size),
        "inserted": int(member.sum()),
        "held_out": int((~member).sum()),
        "rounds": rounds,
        "insertions": insertions,
        "epsilon_one_shot": est,
        "epsilon_lower_bound": bound["epsilon"],
        "confidence": confidence,
        "lower_bound_guesses": bound["guesses"],
        "lower_bound_correct": bound["correct"],
        "accountant_epsilon": accountant_epsilon,
        "exceeds_accountant": any(x > accountant_epsilon for x in audited),
        "cosine_mean": {
            "inserted": _stat(cos[member], np.mean),
            "held_out": _stat(cos[~member], np.mean),
        },
        "cosine_std": {
            "inserted": _stat(cos[member], np.std),
            "held_out": _stat(cos[~member], np.std),
        },
        "note": AUDIT_NOTE,
    }


def _stat(values: np.ndarray, fn) -> float | None:
    return float(fn(values)) if values.size else None


def plot_audit_cosines(
    cosines: Sequence[float],
    is_inserted: Sequence[bool],
    audit: Mapping[str, Any],
    path: str | Path,
    *,
    scored: str = "final model delta",
) -> Path:
    """Histogram of the inserted and held-out canaries' cosines (``plots/audit_cosines.png``).

    Arguments
    ---------
    cosines, is_inserted : sequence
        As for :func:`audit_summary` (from memory; the plot shows no canary's index).
    audit : mapping
        :func:`audit_summary`'s output (the figures in the title).
    path : str or Path
        The PNG to write (its folder is created).
    scored : str
        What each canary's direction was compared with (the x axis): the final model delta in
        DP-FedAvg; ``theta_0 - theta_T`` for gradient canaries in DP-SGD, whose inserted
        gradients push the model against their direction.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cos, member = np.asarray(cosines, float), np.asarray(is_inserted, bool)
    ins, out = cos[member].tolist(), cos[~member].tolist()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = np.asarray(ins + out, float)
    bins = np.linspace(values.min(), values.max(), 30) if values.size else 10
    ax.hist(out, bins=bins, alpha=0.6, label=f"held out ({len(out)})")
    ax.hist(ins, bins=bins, alpha=0.6, label=f"inserted ({len(ins)})")
    one_shot = audit.get("epsilon_one_shot")
    ax.set_title(
        "canary cosines: eps one-shot "
        + ("n/a" if one_shot is None else f"{one_shot:.3g}")
        + f", lower bound {audit['epsilon_lower_bound']:.3g} "
        f"({100 * audit['confidence']:.0f}%), accountant {audit['accountant_epsilon']:.3g}",
        fontsize=8,
    )
    ax.set_xlabel(f"cos({scored}, canary direction)")
    ax.set_ylabel("canaries")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
