"""Norm profiling: non-DP rounds that measure per-component update norms (paper Sec. III-A, VI).

Before choosing a privacy method, a few federated rounds run without noise and with a clip no
update reaches (``C = 1e6``, ``pfl_dim`` groups), so the engine records every client's pre-clip
norms without changing any update (:func:`profile_config`). :func:`norm_profile` turns the last
round's :class:`~speechbrain_fl.fl.aggregate.round_report.RoundReport` into the paper's diagnostics: the mean
per-matrix update norm of each component, the LLM/encoder ratio, the alpha that makes the
encoder pool budget twice the observed encoder norm (:func:`speechbrain_fl.privacy.select_alpha`)
and a recommended method. The thresholds are ours: a ratio of 5 or more recommends alpha-split
(the paper's large-gap regime, ~12x), below it PFL-Dim+EMA (its mild regime, ~1.7x).

The norms come from the training clients without noise: they are outside the DP guarantee
(:data:`PROFILE_CAVEAT`, written into ``profile.json``). Profile on public or proxy data, or count
the profiling rounds in the budget, for a privacy-compatible choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy import Layout, select_alpha
from speechbrain_fl.utils.atomic import atomic_open

__all__ = [
    "PROFILE_CAVEAT",
    "format_profile",
    "norm_profile",
    "pool_norms",
    "pool_retention",
    "profile_config",
    "write_profile",
]

logger = logging.getLogger(__name__)

PROFILE_CAVEAT = (
    "Privacy caveat: these norms come from non-DP rounds on the training clients; they are "
    "outside the DP guarantee. For a privacy-compatible choice, profile on public or proxy data "
    "(the paper's Sec. IV-A3) or count the profiling rounds in the privacy budget."
)
PROFILE_CLIP = 1e6
SPLIT_RATIO = 5.0


def profile_config(config: FLConfig, *, rounds: int, output_folder: str) -> FLConfig:
    """The run's config turned into ``rounds`` measuring rounds (no noise, no effective clip).

    Example
    -------
    >>> cfg = profile_config(FLConfig(output_folder="o", noise_multiplier=1.0, clip=1.0),
    ...                      rounds=2, output_folder="o/profile")
    >>> cfg.private, cfg.clip, cfg.num_rounds, cfg.aggregation_rule_name
    (False, 1000000.0, 2, 'weighted')
    """
    return dataclasses.replace(
        config,
        output_folder=str(output_folder),
        num_rounds=rounds,
        noise_multiplier=0.0,
        clip=PROFILE_CLIP,
        method="pfl_dim",
        alpha=None,
        aggregation="weighted",
        eval_every=0,
        max_epsilon=None,
        noise_cohort_size=None,
        accounting_population=None,
    )


def _pool(component: str) -> str:
    """alpha-split's pool of a component: ``encoder``, or ``llm`` (LLM + connector)."""
    return "encoder" if component == "encoder" else "llm"


def pool_norms(group_norms: Mapping[str, float], layout: Layout) -> dict[str, Any]:
    """Per-matrix and per-coordinate update norms of alpha-split's two pools, and their ratios.

    For pool P (``encoder``; ``llm`` = LLM + connector) with groups h of sizes p_h and mean
    update norms n_h: the per-matrix norm is mean_h n_h (the paper's Fig. 2 quantity), the
    per-coordinate norm is sqrt(sum_h n_h^2) / sqrt(sum_h p_h), the pool's norm divided by
    sqrt(p_P) (the per-parameter signal of Eq. 7). Per matrix, large tensors look large; per
    coordinate, an update that moves every coordinate by the same amount (AdamW's) gives a ratio
    of 1 whatever the sizes.

    Example
    -------
    >>> from speechbrain_fl.privacy import Group
    >>> lay = Layout([Group("e", "encoder", 100), Group("l", "llm", 4)])
    >>> out = pool_norms({"e": 1.0, "l": 0.4}, lay)
    >>> round(out["ratio_per_matrix"], 2), round(out["ratio_per_coordinate"], 2)
    (0.4, 2.0)
    """
    sums: dict[str, list[float]] = {}  # pool -> [sum n^2, sum p, sum n, groups]
    for group in layout:
        norm = group_norms.get(group.name)
        if norm is None or not math.isfinite(norm):
            continue
        row = sums.setdefault(_pool(group.component), [0.0, 0.0, 0.0, 0])
        row[0] += float(norm) ** 2
        row[1] += float(group.numel)
        row[2] += float(norm)
        row[3] += 1
    per_matrix = {k: v[2] / v[3] for k, v in sums.items()}
    per_coord = {k: math.sqrt(v[0] / v[1]) for k, v in sums.items() if v[1] > 0}

    def ratio(values: dict[str, Any]) -> float | None:
        enc, llm = values.get("encoder"), values.get("llm")
        return llm / enc if enc and llm is not None else None

    return {
        "per_matrix_mean_norm": per_matrix,
        "per_coordinate_norm": per_coord,
        "ratio_per_matrix": ratio(per_matrix),
        "ratio_per_coordinate": ratio(per_coord),
    }


def pool_retention(report: Any, layout: Layout) -> dict[str, float] | None:
    """Clipped-signal retention of each pool in a round: post-clip / pre-clip norm (Fig. 5).

    With one joint clip (``flat``; FedAvg, nothing clipped) every pool of client i keeps the
    same share r_i = min(1, C / ||Delta_i||), so the pool retention is the round's mean clip
    ratio, exactly. With per-group budgets C_h (the per-layer methods and alpha-split), group h
    keeps min(n_h, C_h) of its norm n_h and the pool keeps
    sqrt(sum_h min(n_h, C_h)^2) / sqrt(sum_h n_h^2); the report holds the clients' *mean* group
    norms, so this is an estimate from them (ours: exact when the clients' norms agree).

    Returns
    -------
    dict or None
        ``{"encoder": r, "llm": r}`` over the pools that have norms; None without statistics.
    """
    budgets = getattr(report, "group_budgets", None) or {}
    norms = getattr(report, "group_norms", None) or {}
    if not budgets:
        ratio = getattr(report, "mean_clip_ratio", None)
        if ratio is None or not norms:
            return None
        pools = {_pool(g.component) for g in layout if norms.get(g.name) is not None}
        return {pool: float(ratio) for pool in sorted(pools)}
    pre: dict[str, float] = {}
    post: dict[str, float] = {}
    for group in layout:
        norm, budget = norms.get(group.name), budgets.get(group.name)
        if norm is None or budget is None:
            continue
        pool = _pool(group.component)
        pre[pool] = pre.get(pool, 0.0) + float(norm) ** 2
        post[pool] = post.get(pool, 0.0) + min(float(norm), float(budget)) ** 2
    return {k: math.sqrt(post[k] / pre[k]) if pre[k] > 0 else 1.0 for k in sorted(pre)}


def norm_profile(report: Any, layout: Layout, *, clip: float, kappa: float = 2.0) -> dict[str, Any]:
    """Diagnostics of a profiling round (see the module docstring).

    When ``kappa`` times the encoder norm reaches ``clip`` (alpha would be >= 1:
    :func:`~speechbrain_fl.privacy.select_alpha` refuses), the profile still holds the norms and
    the recommendation, with ``alpha`` None and ``alpha_refused`` naming a ``clip`` and a
    ``kappa`` that would give alpha = 0.25 (ours: the middle of the encoder-light range).

    Arguments
    ---------
    report : RoundReport
        The last profiling round (``group_norms`` and ``component_norms`` filled).
    layout : Layout
        Groups and their component labels.
    clip : float
        The total budget ``C`` the private run will use (for the alpha).
    kappa : float
        Encoder pool budget / observed encoder norm (``select_alpha``; the paper's ~2).

    Returns
    -------
    dict
        ``per_matrix_mean_norm``, ``component_norm``, ``llm_encoder_ratio`` (when the encoder
        trains; the connector's norm stands for the LLM's when no LLM group trains), ``alpha`` (None with ``alpha_refused`` when no alpha < 1 fits),
        ``recommendation`` and ``caveat``.

    Example
    -------
    >>> from types import SimpleNamespace
    >>> from speechbrain_fl.privacy import Group
    >>> lay = Layout([Group("e", "encoder", 4), Group("l", "llm", 4)])
    >>> rep = SimpleNamespace(group_norms={"e": 0.01, "l": 0.2},
    ...                       component_norms={"encoder": 0.01, "llm": 0.2})
    >>> p = norm_profile(rep, lay, clip=1.0)
    >>> p["llm_encoder_ratio"], p["recommendation"]["method"]
    (20.0, 'alpha_split')
    >>> rep.component_norms = {"encoder": 0.6, "llm": 0.2}
    >>> p = norm_profile(rep, lay, clip=1.0)
    >>> p["alpha"], p["alpha_refused"].split("; ")[-1]
    (None, 'clip >= 2.4 or kappa <= 0.833 gives alpha = 0.25')
    """
    per_matrix: dict[str, float] = {}
    for label in layout.components:
        norms = [report.group_norms[g.name] for g in layout if g.component == label]
        norms = [n for n in norms if n is not None]
        if norms:
            per_matrix[label] = sum(norms) / len(norms)
    component = {k: float(v) for k, v in report.component_norms.items()}
    profile: dict[str, Any] = {"per_matrix_mean_norm": per_matrix, "component_norm": component}
    if per_matrix.get("encoder", 0.0) > 0:
        # the LLM's adapters frozen (a connector but no LLM group trains): the connector
        # stands for the LLM side, as in alpha-split's pools
        ratio = per_matrix.get("llm", per_matrix.get("connector", 0.0)) / per_matrix["encoder"]
        profile["llm_encoder_ratio"] = ratio
        try:
            profile["alpha"] = select_alpha(component, clip=clip, kappa=kappa)
        except ValueError as err:
            encoder = abs(component.get("encoder", 0.0))
            if encoder == 0.0:
                raise
            profile["alpha"] = None
            profile["alpha_refused"] = (
                f"{err}; clip >= {math.ceil(20 * kappa * encoder) / 10:g} or kappa <= "
                f"{math.floor(500 * clip / encoder) / 1000:g} gives alpha = 0.25"
            )
        method = "alpha_split" if ratio >= SPLIT_RATIO else "pfl_dim_ema"
        profile["recommendation"] = {"method": method, "alpha": profile["alpha"]}
    else:
        profile["alpha"] = None
        profile["recommendation"] = {"method": "pfl_dim_ema", "alpha": None}
        profile["note"] = "encoder frozen: no encoder norms; a pool split has nothing to protect"
    profile["pools"] = pool_norms(report.group_norms, layout)
    profile["caveat"] = PROFILE_CAVEAT
    return profile


def write_profile(profile: Mapping[str, Any], folder: str | Path) -> Path:
    """Write ``profile.json`` into ``folder`` (atomically) and log it."""
    path = Path(folder) / "profile.json"
    with atomic_open(path) as handle:
        json.dump(dict(profile), handle, indent=2)
    logger.info("Norm profile: %s", json.dumps(profile))
    return path


def format_profile(profile: Mapping[str, Any], *, rounds: int) -> str:
    """The profile as the few lines a user reads at the end of profiling."""
    lines = [f"Norm profile ({rounds} non-DP rounds):"]
    for label, value in profile["per_matrix_mean_norm"].items():
        lines.append(f"  mean per-matrix update norm, {label:9s}: {value:.4g}")
    if "llm_encoder_ratio" in profile:
        lines.append(f"  LLM/encoder per-matrix norm ratio: {profile['llm_encoder_ratio']:.2f}x")
    per_coord = (profile.get("pools") or {}).get("ratio_per_coordinate")
    if per_coord is not None:
        lines.append(
            f"  (LLM + connector)/encoder per-coordinate norm ratio (norm / sqrt(p) per pool): "
            f"{per_coord:.2f}x"
        )
    lines.append(f"  recommended method: {profile['recommendation']['method']}")
    if profile["alpha"] is not None:
        lines.append(
            f"  alpha for alpha-split (encoder pool ~ kappa x its norm): {profile['alpha']:.4f}"
        )
    elif "alpha_refused" in profile:
        lines.append(f"  no alpha for alpha-split: {profile['alpha_refused']}")
    lines.append(f"  {PROFILE_CAVEAT}")
    return "\n".join(lines)
