"""Per-group clip budgets (docs/api.md, `speechbrain_fl.privacy`; alpha-split paper, Section IV).

The methods live in a registry (:func:`register_budget_method`, :func:`get_budget_method`):
:func:`compute_budgets` looks the method up by name, so a new allocator is one decorated
function. Every built-in allocator except ``flat`` returns one clip norm ``C_l`` per group with
``sqrt(sum_l C_l^2) == C`` ("Euclidean-tight", paper Eq. 9), so the joint L2 sensitivity of a
clipped update is at most ``C`` whatever the method (paper Eq. 14) and the server noise and the
accountant need no change.

- ``flat``: one clip ``C`` over the concatenated update (paper Eq. 3); returned as a float.
- ``pfl_uniform``: ``C_l = C / sqrt(H)``.
- ``pfl_dim``: ``C_l = C * sqrt(p_l / sum_k p_k)`` (Eq. 9).
- ``pfl_dim_ema`` / ``pfl_unif_ema``: ``C_l = C * sqrt(w_l)`` with the EMA weights of
  :class:`EMABudgetState` (Eq. 10-11).
- ``alpha_split``: pools with fractions summing to 1, ``C_l = C * sqrt(f_pool) * sqrt(w_l)``
  with ``w_l`` an inner allocation normalised within the pool (Eq. 12-13 for two pools and the
  ``dim`` inner allocator).

Decisions
---------
- The EMA starts at ``nu_l = 0`` (Eq. 10 taken literally). Because weights are normalised,
  the zero start only rescales every ``nu_l`` by the same ``1 - (1 - beta)^t`` and so acts as a
  bias-corrected EMA; no single early round dominates.
- A pool with no group in the layout (e.g. alpha-split with a frozen encoder, the paper's
  "bare" alpha-Split rows) leaves its share of ``C^2`` unused: the budgets are then *not*
  Euclidean-tight (``sqrt(sum C_l^2) = C * sqrt(1 - f_empty) < C``), which is still a valid,
  smaller sensitivity. A warning says so.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .layout import Layout, check_names

__all__ = [
    "METHODS",
    "BudgetMethod",
    "register_budget_method",
    "unregister_budget_method",
    "get_budget_method",
    "budget_methods",
    "Pool",
    "EMABudgetState",
    "ALPHA_SPLIT_POOLS",
    "alpha_split_pools",
    "compute_budgets",
    "component_budgets",
    "select_alpha",
]

logger = logging.getLogger(__name__)

ALLOCATORS = ("dim", "uniform", "ema")
#: What the EMA budgets are adapted from; the same words as the YAML key ``ema_signal`` and
#: ``FLConfig.ema_signal`` (``speechbrain_fl/fl/config.py``).
SIGNALS = ("noisy", "raw")


def check_clip(clip) -> float:
    """Return ``clip`` as a float, raising ``ValueError`` unless it is finite and > 0."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        raise ValueError(f"clip must be a positive number, got {clip!r}")
    if not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"clip must be a finite positive number, got {clip!r}")
    return float(clip)


def check_alpha(alpha) -> float:
    """Return ``alpha`` as a float, raising ``ValueError`` unless ``0 < alpha < 1``."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha!r}")
    return float(alpha)


def _base_weights(layout: Layout, base: str) -> dict[str, float]:
    """Normalised base weights: ``p_l / sum p`` (dim) or ``1 / H`` (uniform)."""
    if base == "dim":
        total = layout.total_numel
        return {g.name: g.numel / total for g in layout}
    if base == "uniform":
        return {g.name: 1.0 / len(layout) for g in layout}
    raise ValueError(f"unknown base allocation {base!r}; expected 'dim' or 'uniform'")


@dataclass(frozen=True)
class Pool:
    """A budget pool for (generalised) alpha-split.

    Arguments
    ---------
    name : str
        Pool name used in messages and reports.
    components : tuple of str
        Component labels the pool covers.
    fraction : float
        Share of ``C^2`` given to the pool, in (0, 1]; the fractions of all pools sum to 1.
    allocator : str
        Inner allocation within the pool: ``"dim"`` (Eq. 12-13), ``"uniform"`` or ``"ema"``
        (the EMA weights of an :class:`EMABudgetState`, renormalised within the pool).

    Example
    -------
    >>> Pool("encoder", ("encoder",), 0.05).allocator
    'dim'
    """

    name: str
    components: tuple[str, ...]
    fraction: float
    allocator: str = "dim"

    def __post_init__(self):
        comps = (self.components,) if isinstance(self.components, str) else self.components
        object.__setattr__(self, "components", tuple(comps))
        if not self.components:
            raise ValueError(f"pool {self.name!r} covers no component")
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(f"pool {self.name!r}: fraction must lie in (0, 1], got {f!r}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(
                f"pool {self.name!r}: unknown allocator {self.allocator!r}; expected one of "
                f"{ALLOCATORS}"
            )


#: The paper's two alpha-split pools (Section IV-A1): name and component labels. The only
#: place the pools are defined; the first gets the fraction alpha, the second 1 - alpha.
ALPHA_SPLIT_POOLS = (("encoder", ("encoder",)), ("llm", ("llm", "connector")))


def alpha_split_pools(alpha: float, *, allocator: str = "dim") -> list[Pool]:
    """The paper's two pools (:data:`ALPHA_SPLIT_POOLS`): ``{encoder}`` with ``alpha``,
    ``{llm, connector}`` with ``1 - alpha``.

    Arguments
    ---------
    alpha : float
        Encoder budget fraction, strictly between 0 and 1 (paper Section IV-A1).
    allocator : str
        Inner allocator of both pools (``"dim"`` reproduces Eq. 12-13).

    Returns
    -------
    list of Pool

    Example
    -------
    >>> [(p.name, p.fraction) for p in alpha_split_pools(0.25)]
    [('encoder', 0.25), ('llm', 0.75)]
    """
    alpha = check_alpha(alpha)
    (first, first_components), (second, second_components) = ALPHA_SPLIT_POOLS
    return [
        Pool(first, first_components, alpha, allocator),
        Pool(second, second_components, 1.0 - alpha, allocator),
    ]


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


def _pool_weights(layout: Layout, pool: Pool, names: list[str], ema_state) -> dict[str, float]:
    """Inner weights of ``pool`` over its group ``names``, summing to 1."""
    if pool.allocator == "uniform":
        return {n: 1.0 / len(names) for n in names}
    if pool.allocator == "dim":
        total = sum(layout.group(n).numel for n in names)
        return {n: layout.group(n).numel / total for n in names}
    if ema_state is None:
        raise ValueError(f"pool {pool.name!r} uses the 'ema' allocator but no ema_state was given")
    w = ema_state.weights()
    total = math.fsum(w[n] for n in names)
    if total <= 0.0:
        return _pool_weights(layout, Pool(pool.name, pool.components, pool.fraction), names, None)
    return {n: w[n] / total for n in names}


def _check_pools(layout: Layout, pools: Sequence[Pool]) -> None:
    if not pools:
        raise ValueError("alpha_split needs at least one pool")
    total = math.fsum(p.fraction for p in pools)
    if abs(total - 1.0) > 1e-9:
        raise ValueError(
            f"pool fractions must sum to 1, got {total!r} from "
            f"{ {p.name: p.fraction for p in pools} }"
        )
    owner: dict[str, str] = {}
    for p in pools:
        for c in p.components:
            if c in owner:
                raise ValueError(f"component {c!r} is in two pools: {owner[c]!r} and {p.name!r}")
            owner[c] = p.name
    uncovered = [c for c in layout.components if c not in owner]
    if uncovered:
        raise ValueError(
            f"component(s) {uncovered} are not covered by any pool "
            f"({ {p.name: list(p.components) for p in pools} })"
        )


@dataclass(frozen=True)
class BudgetMethod:
    """A registered budget method: a name and the allocator that computes its budgets.

    Arguments
    ---------
    name : str
        The ``method`` value that selects it (YAML key ``method``, ``--method`` of the CLI).
    allocate : callable
        ``allocate(layout, *, clip, alpha, pools, ema_state)`` returning ``C`` (a float, for a
        flat clip) or ``{group: C_l}``. ``clip`` is already checked; the other arguments are
        ``None`` when not given.
    pooled : bool
        Whether the method takes ``alpha``/``pools`` (for every other method, passing them is
        an error).
    ema_base : str or None
        ``"dim"`` or ``"uniform"`` for a method driven by an :class:`EMABudgetState` with that
        base allocation; ``None`` otherwise.
    """

    name: str
    allocate: Callable[..., float | dict[str, float]]
    pooled: bool = False
    ema_base: str | None = None


_BUDGET_METHODS: dict[str, BudgetMethod] = {}


def register_budget_method(
    name: str, *, pooled: bool = False, ema_base: str | None = None, replace: bool = False
) -> Callable:
    """Decorator registering ``allocate`` as budget method ``name`` (see :class:`BudgetMethod`).

    A new method must keep the Euclidean-tight contract of this module (``sqrt(sum C_l^2) <= C``)
    so that the server noise and the accountant stay valid (``tests/unit/test_privacy_budgets.py``
    checks it for the built-in methods; a new one needs the same property test).

    Example
    -------
    >>> @register_budget_method("first_group_only")
    ... def _first(layout, *, clip, **_):
    ...     return {g.name: (clip if i == 0 else 0.0) for i, g in enumerate(layout)}
    >>> from speechbrain_fl.privacy.layout import Group
    >>> compute_budgets(Layout([Group("a", "x", 1), Group("b", "y", 1)]), method="first_group_only",
    ...                 clip=1.0)
    {'a': 1.0, 'b': 0.0}
    >>> _ = unregister_budget_method("first_group_only")
    """
    if ema_base is not None and ema_base not in ("dim", "uniform"):
        raise ValueError(f"ema_base must be 'dim', 'uniform' or None, got {ema_base!r}")

    def decorator(allocate: Callable) -> Callable:
        if name in _BUDGET_METHODS and not replace:
            raise ValueError(f"budget method {name!r} is already registered")
        _BUDGET_METHODS[name] = BudgetMethod(name, allocate, pooled=pooled, ema_base=ema_base)
        return allocate

    return decorator


def unregister_budget_method(name: str) -> BudgetMethod:
    """Remove and return a registered method (for tests and plug-ins)."""
    method = get_budget_method(name)
    del _BUDGET_METHODS[name]
    return method


def get_budget_method(name: str) -> BudgetMethod:
    """The registered method ``name``; ``ValueError`` listing the registered ones otherwise.

    Example
    -------
    >>> get_budget_method("pfl_dim_ema").ema_base
    'dim'
    """
    try:
        return _BUDGET_METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown budget method {name!r}; registered methods: {budget_methods()}"
        ) from None


def budget_methods() -> tuple[str, ...]:
    """Names of the registered budget methods, in registration order."""
    return tuple(_BUDGET_METHODS)


@register_budget_method("flat")
def _flat(layout: Layout, *, clip: float, **_) -> float:
    """One clip ``C`` over the concatenated update (paper Eq. 3)."""
    return clip


@register_budget_method("pfl_uniform")
def _pfl_uniform(layout: Layout, *, clip: float, **_) -> dict[str, float]:
    """``C_l = C / sqrt(H)``."""
    c = clip / math.sqrt(len(layout))
    return {g.name: c for g in layout}


@register_budget_method("pfl_dim")
def _pfl_dim(layout: Layout, *, clip: float, **_) -> dict[str, float]:
    """``C_l = C * sqrt(p_l / sum_k p_k)`` (Eq. 9)."""
    total = layout.total_numel
    return {g.name: clip * math.sqrt(g.numel / total) for g in layout}


def _ema_allocator(name: str, base: str) -> Callable[..., dict[str, float]]:
    def allocate(layout: Layout, *, clip: float, ema_state=None, **_) -> dict[str, float]:
        """``C_l = C * sqrt(w_l)`` with the EMA weights (Eq. 10-11)."""
        if ema_state is None:
            ema_state = EMABudgetState(layout, base=base)
        elif ema_state.base != base:
            raise ValueError(
                f"method {name!r} needs an EMA state with base {base!r}, got {ema_state.base!r}"
            )
        elif ema_state.layout.names != layout.names:
            raise ValueError("the EMA state was built for a different layout")
        return {k: clip * math.sqrt(w) for k, w in ema_state.weights().items()}

    return allocate


register_budget_method("pfl_dim_ema", ema_base="dim")(_ema_allocator("pfl_dim_ema", "dim"))
register_budget_method("pfl_unif_ema", ema_base="uniform")(
    _ema_allocator("pfl_unif_ema", "uniform")
)


@register_budget_method("alpha_split", pooled=True)
def _alpha_split(
    layout: Layout, *, clip: float, alpha=None, pools=None, ema_state=None
) -> dict[str, float]:
    """``C_l = C * sqrt(f_pool) * sqrt(w_l)`` over N pools (Eq. 12-13 for the default two)."""
    if pools is None:
        if alpha is None:
            raise ValueError("alpha_split needs alpha (or explicit pools)")
        pools = alpha_split_pools(alpha)
    elif alpha is not None:
        raise ValueError("give alpha_split either alpha or pools, not both")
    pools = list(pools)
    _check_pools(layout, pools)
    budgets: dict[str, float] = {}
    for pool in pools:
        names = [g.name for g in layout if g.component in pool.components]
        if not names:
            msg = (
                f"pool {pool.name!r} ({list(pool.components)}) has no group in the layout; its "
                f"share {pool.fraction} of C^2 is unused and the budgets are not Euclidean-tight"
            )
            logger.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=3)
            continue
        scale = clip * math.sqrt(pool.fraction)
        for n, w in _pool_weights(layout, pool, names, ema_state).items():
            budgets[n] = scale * math.sqrt(w)
    return {n: budgets[n] for n in layout.names}


#: The built-in methods (paper Section IV), in the paper's order; :func:`budget_methods` also
#: lists any registered later.
METHODS = budget_methods()


def compute_budgets(
    layout: Layout,
    *,
    method: str,
    clip: float,
    alpha: float | None = None,
    pools: Sequence[Pool] | None = None,
    ema_state: EMABudgetState | None = None,
) -> float | dict[str, float]:
    """Clip budget(s) for ``layout`` under the registered ``method`` (paper Eq. 3, 9, 11-13).

    Arguments
    ---------
    layout : Layout
        The trainable groups.
    method : str
        A registered method (:func:`budget_methods`; built-in: :data:`METHODS`).
    clip : float
        Total L2 budget ``C`` > 0.
    alpha : float, optional
        Encoder fraction for ``alpha_split`` with the default pools.
    pools : list of Pool, optional
        Explicit pools for ``alpha_split`` (N pools, fractions summing to 1).
    ema_state : EMABudgetState, optional
        For ``*_ema`` methods and ``ema`` pool allocators; without it the EMA methods return
        their base (warm-up) allocation.

    Returns
    -------
    float or dict of str to float
        ``clip`` for ``flat``; otherwise ``{group: C_l}`` with ``sqrt(sum C_l^2) == clip``.

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> lay = Layout([Group("e", "encoder", 16), Group("l", "llm", 48)])
    >>> compute_budgets(lay, method="pfl_dim", clip=2.0)
    {'e': 1.0, 'l': 1.7320508075688772}
    >>> b = compute_budgets(lay, method="alpha_split", clip=1.0, alpha=0.04)
    >>> round(b["e"], 6), round(b["l"], 6)
    (0.2, 0.979796)
    """
    entry = get_budget_method(method)
    clip = check_clip(clip)
    if not entry.pooled and (alpha is not None or pools is not None):
        raise ValueError(
            f"alpha/pools only apply to a pooled method such as 'alpha_split', not {method!r}"
        )
    return entry.allocate(layout, clip=clip, alpha=alpha, pools=pools, ema_state=ema_state)


def component_budgets(layout: Layout, budgets: float | Mapping[str, float]) -> dict[str, float]:
    """Budget of each component label, ``sqrt(sum_{l in label} C_l^2)``.

    For a flat (float) budget every component may use the whole ``C``, so each label gets ``C``.

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> lay = Layout([Group("a", "encoder", 1), Group("b", "encoder", 1), Group("c", "llm", 1)])
    >>> component_budgets(lay, {"a": 0.3, "b": 0.4, "c": 1.0})
    {'encoder': 0.5, 'llm': 1.0}
    """
    if not isinstance(budgets, Mapping):
        c = check_clip(budgets)
        return {label: c for label in layout.components}
    check_names(budgets.keys(), layout.names, what="budget")
    return {
        label: math.sqrt(math.fsum(budgets[g.name] ** 2 for g in groups))
        for label, groups in layout.by_component().items()
    }


def select_alpha(
    component_norms: Mapping[str, float],
    *,
    clip: float,
    kappa: float = 2.0,
    encoder_components: Sequence[str] = ALPHA_SPLIT_POOLS[0][1],
) -> float:
    """Choose alpha so the encoder pool budget is ``kappa`` times the observed encoder norm.

    Solves ``C * sqrt(alpha) = kappa * ||Delta theta_E||`` (paper Section IV-A3: the encoder
    clip is ~2x the observed encoder delta-norm), ``||Delta theta_E||`` being the L2 norm over
    ``encoder_components`` (squares of the given component norms summed). With the dim inner
    allocator and equal-size encoder groups this is the same as the paper's per-layer criterion
    ``C_l^enc ~= kappa * (per-layer norm)``: with the paper's per-layer norm 0.013 over 64
    groups it gives alpha = (2 * 0.013 * 8)^2 ~= 0.043, close to the chosen 0.05.

    Privacy cost: the norms are a statistic of the training data. They must come from a
    *public or proxy* corpus (or a model/data that is not the private training set); then alpha
    is data-independent and the (epsilon, delta) of the run is unchanged. If they come from a
    non-DP warm-up on the private clients, that warm-up leaks information that the run's
    accountant does NOT cover; it would have to be privatised and accounted separately.

    Arguments
    ---------
    component_norms : mapping of str to float
        Mean observed update norm per component label (on public/proxy data).
    clip : float
        Total budget ``C``.
    kappa : float
        Target ratio of encoder pool budget to observed encoder norm (default 2).
    encoder_components : sequence of str
        Labels forming the encoder pool (default: the first pool of :data:`ALPHA_SPLIT_POOLS`).

    Returns
    -------
    float
        ``alpha = (kappa * ||Delta theta_E|| / C)^2``, strictly inside (0, 1).

    Example
    -------
    >>> round(select_alpha({"encoder": 0.104, "llm": 3.0}, clip=1.0), 4)
    0.0433
    """
    clip = check_clip(clip)
    if not (math.isfinite(kappa) and kappa > 0):
        raise ValueError(f"kappa must be a finite positive number, got {kappa!r}")
    missing = [c for c in encoder_components if c not in component_norms]
    if missing:
        raise ValueError(f"component_norms lacks encoder component(s) {missing}")
    for c in encoder_components:
        v = component_norms[c]
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"observed norm of component {c!r} must be finite and >= 0, got {v!r}")
    enc = math.sqrt(math.fsum(component_norms[c] ** 2 for c in encoder_components))
    if enc == 0.0:
        raise ValueError("the observed encoder norm is zero; alpha cannot be chosen from it")
    alpha = (kappa * enc / clip) ** 2
    if alpha >= 1.0:
        raise ValueError(
            f"kappa * encoder norm ({kappa} * {enc:.4g}) reaches the total clip {clip}: "
            f"alpha would be {alpha:.4g} >= 1; use a larger clip or a smaller kappa"
        )
    return alpha
