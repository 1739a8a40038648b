"""Short results tables from ``results.json`` dicts (DESIGN.md contract 7).

A run ends by printing :func:`format_results_table` of its own ``results.json``; the method-table
script passes a list of them to get one row per run. Expected shape (missing entries print as
``-``, e.g. a FedAvg run has no ``privacy`` section)::

    {"method": "alpha_split", "model": "tiny",
     "test": {"WER": 0.41, "WER_ci95": [0.38, 0.44], "per_language": {"de": {"WER": 0.4}, ...}},
     "privacy": {"epsilon": 7.9, "delta": 1e-5, "noise_multiplier": 0.1, "clip": 1.0,
                 "sampling_rate": 0.3, "rounds": 40,
                 "sigma_eff": {"encoder": 0.447, "llm": 0.103}}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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

    Raises ``ValueError`` naming the run (by index and method) that lacks ``test.WER``.

    Example
    -------
    >>> header, rows = results_rows({"method": "flat", "model": "tiny", "test": {"WER": 0.5}})
    >>> rows[0][:3]
    ['flat', 'tiny', '0.5000']
    """
    runs = [results] if isinstance(results, Mapping) else list(results)
    if not runs:
        raise ValueError("no results to tabulate")
    for index, run in enumerate(runs):
        if _get(run, "test", "WER") is None:
            raise ValueError(f"results[{index}] ({run.get('method', '?')!r}) has no test.WER")
    languages = sorted({lang for run in runs for lang in _get(run, "test", "per_language") or {}})
    header = ["Method", "Model", "WER", "95% CI", *[f"WER {lang}" for lang in languages]]
    header += ["ε", "δ", "σ", "C", "q", "rounds", "σ_eff enc", "σ_eff LLM"]
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
                _num(_get(privacy, "sigma_eff", "encoder"), ".3f"),
                _num(_get(privacy, "sigma_eff", "llm"), ".3f"),
            ]
        )
    return header, rows


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
    Method  Model  WER     95% CI            ε  δ  σ  C  q  rounds  σ_eff enc  σ_eff LLM
    fedavg  tiny   0.2500  [0.2000, 0.3000]  -  -  -  -  -  -       -          -
    """
    header, rows = results_rows(results)
    if style == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    if style == "text":
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]
        )
    raise ValueError(f"style must be 'markdown' or 'text', got {style!r}")
