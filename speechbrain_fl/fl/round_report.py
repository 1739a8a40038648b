"""What one aggregated round did: :class:`RoundReport`, its failures and the clients' statistics.

The server strategy (:mod:`.strategy`) fills a report per round; the telemetry
(:mod:`.telemetry`) writes it as a ``rounds.csv`` row and ``group_norms.csv`` rows, and the
server's state keeps the committed round's report until its rows are written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from speechbrain_fl.privacy import Layout, component_budgets

from .updates import ClientUpdate

__all__ = ["AggregateFailed", "RoundFailed", "RoundReport", "client_statistics", "mean_or_none"]


class RoundFailed(RuntimeError):
    """Fewer than ``min_clients`` valid replies in a non-private run; the round may be retried."""


class AggregateFailed(RoundFailed):
    """The aggregate of a non-private round is unusable (the rule raised, or a value non-finite).

    Retried like :class:`RoundFailed`; once the retries are spent the server records the round
    as failed, keeps the global model and goes on (:func:`speechbrain_fl.fl.server.run_server`).
    """


@dataclass
class RoundReport:
    """What one aggregated round did (the source of a ``rounds.csv`` row)."""

    round: int
    cohort_size: int
    population: int
    num_replied: int
    num_failed: int
    failures: list[str] = field(default_factory=list)
    noise_std: float | None = None
    joint_norm_mean: float | None = None
    clip_rate: float | None = None
    mean_clip_ratio: float | None = None
    train_loss: float | None = None
    group_norms: dict[str, float] = field(default_factory=dict)
    group_clip_rates: dict[str, float] = field(default_factory=dict)
    group_budgets: dict[str, float] = field(default_factory=dict)
    component_norms: dict[str, float] = field(default_factory=dict)
    component_clip_rates: dict[str, float] = field(default_factory=dict)
    component_budgets: dict[str, float] = field(default_factory=dict)
    connected: int | None = None
    ignored: list[str] = field(default_factory=list)
    num_dropped: int = 0
    round_failed: str | None = None


def mean_or_none(values: list[float]) -> float | None:
    """The mean of ``values``, ``None`` for none.

    Example
    -------
    >>> mean_or_none([1.0, 2.0]), mean_or_none([])
    (1.5, None)
    """
    return float(np.mean(values)) if values else None


def client_statistics(
    updates: list[ClientUpdate],
    budgets: float | dict[str, float] | None,
    report: RoundReport,
    *,
    layout: Layout,
) -> None:
    """Average the pre-clip statistics the clients reported into ``report`` (Fig. 2/3/5).

    Per group and per component: the mean over the replies of the reported norms and clip
    indicators; the joint norm, the mean clip ratio min(1, C / ||u||) and the clip rate (the
    share of replies with ratio < 1); and the round's budgets (per group and per component).
    """
    groups, comps = list(layout.names), list(layout.components)

    def column(key: str, names: list[str]) -> dict[str, float]:
        rows = [u.metrics[key] for u in updates if isinstance(u.metrics.get(key), list)]
        rows = [r for r in rows if len(r) == len(names)]
        if not rows:
            return {}
        return dict(zip(names, np.asarray(rows, dtype=float).mean(axis=0).tolist(), strict=True))

    report.group_norms = column("group-norms", groups)
    report.group_clip_rates = column("group-clipped", groups)
    report.component_norms = column("component-norms", comps)
    report.component_clip_rates = column("component-clipped", comps)
    report.joint_norm_mean = mean_or_none(
        [u.metrics["joint-norm"] for u in updates if "joint-norm" in u.metrics]
    )
    ratios = [u.metrics["clip-ratio"] for u in updates if "clip-ratio" in u.metrics]
    report.mean_clip_ratio = mean_or_none(ratios)
    report.clip_rate = mean_or_none([float(r < 1.0) for r in ratios])
    if isinstance(budgets, dict):
        report.group_budgets = dict(budgets)
        report.component_budgets = dict(component_budgets(layout, budgets))
    elif budgets is not None:
        report.component_budgets = {"all": float(budgets)} if comps == ["all"] else {}
