"""The MLS method tables: the runs' results.json read back and formatted as README tables.

- :func:`load_results`: every (method, encoder variant) run's ``results.json``;
- :func:`format_method_table`: the paper's Table III for this repository (WER [95% CI], the gap
  to FedAvg, epsilon, the effective noise per pool);
- :func:`format_change_table`, :func:`format_private_table`: the change from round 0 and the
  runs at a target epsilon;
- :func:`write_dev_wer_figure`: the dev WER by round of every run.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The hparams files, in the row order of the paper's Table III, with their display names.
METHODS: dict[str, str] = {
    "fedavg": "FedAvg (no DP)",
    "flat": "Flat",
    "pfl_uniform": "PFL-Uniform",
    "pfl_dim": "PFL-Dim",
    "pfl_dim_ema": "PFL-Dim+EMA",
    "pfl_unif_ema": "PFL-Unif+EMA",
    "alpha_split": "α-Split",
}
#: Encoder variants and the value of ``freeze_encoder`` each one passes to train_fl.py.
VARIANTS: dict[str, bool] = {"frozen": True, "unfrozen": False}
BASELINE = "fedavg"
HEADER = (
    "| Method | Enc. frozen WER [95% CI] | Gap | Enc. unfrozen WER [95% CI] | Gap "
    "| epsilon | sigma_eff enc / LLM |"
)
_MISSING = "-"


def run_folder(output_root: str | os.PathLike, method: str, variant: str) -> Path:
    """The output folder of one run: ``<output_root>/<method>/freeze_encoder_<True|False>``."""
    return Path(output_root) / method / f"freeze_encoder_{VARIANTS[variant]}"


def load_results(output_root: str | os.PathLike) -> dict[tuple[str, str], dict]:
    """Every ``results.json`` found under ``output_root``, keyed by ``(method, variant)``.

    Raises ``ValueError`` naming a file that is not valid JSON or has no ``test.WER``.
    """
    found = {}
    for method in METHODS:
        for variant in VARIANTS:
            path = run_folder(output_root, method, variant) / "results.json"
            if not path.is_file():
                continue
            try:
                with open(path, encoding="utf-8") as handle:
                    results = json.load(handle)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not valid JSON ({err})") from err
            if _get(results, "test", "WER") is None:
                raise ValueError(f"{path}: no test.WER (did the run finish?)")
            found[(method, variant)] = results
    return found


def _get(mapping, *keys):
    """``mapping[k1][k2]...`` of a results.json, or ``None`` where a level is missing or None
    (also used by seed_table.py)."""
    for key in keys:
        if not isinstance(mapping, Mapping) or mapping.get(key) is None:
            return None
        mapping = mapping[key]
    return mapping


def _wer_cell(results: Mapping | None) -> str:
    if results is None:
        return _MISSING
    wer = _get(results, "test", "WER")
    ci = _get(results, "test", "WER_ci95")
    cell = f"{wer:.4f}" if not ci else f"{wer:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]"
    round0 = _get(results, "test_round0", "WER")
    if round0 is not None and wer >= round0:
        cell += " †"
    if _get(results, "test_change_from_round0", "significant"):
        cell += " §"
    if results.get("stopped_early"):
        cell += " ‡"
    return cell


def _gap_cell(results: Mapping | None, baseline: Mapping | None, *, is_baseline: bool) -> str:
    if results is None:
        return _MISSING
    if is_baseline:
        return "—"
    if baseline is None:
        return _MISSING
    return f"{_get(results, 'test', 'WER') - _get(baseline, 'test', 'WER'):+.4f}"


def _joined(values: Sequence) -> str:
    """One value if all runs agree, else ``frozen / unfrozen``."""
    shown = [_MISSING if v is None else v for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _epsilon_cell(runs: Sequence[Mapping | None]) -> str:
    runs = [r for r in runs if r is not None]
    values = [_get(r, "privacy", "epsilon") for r in runs]
    if not values:
        return _MISSING
    # *: results.json privacy.caveats lists what this epsilon does not cover
    marks = ["*" if _get(r, "privacy", "epsilon_covers_everything") is False else "" for r in runs]
    return _joined(
        [None if v is None else f"{v:.4g}{m}" for v, m in zip(values, marks, strict=True)]
    )


def _sigma_cell(runs: Sequence[Mapping | None]) -> str:
    # Prefer the unfrozen run: it is the one that trains (and noises) the encoder.
    for results in reversed(runs):
        if results is not None and _get(results, "privacy", "epsilon") is not None:
            enc = _get(results, "privacy", "sigma_eff", "encoder")
            llm = _get(results, "privacy", "sigma_eff", "llm")
            return " / ".join(_MISSING if v is None else f"{v:.3f}" for v in (enc, llm))
    return _MISSING


def format_method_table(results: Mapping[tuple[str, str], Mapping]) -> str:
    """The markdown table of the runs, with the round-0 WER and the runs' settings below it.

    Arguments
    ---------
    results : mapping
        ``{(method, variant): results.json dict}`` as returned by :func:`load_results`.

    Returns
    -------
    str
        Markdown: the table, its legend, the round-0 WER and a settings line.

    Example
    -------
    >>> runs = {("fedavg", "frozen"): {"test": {"WER": 0.3}},
    ...         ("flat", "frozen"): {"test": {"WER": 0.35}, "privacy": {"epsilon": 614.1}}}
    >>> print(format_method_table(runs).splitlines()[3])
    | Flat | 0.3500 | +0.0500 | - | - | 614.1 | - / - |
    """
    if not results:
        raise ValueError("no results.json to tabulate")
    lines = [HEADER, "|---|---:|---:|---:|---:|---:|---:|"]
    for method, name in METHODS.items():
        runs = [results.get((method, variant)) for variant in VARIANTS]
        if all(r is None for r in runs):
            continue
        cells = [name]
        for variant, run in zip(VARIANTS, runs, strict=True):
            cells.append(_wer_cell(run))
            cells.append(
                _gap_cell(run, results.get((BASELINE, variant)), is_baseline=method == BASELINE)
            )
        cells.append(_epsilon_cell(runs))
        cells.append(_sigma_cell(runs))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", _legend(), "", _round0_line(results), "", _settings_line(results)]
    return "\n".join(lines)


def _legend() -> str:
    return (
        "Gap = WER - FedAvg WER of the same encoder variant (as in the paper's Table III). "
        "95% CI: speaker-level percentile bootstrap. †: not below the round-0 WER (the "
        "federated stage did not improve on the seed model). §: the change from round 0 is "
        "significant (paired speaker-level bootstrap 95% CI of final - round-0 WER excludes 0). "
        "‡: stopped early (max_epsilon or "
        "too few clients). epsilon: joint client-level (epsilon, delta)-DP of the whole run from "
        "the run's accountant (PLD by default; results.json has RDP beside it), one value when "
        "both variants agree, else frozen / unfrozen; "
        "*: not covered by it (profiling rounds, alpha: auto, a raw EMA signal or test-only "
        "seeds; see results.json privacy.caveats). sigma_eff: "
        "effective noise multiplier of the encoder pool and of the LLM + connector pool, from "
        "the unfrozen run when there is one (a frozen encoder has no encoder pool; for the EMA "
        "methods the smallest value any round had)."
    )


def _round0_line(results: Mapping[tuple[str, str], Mapping]) -> str:
    cells = {}
    for run in results.values():
        wer = _get(run, "test_round0", "WER")
        if wer is None:
            continue
        ci = _get(run, "test_round0", "WER_ci95")
        cells[f"{wer:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")] = True
    if not cells:
        return "Round 0 (seed model, before any federated round): not recorded."
    return (
        "Round 0 (the seed model, before any federated round; every run starts from it): "
        f"WER {' / '.join(cells)}."
    )


def _settings_line(results: Mapping[tuple[str, str], Mapping]) -> str:
    runs = list(results.values())

    def values(*keys):
        found = sorted({str(v) for v in (_get(r, *keys) for r in runs) if v is not None})
        return "/".join(found) if found else _MISSING

    corpus = {bool(_get(r, "data", "embedded_corpus")) for r in runs}
    corpus_name = (
        "the embedded espeak-ng corpus"
        if corpus == {True}
        else "MLS"
        if corpus == {False}
        else "mixed corpora"
    )
    total = sum(_get(r, "timings_s", "total") or 0.0 for r in runs)
    private = [r for r in runs if _get(r, "privacy", "epsilon") is not None]

    def private_values(*keys):
        found = sorted({str(v) for v in (_get(r, *keys) for r in private) if v is not None})
        return "/".join(found) if found else _MISSING

    return (
        f"Settings: model {values('model')} on {corpus_name}, K={values('num_clients')} "
        f"clients, T={values('privacy', 'rounds')} rounds, q={values('privacy', 'sampling_rate')}, "
        f"C={private_values('privacy', 'clip')}, "
        f"sigma={private_values('privacy', 'noise_multiplier')}, "
        f"delta={private_values('privacy', 'delta')}; {len(runs)} runs, "
        f"{total / 60:.0f} min of run time in all."
    )


def _change_cell(results: Mapping | None) -> str:
    change = _get(results, "test_change_from_round0") if results else None
    if change is None:
        return _MISSING
    round0 = _get(results, "test_round0", "WER")
    rel = f" ({change['difference'] / round0:+.0%})" if round0 else ""
    low, high = change["ci95"]
    return f"{change['difference']:+.4f} [{low:+.4f}, {high:+.4f}]{rel}"


def _ratio_cell(results: Mapping | None) -> str:
    ratio = _get(results, "noise_vs_update") if results else None
    if not ratio or ratio.get("ratio") is None:
        return _MISSING
    cell = f"{ratio['noise_norm']:.3g} / {ratio['mean_update_norm']:.3g} = {ratio['ratio']:.2f}"
    return cell + (" (σ 0.1)" if ratio.get("sigma_source", "").startswith("paper") else "")


def _pool_cells(results: Mapping | None) -> list[str]:
    """Per-matrix and per-coordinate (LLM + connector)/encoder ratios, and pool retention."""
    pools = _get(results, "pools") if results else None
    if not pools:
        return [_MISSING, _MISSING, _MISSING]
    fmt = lambda v: _MISSING if v is None else f"{v:.2f}x"  # noqa: E731
    retention = pools.get("retention") or {}
    kept = " / ".join(f"{retention[k]:.2f}" if k in retention else _MISSING
                      for k in ("encoder", "llm"))  # fmt: skip
    return [fmt(pools.get("ratio_per_matrix")), fmt(pools.get("ratio_per_coordinate")), kept]


def format_change_table(results: Mapping[tuple[str, str], Mapping]) -> str:
    """Per run: final - round-0 WER (paired CI), noise/update norms, pool ratios and retention.

    The pool columns come from results.json's ``pools``: the (LLM + connector)/encoder
    update-norm ratio per matrix and per coordinate (norm / sqrt(p) per pool), and each pool's
    clipped-signal retention, post-clip / pre-clip norm, encoder / LLM (the paper's Fig. 5).

    Example
    -------
    >>> runs = {("fedavg", "unfrozen"): {"test": {"WER": 0.3}, "test_round0": {"WER": 0.5},
    ...     "test_change_from_round0": {"difference": -0.2, "ci95": [-0.25, -0.15]}}}
    >>> print(format_change_table(runs).splitlines()[2])
    | FedAvg (no DP) | unfrozen | -0.2000 [-0.2500, -0.1500] (-40%) | - | - | - | - |
    """
    lines = [
        "| Method | Encoder | Test WER change from round 0 [paired 95% CI] (relative) "
        "| noise norm / mean client update norm = ratio | LLM/encoder norm ratio per matrix "
        "| per coordinate | retention enc / LLM |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for method, name in METHODS.items():
        for variant in VARIANTS:
            run = results.get((method, variant))
            if run is None:
                continue
            cells = [name, variant, _change_cell(run), _ratio_cell(run), *_pool_cells(run)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_private_table(
    results: Mapping[tuple[str, str], Mapping], *, target_epsilon: float
) -> str:
    """The runs at the noise multiplier for ``target_epsilon``, and what it costs at scale.

    The extrapolation (:func:`speechbrain_fl.privacy.accounting.extrapolate_privacy`) keeps
    sigma, q and T (so epsilon) and shows the noise std on the mean, ``sigma C / n``, and its norm
    over the run's trainable values at the paper's K = 316 clients and at 10,000 clients, against
    this cohort's.
    """
    from speechbrain_fl.privacy.accounting import extrapolate_privacy

    if not results:
        return f"No runs at epsilon <= {target_epsilon:g} yet."
    lines = [
        f"| Method (epsilon <= {target_epsilon:g}) | Encoder | sigma | epsilon | Test WER [95% CI] "
        "| change from round 0 [paired 95% CI] | noise / update norm |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    example = None
    for method, name in METHODS.items():
        for variant in VARIANTS:
            run = results.get((method, variant))
            if run is None:
                continue
            example = example or run
            sigma = _get(run, "privacy", "noise_multiplier")
            eps = _get(run, "privacy", "epsilon")
            cells = [
                name, variant, _MISSING if sigma is None else f"{sigma:g}",
                _MISSING if eps is None else f"{eps:.2f}", _wer_cell(run), _change_cell(run),
                _ratio_cell(run),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    privacy = _get(example, "privacy") or {}
    ratio = _get(example, "noise_vs_update") or {}
    q, rounds, delta = (privacy.get(k) for k in ("sampling_rate", "rounds", "delta"))
    sigma, clip = privacy.get("noise_multiplier"), privacy.get("clip") or 1.0
    d, n = ratio.get("trainable_values"), ratio.get("expected_cohort_size")
    if None in (q, rounds, delta, sigma, d, n):
        return "\n".join(lines)
    lines += [
        "",
        f"What this guarantee costs (sigma {sigma:g}, q {q:g}, T {rounds}, delta {delta:g}: the "
        "same epsilon at any population with the same q; `extrapolate_privacy`):",
        "",
        "| Population K | expected cohort n = qK | noise std on the mean sigma C / n "
        f"| noise norm (d = {d}) | epsilon |",
        "|---:|---:|---:|---:|---:|",
    ]
    for population in (round(n / q), 316, 10_000):
        cohort = max(1, round(q * population))
        out = extrapolate_privacy(
            noise_multiplier=sigma, clip=clip, cohort_size=cohort, population=population,
            rounds=rounds, delta=delta,
        )  # fmt: skip
        lines.append(
            f"| {population:,} | {cohort:,} | {out['noise_std']:.2e} "
            f"| {out['noise_std'] * math.sqrt(d):.3g} | {out['epsilon']:.2f} |"
        )
    return "\n".join(lines)


def write_dev_wer_figure(
    results_roots: Mapping[str, str | os.PathLike], path: str | os.PathLike
) -> Path | None:
    """Dev WER by round of every method, one panel per (run set, encoder variant), shared axes.

    ``results_roots`` maps a panel prefix (e.g. ``"sigma 0.1"``) to an output root; runs without
    ``rounds.csv`` are left out. Returns the PNG path, or None when no run has rounds.
    """
    from speechbrain_fl.plots import plot_runs_by_round
    from speechbrain_fl.run_outputs import read_rounds

    panels: dict[str, dict] = {}
    for prefix, root in results_roots.items():
        for variant in VARIANTS:
            tables = {}
            for method, name in METHODS.items():
                table = read_rounds(run_folder(root, method, variant))
                if table is not None:
                    tables[name] = table
            if tables:
                panels[f"{prefix}, encoder {variant}"] = tables
    if not panels:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return plot_runs_by_round(panels, path, column="WER", title="Dev WER by round, every method")
