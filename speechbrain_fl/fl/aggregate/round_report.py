"""What one aggregated round did: :class:`RoundReport`, its failures and the clients' statistics.

The server strategy (:mod:`speechbrain_fl.fl.serverapp.strategy`) fills a report per round; the telemetry
(:mod:`speechbrain_fl.fl.serverapp.telemetry`) writes it as a ``rounds.csv`` row and ``group_norms.csv`` rows, and the
server's state keeps the committed round's report until its rows are written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.privacy import Layout, component_budgets

__all__ = [
    "AggregateFailed",
    "RoundFailed",
    "RoundReport",
    "UnreadableTally",
    "client_statistics",
    "cohort_report",
    "mean_or_none",
    "unreadable_counts",
]


class RoundFailed(RuntimeError):
    """Fewer than ``min_clients`` valid replies in a non-private run; the round may be retried."""


class AggregateFailed(RoundFailed):
    """The aggregate of a non-private round is unusable (the rule raised, or a value non-finite).

    Retried like :class:`RoundFailed`; once the retries are spent the server records the round
    as failed, keeps the global model and goes on (:func:`speechbrain_fl.fl.serverapp.main.run_server`).
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
    unreadable_utterances: int = 0
    none_readable: list[int] = field(default_factory=list)
    #: further ``rounds.csv`` columns of the round (adaptive clipping's clips and fractions)
    extra: dict[str, float] = field(default_factory=dict)


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


def unreadable_counts(updates: list[ClientUpdate]) -> dict[str, int | list[int]]:
    """The round's undecodable training utterances, from the replies' metrics.

    ``unreadable_utterances`` is the sum over the counted replies of ``unreadable-utterances``
    (utterances a client skipped because their audio failed to decode, :mod:`speechbrain_fl.fl.clientapp.train`);
    ``none_readable`` the partitions (``partition-id``, else the node id) that reported
    ``readable-utterances`` 0: nothing of theirs could be read, their update is zero.

    Example
    -------
    >>> ups = [ClientUpdate(1, {}, {"unreadable-utterances": 2, "readable-utterances": 3}),
    ...        ClientUpdate(2, {}, {"unreadable-utterances": 4, "readable-utterances": 0,
    ...                             "partition-id": 7}), ClientUpdate(3, {}, {})]
    >>> unreadable_counts(ups)
    {'unreadable_utterances': 6, 'none_readable': [7]}
    """
    total, none = 0, []
    for update in updates:
        total += int(update.metrics.get("unreadable-utterances", 0))
        if update.metrics.get("readable-utterances", 1) == 0:
            none.append(int(update.metrics.get("partition-id", update.node_id)))
    return {"unreadable_utterances": total, "none_readable": sorted(none)}


def cohort_report(
    strategy, server_round: int, counted: list[ClientUpdate], failures: list[str], **fields
) -> RoundReport:
    """The round's report as both collection paths (plaintext replies, SecAgg+) fill it.

    ``counted`` are the replies that entered the aggregate (their metrics give the unreadable
    counts), ``failures`` the reasons of the rest; ``population`` is the accounted population
    in a private run and the connected one otherwise. ``fields`` are further report fields.
    """
    return RoundReport(
        round=server_round,
        cohort_size=len(strategy.cohort),
        population=strategy.population_size if strategy.config.private else strategy.population,
        num_replied=len(counted),
        num_failed=len(failures),
        failures=failures,
        connected=strategy.population,
        **unreadable_counts(counted),
        **fields,
    )


@dataclass
class UnreadableTally:
    """A run's undecodable training utterances, summed over its released rounds.

    ``utterances`` adds every round's :attr:`RoundReport.unreadable_utterances` (an utterance
    skipped in several rounds counts once per round); ``clients_with_none_readable`` lists the
    partitions that had no readable utterance in some round. Kept in the server state so that
    a resumed run reports the whole run (results.json ``data.unreadable_in_training``).

    Example
    -------
    >>> tally = UnreadableTally()
    >>> tally.add(RoundReport(1, 2, 2, 2, 0, unreadable_utterances=3, none_readable=[1]))
    >>> tally.as_dict()
    {'utterances': 3, 'rounds': [1], 'clients_with_none_readable': [1]}
    """

    utterances: int = 0
    rounds: list[int] = field(default_factory=list)
    clients_with_none_readable: list[int] = field(default_factory=list)

    def add(self, report: RoundReport | None) -> None:
        """Count ``report``'s round (nothing for ``None`` or a round without any)."""
        if report is None or not (report.unreadable_utterances or report.none_readable):
            return
        self.utterances += int(report.unreadable_utterances)
        self.rounds.append(int(report.round))
        self.clients_with_none_readable = sorted(
            set(self.clients_with_none_readable) | set(report.none_readable)
        )

    def as_dict(self) -> dict[str, int | list[int]]:
        """``{"utterances", "rounds", "clients_with_none_readable"}`` (plain values)."""
        return {
            "utterances": self.utterances,
            "rounds": list(self.rounds),
            "clients_with_none_readable": list(self.clients_with_none_readable),
        }
