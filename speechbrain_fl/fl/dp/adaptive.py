"""Adaptive clipping of a run (``clip_quantile``): its pools, state, noise and report.

With ``clip_quantile: gamma`` the server moves each pool's clip towards the gamma quantile of the
clients' pre-clip pool norms (:mod:`speechbrain_fl.privacy.adaptive_clipping`, Andrew et al.
2021). The pools are the method's: ``flat`` has one (``all``, every component), ``alpha_split``
its two (:data:`speechbrain_fl.privacy.budgets.ALPHA_SPLIT_POOLS`), so alpha follows from the
two clips, ``alpha_t = C_encoder^2 / (C_encoder^2 + C_llm^2)``, and the total clip is
``C_t = sqrt(sum_p C_p^2)``. The round's budgets are the method's allocator at ``C_t`` with the
pools' shares (:func:`round_budgets`), so the within-pool allocation is unchanged.

The update's noise multiplier is ``sigma_Delta`` of Theorem 1 (the pair spends the YAML
``noise_multiplier`` z, the accountant's), on the round's ``C_t``: std ``sigma_Delta C_t / n``.

Our choices: the initial clips are the method's budgets at the YAML ``clip`` (``C sqrt(alpha)``
and ``C sqrt(1 - alpha)`` for alpha-split); ``clip_count_stddev`` null is ``n / 20`` for the
expected cohort n (M of a simulated deployment); a reply without valid ``clip-bits`` is dropped
(its update with it) in the central model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from speechbrain_fl.privacy import Layout, compute_budgets
from speechbrain_fl.privacy.accounting import privacy_report
from speechbrain_fl.privacy.adaptive_clipping import (
    QuantileClipState,
    default_count_stddev,
    update_noise_multiplier,
)
from speechbrain_fl.privacy.budgets import ALPHA_SPLIT_POOLS, Pool
from speechbrain_fl.run_outputs import read_rounds

__all__ = [
    "ADAPTIVE_METHODS",
    "adaptive_columns",
    "adaptive_privacy",
    "adaptive_state",
    "method_pools",
    "pools_message",
    "round_budgets",
    "round_row",
    "rounds_clips",
]

#: The methods adaptive clipping supports (their pools are :func:`method_pools`).
ADAPTIVE_METHODS = ("flat", "alpha_split")


def method_pools(method: str, layout: Layout) -> dict[str, list[str]]:
    """``{pool: component labels}`` of ``method`` over ``layout`` (pools in the layout only).

    Example
    -------
    >>> from speechbrain_fl.privacy import Group
    >>> lay = Layout([Group("e", "encoder", 2), Group("c", "connector", 2), Group("l", "llm", 2)])
    >>> method_pools("alpha_split", lay), method_pools("flat", lay)
    ({'encoder': ['encoder'], 'llm': ['llm', 'connector']}, {'all': ['encoder', 'connector', 'llm']})
    """
    labels = list(layout.components)
    if method == "flat":
        return {"all": labels}
    if method != "alpha_split":
        raise ValueError(f"clip_quantile supports methods {list(ADAPTIVE_METHODS)}, not {method!r}")
    pools = {name: [c for c in comps if c in labels] for name, comps in ALPHA_SPLIT_POOLS}
    empty = [name for name, comps in pools.items() if not comps]
    if empty:
        raise ValueError(
            f"clip_quantile with alpha_split: pool(s) {empty} have no trainable group in the "
            "layout, so there is no norm to adapt their clip to; use method flat"
        )
    return pools


def adaptive_state(
    config: Any, layout: Layout, *, expected_cohort_size: float
) -> tuple[QuantileClipState, float, dict[str, list[str]]]:
    """The run's :class:`QuantileClipState`, the update's sigma_Delta and the pools.

    Arguments
    ---------
    config : FLConfig
        With ``clip_quantile`` set (a private run, checked by the config).
    layout : Layout
        The trainable groups.
    expected_cohort_size : float
        n = qK.
    """
    pools = method_pools(config.method, layout)
    if config.method == "flat":
        clips = {"all": float(config.clip)}
    else:
        alpha = float(config.alpha)
        clips = {
            "encoder": config.clip * math.sqrt(alpha),
            "llm": config.clip * math.sqrt(1 - alpha),
        }
    cohort = config.noise_cohort_size or expected_cohort_size
    stddev = config.clip_count_stddev or default_count_stddev(cohort)
    sigma = update_noise_multiplier(
        config.noise_multiplier, count_stddev=stddev, num_pools=len(pools)
    )
    state = QuantileClipState(
        clips,
        quantile=config.clip_quantile,
        learning_rate=config.clip_quantile_lr,
        count_stddev=stddev,
        seed=None if config.noise_seed is None else config.noise_seed + 7919,
    )
    return state, sigma, pools


def round_budgets(
    state: QuantileClipState, layout: Layout, *, method: str, pools: Mapping[str, Sequence[str]]
) -> float | dict[str, float]:
    """This round's budgets: the method's allocator at C_t with the pools' shares C_p^2 / C_t^2.

    Example
    -------
    >>> from speechbrain_fl.privacy import Group
    >>> lay = Layout([Group("e", "encoder", 4), Group("l", "llm", 4)])
    >>> s = QuantileClipState({"encoder": 0.3, "llm": 0.4}, quantile=0.5, learning_rate=0.2,
    ...                       count_stddev=1.0, seed=0)
    >>> b = round_budgets(s, lay, method="alpha_split",
    ...                   pools={"encoder": ["encoder"], "llm": ["llm"]})
    >>> round(b["e"], 6), round(b["l"], 6)
    (0.3, 0.4)
    """
    if method == "flat":
        return compute_budgets(layout, method="flat", clip=state.clips["all"])
    shares = state.fractions()
    return compute_budgets(
        layout,
        method=method,
        clip=state.total_clip,
        pools=[Pool(p, tuple(pools[p]), shares[p]) for p in state.pools],
    )


def pools_message(state: QuantileClipState, pools: Mapping[str, Sequence[str]]) -> str:
    """The round's ``clip-quantile-pools`` entry: ``{pool: {"components", "clip"}}`` as JSON."""
    return json.dumps(
        {p: {"components": list(pools[p]), "clip": state.clips[p]} for p in state.pools}
    )


def adaptive_columns(pools: Sequence[str]) -> list[str]:
    """The ``rounds.csv`` columns of adaptive clipping: ``clip`` (C_t), then per pool its clip
    and its released noisy unclipped fraction.

    Example
    -------
    >>> adaptive_columns(["encoder", "llm"])
    ['clip', 'clip_encoder', 'clip_llm', 'unclipped_encoder', 'unclipped_llm']
    """
    return ["clip", *(f"clip_{p}" for p in pools), *(f"unclipped_{p}" for p in pools)]


def round_row(clips: Mapping[str, float], fractions: Mapping[str, float]) -> dict[str, float]:
    """A round's values of :func:`adaptive_columns`."""
    row = {"clip": math.sqrt(math.fsum(c * c for c in clips.values()))}
    row.update({f"clip_{p}": c for p, c in clips.items()})
    row.update({f"unclipped_{p}": b for p, b in fractions.items()})
    return row


def rounds_clips(output_folder: Any, pools: Sequence[str]) -> list[dict[str, float]]:
    """Each trained round's pool clips, from the ``clip_<pool>`` columns of ``rounds.csv``
    (the run's own record; the server state keeps no per-round history). Empty without it.
    """
    table = read_rounds(output_folder)
    if table is None or not all(f"clip_{p}" in table for p in pools):
        return []
    keep = [i for i, r in enumerate(table["round"]) if r >= 1]
    return [{p: float(table[f"clip_{p}"][i]) for p in pools} for i in keep]


def adaptive_privacy(
    state: QuantileClipState,
    *,
    layout: Layout,
    round_clips: Sequence[Mapping[str, float]],
    round_component_budgets: Sequence[Mapping[str, float]],
    update_noise_multiplier: float,
    sampling_rate: float,
    delta: float,
    accountant: str,
    rounds: int,
) -> dict[str, Any]:
    """results.json ``privacy`` entries of an adaptive run: the per-pool figures and the clips.

    The joint epsilon is the accountant's at the YAML z (Theorem 1: the pair spends z). A pool's
    ``sigma_eff`` covers its update sub-vector only: ``sigma_Delta C_t / min(C_t, B_pool,t)``
    with ``B_pool,t`` its budget in round t, the smallest over the rounds (conservative); it is
    :func:`~speechbrain_fl.privacy.privacy_report`'s figure on the budgets scaled by
    ``C_0 / C_t`` (a flat clip over several components records no component budget: each
    sub-vector then counts the whole C_t, sigma_eff = sigma_Delta).

    Arguments
    ---------
    round_clips : sequence of mapping
        Per trained round, the pools' clips it used (:func:`rounds_clips`).
    round_component_budgets : sequence of mapping
        Per trained round, its component budgets (``budgets.csv``).

    Returns
    -------
    dict
        ``sigma_eff``, ``epsilon_per_component`` (replacing the fixed-C figures) and
        ``adaptive_clipping``: the settings, ``update_noise_multiplier``, the initial and
        final clips, and per round the clips it used (its noisy fractions: ``rounds.csv``).
    """
    c0 = math.sqrt(math.fsum(c * c for c in state.initial.values()))
    scaled, per_round = [], []
    for t, (clips, budgets) in enumerate(
        zip(round_clips, round_component_budgets, strict=False), start=1
    ):
        c_t = math.sqrt(math.fsum(c * c for c in clips.values()))
        scaled.append({k: v * c0 / c_t for k, v in budgets.items()})
        per_round.append({"round": t, "clip": c_t, **{f"clip_{p}": c for p, c in clips.items()}})
    per_pool = privacy_report(
        layout,
        scaled,
        noise_multiplier=update_noise_multiplier,
        clip=c0,
        sampling_rate=sampling_rate,
        rounds=rounds,
        delta=delta,
        accountant=accountant,
    )
    return {
        "sigma_eff": per_pool["sigma_eff"],
        "epsilon_per_component": per_pool["epsilon_per_component"],
        "adaptive_clipping": {
            "clip_quantile": state.quantile,
            "clip_quantile_lr": state.learning_rate,
            "clip_count_stddev": state.count_stddev,
            "update_noise_multiplier": update_noise_multiplier,
            "initial_clips": dict(state.initial),
            "final_clips": dict(state.clips),
            "rounds": per_round,
        },
    }
