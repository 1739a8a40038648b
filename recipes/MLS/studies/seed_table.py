"""The MLS method table over several test-only seeds, with paired comparisons between methods.

``method_table.py --seeds S1 S2 S3`` runs every (method, encoder variant) once per seed into
``<output-root>/seed<S>`` with ``--sampler_seed S --noise_seed S``: the runs of one seed share
their cohorts and noise draws (the clients' training ``seed``, the corpus and the seed model are
the same for all), so a difference between two methods at one seed is the methods', and three
seeds show how much the draws move it. This module tabulates those runs:

- per method, the test WER of each seed and the pooled WER over the seeds (sum of edits over
  sum of reference words, :func:`compare.pool_seeds`), the pooled change from round 0 with its
  paired speaker-level 95% CI, the per-coordinate (LLM + connector)/encoder update-norm ratio
  and each pool's clipped-signal retention (mean over seeds), and the LLM retention against
  Flat's;
- the paired comparisons (Flat against PFL-Uniform, PFL-Dim, the EMA variants and
  alpha-split; alpha-split against PFL-Uniform and PFL-Dim; Flat against FedAvg), pooled over
  the seeds:
  ``WER_A - WER_B`` with its 95% CI and p-value (:func:`compare.compare_runs`).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from compare import compare_runs, pool_seeds
from method_tables import _get

from speechbrain_fl.metrics import paired_bootstrap_details, read_utterance_details

#: (A, B) method pairs compared on shared seeds: WER_A - WER_B. With the
#: encoder frozen, alpha-split runs as PFL-Dim (the paper's alpha = 0 row,
#: ``mls_settings.engine_hparams``): that pair then measures what the paired comparison leaves
#: unpaired (the audit canaries' OS-drawn directions), a floor for every other pair.
PAIRS = (
    ("pfl_uniform", "flat"),
    ("pfl_dim", "flat"),
    ("pfl_dim_ema", "flat"),
    ("pfl_unif_ema", "flat"),
    ("alpha_split", "flat"),
    ("alpha_split", "pfl_uniform"),
    ("alpha_split", "pfl_dim"),
    ("flat", "fedavg"),
)
_MISSING = "-"


def seed_root(output_root: str | os.PathLike, seed: int) -> Path:
    """Where the runs of one test-only seed go: ``<output_root>/seed<seed>``."""
    return Path(output_root) / f"seed{seed}"


def seed_overrides(seed: int) -> list[str]:
    """The train_fl.py arguments of one seed: the cohort sampler's and the noise's seeds."""
    return ["--sampler_seed", str(seed), "--noise_seed", str(seed)]


def _read(folder: Path) -> dict | None:
    path = folder / "results.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as handle:
        results = json.load(handle)
    if _get(results, "test", "WER") is None:
        raise ValueError(f"{path}: no test.WER (did the run finish?)")
    return results


def collect(
    folders: Mapping[str, Sequence[Path]],
) -> dict[str, list[tuple[Path, dict]]]:
    """``{method: [(run folder, results), ...]}``, only the seeds whose run finished."""
    out = {}
    for method, runs in folders.items():
        done = [(f, r) for f in runs if (r := _read(Path(f))) is not None]
        if done:
            out[method] = done
    return out


def pooled_change(runs: Sequence[Path], *, num_resamples: int = 10000):
    """Final minus round-0 test WER pooled over the seeds' runs, paired speaker bootstrap.

    Each run's ``test_utterances_round0.csv`` (the seed model, identical for every run) is paired
    with its ``test_utterances.csv``; the seeds are pooled by :func:`compare.pool_seeds`.
    """
    final = pool_seeds([read_utterance_details(Path(r) / "test_utterances.csv") for r in runs])
    start = pool_seeds(
        [read_utterance_details(Path(r) / "test_utterances_round0.csv") for r in runs]
    )
    return paired_bootstrap_details(
        final, start, names=("final", "round 0"), num_resamples=num_resamples
    )


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _fmt(value, spec=".3f", suffix=""):
    return _MISSING if value is None else f"{value:{spec}}{suffix}"


def method_rows(done: Mapping[str, list], names: Mapping[str, str], *, num_resamples=10000):
    """One row per method: seeds' WERs, pooled WER, pooled change, ratio, retention."""
    flat_llm = _mean(_get(r, "pools", "retention", "llm") for _, r in done.get("flat", []))
    rows = []
    for method, name in names.items():
        runs = done.get(method)
        if not runs:
            continue
        wers = [r["test"]["WER"] for _, r in runs]
        change = pooled_change([f for f, _ in runs], num_resamples=num_resamples)
        rel = change.difference / change.wer_b
        llm = _mean(_get(r, "pools", "retention", "llm") for _, r in runs)
        enc = _mean(_get(r, "pools", "retention", "encoder") for _, r in runs)
        vs_flat = llm / flat_llm if llm is not None and flat_llm else None
        eps = _mean(_get(r, "privacy", "epsilon") for _, r in runs)
        rows.append(
            {
                "method": method,
                "name": name,
                "seeds": len(runs),
                "wers": wers,
                "wer_pooled": change.wer_a,
                "wer_round0": change.wer_b,
                "change": change.difference,
                "change_ci": (change.ci_low, change.ci_high),
                "change_relative": rel,
                "change_significant": change.significant,
                "ratio_per_coordinate": _mean(
                    _get(r, "pools", "ratio_per_coordinate") for _, r in runs
                ),
                "retention_encoder": enc,
                "retention_llm": llm,
                "llm_retention_vs_flat": vs_flat,
                "epsilon": eps,
                "epsilon_rdp": _mean(_get(r, "privacy", "epsilon_rdp") for _, r in runs),
                "audit_one_shot": [
                    _get(r, "privacy", "audit", "epsilon_one_shot") for _, r in runs
                ],
                "audit_lower_bound": [
                    _get(r, "privacy", "audit", "epsilon_lower_bound") for _, r in runs
                ],
            }
        )
    return rows


def comparisons(done: Mapping[str, list], *, pairs=PAIRS, num_resamples=10000):
    """Paired, seed-pooled ``WER_A - WER_B`` for each pair with runs at the same seeds."""
    out = []
    for a, b in pairs:
        seeds_a = {f.parent.parent.name: f for f, _ in done.get(a, [])}
        seeds_b = {f.parent.parent.name: f for f, _ in done.get(b, [])}
        shared = sorted(set(seeds_a) & set(seeds_b))
        if not shared:
            continue
        result = compare_runs(
            [seeds_a[s] for s in shared], [seeds_b[s] for s in shared],
            num_resamples=num_resamples,
        )  # fmt: skip
        out.append({"a": a, "b": b, "seeds": len(shared), "result": result})
    return out


def _audit_cell(row) -> str:
    pairs = [
        f"{_fmt(o, '.3g')} / {_fmt(b, '.3g')}"
        for o, b in zip(row["audit_one_shot"], row["audit_lower_bound"], strict=True)
        if o is not None or b is not None
    ]
    return "; ".join(pairs) if pairs else _MISSING


def format_seed_table(
    done: Mapping[str, list], names: Mapping[str, str], *, num_resamples: int = 10000
) -> str:
    """The multi-seed method table and the paired comparisons, as Markdown."""
    rows = method_rows(done, names, num_resamples=num_resamples)
    lines = [
        "| Method | seeds | test WER per seed | pooled WER | change from round 0 [paired 95% CI] "
        "(relative) | LLM/enc. ratio per coord. | retention enc / LLM | LLM retention / Flat's "
        "| epsilon PLD (RDP) | audit: one-shot / lower bound (95%) per seed |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        low, high = row["change_ci"]
        eps = (
            _MISSING
            if row["epsilon"] is None
            else f"{row['epsilon']:.1f} ({_fmt(row['epsilon_rdp'], '.1f')})"
        )
        lines.append(
            "| " + " | ".join([
                row["name"], str(row["seeds"]), " / ".join(f"{w:.3f}" for w in row["wers"]),
                f"{row['wer_pooled']:.4f}",
                f"{row['change']:+.4f} [{low:+.4f}, {high:+.4f}] ({row['change_relative']:+.0%})"
                + (" §" if row["change_significant"] else ""),
                _fmt(row["ratio_per_coordinate"], ".2f", "x"),
                f"{_fmt(row['retention_encoder'], '.2f')} / {_fmt(row['retention_llm'], '.2f')}",
                _fmt(row["llm_retention_vs_flat"], ".2f", "x"), eps, _audit_cell(row),
            ]) + " |"
        )  # fmt: skip
    lines += [
        "",
        "Paired comparisons on shared test-only seeds (pooled over the seeds; speaker-level "
        "bootstrap; A - B < 0: A has the lower WER):",
        "",
        "| A | B | seeds | WER A | WER B | A - B [95% CI] | p | significant |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for item in comparisons(done, num_resamples=num_resamples):
        r = item["result"]
        lines.append(
            f"| {names.get(item['a'], item['a'])} | {names.get(item['b'], item['b'])} "
            f"| {item['seeds']} | {r.wer_a:.4f} | {r.wer_b:.4f} "
            f"| {r.difference:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}] | {r.p_value:.3f} "
            f"| {'yes' if r.significant else 'no'} |"
        )
    lines += [
        "",
        "§: significant change from round 0 (the interval excludes 0). Retention: post-clip / "
        "pre-clip pool norm, mean over rounds and seeds (the paper's Fig. 5 quantity); LLM = "
        "LLM + connector pool. epsilon: joint client-level epsilon of the accountant (PLD, RDP "
        "beside it) at (q, sigma, T); with test-only seeds it does not cover the run "
        "(results.json privacy.caveats).",
    ]
    return "\n".join(lines)
