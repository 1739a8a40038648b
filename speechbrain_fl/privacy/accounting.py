"""(epsilon, delta) accounting: PLD by default, RDP beside it (docs/design.md contract 5).

One FL round is one application of the sampled Gaussian mechanism: each client joins the cohort
with probability ``q`` (Poisson sampling), its clipped update has L2 sensitivity ``C`` and the
server adds ``N(0, (sigma C)^2)`` to the sum (``(sigma C / n)^2`` on the mean). ``T`` rounds
compose, so the guarantee is an accountant evaluated at ``(sigma, q, T)``: client-level DP for a
population of ``K = n / q`` clients under add/remove adjacency.

Accountants (``accountant=``):

- ``"pld"`` (default): the privacy loss distribution of Google's ``dp-accounting``
  (``PLDAccountant``; Koskela et al. 2020, Doroshenko et al. 2022), composed by FFT with
  pessimistic discretisation (interval :data:`PLD_DISCRETIZATION`, wider in proportion above an
  RDP epsilon of 2: :func:`pld_interval`), so the epsilon it reports is an upper bound on the
  exact one and the tightest of the three here.
- ``"rdp"``: Opacus's ``RDPAccountant`` (Mironov et al. 2019, Balle et al. 2020 conversion); an
  upper bound too, looser by about 10% at the recipes' settings (10.46 PLD vs 11.54 RDP at
  ``q=0.5, sigma=1, T=10, delta=1e-5``; tests/unit/test_privacy_accounting.py). Every report
  carries it beside the default as a cross-check (``epsilon_rdp``).
- ``"prv"``: Opacus's ``PRVAccountant`` (Gopi et al. 2021).

The sigma search (:func:`noise_multiplier_for_epsilon`), the running accountant and the cohort
extrapolation use whichever accountant they are given, so a run's sigma, its epsilon and its
extrapolation agree.

Per-component privacy (paper Section IV-A4): a component whose clipped contribution is bounded
by its budget ``C_L`` sees the same noise ``sigma C`` as a mechanism with multiplier
``sigma_eff = sigma C / C_L`` (e.g. ``sigma / sqrt(alpha)`` for the alpha-split encoder), so
its sub-vector alone is released with the epsilon of ``(sigma_eff, q, T)``. The joint
guarantee is always the one of ``(sigma, q, T)``. :func:`effective_noise_multiplier` is the one
place that formula lives; :func:`privacy_report` applies it to the pools of a finished run.

Opacus and dp-accounting are imported on first use, inside the functions that call them: a
non-private run never needs them, and importing them costs ~1 s or more of its start-up
(``benchmarks/fl_overhead.py``). The RDP figures (``"rdp"``, the per-round figure, the report's
cross-check, the PLD grid's width) need only Opacus's RDP analysis,
``opacus/accountants/analysis/rdp.py``, a module of pure functions over NumPy and SciPy;
importing it the usual way runs the ``opacus`` package's ``__init__`` first (its
``PrivacyEngine``, the grad samplers, the optimisers): ~0.3 s on the 2-core test machine
beyond ``torch._dynamo``, which that import also pulls in (~0.3 s more) and which a process's
first ``torch.optim`` optimiser imports anyway; the RDP arithmetic itself takes ~0.1 s.
:func:`_rdp_analysis` loads that one file of the installed Opacus on its own instead (the same
code; the package's own module when ``opacus`` is already imported, the usual import should
the file ever need its package), at Opacus's default orders :data:`RDP_ORDERS`
(``RDPAccountant.DEFAULT_ALPHAS``, checked equal in tests/unit/test_privacy_accounting_rdp.py).
Why hand-written: Python imports a submodule only after its package's ``__init__``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from .budgets import alpha_split_pools, check_clip, component_budgets
from .layout import Layout

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_ACCOUNTANT",
    "OPACUS_ACCOUNTANTS",
    "PrivacyAccountant",
    "REPORT_POOLS",
    "compute_epsilon",
    "component_privacy",
    "effective_noise_multiplier",
    "effective_noise_multipliers",
    "extrapolate_privacy",
    "noise_multiplier_for_epsilon",
    "pld_interval",
    "privacy_report",
]

logger = logging.getLogger(__name__)

ACCOUNTANTS = ("pld", "rdp", "prv")
#: The accountants Opacus's ``PrivacyEngine`` knows (DP-SGD paths that account with it).
OPACUS_ACCOUNTANTS = ("rdp", "prv")
DEFAULT_ACCOUNTANT = "pld"
#: Width of the PLD's privacy-loss grid (dp-accounting's default): epsilon is pessimistic, i.e.
#: rounded up, by at most about this much per composition (our tests bound it at q=1).
PLD_DISCRETIZATION = 1e-4
#: RDP epsilon above which the PLD grid widens in proportion (see :func:`pld_interval`).
PLD_COARSE_ABOVE = 2.0
LARGE_EPSILON = 10.0
#: Opacus's default RDP orders (``opacus.accountants.RDPAccountant.DEFAULT_ALPHAS`` of Opacus
#: 1.5-1.6), the orders of every RDP figure here.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
#: Where Opacus keeps its RDP analysis, and the name it is loaded under by :func:`_rdp_analysis`.
_RDP_MODULE = "opacus.accountants.analysis.rdp"
_RDP_STANDALONE = "speechbrain_fl.privacy._opacus_rdp_analysis"


@functools.lru_cache(maxsize=1)
def _rdp_analysis() -> ModuleType:
    """Opacus's RDP analysis module (``compute_rdp``, ``get_privacy_spent``), see the module
    docstring: Opacus's own when the package is imported, else the installed file loaded on its
    own (under a private name, so a later ``import opacus`` builds its own as usual); the usual
    import when that fails (no such file, a file that needs its package or raises)."""
    loaded = sys.modules.get(_RDP_MODULE)
    if loaded is not None:
        return loaded
    try:
        package = importlib.util.find_spec("opacus")
        folder = (package.submodule_search_locations or [None])[0] if package else None
        path = Path(folder, "accountants", "analysis", "rdp.py") if folder else None
        if path is not None and path.is_file():
            spec = importlib.util.spec_from_file_location(_RDP_STANDALONE, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if callable(getattr(module, "compute_rdp", None)) and callable(
                getattr(module, "get_privacy_spent", None)
            ):
                return module
    except Exception:  # noqa: BLE001  (e.g. a relative import: the file needs its package)
        pass
    return importlib.import_module(_RDP_MODULE)


def _check(*, sampling_rate=None, noise_multiplier=None, rounds=None, delta=None, accountant=None):
    if sampling_rate is not None and not (0.0 < sampling_rate <= 1.0):
        raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate!r}")
    if noise_multiplier is not None and not (
        math.isfinite(noise_multiplier) and noise_multiplier >= 0
    ):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    if rounds is not None and (
        isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0
    ):
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    if delta is not None and not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if accountant is not None and accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; expected one of {ACCOUNTANTS}")


def _warn_large(epsilon: float, what: str) -> None:
    if epsilon > LARGE_EPSILON:
        msg = f"{what}: epsilon = {epsilon:.4g} exceeds {LARGE_EPSILON:g}; the DP guarantee is weak"
        logger.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)


@functools.lru_cache(maxsize=256)
def _rdp_per_step(sampling_rate: float, noise_multiplier: float):
    """RDP of one step of the sampled Gaussian mechanism at Opacus's default orders (cached).

    RDP composes additively, ``RDP_T(alpha) = T RDP_1(alpha)`` (Mironov 2017, Prop. 1), which is
    how Opacus's ``compute_rdp`` scales ``steps`` too, so ``T`` rounds cost one multiplication
    and the (eps, delta) conversion instead of the per-order series again.
    """
    return _rdp_analysis().compute_rdp(
        q=sampling_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(RDP_ORDERS)
    )


@functools.lru_cache(maxsize=64)
def _pld_one_step(sampling_rate: float, noise_multiplier: float, interval: float):
    """The PLD of one Poisson-subsampled Gaussian step, as ``PLDAccountant`` builds it (cached).

    Building it is most of an epsilon's cost (~1.2 s of ~1.4 s at q=0.5, sigma=1 on one CPU
    thread; the ``T``-fold self-composition and the epsilon search are the rest), and it
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


def _pld_epsilon(sampling_rate: float, noise_multiplier: float, rounds: int, delta: float):
    """Epsilon of ``rounds`` Poisson-subsampled Gaussian steps from dp-accounting's PLD.

    The event is ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` under add/remove
    adjacency (``NeighboringRelation.ADD_OR_REMOVE_ONE``), the adjacency of the guarantee.

    The grid's width is :func:`pld_interval`'s. If the PLD cannot be computed (a noise
    multiplier so small that its grid does not fit in memory), the RDP figure, also an upper
    bound, is returned with a warning.
    """
    from dp_accounting.pld import privacy_loss_distribution as _pld_module

    eps_rdp = _epsilon(sampling_rate, noise_multiplier, rounds, delta, "rdp")
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


@functools.lru_cache(maxsize=4096)
def _epsilon(sampling_rate, noise_multiplier, rounds, delta, accountant) -> float:
    """The accountant's epsilon of ``rounds`` steps of one ``(q, sigma)``, cached per process.

    A pure function of hashable arguments; the server asks for the same value several times a
    round (telemetry, the ``max_epsilon`` check, the strategy's metrics), so each distinct value
    is computed once. ``"rdp"`` reuses the cached per-step RDP (same arithmetic as Opacus's
    ``RDPAccountant.get_epsilon``, tested equal in tests/unit/test_fl_speed.py).
    """
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    if accountant == "rdp":
        rdp = _rdp_per_step(float(sampling_rate), float(noise_multiplier)) * int(rounds)
        eps, _ = _rdp_analysis().get_privacy_spent(
            orders=list(RDP_ORDERS), rdp=rdp, delta=delta
        )
        return float(eps)
    if accountant == "pld":
        return _pld_epsilon(float(sampling_rate), float(noise_multiplier), int(rounds), delta)
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(noise_multiplier), float(sampling_rate), int(rounds))]
    return float(acc.get_epsilon(delta=delta))


def compute_epsilon(
    *,
    sampling_rate: float,
    noise_multiplier: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    warn: bool = True,
) -> float:
    """Epsilon after ``rounds`` of the sampled Gaussian mechanism (Opacus accountant).

    Arguments
    ---------
    sampling_rate : float
        Client sampling rate ``q`` in (0, 1].
    noise_multiplier : float
        ``sigma`` >= 0 (0 gives ``inf``).
    rounds : int
        Number of rounds ``T`` >= 0.
    delta : float
        Target delta in (0, 1).
    accountant : str
        ``"pld"`` (default; dp-accounting's ``PLDAccountant``), ``"rdp"`` (Opacus
        ``RDPAccountant``, Mironov et al. 2019 + Balle et al. 2020 conversion) or ``"prv"``
        (Opacus ``PRVAccountant``, Gopi et al. 2021).
    warn : bool
        Warn (logging and ``warnings``) when epsilon exceeds 10.

    Returns
    -------
    float

    Example
    -------
    >>> round(compute_epsilon(sampling_rate=0.04, noise_multiplier=1.5, rounds=2250,
    ...                       delta=1e-5, accountant="rdp"), 6)
    7.329111
    >>> round(compute_epsilon(sampling_rate=0.04, noise_multiplier=1.5, rounds=2250,
    ...                       delta=1e-5), 2)
    6.77
    """
    _check(
        sampling_rate=sampling_rate,
        noise_multiplier=noise_multiplier,
        rounds=rounds,
        delta=delta,
        accountant=accountant,
    )
    eps = _epsilon(sampling_rate, noise_multiplier, rounds, delta, accountant)
    if warn:
        _warn_large(eps, f"q={sampling_rate}, sigma={noise_multiplier}, T={rounds}")
    return eps


def noise_multiplier_for_epsilon(
    *,
    sampling_rate: float,
    target_epsilon: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest ``sigma`` (to the bisection tolerance) reaching ``target_epsilon`` after ``rounds``.

    Bisection on ``sigma`` until the epsilon is within ``epsilon_tolerance`` *below* the target
    (the returned sigma always meets it). ``"rdp"`` and ``"prv"`` use Opacus's
    :func:`~opacus.accountants.utils.get_noise_multiplier`; ``"pld"`` the same search on
    :func:`compute_epsilon`, so the sigma a run derives and the epsilon it reports come from one
    accountant.

    Example
    -------
    >>> round(noise_multiplier_for_epsilon(sampling_rate=0.04, target_epsilon=8.0,
    ...                                    rounds=2000, delta=1e-5, accountant="rdp"), 4)
    1.3562
    """
    _check(sampling_rate=sampling_rate, rounds=rounds, delta=delta, accountant=accountant)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    if rounds == 0:
        return 0.0
    _warn_large(target_epsilon, "target")
    if accountant == "pld":
        return _pld_noise_multiplier(
            sampling_rate=sampling_rate,
            target_epsilon=target_epsilon,
            rounds=rounds,
            delta=delta,
            epsilon_tolerance=epsilon_tolerance,
        )
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sampling_rate,
            steps=rounds,
            accountant=accountant,
            epsilon_tolerance=epsilon_tolerance,
        )
    )


def _pld_noise_multiplier(
    *,
    sampling_rate: float,
    target_epsilon: float,
    rounds: int,
    delta: float,
    epsilon_tolerance: float,
) -> float:
    """Bisection of :func:`noise_multiplier_for_epsilon` on the PLD epsilon (monotone in sigma)."""

    def eps(sigma: float) -> float:
        return _epsilon(sampling_rate, sigma, rounds, delta, "pld")

    low, high = 0.0, 1.0
    while eps(high) > target_epsilon:
        low, high = high, 2.0 * high
        if high > 1e6:
            raise ValueError(
                f"no sigma below 1e6 reaches epsilon {target_epsilon} at q={sampling_rate}, "
                f"T={rounds}, delta={delta}"
            )
    while True:
        value = eps(high)
        if target_epsilon - epsilon_tolerance <= value <= target_epsilon:
            return high
        mid = (low + high) / 2.0
        if high - low < 1e-9:
            return high
        if eps(mid) > target_epsilon:
            low = mid
        else:
            high = mid


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
        _check(
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
            _warn_large(eps, f"q={self.sampling_rate}, sigma={self.noise_multiplier}, T={rounds}")
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


def effective_noise_multiplier(*, noise_multiplier: float, clip: float, budget: float) -> float:
    """``sigma_eff = sigma * C / C_P`` of a sub-vector whose clipped norm is at most ``C_P``.

    The noise ``N(0, (sigma C)^2 I)`` added to the sum covers every coordinate, so a part of the
    update with sensitivity ``C_P <= C`` is released like a Gaussian mechanism with multiplier
    ``sigma C / C_P`` (paper Section IV-A4); e.g. ``sigma / sqrt(alpha)`` for the alpha-split
    encoder pool (docs/design.md contract 2). A part with no budget is never released: ``inf``.

    Example
    -------
    >>> round(effective_noise_multiplier(noise_multiplier=0.1, clip=1.0, budget=0.05**0.5), 4)
    0.4472
    """
    return noise_multiplier * clip / budget if budget > 0 else math.inf


def effective_noise_multipliers(
    layout: Layout, budgets: float | Mapping[str, float], *, clip: float, noise_multiplier: float
) -> dict[str, float]:
    """Per-component effective noise multiplier ``sigma * C / C_L`` (paper Section IV-A4).

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> from speechbrain_fl.privacy.budgets import compute_budgets
    >>> lay = Layout([Group("e", "encoder", 8), Group("l", "llm", 8)])
    >>> b = compute_budgets(lay, method="alpha_split", clip=1.0, alpha=0.05)
    >>> {k: round(v, 3) for k, v in effective_noise_multipliers(
    ...     lay, b, clip=1.0, noise_multiplier=0.1).items()}
    {'encoder': 0.447, 'llm': 0.103}
    """
    clip = check_clip(clip)
    _check(noise_multiplier=noise_multiplier)
    return {
        label: effective_noise_multiplier(noise_multiplier=noise_multiplier, clip=clip, budget=cb)
        for label, cb in component_budgets(layout, budgets).items()
    }


def component_privacy(
    layout: Layout,
    budgets: float | Mapping[str, float],
    *,
    clip: float,
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> dict[str, dict[str, float]]:
    """Budget, effective sigma and epsilon of each component label.

    The component epsilon is the one of the same mechanism run with ``sigma_eff``: what an
    observer learns about that component's sub-vector alone. It is *not* a replacement for the
    joint epsilon (:func:`compute_epsilon` with ``sigma``), which covers the whole update.

    Returns
    -------
    dict of str to dict
        ``{label: {"budget", "sigma_eff", "epsilon"}}``.
    """
    out = {}
    budgets_c = component_budgets(layout, budgets)
    sig = effective_noise_multipliers(layout, budgets, clip=clip, noise_multiplier=noise_multiplier)
    for label, cb in budgets_c.items():
        eps = (
            0.0
            if math.isinf(sig[label])
            else compute_epsilon(
                sampling_rate=sampling_rate,
                noise_multiplier=sig[label],
                rounds=rounds,
                delta=delta,
                accountant=accountant,
                warn=False,
            )
        )
        out[label] = {"budget": cb, "sigma_eff": sig[label], "epsilon": eps}
    return out


def extrapolate_privacy(
    *,
    noise_multiplier: float,
    clip: float,
    cohort_size: int,
    population: int,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> dict[str, float]:
    """What the same ``sigma`` gives at a deployment's cohort size and population.

    pfl-research's ``noise_cohort_size`` idea: a simulation with a few clients reports the noise
    std ``sigma C / n'`` on the mean and the epsilon at ``q' = n' / K'`` of a deployment with
    expected cohort ``n'`` out of ``K'`` clients. To *simulate* that deployment's
    signal-to-noise, add noise of std ``sigma C / n'`` to the simulated mean.

    Returns
    -------
    dict
        ``{"noise_multiplier", "clip", "cohort_size", "population", "sampling_rate", "rounds",
        "delta", "accountant", "noise_std", "epsilon"}``.

    Example
    -------
    >>> out = extrapolate_privacy(noise_multiplier=1.0, clip=1.0, cohort_size=1000,
    ...                           population=100000, rounds=100, delta=1e-6)
    >>> out["noise_std"], out["sampling_rate"]
    (0.001, 0.01)
    """
    clip = check_clip(clip)
    for key, val in (("cohort_size", cohort_size), ("population", population)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{key} must be a positive integer, got {val!r}")
    if cohort_size > population:
        raise ValueError(f"cohort_size {cohort_size} exceeds population {population}")
    q = cohort_size / population
    eps = compute_epsilon(
        sampling_rate=q,
        noise_multiplier=noise_multiplier,
        rounds=rounds,
        delta=delta,
        accountant=accountant,
    )
    return {
        "noise_multiplier": float(noise_multiplier),
        "clip": clip,
        "cohort_size": cohort_size,
        "population": population,
        "sampling_rate": q,
        "rounds": rounds,
        "delta": delta,
        "accountant": accountant,
        "noise_std": noise_multiplier * clip / cohort_size,
        "epsilon": eps,
    }


# The pools a run's privacy report covers: the alpha-split paper's (Section IV-A1), the encoder
# and the LLM together with the connector. Any other component label is its own pool.
REPORT_POOLS: dict[str, tuple[str, ...]] = {p.name: p.components for p in alpha_split_pools(0.5)}


def privacy_report(
    layout: Layout,
    round_budgets: Sequence[Mapping[str, float]],
    *,
    noise_multiplier: float,
    clip: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    pools: Mapping[str, Sequence[str]] | None = None,
) -> dict:
    """Joint epsilon and, per pool, the effective noise multiplier and epsilon of a run.

    A pool's budget in a round is ``min(C, sqrt(sum_{c in pool} C_c^2))`` from the round's
    component budgets ``C_c``; a component without a recorded budget (a flat budget over several
    components) counts as ``C``, since a flat clip bounds every sub-vector by ``C``. When the
    budgets move between rounds (the EMA methods) the *largest* budget a pool had in any round,
    hence its smallest ``sigma_eff``, is reported: a conservative figure. The pool epsilon is the
    one of ``(sigma_eff, q, T)`` (:func:`effective_noise_multiplier`); it covers that pool's
    sub-vector only, the joint ``epsilon`` covers the whole update.

    Arguments
    ---------
    layout : Layout
        The run's trainable groups (their component labels name the pools' members).
    round_budgets : sequence of mapping
        Per trained round, ``{component: budget}``.
    noise_multiplier, clip, sampling_rate, delta : float
        The mechanism: ``sigma``, ``C``, ``q`` and the target delta.
    rounds : int
        Accountant steps taken (every Poisson draw).
    accountant : str
        ``"pld"`` (default), ``"rdp"`` or ``"prv"``; the report also carries Opacus's RDP
        figure for the same mechanism as ``epsilon_rdp``, a cross-check (PLD <= RDP).
    pools : mapping, optional
        ``{pool: component labels}``; default :data:`REPORT_POOLS`.

    Returns
    -------
    dict
        ``epsilon``, ``epsilon_rdp``, ``delta``, ``accountant``, ``noise_multiplier``, ``clip``,
        ``sampling_rate``, ``rounds``, ``pools`` (the labels each pool covers), ``sigma_eff`` and
        ``epsilon_per_component`` (both keyed by pool).

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> lay = Layout([Group("e", "encoder", 8), Group("c", "connector", 4), Group("l", "llm", 8)])
    >>> rep = privacy_report(lay, [{"encoder": 0.05**0.5, "connector": 0.5, "llm": 0.5}],
    ...     noise_multiplier=0.1, clip=1.0, sampling_rate=0.5, rounds=2, delta=1e-5)
    >>> {k: round(v, 4) for k, v in rep["sigma_eff"].items()}, rep["pools"]["llm"]
    ({'encoder': 0.4472, 'llm': 0.1414}, ['llm', 'connector'])
    """
    clip = check_clip(clip)
    _check(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, delta=delta)
    labels = list(dict.fromkeys(g.component for g in layout))
    members = {name: list(comps) for name, comps in (pools or REPORT_POOLS).items()}
    claimed = {c for comps in members.values() for c in comps}
    members.update({label: [label] for label in labels if label not in claimed})
    report = {
        "epsilon": compute_epsilon(
            sampling_rate=sampling_rate,
            noise_multiplier=noise_multiplier,
            rounds=rounds,
            delta=delta,
            accountant=accountant,
            warn=False,
        ),
        "epsilon_rdp": compute_epsilon(
            sampling_rate=sampling_rate,
            noise_multiplier=noise_multiplier,
            rounds=rounds,
            delta=delta,
            accountant="rdp",
            warn=False,
        ),
        "delta": delta,
        "accountant": accountant,
        "noise_multiplier": noise_multiplier,
        "clip": clip,
        "sampling_rate": sampling_rate,
        "rounds": rounds,
        "pools": {},
        "sigma_eff": {},
        "epsilon_per_component": {},
    }
    for pool, comps in members.items():
        present = [c for c in comps if c in labels]
        if not present:
            continue
        budget = max(
            (
                min(clip, math.sqrt(math.fsum(budgets.get(c, clip) ** 2 for c in present)))
                for budgets in round_budgets
            ),
            default=clip,
        )
        if budget <= 0:
            continue
        sigma_eff = effective_noise_multiplier(
            noise_multiplier=noise_multiplier, clip=clip, budget=budget
        )
        report["pools"][pool] = present
        report["sigma_eff"][pool] = sigma_eff
        report["epsilon_per_component"][pool] = compute_epsilon(
            sampling_rate=sampling_rate,
            noise_multiplier=sigma_eff,
            rounds=rounds,
            delta=delta,
            accountant=accountant,
            warn=False,
        )
    return report
