"""The privacy report of a finished run: joint epsilon and, per pool, sigma_eff and epsilon."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..budgets import alpha_split_pools, check_clip
from ..layout import Layout
from .checks import check_mechanism
from .components import effective_noise_multiplier
from .epsilon import compute_epsilon
from .registry import DEFAULT_ACCOUNTANT

__all__ = ["REPORT_POOLS", "privacy_report"]

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
    check_mechanism(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, delta=delta)
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
    for pool, present in _pool_members(layout, pools or REPORT_POOLS).items():
        budget = _pool_budget(present, round_budgets, clip=clip)
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


def _pool_members(layout: Layout, pools: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """``{pool: the layout's component labels it covers}``, pools covering none left out.

    The pools of ``pools`` come first, in their order; every label of the layout that no pool
    claims follows as a pool of its own.
    """
    labels = list(dict.fromkeys(g.component for g in layout))
    members = {name: list(comps) for name, comps in pools.items()}
    claimed = {c for comps in members.values() for c in comps}
    members.update({label: [label] for label in labels if label not in claimed})
    present = {pool: [c for c in comps if c in labels] for pool, comps in members.items()}
    return {pool: comps for pool, comps in present.items() if comps}


def _pool_budget(
    present: Sequence[str], round_budgets: Sequence[Mapping[str, float]], *, clip: float
) -> float:
    """``max_r min(C, sqrt(sum_{c in pool} C_{c,r}^2))``, ``C`` for a missing ``C_{c,r}``.

    The largest budget the pool had in any round (``C`` when no round is recorded): the
    conservative figure :func:`privacy_report` reports.
    """
    return max(
        (
            min(clip, math.sqrt(math.fsum(budgets.get(c, clip) ** 2 for c in present)))
            for budgets in round_budgets
        ),
        default=clip,
    )
