"""Per-round telemetry: ``rounds.csv``, ``group_norms.csv`` and the progress line.

Columns follow docs/api.md "Run outputs" (each column in :class:`RoundsTelemetry`'s notes);
round 0 is the starting model (evaluation only); a cell is empty where a value does not apply.
"""

from __future__ import annotations

import csv
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from speechbrain_fl.fl.aggregate.round_report import RoundReport
from speechbrain_fl.privacy import Layout
from speechbrain_fl.run_outputs import COMPONENT_COLUMN_KINDS, GROUP_COLUMNS, ROUND_COLUMNS
from speechbrain_fl.utils.atomic import atomic_open

__all__ = ["RoundsTelemetry", "progress_line", "train_log_rounds", "truncate_train_log"]

BASE_COLUMNS = [*ROUND_COLUMNS, "train_loss"]


def _cell(value: Any) -> Any:
    return "" if value is None else value


#: A line the engine writes into ``train_log.txt`` (``write_outputs`` in :mod:`speechbrain_fl.fl.serverapp.main`):
#: ``round: k`` then optionally ``, epsilon_<accountant>: e`` (``, epsilon: e`` in logs of
#: earlier versions) and ``, round_failed: yes``, then `` - `` or
#: the end. A recipe's own lines (``round: 0, stage: test - ...``) do not match.
ENGINE_LOG_LINE = re.compile(
    r"^round: (\d+)(, epsilon(?:_[a-z]+)?: [^,\s]+)?(, round_failed: yes)?( - |\s*$)"
)


def _log_round(line: str) -> int | None:
    """The round of a ``train_log.txt`` line written by the engine, else ``None``."""
    match = ENGINE_LOG_LINE.match(line)
    return int(match.group(1)) if match else None


def train_log_rounds(path: str | Path) -> set[int]:
    """Rounds that have a line in the engine's ``train_log.txt``."""
    path = Path(path)
    if not path.exists():
        return set()
    with open(path, encoding="utf-8") as handle:
        return {r for r in map(_log_round, handle) if r is not None}


def truncate_train_log(path: str | Path, last_round: int) -> None:
    """Drop the engine's lines of rounds after ``last_round`` from ``train_log.txt``.

    Other lines (a recipe's own, even ``round: 0, stage: test ...``) are kept. Used on resume (lines of rounds that were never
    committed, from a version that wrote them first) and at a fresh start (``last_round=-1``:
    the lines of a run whose server state was removed, as ``rounds.csv`` is).

    Example
    -------
    >>> tmp = getfixture("tmp_path") / "train_log.txt"
    >>> _ = tmp.write_text("round: 0 - valid loss: 1\\nround: 1, epsilon: 2\\n"
    ...                    "round: 1, stage: test - test WER: 0.5\\n")
    >>> truncate_train_log(tmp, 0)
    >>> tmp.read_text().splitlines()
    ['round: 0 - valid loss: 1', 'round: 1, stage: test - test WER: 0.5']
    """
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        lines = handle.readlines()
    rounds = [_log_round(line) for line in lines]
    kept = [line for line, r in zip(lines, rounds, strict=True) if r is None or r <= last_round]
    if len(kept) != len(lines):
        with atomic_open(path, "w") as handle:
            handle.writelines(kept)


def _rewrite_upto(path: Path, last_round: int) -> None:
    if not path.exists():
        return
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        return
    kept = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) <= last_round]
    with atomic_open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(kept)


class RoundsTelemetry:
    """Append-only writer of the two CSV files.

    Arguments
    ---------
    folder : str or Path
        The run's output folder.
    layout : speechbrain_fl.privacy.Layout
        Groups and components of the trainable parameters.
    metric_names : sequence of str
        Evaluation metric columns (e.g. ``valid_loss``, ``WER``).
        A name also filled from ``RoundReport.extra`` (adaptive clipping's ``clip``,
        ``clip_<pool>`` and ``unclipped_<pool>``) gets those values.

    Notes
    -----
    Columns follow docs/api.md "Run outputs": ``rounds.csv`` has ``round, cohort_size, num_replied,
    num_failed, dropped_replies, unreadable_utterances, epsilon, joint_norm_mean, clip_rate,
    mean_clip_ratio, noise_std, train_loss``, the evaluation metric columns, then ``norm_<L>,
    clip_rate_<L>, budget_<L>`` per component label L; ``group_norms.csv`` has one row per (round,
    group). Round 0 is the starting model (evaluation only). Empty cells where a value does not
    apply. ``num_failed`` counts the sampled nodes whose reply did not count (dropped or missing),
    ``dropped_replies`` the replies that arrived and were dropped by a check
    (:mod:`speechbrain_fl.fl.serverapp.replies`, one log line each), ``unreadable_utterances`` the
    training utterances the counted replies skipped because their audio failed to decode
    (:func:`speechbrain_fl.fl.aggregate.round_report.unreadable_counts`). ``epsilon`` is the
    running figure after the round from FLConfig's ``round_accountant`` (Opacus RDP by default, an
    upper bound of the same mechanism's); the run's guarantee, from its ``accountant`` (PLD by
    default), is results.json's ``privacy.epsilon`` and is at most the last row's figure for RDP
    over PLD.

    Norms, clip rates and the train loss are means of the *pre-clip* values the clients report (the
    paper's Fig. 3 and 5 quantities), and the cohort columns reveal who took part: diagnostics for
    the operator, computed from raw client statistics, **outside the DP guarantee** (only the
    models and epsilon are covered). results.json lists these files under
    ``privacy.outside_guarantee`` (:data:`speechbrain_fl.fl.dp.disclosure.OUTSIDE_GUARANTEE`); keep
    them with the operator.

    Example
    -------
    >>> from speechbrain_fl.privacy import Group, Layout
    >>> tmp = getfixture("tmp_path")
    >>> tel = RoundsTelemetry(tmp, Layout([Group("w", "all", 2)]), ["valid_loss"])
    >>> tel.write_round(0, report=None, epsilon=None, metrics={"valid_loss": 1.0})
    >>> (tmp / "rounds.csv").read_text().splitlines()[1].split(",")[:2]
    ['0', '']
    """

    def __init__(self, folder: str | Path, layout: Layout, metric_names: Sequence[str]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.rounds_path = self.folder / "rounds.csv"
        self.groups_path = self.folder / "group_norms.csv"
        comps = list(layout.components)
        self.columns = (
            BASE_COLUMNS
            + [m for m in metric_names if m not in BASE_COLUMNS]
            + [f"{k}_{c}" for c in comps for k in COMPONENT_COLUMN_KINDS]
        )
        for path, header in ((self.rounds_path, self.columns), (self.groups_path, GROUP_COLUMNS)):
            if not path.exists() or path.stat().st_size == 0:
                with open(path, "w", newline="", encoding="utf-8") as handle:
                    csv.writer(handle).writerow(header)

    def last_round(self) -> int:
        """The last round with a row in ``rounds.csv`` (-1 when none)."""
        with open(self.rounds_path, newline="", encoding="utf-8") as handle:
            rows = [r for r in csv.reader(handle)][1:]
        return max((int(r[0]) for r in rows if r), default=-1)

    def truncate(self, last_round: int) -> None:
        """Drop rows after ``last_round`` (rows written before a kill but not checkpointed)."""
        _rewrite_upto(self.rounds_path, last_round)
        _rewrite_upto(self.groups_path, last_round)

    def write_round(
        self,
        server_round: int,
        *,
        report: RoundReport | None,
        epsilon: float | None,
        metrics: dict[str, float] | None,
    ) -> None:
        """Append the row of ``server_round`` (and its group rows when ``report`` is given)."""
        row: dict[str, Any] = {"round": server_round, "epsilon": _cell(epsilon)}
        if report is not None:
            row.update(
                cohort_size=report.cohort_size,
                num_replied=report.num_replied,
                num_failed=report.num_failed,
                dropped_replies=report.num_dropped,
                unreadable_utterances=report.unreadable_utterances,
                joint_norm_mean=_cell(report.joint_norm_mean),
                clip_rate=_cell(report.clip_rate),
                mean_clip_ratio=_cell(report.mean_clip_ratio),
                noise_std=_cell(report.noise_std),
                train_loss=_cell(report.train_loss),
            )
            for comp in self.layout.components:
                row[f"norm_{comp}"] = _cell(report.component_norms.get(comp))
                row[f"clip_rate_{comp}"] = _cell(report.component_clip_rates.get(comp))
                row[f"budget_{comp}"] = _cell(report.component_budgets.get(comp))
            row.update(report.extra)
        row.update(metrics or {})
        with open(self.rounds_path, "a", newline="", encoding="utf-8") as handle:
            csv.DictWriter(handle, self.columns, restval="", extrasaction="ignore").writerow(row)
        if report is not None and report.group_norms:
            with open(self.groups_path, "a", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                for group in self.layout:
                    writer.writerow(
                        [
                            server_round,
                            group.name,
                            group.component,
                            group.numel,
                            _cell(report.group_norms.get(group.name)),
                            _cell(report.group_budgets.get(group.name)),
                            _cell(report.group_clip_rates.get(group.name)),
                        ]
                    )


def progress_line(
    *,
    server_round: int,
    num_rounds: int,
    report: RoundReport | None,
    epsilon: float | None,
    metrics: dict[str, float] | None,
    started: float,
    rounds_done_here: int,
    accountant: str | None = None,
) -> str:
    """Return ``round k/T | cohort c/K | eps (accountant) | last metric | time left``.

    Example
    -------
    >>> progress_line(server_round=1, num_rounds=4, report=None, epsilon=0.5,
    ...               metrics={"valid_loss": 0.25}, started=time.time(), rounds_done_here=1)[:9]
    'round 1/4'
    """
    parts = [f"round {server_round}/{num_rounds}"]
    if report is not None:
        parts.append(f"cohort {report.num_replied}/{report.cohort_size} of K={report.population}")
    label = "eps" if accountant is None else f"eps ({accountant})"
    parts.append("eps -" if epsilon is None else f"{label} {epsilon:.3f}")
    for key, value in (metrics or {}).items():
        parts.append(f"{key} {value:.4g}")
    if rounds_done_here > 0:
        per_round = (time.time() - started) / rounds_done_here
        left = per_round * (num_rounds - server_round)
        parts.append(
            f"{per_round:.1f} s/round, ~{time.strftime('%H:%M:%S', time.gmtime(left))} left"
        )
    return " | ".join(parts)
