#!/usr/bin/env python3
"""Run every MLS method with the encoder frozen and unfrozen, and tabulate the test WER.

For each hparams file (FedAvg, Flat, PFL-Uniform, PFL-Dim, PFL-Dim+EMA, PFL-Unif+EMA,
alpha-split) and each encoder variant (``--freeze_encoder True|False``) this script runs
``train_fl.py`` as a subprocess, one run after the other, all with the same ``cache_folder`` so
the embedded corpus and the pretrained seed model are made once and shared. It then reads each
run's ``results.json`` and writes the table of the alpha-split paper's Table III for this
repository::

    | Method | Enc. frozen WER [95% CI] | Gap | Enc. unfrozen WER [95% CI] | Gap | epsilon | ... |

where Gap = WER - FedAvg WER of the same variant, followed by the round-0 WER (the seed model
before any federated round) and the settings the runs used. The table goes to
``results/MLS/method_table.md`` and, when every run used the embedded corpus, into
``recipes/MLS/README.md`` between the ``<!-- method-table:start -->`` and
``<!-- method-table:end -->`` markers (the end marker is created the first time).

With ``--private-epsilon E`` (default 10; 0 disables) it then runs every DP method again at the
noise multiplier whose epsilon (the default accountant, PLD) is at most E at the runs' q, T and
delta (encoder variants of ``--private-variants``, default unfrozen) into ``<output-root>/eps<E>``, and tabulates them with
what that guarantee costs at the paper's K = 316 and at 10,000 clients
(:func:`speechbrain_fl.privacy.accounting.extrapolate_privacy`). A second table gives each run's
change from round 0 with its paired CI, its noise norm against the mean client update norm, and
the LLM/encoder update-norm ratio; ``method_table_dev_wer.png`` (beside the table file) draws the
dev WER by round of every run on shared axes.

A run whose ``results.json`` exists is skipped unless ``--force``; an interrupted run has no
``results.json`` yet, so running this script again resumes it (``train_fl.py`` resumes from its
last finished round). Arguments this script does not know are passed to every ``train_fl.py``
run, e.g. ``--number_of_rounds 6`` or ``--device cuda``.

Usage (from the repository root; at K = 128 one run takes 2.5-7 min on 2 shared CPU cores with
the seed cached, so the 14 + 6 runs take 1-2 hours; select with --methods/--variants)::

    python recipes/MLS/studies/method_table.py
    python recipes/MLS/studies/method_table.py --methods fedavg flat alpha_split --variants unfrozen
    python recipes/MLS/studies/method_table.py --number_of_rounds 6 --output-root results/MLS/short
    python recipes/MLS/studies/method_table.py --table-only      # tabulate the runs that exist
    python recipes/MLS/studies/method_table.py --jobs 16         # on a 16-core machine, ~2 x one run

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from speechbrain_fl.recipe import insert_table as kit_insert_table
from speechbrain_fl.recipe import markers, update_readme_table

STUDY_DIR = Path(__file__).resolve().parent
RECIPE_DIR = STUDY_DIR.parent
sys.path.insert(0, str(STUDY_DIR))  # method_tables.py, seed_table.py, compare.py

from method_tables import (  # noqa: E402, F401 (re-exported: the tables of this study)
    _MISSING,
    BASELINE,
    HEADER,
    METHODS,
    VARIANTS,
    _get,
    format_change_table,
    format_method_table,
    format_private_table,
    load_results,
    run_folder,
    write_dev_wer_figure,
)

TABLE_NAME = "method-table"  # README markers <!-- method-table:start --> ... :end -->
START_MARKER, END_MARKER = markers(TABLE_NAME)
#: train_fl.py keys this script sets itself; passing them through would break the table.
RESERVED_OVERRIDES = ("--freeze_encoder", "--output_folder", "--cache_folder")


def private_root(output_root: str | os.PathLike, target_epsilon: float) -> Path:
    """Where the runs at a noise multiplier for ``target_epsilon`` go: ``<root>/eps<target>``."""
    return Path(output_root) / f"eps{target_epsilon:g}"


def sigma_for_epsilon(
    *, sampling_rate: float, rounds: int, delta: float, target_epsilon: float
) -> float:
    """The noise multiplier, rounded up to 0.01, whose epsilon (PLD) is at most the target.

    ``speechbrain_fl.privacy.noise_multiplier_for_epsilon`` (Opacus's bisection) may land a
    hair above the target; rounding sigma up to two decimals keeps epsilon at or below it.

    Example
    -------
    >>> sigma_for_epsilon(sampling_rate=0.3, rounds=10, delta=1e-5, target_epsilon=10.0)
    0.87
    """
    from speechbrain_fl.privacy.accounting import compute_epsilon, noise_multiplier_for_epsilon

    sigma = noise_multiplier_for_epsilon(
        sampling_rate=sampling_rate, target_epsilon=target_epsilon, rounds=rounds, delta=delta
    )
    sigma = math.ceil(sigma * 100) / 100
    while (
        compute_epsilon(sampling_rate=sampling_rate, noise_multiplier=sigma, rounds=rounds,
                        delta=delta) > target_epsilon
    ):  # fmt: skip
        sigma = round(sigma + 0.01, 2)
    return sigma


def train_command(
    *,
    method: str,
    variant: str,
    output_root: str | os.PathLike,
    cache_folder: str | os.PathLike,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``train_fl.py`` command line of one run.

    Arguments
    ---------
    method : str
        A key of :data:`METHODS` (the hparams file name without ``.yaml``).
    variant : str
        ``"frozen"`` or ``"unfrozen"``.
    output_root : str or PathLike
        Folder holding the runs (see :func:`run_folder`).
    cache_folder : str or PathLike
        Shared cache for the embedded corpus and the seed model.
    extra : sequence of str
        Further train_fl.py arguments, passed unchanged.

    Returns
    -------
    list of str

    Example
    -------
    >>> cmd = train_command(method="flat", variant="frozen", output_root="r", cache_folder="c")
    >>> Path(cmd[2]).name, cmd[3:6]
    ('flat.yaml', ['--freeze_encoder', 'True', '--output_folder'])
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)}")
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {list(VARIANTS)}")
    for arg in extra:
        key = arg.split("=", 1)[0]
        if key in RESERVED_OVERRIDES:
            raise ValueError(
                f"{key} is set by method_table.py; use --variants, --output-root or "
                "--cache-folder instead"
            )
    return [
        sys.executable,
        str(RECIPE_DIR / "train_fl.py"),
        str(RECIPE_DIR / "hparams" / f"{method}.yaml"),
        "--freeze_encoder",
        str(VARIANTS[variant]),
        "--output_folder",
        str(run_folder(output_root, method, variant)),
        "--cache_folder",
        str(cache_folder),
        *extra,
    ]


def insert_table(text: str, table: str) -> str:
    """Put ``table`` between the method-table markers of ``text`` (a README's content).

    The kit's one marker syntax (:func:`speechbrain_fl.recipe.insert_table`), table name
    ``method-table``: ``<!-- method-table:start -->`` ... ``<!-- method-table:end -->``.

    Example
    -------
    >>> insert_table("a\\n<!-- method-table:start -->\\nb", "T")
    'a\\n<!-- method-table:start -->\\nT\\n<!-- method-table:end -->\\nb'
    """
    return kit_insert_table(text, TABLE_NAME, table)


def update_readme(readme: str | os.PathLike, table: str) -> None:
    """Insert ``table`` into the README file at the markers (see :func:`insert_table`)."""
    update_readme_table(readme, TABLE_NAME, table)


def _names(values: Sequence[str], *, choices: Sequence[str], option: str) -> list[str]:
    names = [v for value in values for v in value.split(",") if v]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise SystemExit(f"method_table.py: {option}: unknown {unknown}; choose from {choices}")
    return [c for c in choices if c in names]  # table order, no duplicates


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the remaining arguments (passed on to train_fl.py)."""
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments (e.g. --number_of_rounds 6) are passed to every train_fl.py run.",
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=", ".join(METHODS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="frozen, unfrozen")
    parser.add_argument("--output-root", default="results/MLS/method_table")
    parser.add_argument("--cache-folder", default="results/MLS/cache")
    parser.add_argument("--table-file", default="results/MLS/method_table.md")
    parser.add_argument("--readme", default=str(RECIPE_DIR / "README.md"))
    parser.add_argument("--no-readme", action="store_true", help="do not touch the README")
    parser.add_argument("--force", action="store_true", help="rerun runs that have results")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs side by side (one thread each, after a preparation-only run fills the cache)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--table-only", action="store_true", help="run nothing; tabulate")
    parser.add_argument(
        "--private-epsilon",
        type=float,
        default=10.0,
        help="also run every DP method at the noise multiplier giving this epsilon (at the "
        "runs' q, T and delta) into <output-root>/eps<value>; 0 disables",
    )
    parser.add_argument(
        "--private-variants", nargs="+", default=["unfrozen"], help="encoder variants of those"
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help="test-only seeds: run everything once per seed into <output-root>/seed<S> with "
        "--sampler_seed S --noise_seed S (shared cohorts and noise across methods), and "
        "tabulate the seeds pooled with paired comparisons (seed_table.py); the epsilon rows "
        "run at the first seed only",
    )
    parser.add_argument(
        "--figure",
        default=None,
        help="the dev-WER-by-round figure of every run (default: method_table_dev_wer.png "
        "beside --table-file)",
    )
    args, extra = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    args.methods = _names(args.methods, choices=list(METHODS), option="--methods")
    args.variants = _names(args.variants, choices=list(VARIANTS), option="--variants")
    args.private_variants = _names(
        args.private_variants, choices=list(VARIANTS), option="--private-variants"
    )
    return args, extra


def _write_figure(args, label, root, private) -> None:
    """The dev-WER-by-round figure of the runs under ``root`` (and the epsilon rows, if any)."""
    roots = {label: root}
    if private is not None:
        roots[f"ε ≤ {args.private_epsilon:g}"] = private
    figure_path = args.figure or Path(args.table_file).with_name("method_table_dev_wer.png")
    figure = write_dev_wer_figure(roots, figure_path)
    if figure is not None:
        print(f"Dev WER figure: {figure}")


def _private_rows(args, root, extra, failed):
    """The epsilon <= target rows: sigma for the target at the runs' (q, T, delta), then runs.

    Returns the folder of those rows, or ``None`` when they are off (``--private_epsilon 0``,
    ``--dry_run``) or no private run under ``root`` gives q, T and delta (said).
    """
    if args.private_epsilon <= 0 or args.dry_run:
        return None
    done = load_results(root)
    reference = next((r for r in done.values() if _get(r, "privacy", "epsilon") is not None), None)
    if reference is None:
        print("method_table.py: no private run to take q, T and delta from; epsilon rows skipped")
        return None
    private = private_root(root, args.private_epsilon)
    if not args.table_only:
        sigma = sigma_for_epsilon(
            sampling_rate=reference["privacy"]["sampling_rate"],
            rounds=reference["privacy"]["rounds"],
            delta=reference["privacy"]["delta"],
            target_epsilon=args.private_epsilon,
        )
        print(f"epsilon <= {args.private_epsilon:g}: noise multiplier {sigma:g}")
        methods = [m for m in args.methods if m != BASELINE]
        extra_sigma = [*extra, "--noise_multiplier", str(sigma)]
        _run_all(args, private, methods, args.private_variants, extra_sigma, failed)
    return private


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected runs, then write the table; exit status 1 if a run failed."""
    args, extra = parse_args(argv)
    if args.seeds:
        return main_seeds(args, extra)
    failed = []
    if not args.table_only:
        _run_all(args, args.output_root, args.methods, args.variants, extra, failed)
    private = _private_rows(args, args.output_root, extra, failed)
    if args.dry_run:
        return 0
    results = load_results(args.output_root)
    if not results:
        print(f"method_table.py: no results.json under {args.output_root}", file=sys.stderr)
        return 1
    table = format_method_table(results) + "\n\n" + format_change_table(results)
    if private is not None:
        table += "\n\n" + format_private_table(
            load_results(private), target_epsilon=args.private_epsilon
        )
    _write_figure(args, "σ 0.1", args.output_root, private)
    return _write_table(args, table, results, failed)


def main_seeds(args, extra) -> int:
    """``--seeds``: every run once per test-only seed, then the seed-pooled tables."""
    from seed_table import format_seed_table, seed_overrides, seed_root

    failed: list[str] = []
    roots = [seed_root(args.output_root, s) for s in args.seeds]
    first = roots[0]
    if not args.table_only:
        for seed, root in zip(args.seeds, roots, strict=True):
            _run_all(args, root, args.methods, args.variants, [*extra, *seed_overrides(seed)],
                     failed)  # fmt: skip
    private = _private_rows(args, first, [*extra, *seed_overrides(args.seeds[0])], failed)
    if args.dry_run:
        return 0
    results = load_results(first)
    if not results:
        print(f"method_table.py: no results.json under {first}", file=sys.stderr)
        return 1
    parts = []
    for variant in args.variants:
        done = {
            m: [run_folder(root, m, variant) for root in roots]
            for m in METHODS
        }  # fmt: skip
        from seed_table import collect

        found = collect(done)
        if found:
            parts.append(
                f"Encoder {variant}, seeds {', '.join(map(str, args.seeds))}:\n\n"
                + format_seed_table(found, METHODS)
            )
    parts.append(f"Per run at seed {args.seeds[0]}:\n\n" + format_change_table(results))
    if private is not None:
        parts.append(
            format_private_table(load_results(private), target_epsilon=args.private_epsilon)
        )
    table = "\n\n".join(parts)
    _write_figure(args, f"σ 0.1, seed {args.seeds[0]}", first, private)
    return _write_table(args, table, results, failed)


def _run_all(args, output_root, methods, variants, extra, failed) -> None:
    """Run train_fl.py for each (method, variant) without results under ``output_root``.

    With ``--jobs N`` > 1 a preparation-only run (``--prepare_only True``) first fills the
    shared cache (corpus, manifests, seed model), then up to N runs go side by side, each with
    one intra-op thread (``OMP_NUM_THREADS=1`` unless set) and its output in
    ``<run folder>/stdout.txt``.
    """
    todo = []
    for method in methods:
        for variant in variants:
            folder = run_folder(output_root, method, variant)
            cmd = train_command(
                method=method,
                variant=variant,
                output_root=output_root,
                cache_folder=args.cache_folder,
                extra=extra,
            )
            if (folder / "results.json").is_file() and not args.force:
                print(f"[{method}, {variant}] skipped: {folder}/results.json exists (--force)")
                continue
            print(f"[{method}, {variant}] $ {' '.join(cmd)}", flush=True)
            todo.append((f"{method}, {variant}", folder, cmd))
    if args.dry_run or not todo:
        return
    if args.jobs <= 1:
        for name, _, cmd in todo:
            start = time.time()
            code = subprocess.run(cmd, check=False).returncode
            print(f"[{name}] exit {code} after {time.time() - start:.0f} s")
            if code != 0:
                failed.append(f"{name.replace(', ', '/')} (exit {code})")
        return
    prepare = list(todo[0][2])
    prepare[prepare.index("--output_folder") + 1] = str(Path(output_root) / "prepare")
    print(f"[prepare] $ {' '.join(prepare)} --prepare_only True", flush=True)
    if subprocess.run([*prepare, "--prepare_only", "True"], check=False).returncode != 0:
        failed.append("prepare (the shared cache could not be made; no run started)")
        return
    run_side_by_side(todo, jobs=args.jobs, failed=failed)


def run_side_by_side(todo: Sequence[tuple], *, jobs: int, failed: list[str]) -> None:
    """Run ``(name, folder, command)`` items, at most ``jobs`` at once, one thread each.

    Each command's output goes to ``<folder>/stdout.txt``; a command that exits non-zero is
    appended to ``failed`` with that file's path. ``OMP_NUM_THREADS`` is 1 unless already set
    (``jobs`` processes with torch's default thread count each would oversubscribe the cores).
    """
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or "1"}
    running: dict = {}
    pending = list(todo)
    while pending or running:
        while pending and len(running) < jobs:
            name, folder, cmd = pending.pop(0)
            Path(folder).mkdir(parents=True, exist_ok=True)
            log = open(Path(folder) / "stdout.txt", "w", encoding="utf-8")  # noqa: SIM115
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[proc] = (name, folder, log, time.time())
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None]:
            name, folder, log, start = running.pop(proc)
            log.close()
            print(f"[{name}] exit {proc.returncode} after {time.time() - start:.0f} s", flush=True)
            if proc.returncode != 0:
                failed.append(
                    f"{name.replace(', ', '/')} (exit {proc.returncode}; {folder}/stdout.txt)"
                )


def _write_table(args, table, results, failed) -> int:
    table_file = Path(args.table_file)
    table_file.parent.mkdir(parents=True, exist_ok=True)
    table_file.write_text(table + "\n", encoding="utf-8")
    print("\n" + table + f"\n\nTable written to {table_file}")
    embedded = all(_get(r, "data", "embedded_corpus") for r in results.values())
    if args.no_readme:
        pass
    elif not embedded:
        print(f"{args.readme} not updated: its table is for the embedded corpus only")
    else:
        update_readme(args.readme, table)
        print(f"Table inserted into {args.readme}")
    if failed:
        print("method_table.py: failed runs: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
