"""Reports of the Private-Gender recipe: the printed results table and ``results.json``.

* :func:`results_table`: an aligned text table, one row per model: epsilon, accuracy, balanced
  accuracy, macro-F1, MajPred and top share with their 95% speaker-level bootstrap intervals,
  then the per-class recall.
* :func:`write_json`: ``results.json`` written atomically
  (:func:`speechbrain_fl.atomic.atomic_open`).

The shared :func:`speechbrain_fl.run_outputs.format_results_table` tabulates the federated
recipes' ``test.WER`` and privacy columns; this recipe's metrics are classification metrics
with intervals per cell, so it keeps its own table.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json

from speechbrain_fl.atomic import atomic_open

__all__ = ["eps_str", "joint_row", "results_table", "write_json"]

METRIC_COLUMNS = (
    ("accuracy", "Accuracy"),
    ("balanced_accuracy", "Balanced acc."),
    ("macro_f1", "Macro-F1"),
    ("majpred", "MajPred"),
    ("top_share", "Top share"),
)


def _fmt(block: dict | None, key: str) -> str:
    if not block or key not in block:
        return "-"
    value, ci = block[key]["value"], block[key]["ci"]
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def results_table(rows: list[tuple[str, dict | None, str]], classes) -> str:
    """Aligned text table of ``(model name, collapse report or None, epsilon string)`` rows.

    Example
    -------
    >>> block = {"accuracy": {"value": 0.5, "ci": [0.25, 0.75]},
    ...          "per_class_recall": {"m": {"value": 1.0}}}
    >>> print(results_table([("DP-direct", block, "0.990")], ["m"]))
    Model      ε      Accuracy              Balanced acc.  Macro-F1  MajPred  Top share  Recall m
    DP-direct  0.990  0.500 [0.250, 0.750]  -              -         -        -          1.000
    """
    header = ["Model", "ε", *[title for _, title in METRIC_COLUMNS]]
    header += [f"Recall {c}" for c in classes]
    lines = [header]
    for name, block, eps in rows:
        recall = (block or {}).get("per_class_recall", {})
        lines.append(
            [
                name,
                eps,
                *[_fmt(block, key) for key, _ in METRIC_COLUMNS],
                *[f"{recall[c]['value']:.3f}" if c in recall else "-" for c in classes],
            ]
        )
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines
    )


def joint_row(privacy_joint: dict) -> tuple[str, None, str]:
    """The table row of the joint epsilon of every release from D_priv (no metrics).

    Example
    -------
    >>> joint_row({"epsilon": 1.43, "releases": [{"name": "teacher"}, {"name": "DP-direct"}]})
    ('all releases from D_priv, joint (teacher + DP-direct)', None, '1.430')
    """
    names = " + ".join(r["name"] for r in privacy_joint["releases"])
    return (f"all releases from D_priv, joint ({names})", None, eps_str(privacy_joint["epsilon"]))


def write_json(path, content) -> None:
    """Write ``content`` as indented JSON to ``path`` atomically (numbers as floats)."""
    with atomic_open(path) as handle:
        json.dump(content, handle, indent=2, default=float)


def eps_str(epsilon) -> str:
    """``"∞ (no DP)"`` for ``None``, else epsilon to 3 decimals."""
    return "∞ (no DP)" if epsilon is None else f"{epsilon:.3f}"
