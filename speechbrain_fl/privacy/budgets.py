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

from .ema_budgets import SIGNALS, EMABudgetState
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
    "SIGNALS",
    "ALPHA_SPLIT_POOLS",
    "alpha_split_pools",
    "compute_budgets",
    "component_budgets",
]

logger = logging.getLogger(__name__)

ALLOCATORS = ("dim", "uniform", "ema")


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
