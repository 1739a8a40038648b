"""``budgets.csv``: the clip budget of each component in each round, the privacy report's input.

The joint epsilon needs only the accountant's state, but the per-pool figures of results.json
(:func:`speechbrain_fl.privacy.accounting.privacy_report`: a pool's ``sigma_eff`` from the
largest budget it had in any round) read every round's component budgets. They are kept in
this file, one row ``round,component,budget`` per (round, component) and a row with empty
``component`` for a round without per-component budgets (a flat budget over several
components), rather than in the server state: the state then holds only what resume needs
and does not grow with the rounds. Each round's rows are written after the round's state is
committed, by replacing the file atomically; a resume drops rows after the committed round.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path

from speechbrain_fl.utils.atomic import atomic_open

__all__ = ["BUDGETS_FILE", "BudgetLog"]

BUDGETS_FILE = "budgets.csv"
HEADER = ["round", "component", "budget"]


class BudgetLog:
    """The per-round component budgets of a run, in ``<folder>/budgets.csv``.

    Example
    -------
    >>> log = BudgetLog(getfixture("tmp_path"))
    >>> log.append(1, {"encoder": 0.2, "llm": 0.9}); log.append(2, {})
    >>> log.read()
    [{'encoder': 0.2, 'llm': 0.9}, {}]
    >>> log.truncate(1); log.read()
    [{'encoder': 0.2, 'llm': 0.9}]
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / BUDGETS_FILE

    def _rows(self) -> list[list[str]]:
        if not self.path.exists():
            return []
        with open(self.path, newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
        if rows and rows[0] != HEADER:
            raise ValueError(f"{self.path}: header {rows[0]} is not {HEADER}")
        return [r for r in rows[1:] if r]

    def _write(self, rows: list[list[str]]) -> None:
        text = io.StringIO()
        csv.writer(text).writerows([HEADER, *rows])
        with atomic_open(self.path, "w", newline="") as handle:
            handle.write(text.getvalue())

    def append(self, server_round: int, budgets: Mapping[str, float]) -> None:
        """Record the component budgets of ``server_round`` (replacing any rows it had)."""
        rows = [r for r in self._rows() if int(r[0]) != server_round]
        new = [[str(server_round), c, repr(float(b))] for c, b in budgets.items()]
        self._write(rows + (new or [[str(server_round), "", ""]]))

    def truncate(self, last_round: int) -> None:
        """Drop the rows of rounds after ``last_round`` (written before a kill, uncommitted)."""
        rows = self._rows()
        kept = [r for r in rows if int(r[0]) <= last_round]
        if len(kept) != len(rows):
            self._write(kept)

    def clear(self) -> None:
        """Remove the file (a fresh run)."""
        self.path.unlink(missing_ok=True)

    def read(self) -> list[dict[str, float]]:
        """The budgets of each recorded round, in round order (``{}`` for an empty row)."""
        rounds: dict[int, dict[str, float]] = {}
        for server_round, component, budget in self._rows():
            entry = rounds.setdefault(int(server_round), {})
            if component:
                entry[component] = float(budget)
        return [rounds[r] for r in sorted(rounds)]
