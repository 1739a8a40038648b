"""Reports of the Private-Gender recipe: the printed results table and ``results.json``.

* :func:`results_table`: an aligned text table, one row per model: epsilon, accuracy, balanced
  accuracy, macro-F1, MajPred and top share with their 95% speaker-level bootstrap intervals,
  then the per-class recall.
* :func:`audit_table`: the teacher's DP-SGD audit beside the accountant's epsilon (PLD and RDP).
* :func:`write_json`: ``results.json`` written atomically
  (:func:`speechbrain_fl.utils.atomic.atomic_open`).

The shared :func:`speechbrain_fl.run_outputs.format_results_table` tabulates the federated
recipes' ``test.WER`` and privacy columns; this recipe's metrics are classification metrics
with intervals per cell, so it keeps its own table.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json

from speechbrain_fl.utils.atomic import atomic_open

__all__ = ["audit_table", "eps_str", "joint_row", "results_table", "write_json"]

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


#: How :func:`audit_table` words ``audit["verdict"]`` (speechbrain_fl.privacy.dpsgd_audit).
VERDICTS = {
    "bug": "LOWER BOUND ABOVE THE ACCOUNTANT'S EPSILON: a bug in clipping, noise or sampling "
    "(proven at the stated confidence)",
    "suspect": "ONE-SHOT INTERVAL ABOVE THE ACCOUNTANT'S EPSILON: an estimate, not a proof; "
    "rerun, and if it recurs look for a bug",
    "consistent": "consistent with the accountant (which does not prove the code correct)",
}


def audit_table(audit: dict) -> str:
    """The canary audit's figures beside the accountant's, as printed after a teacher run.

    Example
    -------
    >>> print(audit_table({"accountant": "pld", "accountant_epsilon": 1.0,
    ...     "accountant_epsilon_rdp": 1.1, "epsilon_one_shot": 0.2, "epsilon_lower_bound": 0.0,
    ...     "confidence": 0.95, "canaries": 10, "inserted": 4, "insertions": 9, "steps": 3,
    ...     "exceeds_accountant": False}).splitlines()[1])
      accountant epsilon (PLD)                  1.000   (RDP 1.100)
    """
    one_shot = audit["epsilon_one_shot"]
    bound = f"lower bound (Steinke et al. 2023), {100 * audit['confidence']:.0f}%"
    lines = [
        "Privacy audit of the teacher (gradient canaries; adversary sees the final model only):",
        f"  {'accountant epsilon (' + audit['accountant'].upper() + ')':<40}  "
        f"{audit['accountant_epsilon']:.3f}   (RDP {audit['accountant_epsilon_rdp']:.3f})",
        f"  {'one-shot estimate (Andrew et al. 2024)':<40}  "
        + ("n/a" if one_shot is None else f"{one_shot:.3f}")
        + (
            ""
            if not audit.get("one_shot_ci")
            else f"   [{audit['one_shot_ci'][0]:.3f}, {audit['one_shot_ci'][1]:.3f}] over the canaries"
        ),
        f"  {bound:<40}  {audit['epsilon_lower_bound']:.3f}",
        f"  {audit['canaries']} canaries ({audit['inserted']} inserted; {audit['insertions']} "
        f"insertions over {audit['steps']} steps): " + VERDICTS[audit.get("verdict", "consistent")],
        "  a lower bound for this run's threat model (one clip, add/remove, final model); "
        "canaries are not training examples of any person",
    ]
    return "\n".join(lines)
