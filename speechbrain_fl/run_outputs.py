"""A run's output files: the ``rounds.csv`` / ``group_norms.csv`` contract, their reader, and
the results tables built from ``results.json`` (docs/api.md "Run outputs").

:mod:`speechbrain_fl.fl.serverapp.telemetry` writes the CSV files with the columns defined here; the
figures (:mod:`speechbrain_fl.plots`), the recipes and the method tables read them back through
:func:`read_table`, :func:`read_rounds` and :func:`read_group_norms`. Component labels are never
named here: they are whatever the run's layout called them (``encoder``/``connector``/``llm``
for a speech LLM, layers and exits for SUPERB), found from the ``<kind>_<label>`` columns. This
module imports neither Flower nor matplotlib, so writer and readers share it freely.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

#: Per-round columns of ``rounds.csv`` that are not evaluation metrics, in file order.
ROUND_COLUMNS = (
    "round",
    "cohort_size",
    "num_replied",
    "num_failed",
    "dropped_replies",
    "unreadable_utterances",
    "epsilon",
    "joint_norm_mean",
    "clip_rate",
    "mean_clip_ratio",
    "noise_std",
)
#: Per-component column kinds of ``rounds.csv``; the column of component ``L`` is ``f"{kind}_{L}"``.
COMPONENT_COLUMN_KINDS = ("norm", "clip_rate", "budget")
COMPONENT_PREFIXES = tuple(f"{kind}_" for kind in COMPONENT_COLUMN_KINDS)
#: Columns of ``group_norms.csv``, one row per (round, group).
GROUP_COLUMNS = ("round", "group", "component", "numel", "mean_norm", "budget", "clip_rate")
GROUP_TEXT_COLUMNS = ("group", "component")

Table = dict[str, np.ndarray]


def read_table(path: str | Path, *, text_columns: Sequence[str] = ()) -> Table:
    """Read a run CSV into columns: floats (empty cell = NaN) except ``text_columns`` (str).

    Raises ``ValueError`` naming the file, column and row of a non-numeric cell.

    Example
    -------
    >>> p = getfixture("tmp_path") / "r.csv"
    >>> _ = p.write_text("round,WER\\n0,\\n1,0.5\\n")
    >>> read_table(p)["WER"].tolist()
    [nan, 0.5]
    """
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    table = {}
    for column in header:
        cells = [row.get(column) or "" for row in rows]
        if column in text_columns:
            table[column] = np.array(cells, dtype=str)
            continue
        values = np.full(len(cells), np.nan)
        for i, cell in enumerate(cells):
            if cell.strip():
                try:
                    values[i] = float(cell)
                except ValueError as err:
                    raise ValueError(
                        f"{path}: column {column!r}, data row {i + 1}: {cell!r} is not a number"
                    ) from err
        table[column] = values
    return table


def read_rounds(output_folder: str | Path) -> Table | None:
    """``<output_folder>/rounds.csv`` as columns, or ``None`` when the file is absent.

    Raises ``ValueError`` when the file has no ``round`` column.
    """
    path = Path(output_folder) / "rounds.csv"
    if not path.is_file():
        return None
    table = read_table(path)
    if "round" not in table:
        raise ValueError(f"{path}: no 'round' column; header is {list(table)}")
    return table


def read_group_norms(output_folder: str | Path) -> Table | None:
    """``<output_folder>/group_norms.csv`` as columns, or ``None`` when the file is absent.

    Raises ``ValueError`` naming the missing columns of :data:`GROUP_COLUMNS` needed to draw
    or summarise it (``group``, ``component``, ``mean_norm``).
    """
    path = Path(output_folder) / "group_norms.csv"
    if not path.is_file():
        return None
    table = read_table(path, text_columns=GROUP_TEXT_COLUMNS)
    missing = [c for c in ("group", "component", "mean_norm") if c not in table]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
    return table


def has_values(table: Table, column: str) -> bool:
    """Whether ``column`` exists and holds at least one number."""
    return column in table and bool(np.isfinite(table[column]).any())


def component_labels(table: Table, kind: str) -> list[str]:
    """Component labels ``L`` with a non-empty ``<kind>_<L>`` column, in file (layout) order.

    Example
    -------
    >>> t = {"norm_layer3": np.array([1.0]), "norm_exit1": np.array([np.nan]),
    ...      "clip_rate": np.array([0.5])}
    >>> component_labels(t, "norm")
    ['layer3']
    """
    prefix = f"{kind}_"
    return [
        column[len(prefix) :]
        for column in table
        if column.startswith(prefix) and has_values(table, column)
    ]


def metric_columns(rounds: Table) -> list[str]:
    """Columns of ``rounds.csv`` that hold metrics: neither fixed nor per-component, with data."""
    return [
        c
        for c in rounds
        if c not in ROUND_COLUMNS and not c.startswith(COMPONENT_PREFIXES) and has_values(rounds, c)
    ]


def series(table: Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, values) of ``column`` with its empty cells dropped."""
    rounds, values = table["round"], table[column]
    keep = np.isfinite(values) & np.isfinite(rounds)
    return rounds[keep], values[keep]


def mean_cohort_size(rounds: Table) -> float | None:
    """Mean ``cohort_size`` over the trained rounds (>= 1), ``None`` without one > 0."""
    if "cohort_size" not in rounds:
        return None
    sizes = rounds["cohort_size"][(rounds["round"] >= 1) & np.isfinite(rounds["cohort_size"])]
    return float(sizes.mean()) if sizes.size and sizes.mean() > 0 else None


# ------------------------------------------------------------------------------------------
# Results tables from results.json
# ------------------------------------------------------------------------------------------
# A run ends by printing format_results_table of its own results.json; the method-table script
# passes a list of them to get one row per run. Expected shape (missing entries print as "-",
# e.g. a FedAvg run has no privacy section); the keys of privacy.sigma_eff are the run's pools
# (or components for a flat clip), never fixed names:
#
#     {"method": "alpha_split", "model": "tiny",
#      "test": {"WER": 0.41, "WER_ci95": [0.38, 0.44], "per_language": {"de": {"WER": 0.4}}},
#      "privacy": {"epsilon": 7.9, "delta": 1e-5, "noise_multiplier": 0.1, "clip": 1.0,
#                  "sampling_rate": 0.3, "rounds": 40,
#                  "sigma_eff": {"encoder": 0.447, "llm": 0.103}}}
_MISSING = "-"


def _get(mapping: Mapping, *keys):
    for key in keys:
        if not isinstance(mapping, Mapping) or key not in mapping or mapping[key] is None:
            return None
        mapping = mapping[key]
    return mapping


def _num(value, spec: str = ".4f") -> str:
    return _MISSING if value is None else format(value, spec)


def _language_wer(entry) -> float | None:
    return entry.get("WER") if isinstance(entry, Mapping) else entry


def results_rows(results: Mapping | Sequence[Mapping]) -> tuple[list[str], list[list[str]]]:
    """Header and string cells of the results table, one row per run.

    Per-language WER and ``σ_eff`` columns are the union over the runs (languages sorted,
    ``σ_eff`` pools in first-seen order). Raises ``ValueError`` naming the run (by index and
    method) that lacks ``test.WER``.

    Example
    -------
    >>> header, rows = results_rows({"method": "flat", "model": "tiny", "test": {"WER": 0.5},
    ...                              "privacy": {"sigma_eff": {"layer1": 0.1, "exit1": 0.2}}})
    >>> rows[0][:3], header[-2:]
    (['flat', 'tiny', '0.5000'], ['σ_eff layer1', 'σ_eff exit1'])
    """
    runs = [results] if isinstance(results, Mapping) else list(results)
    if not runs:
        raise ValueError("no results to tabulate")
    for index, run in enumerate(runs):
        if _get(run, "test", "WER") is None:
            raise ValueError(f"results[{index}] ({run.get('method', '?')!r}) has no test.WER")
    languages = sorted({lang for run in runs for lang in _get(run, "test", "per_language") or {}})
    pools = list(dict.fromkeys(p for run in runs for p in _get(run, "privacy", "sigma_eff") or {}))
    header = ["Method", "Model", "WER", "95% CI", *[f"WER {lang}" for lang in languages]]
    header += ["ε", "δ", "σ", "C", "q", "rounds", *[f"σ_eff {pool}" for pool in pools]]
    rows = []
    for run in runs:
        ci = _get(run, "test", "WER_ci95")
        per_language = _get(run, "test", "per_language") or {}
        privacy = _get(run, "privacy") or {}
        rounds = _get(privacy, "rounds")
        rows.append(
            [
                str(run.get("method", _MISSING)),
                str(run.get("model", _MISSING)),
                _num(_get(run, "test", "WER")),
                _MISSING if not ci else f"[{ci[0]:.4f}, {ci[1]:.4f}]",
                *[_num(_language_wer(per_language.get(lang))) for lang in languages],
                _num(_get(privacy, "epsilon"), ".2f"),
                _num(_get(privacy, "delta"), ".0e"),
                _num(_get(privacy, "noise_multiplier"), "g"),
                _num(_get(privacy, "clip"), "g"),
                _num(_get(privacy, "sampling_rate"), "g"),
                _MISSING if rounds is None else str(rounds),
                *[_num(_get(privacy, "sigma_eff", pool), ".3f") for pool in pools],
            ]
        )
    return header, rows


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, style: str) -> str:
    """A table of string cells: ``"markdown"`` (pipe table) or ``"text"`` (aligned columns).

    Example
    -------
    >>> print(render_table(["exit", "acc"], [["3", "0.5"]], style="markdown"))
    | exit | acc |
    |---|---|
    | 3 | 0.5 |
    >>> print(render_table(["exit", "accuracy"], [["3", "0.5"]], style="text"))
    exit  accuracy
    3     0.5
    """
    rows = [[str(c) for c in row] for row in rows]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row} has {len(row)} cells for {len(header)} columns")
    if style == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    if style == "text":
        widths = [max(len(r[i]) for r in [list(header), *rows]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [list(header), *rows]
        )
    raise ValueError(f"style must be 'markdown' or 'text', got {style!r}")


def format_results_table(results: Mapping | Sequence[Mapping], *, style: str = "markdown") -> str:
    """Format one or more ``results.json`` dicts as a table.

    Arguments
    ---------
    results : mapping or sequence of mappings
        One run's results, or several (one row each).
    style : str
        ``"markdown"`` (pipe table, for READMEs) or ``"text"`` (aligned columns, for logs).

    Returns
    -------
    str

    Example
    -------
    >>> print(format_results_table({"method": "fedavg", "model": "tiny",
    ...                             "test": {"WER": 0.25, "WER_ci95": [0.2, 0.3]}}, style="text"))
    Method  Model  WER     95% CI            ε  δ  σ  C  q  rounds
    fedavg  tiny   0.2500  [0.2000, 0.3000]  -  -  -  -  -  -
    """
    header, rows = results_rows(results)
    return render_table(header, rows, style=style)
