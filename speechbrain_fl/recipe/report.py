"""The report of a run: results.json, the printed results table, README tables between markers.

One writer for each output a recipe reports:

- :func:`write_results`: ``results.json``, written atomically (a killed run leaves the previous
  file or none, never half of one);
- :func:`write_rows`: a CSV of per-utterance or per-epoch rows, written atomically;
- :func:`render_table` (from :mod:`speechbrain_fl.run_outputs`): a header and string cells as
  a Markdown pipe table (READMEs) or aligned text columns (logs), the one table formatter;
- :func:`print_summary`: the end-of-run printout (table, timings, where the outputs are);
  :func:`timing_line` its timings;
- :func:`update_readme_table` / :func:`insert_table`: a generated table between the README
  markers ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, the one marker syntax of every
  generated README table (``NAME`` e.g. ``method-table``, ``results:kws12``, ``studies``).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from speechbrain_fl.run_outputs import render_table
from speechbrain_fl.utils.atomic import atomic_open

__all__ = [
    "RESULTS_FILE",
    "insert_table",
    "markers",
    "print_summary",
    "render_table",
    "timing_line",
    "update_readme_table",
    "write_results",
    "write_rows",
]

RESULTS_FILE = "results.json"


def write_results(output_folder: str | os.PathLike, results: Mapping[str, Any]) -> Path:
    """Write ``results`` as ``<output_folder>/results.json`` (indented; numpy floats as floats).

    Example
    -------
    >>> import tempfile, json
    >>> path = write_results(tempfile.mkdtemp(), {"test": {"WER": 0.5}})
    >>> json.loads(path.read_text())["test"]["WER"]
    0.5
    """
    path = Path(output_folder) / RESULTS_FILE
    with atomic_open(path) as handle:
        json.dump(results, handle, indent=2, default=float)
    return path


def write_rows(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], header=None) -> Path:
    """Write ``rows`` (dicts) as a CSV with ``header`` (default: the first row's keys).

    Example
    -------
    >>> import tempfile, pathlib
    >>> p = write_rows(pathlib.Path(tempfile.mkdtemp()) / "r.csv", [{"a": 1, "b": 2}])
    >>> p.read_text().splitlines()
    ['a,b', '1,2']
    """
    if not rows:
        raise ValueError(f"{path}: no rows to write")
    fields = list(header or rows[0])
    with atomic_open(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def timing_line(timings: Mapping[str, float]) -> str:
    """``Time (s): part t, ..., total T``, saying so when the parts exceed the total.

    ``total`` is this process's wall time; a part can be work an earlier process did and this
    one reused (the corpus and seed model of a prepared run, read from ``prepared.json``), so
    the parts may add up to more than the total: the line then says which time is which.

    Example
    -------
    >>> timing_line({"corpus": 2.0, "federated": 5.0, "total": 8.0})
    'Time (s): corpus 2, federated 5, total 8'
    >>> timing_line({"corpus": 37.0, "federated": 5.0, "total": 9.0})
    'Time (s): corpus 37, federated 5, total 9 (this process; the parts include work of an earlier process that this run reused)'
    """  # noqa: E501
    parts = {k: v for k, v in timings.items() if k != "total"}
    text = "Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
    if "total" not in timings:
        return text
    total = float(timings["total"])
    text += f"{', ' if parts else ''}total {total:.0f}"
    if sum(parts.values()) > total + 1.0:
        text += " (this process; the parts include work of an earlier process that this run reused)"
    return text


def print_summary(
    table: str,
    *,
    output_folder: str | os.PathLike,
    timings: Mapping[str, float],
    plots: Sequence[Any] = (),
    extra: Sequence[str] = (),
) -> None:
    """Print the end-of-run results: the table, extra lines, the timings, where outputs are."""
    print("\n" + table)
    for line in extra:
        print(line)
    print(timing_line(timings))
    print(
        f"Results: {os.path.join(output_folder, RESULTS_FILE)}; "
        f"{len(plots)} plot(s) in {os.path.join(output_folder, 'plots')}"
    )


def markers(name: str) -> tuple[str, str]:
    """The README markers of the generated table ``name``.

    Example
    -------
    >>> markers("results:kws12")
    ('<!-- results:kws12:start -->', '<!-- results:kws12:end -->')
    """
    if not name or "--" in name or "\n" in name:
        raise ValueError(f"table name {name!r} must be non-empty, one line, without '--'")
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def insert_table(text: str, name: str, markdown: str) -> str:
    """Put ``markdown`` between the markers of table ``name`` in ``text`` (a README).

    Replaces whatever lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; when only
    the start marker is present, the table and the end marker are inserted right after it.
    Raises ``ValueError`` when the start marker is missing, appears twice, or an end marker
    comes before it.

    Example
    -------
    >>> insert_table("a\\n<!-- t:start -->\\nold\\n<!-- t:end -->\\nb", "t", "T")
    'a\\n<!-- t:start -->\\nT\\n<!-- t:end -->\\nb'
    >>> insert_table("a\\n<!-- t:start -->\\nb", "t", "T")
    'a\\n<!-- t:start -->\\nT\\n<!-- t:end -->\\nb'
    """
    start_marker, end_marker = markers(name)
    count = text.count(start_marker)
    if count == 0:
        raise ValueError(f"no {start_marker} marker to insert the table at")
    if count > 1:
        raise ValueError(f"{start_marker} appears {count} times; it must appear once")
    start = text.index(start_marker) + len(start_marker)
    head, rest = text[:start], text[start:]
    if end_marker in head:
        raise ValueError(f"{end_marker} comes before {start_marker}")
    block = f"\n{markdown.strip()}\n{end_marker}"
    end = rest.find(end_marker)
    if end < 0:
        return head + block + rest
    return head + block + rest[end + len(end_marker) :]


def update_readme_table(readme_path: str | os.PathLike, name: str, markdown: str) -> Path:
    """Write ``markdown`` between the markers of table ``name`` of a README file (atomically).

    The one README-table writer of the recipes (MLS ``method_table.py``, SUPERB
    ``studies/results_table.py``, Private-Gender ``studies.py``); see :func:`insert_table`.
    Errors name the file.
    """
    path = Path(readme_path)
    try:
        text = insert_table(path.read_text(encoding="utf-8"), name, markdown)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    with atomic_open(path) as handle:
        handle.write(text)
    return path
