#!/usr/bin/env python3
"""One source for the MLS figures: the READMEs' results tables from the studies' results files.

Two steps:

1. ``collect`` reads finished runs and writes the results files this folder commits
   (``measured/``): ``main_command.json`` (the main command's run: test WER against round 0,
   epsilon, the time of each stage) and ``table3.json`` (the Table III grid over test-only
   seeds: per method the seeds' test WER and CE, the pooled change from round 0 with its
   paired speaker-level CI, and the paired method comparisons of :mod:`seed_table`).
2. ``write`` (or ``--check``) renders them into recipes/MLS/README.md between
   ``<!-- mls-results:start -->`` and ``<!-- mls-results:end -->`` and into the root README's
   results table as its one line starting ``| MLS |`` (a comment line would end the Markdown
   table, so the row is its own marker). ``--check`` writes
   nothing and exits 1 when a README differs from what the results files give
   (tests/unit/test_mls_readme_results.py runs it).

Usage::

    > python recipes/MLS/studies/readme_results.py collect --main RUN_FOLDER \\
          --grid GRID_ROOT --seeds 11 12 13
    > python recipes/MLS/studies/readme_results.py write
    > python recipes/MLS/studies/readme_results.py --check

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

STUDY_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(STUDY_DIR))
from ceiling_ce import CLOSURE_TARGET, ce_pairs, ce_rows, ceiling  # noqa: E402
from method_tables import METHODS, _get, run_folder  # noqa: E402
from seed_table import collect as collect_runs  # noqa: E402
from seed_table import comparisons, method_rows, seed_root  # noqa: E402

RESULTS = STUDY_DIR / "measured"
RECIPE_README = STUDY_DIR.parent / "README.md"
ROOT_README = STUDY_DIR.parents[2] / "README.md"
MARKERS = ("<!-- mls-results:start -->", "<!-- mls-results:end -->")
MAIN_MARKERS = ("<!-- mls-main:start -->", "<!-- mls-main:end -->")
ROW_PREFIX = "| MLS |"
#: The root README's quickstart paragraph on the main job (regenerated whole).
QUICKSTART_PREFIX = "The main job (no `--debug`)"


def collect_main(run: Path, command: str, machine: str) -> dict:
    """The main command's figures from its run folder's results.json, and the machine it ran on."""
    r = json.loads((Path(run) / "results.json").read_text())
    change = r["test_change_from_round0"]
    privacy = r["privacy"]
    return {
        "command": command,
        "method": r["method"],
        "test_wer": r["test"]["WER"],
        "test_wer_ci95": r["test"]["WER_ci95"],
        "round0_wer": r["test_round0"]["WER"],
        "change": change["difference"],
        "change_ci95": change["ci95"],
        "change_p": change["p_value"],
        "significant": change["significant"],
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "sampling_rate": privacy["sampling_rate"],
        "simulated_deployment": privacy.get("simulated_deployment"),
        "timings_s": r["timings_s"],
        "machine": machine,
    }


def collect_grid(root: Path, seeds: list[int], variant: str = "unfrozen") -> dict:
    """The seed-pooled Table III rows and paired comparisons of a ``method_table.py`` grid."""
    folders = {m: [run_folder(seed_root(root, s), m, variant) for s in seeds] for m in METHODS}
    done = collect_runs(folders)
    rows = method_rows(done, METHODS)
    with_ci = ce_rows(done)
    for row in rows:
        row["ce"] = [_get(r, "audio_reliance", "final", "true") for _, r in done[row["method"]]]
        row.update(with_ci.get(row["method"], {}))
    pairs = []
    for item in comparisons(done):
        res = item["result"]
        pairs.append(
            {"a": item["a"], "b": item["b"], "seeds": item["seeds"], "difference": res.difference,
             "ci95": [res.ci_low, res.ci_high], "p": res.p_value, "significant": res.significant}
        )  # fmt: skip
    ce = {(p["a"], p["b"]): p for p in ce_pairs(done)}
    for pair in pairs:
        pair["ce"] = ce.get((pair["a"], pair["b"]))
    return {"variant": variant, "seeds": seeds, "rows": rows, "pairs": pairs,
            "ceiling": ceiling(root, seeds, variant)}  # fmt: skip


#: The paper's Table III (test WER; encoder frozen, encoder LoRA; *: mean of 3 seeds,
#: †: collapsed), set beside ours.
PAPER = {
    "fedavg": ("0.1415", "0.1842"),
    "flat": ("0.1685", "0.1959*"),
    "pfl_uniform": ("0.4643", "0.9944†"),
    "pfl_dim": ("0.1711", "0.3051"),
    "pfl_dim_ema": ("0.1657", "0.2599*"),
    "pfl_unif_ema": ("0.2360", "0.8243†"),
    "alpha_split": ("0.1677", "0.1986*"),
}


def _pm(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def recipe_block(main: dict | None, grid: dict | None) -> str:
    """The recipe README's generated results: the main command, then the Table III grid."""
    lines = []
    if main:
        low, high = main["change_ci95"]
        t = main["timings_s"]
        lines.append(
            f"`{main['command']}` from an empty cache: test WER {main['round0_wer']:.3f} at "
            f"round 0 -> {main['test_wer']:.3f} [{main['test_wer_ci95'][0]:.3f}, "
            f"{main['test_wer_ci95'][1]:.3f}], change {main['change']:+.3f} [{low:+.3f}, "
            f"{high:+.3f}] ({'significant' if main['significant'] else 'not significant'}, "
            f"p = {main['change_p']:.3f}); ε = {main['epsilon']:.2f} at δ = {main['delta']:g} "
            f"for the simulated deployment (q = {main['sampling_rate']:g}); "
            f"{t['total']:.0f} s in all (corpus {t.get('corpus', 0):.0f} s, federated "
            f"{t.get('federated', 0):.0f} s)."
        )
    rows = {row["method"]: row for row in (grid or {}).get("rows", [])}
    seeds = ", ".join(map(str, (grid or {}).get("seeds", []))) or "-"
    lines += [
        "",
        f"Table III: the paper's test WER (frozen, LoRA; \\*: mean of 3 seeds, †: collapsed) and "
        f"ours, encoder LoRA, test-only seeds {seeds} shared across methods (paired):",
        "",
        "| Method | Paper, frozen | Paper, LoRA | Ours: test WER per seed | pooled | change from "
        "round 0 [95% CI] | test CE [95% CI] |",
        "|---|---:|---:|---|---:|---|---:|",
    ]
    for method, name in METHODS.items():
        frozen, lora = (v.replace("*", "\\*") for v in PAPER[method])
        row = rows.get(method)
        if row is None:
            lines.append(f"| {name} | {frozen} | {lora} | not run | - | - | - |")
            continue
        low, high = row["change_ci"]
        lines.append(
            f"| {name} | {frozen} | {lora} | {' / '.join(f'{w:.3f}' for w in row['wers'])} "
            f"| {row['wer_pooled']:.3f} | {row['change']:+.3f} [{low:+.3f}, {high:+.3f}] "
            f"| {_ce_cell(row)} |"
        )
    top = (grid or {}).get("ceiling")
    if top:
        low, high = top["change_ci"]
        lines.append(
            f"| Central ceiling (pooled client data, no DP) | - | - "
            f"| {' / '.join(f'{w:.3f}' for w in top['wers'])} | {top['wer_pooled']:.3f} "
            f"| {top['change']:+.3f} [{low:+.3f}, {high:+.3f}] | {_ce_cell(top)} |"
        )
    if grid:
        lines += ["", "| A - B | seeds | WER difference [95% CI] | p | significant "
                  "| CE difference [95% CI] | p |", "|---|---:|---|---:|---|---|---:|"]  # fmt: skip
        for p in grid["pairs"]:
            ce = p.get("ce")
            ce_cells = (
                f"{ce['difference']:+.3f} [{ce['ci95'][0]:+.3f}, {ce['ci95'][1]:+.3f}] "
                f"| {ce['p']:.3f}"
                if ce
                else "- | -"
            )
            lines.append(
                f"| {METHODS.get(p['a'], p['a'])} - {METHODS.get(p['b'], p['b'])} "
                f"| {p['seeds']} | {p['difference']:+.3f} [{p['ci95'][0]:+.3f}, "
                f"{p['ci95'][1]:+.3f}] | {p['p']:.3f} | {'yes' if p['significant'] else 'no'} "
                f"| {ce_cells} |"
            )
        if top:
            low, high = top["closure_ci"]
            lines += ["", (
                f"FedAvg against the central ceiling (seeds {', '.join(map(str, top['seeds']))}, "
                f"paired): round 0 {top['wer_round0']:.3f}, FedAvg {top['wer_fedavg']:.3f}, "
                f"ceiling {top['wer_pooled']:.3f} (ceiling - FedAvg "
                f"{top['central_minus_fedavg']:+.3f} [{top['central_minus_fedavg_ci'][0]:+.3f}, "
                f"{top['central_minus_fedavg_ci'][1]:+.3f}]); FedAvg closes {top['closure']:.0%} "
                f"[{low:.0%}, {high:.0%}] of the gap from round 0 to the ceiling."
            )]  # fmt: skip
        lines += ["", *targets(grid["pairs"], top)]
    return "\n".join(lines)


def _ce_cell(row) -> str:
    """Pooled test CE with its speaker-level CI, or the seeds' batch-mean CE (mean ± sd)."""
    if row.get("ce_pooled") is not None:
        low, high = row["ce_ci"]
        return f"{row['ce_pooled']:.3f} [{low:.3f}, {high:.3f}]"
    return f"{_pm(row.get('ce', []))} (mean ± sd)"


def targets(pairs: list[dict], top: dict | None = None) -> list[str]:
    """Each ordering target of the paper's Table III, met or not, from the paired comparisons,
    and FedAvg's share of the gap to the central ceiling (``top``).

    A pair ``(a, b)`` holds ``WER_a - WER_b``; "worse" means a positive difference whose
    95% CI excludes 0; a pair with per-utterance CE files is judged on the CE too, alike. The
    closure target is met when its 95% CI lies at or above the target.
    """
    found = {(p["a"], p["b"]): p for p in pairs}
    checks = (
        ("PFL-Uniform significantly worse than Flat", ("pfl_uniform", "flat"),
         lambda p: p["significant"] and p["difference"] > 0),
        ("α-Split not significantly worse than Flat", ("alpha_split", "flat"),
         lambda p: not (p["significant"] and p["difference"] > 0)),
        ("α-Split significantly better than PFL-Uniform", ("alpha_split", "pfl_uniform"),
         lambda p: p["significant"] and p["difference"] < 0),
        ("FedAvg at or below Flat", ("flat", "fedavg"),
         lambda p: not (p["significant"] and p["difference"] < 0)),
    )  # fmt: skip
    out = []
    for text, key, test in checks:
        pair = found.get(key)
        verdict = "not measured" if pair is None else ("met" if test(pair) else "not met")
        ce = (pair or {}).get("ce")
        on_ce = f" on test WER; **{'met' if test(ce) else 'not met'}** on test CE" if ce else ""
        out.append(f"- {text}: **{verdict}**{on_ce}")
    target = f"FedAvg closes at least {CLOSURE_TARGET:.0%} of the gap to the ceiling (CI above it)"
    if top is None:
        out.append(f"- {target}: **not measured**")
    else:
        out.append(
            f"- {target}: **{'met' if top['closure_ci'][0] >= CLOSURE_TARGET else 'not met'}**"
        )
    return out


def main_line(main: dict | None) -> str:
    """What the main command gives, stated next to it in the recipe README."""
    if not main:
        return "Expected figures: pending."
    low, high = main["test_wer_ci95"]
    return (
        f"Expected from an empty cache: test WER {main['round0_wer']:.3f} at round 0 -> "
        f"{main['test_wer']:.3f} [{low:.3f}, {high:.3f}] "
        f"({'a significant' if main['significant'] else 'not a significant'} change, "
        f"{main['change']:+.3f}), ε = {main['epsilon']:.2f} at δ = {main['delta']:g} for the "
        f"simulated deployment, {main['timings_s']['total'] / 60:.1f} minutes here (Results)."
    )


def quickstart(main: dict | None) -> str:
    """The root README's paragraph on the main job, with its measured figures."""
    text = (
        f"{QUICKSTART_PREFIX} generates an 8-language espeak-ng corpus in the MLS layout,\n"
        "loads the tiny speech-LLM seed the recipe ships, trains it federated across 128 speaker\n"
        "clients with alpha-split DP and prints the test WER with its 95% confidence interval,\n"
        "the (epsilon, delta) it spent and the per-component effective noise."
    )
    if not main:
        return text
    t = main["timings_s"]
    return (
        f"{text} Measured here\n({main['machine']}): "
        f"{t['total'] / 60:.1f} minutes from an\nempty cache, test WER "
        f"{main['round0_wer']:.3f} -> {main['test_wer']:.3f} "
        f"({'significant' if main['significant'] else 'not significant'}), ε = "
        f"{main['epsilon']:.2f} (a simulated\ndeployment of {main['simulated_deployment']['population']:,} clients, "
        "labelled so in its results)."
    )


def root_row(main: dict | None, grid: dict | None) -> str:
    """The root README's MLS row."""
    ours = []
    if main:
        low, high = main["change_ci95"]
        ours.append(
            f"Main command (α-split): test WER {main['round0_wer']:.3f} -> "
            f"{main['test_wer']:.3f}, {main['change']:+.3f} [{low:+.3f}, {high:+.3f}] "
            f"({'significant' if main['significant'] else 'not significant'}) at ε = "
            f"{main['epsilon']:.2f} (simulated deployment), {main['timings_s']['total']:.0f} s"
        )
    if grid:
        wers = ", ".join(f"{r['name']} {r['wer_pooled']:.3f}" for r in grid["rows"])
        top = grid.get("ceiling")
        if top:
            wers += (
                f"; central ceiling {top['wer_pooled']:.3f} (FedAvg closes {top['closure']:.0%} "
                f"of the gap from round 0 {top['wer_round0']:.3f})"
            )
        ours.append(f"{len(grid['seeds'])} paired seeds: {wers}")
    paper = (
        "α-Split ≈ Flat, per-matrix budgets degrade (Whisper + TinyLlama, unfrozen: FedAvg "
        "0.184, Flat 0.196, α-Split 0.199, PFL-Dim 0.305, PFL-Uniform collapses at 0.994)"
    )
    return f"| MLS | {'; '.join(ours) or 'pending'} | {paper} |"


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def rendered() -> dict[str, str]:
    """``{"recipe": block, "root": row}`` from the committed results files."""
    main, grid = _load("main_command.json"), _load("table3.json")
    return {
        "recipe": recipe_block(main, grid),
        "main": main_line(main),
        "root": root_row(main, grid),
        "quickstart": quickstart(main),
    }


def replace_between(text: str, markers: tuple[str, str], body: str, *, where: str) -> str:
    """``text`` with the lines between the two markers replaced by ``body``."""
    start, end = markers
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{where}: needs exactly one {start} and one {end}")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def replace_row(text: str, row: str, *, where: str) -> str:
    """``text`` with its one line starting with :data:`ROW_PREFIX` replaced by ``row``."""
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line.startswith(ROW_PREFIX)]
    if len(hits) != 1:
        raise ValueError(f"{where}: needs exactly one line starting with {ROW_PREFIX!r}")
    lines[hits[0]] = row
    return "\n".join(lines)


def replace_paragraph(text: str, prefix: str, body: str, *, where: str) -> str:
    """``text`` with the paragraph starting with ``prefix`` (to the next blank line) replaced."""
    if text.count("\n" + prefix) != 1:
        raise ValueError(f"{where}: needs exactly one paragraph starting with {prefix!r}")
    head, rest = text.split("\n" + prefix)
    _, _, tail = rest.partition("\n\n")
    return f"{head}\n{body}\n\n{tail}"


def update(*, check: bool) -> list[str]:
    """Write (or, ``check``, compare) both READMEs; the paths that differ(ed)."""
    blocks = rendered()
    differ = []
    for key, path in (("recipe", RECIPE_README), ("root", ROOT_README)):
        text = path.read_text()
        if key == "recipe":
            new = replace_between(text, MARKERS, blocks[key], where=str(path))
            new = replace_between(new, MAIN_MARKERS, blocks["main"], where=str(path))
        else:
            new = replace_row(text, blocks[key], where=str(path))
            new = replace_paragraph(new, QUICKSTART_PREFIX, blocks["quickstart"], where=str(path))
        if new != text:
            differ.append(str(path))
            if not check:
                path.write_text(new)
    return differ


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", nargs="?", choices=("collect", "write"), default="write")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a diff")
    parser.add_argument("--main", type=Path, help="collect: the main command's run folder")
    parser.add_argument(
        "--command", default="python recipes/MLS/train_fl.py hparams/alpha_split.yaml"
    )
    parser.add_argument(
        "--machine",
        default="2 CPU cores shared with other jobs, one torch thread",
        help="collect: the machine and load the main command ran on, as the READMEs state it",
    )
    parser.add_argument("--grid", type=Path, help="collect: method_table.py --output-root")
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    args = parser.parse_args(argv)
    if args.step == "collect":
        RESULTS.mkdir(exist_ok=True)
        if args.main:
            out = collect_main(args.main, args.command, args.machine)
            (RESULTS / "main_command.json").write_text(json.dumps(out, indent=2) + "\n")
        if args.grid:
            out = collect_grid(args.grid, args.seeds)
            (RESULTS / "table3.json").write_text(json.dumps(out, indent=2) + "\n")
        return 0
    differ = update(check=args.check)
    for path in differ:
        print(f"{path}: {'differs from' if args.check else 'updated from'} {RESULTS}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
