#!/usr/bin/env python3
"""Studies of the Private-Gender recipe; writes the tables of this folder's README.

Runs ``train_teacher.py`` and ``distill_student.py`` (in this process, through their
``main``) for

* ``repeats`` (``gender_repeats.py``): the paper's claims with their controls, every row for
  each of ``--seeds`` (default 1-5), mean and spread, paired differences with t-intervals,
  written to the README's ``repeats-models`` and ``repeats-claims`` tables; resumable (a seed
  in ``studies.json`` is not rerun; students added to the study since are);

* an epsilon sweep (0.5, 1, 2, 4, 8 and no DP) of the default pipeline;
* the ablation (base = no DSAF and no AW-DP, +DSAF, +AW-DP, +dropout, all) at epsilon = 1,
  for DP-direct and the student;
* the binary male/female variant (its own epsilon, AW-DP weights from a public prior);
* a |D_aux| sweep: students distilled from one teacher's outputs on subsets of D_aux;
* what the teacher adds: students of that teacher with alpha = 0 (no teacher), 0.5, 0.7, 1,
  and alpha = 0 with class-balanced CE on D_aux (the label-only rebalancing control),

then writes ``<root>/studies.json`` (merged with the studies already there) and the README's
``studies`` table block (``update_readme_table``). Outside ``repeats`` each row is ONE run (the DP
noise and the Poisson sampling come from the OS, so a rerun gives other figures): read the
95% bootstrap intervals, which cover the test-set sampling only, not the training randomness.

    > python recipes/Private-Gender/studies.py --only repeats --seeds 1 2 3 4 5
    > python recipes/Private-Gender/studies.py --root results/Private-Gender/studies
    > python recipes/Private-Gender/studies.py --only ablation --extra "--epochs 10"
    > python recipes/Private-Gender/studies.py --only    # rewrite the tables, run nothing

**Tuning on a real D_priv is not accounted.** Every row trains new DP models on the same
D_priv, and each row's epsilon covers that row alone. Comparing rows and keeping the best
setting is itself a function of D_priv: on a real private set that choice spends privacy that
nothing here composes or reports (:data:`TUNING_WARNING`, printed at every start). Tune on the
embedded corpus or on public data, then train the chosen setting once on D_priv.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
import warnings
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))

import distill_student  # noqa: E402
import gender_repeats  # noqa: E402
import train_teacher  # noqa: E402

from speechbrain_fl.atomic import atomic_open  # noqa: E402
from speechbrain_fl.recipe import update_readme_table  # noqa: E402

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, None)
ABLATION = {
    "base": ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.0"],
    "+DSAF": ["--dsaf", "True", "--aw_dp", "False", "--modality_dropout", "0.0"],
    "+AW-DP": ["--dsaf", "False", "--aw_dp", "True", "--modality_dropout", "0.0"],
    "+dropout": ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.5"],
    "all": ["--dsaf", "True", "--aw_dp", "True", "--modality_dropout", "0.5"],
}
AUX_SIZES = (25, 50, 100, 200, None)
TUNING_WARNING = (
    "studies.py: each row is a separate DP training on the same D_priv and its epsilon covers "
    "that row alone; choosing settings by comparing rows on a real D_priv spends privacy that "
    "nothing here accounts. Tune on the embedded corpus or public data, then train once."
)


def pipeline(folder: Path, teacher_args, student_args=(), *, extra=()):
    """One teacher + student run into ``folder``; returns the student's results."""
    common = ["--output_folder", str(folder), *extra]
    train_teacher.main(["hparams/teacher.yaml", *common, *teacher_args])
    return distill_student.main(["hparams/student.yaml", *common, *student_args])


def _v(block, key):
    if not block or key not in block:
        return "-"
    value, ci = block[key]["value"], block[key]["ci"]
    return f"{value:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def _eps(value):
    return "∞ (no DP)" if value is None else f"{value:.2f}"


def _joint_eps(res):
    """The joint epsilon of the run's releases from D_priv ("-" for results written before
    the joint figure existed)."""
    if "privacy_joint" not in res:
        return "-"
    return _eps((res["privacy_joint"] or {}).get("epsilon"))


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _row(name, res):
    return [
        name,
        _eps(res["privacy"]["epsilon"]),
        _joint_eps(res),
        _v(res["dp_direct"], "balanced_accuracy"),
        _v(res["dp_direct"], "majpred"),
        _v(res["test"], "balanced_accuracy"),
        _v(res["test"], "macro_f1"),
        _v(res["test"], "majpred"),
    ]


HEADER = [
    "Run",
    "ε (student, RDP)",
    "ε joint (all releases, RDP)",
    "DP-direct bal. acc.",
    "DP-direct MajPred",
    "Student bal. acc.",
    "Student macro-F1",
    "Student MajPred",
]


def write_readme(tables: dict[str, str], readme: Path, note: str) -> None:
    """The single-run studies' tables into the README's ``studies`` block."""
    body = [note]
    for title, table in tables.items():
        body += [f"#### {title}", "", table, ""]
    update_readme_table(readme, "studies", "\n".join(body))


def run_repeats(root: Path, extra: list[str], seeds, store: dict, save) -> None:
    """The repeated study (``gender_repeats``), one seed at a time, resumable: a seed already
    in ``store["repeats"]`` is not rerun."""
    done = store.setdefault("repeats", {})
    for seed in seeds:
        if str(seed) in done:  # students added to the study since: run those only
            if gender_repeats.add_students(
                seed, root / "repeats", extra, done[str(seed)], distill_student
            ):
                save()
            continue
        done[str(seed)] = gender_repeats.run_seed(
            seed, root / "repeats", extra, train_teacher, distill_student
        )
        save()


def write_repeats(store: dict, readme: Path, minutes) -> dict:
    summary = gender_repeats.summarise(store["repeats"])
    built = gender_repeats.tables(summary)
    note = (
        f"Seeds {', '.join(summary['seeds'])} ({len(summary['seeds'])} runs of every row; "
        f"{minutes} min in all on the shared 2-core machine), written by `studies.py --only "
        "repeats`. Mean ± sd [min, max] over the seeds; every figure on the 394 labelled "
        "test clips (one per speaker). The label-only and all-labels students read nothing of "
        "D_priv; the joint ε is that of the teacher run they come with.\n\n"
    )
    update_readme_table(readme, "repeats-models", note + built["models"])
    update_readme_table(readme, "repeats-claims", built["claims"])
    return summary


ALPHAS = (0.0, 0.5, 0.7, 1.0)


def run_study(name: str, root: Path, extra: list[str], rows=None) -> dict:
    """Run one study (only ``rows`` of the epsilon and ablation studies if given); returns
    ``{row_key: student results}``."""
    out = {}
    if name == "epsilon":
        for eps in EPSILONS:
            if rows and str(eps) not in rows:
                continue
            targs = ["--dp", "False"] if eps is None else ["--target_epsilon", str(eps)]
            out[str(eps)] = pipeline(root / f"eps_{eps}", targs, extra=extra)
    elif name == "ablation":
        for row, targs in ABLATION.items():
            if rows and row not in rows:
                continue
            sargs = ["--dsaf", "True" if "DSAF" in row or row == "all" else "False"]
            out[row] = pipeline(root / f"ablation_{row.strip('+')}", targs, sargs, extra=extra)
    elif name == "binary":
        targs = [
            "--classes",
            "[male, female]",
            "--aw_source",
            "prior",
            "--aw_prior",
            "[0.74, 0.26]",
        ]
        out["binary"] = pipeline(root / "binary", targs, extra=extra)
    elif name in ("aux", "alpha"):
        folder = root / "aux"
        if not (folder / "teacher" / "aux_logits.npz").is_file():
            train_teacher.main(["hparams/teacher.yaml", "--output_folder", str(folder), *extra])
        if name == "aux":
            for size in AUX_SIZES:
                sargs = ["--aux_subset", "null" if size is None else str(size)]
                out[str(size)] = distill_student.main(
                    ["hparams/student.yaml", "--output_folder", str(folder), *sargs, *extra]
                )
        else:  # alpha = 0: the same student without the teacher (CE on D_aux labels only)
            for alpha in ALPHAS:
                sargs = ["--alpha", str(alpha)]
                out[str(alpha)] = distill_student.main(
                    ["hparams/student.yaml", "--output_folder", str(folder), *sargs, *extra]
                )
            # The label-only control that also rebalances the classes (no teacher at all).
            sargs = ["--alpha", "0.0", "--ce_class_weight", "balanced"]
            out["0.0, balanced CE"] = distill_student.main(
                ["hparams/student.yaml", "--output_folder", str(folder), *sargs, *extra]
            )
    else:
        raise ValueError(f"unknown study {name!r}")
    return out


def tables(results: dict) -> dict[str, str]:
    """Markdown tables of the studies present in ``results``."""
    titles = {
        "epsilon": (
            "Epsilon sweep (δ = 1e-5, all components)",
            lambda k, r: f"target ε = {_eps(None if k == 'None' else float(k))}",
        ),
        "ablation": (
            "Ablation at ε = 1 (DP-direct and student use the row's components)",
            lambda k, r: k,
        ),
        "binary": (
            "Binary variant (male / female, ε computed for this configuration)",
            lambda k, r: "binary, target ε = 1",
        ),
        "aux": (
            "|D_aux| sweep (one teacher, students on subsets of its D_aux outputs)",
            lambda k, r: f"\\|D_aux\\| = {r['kd']['aux_records']}",
        ),
        "alpha": (
            "What the teacher adds: one teacher, students with α = 0 (no teacher: CE on D_aux only), 0.5, 0.7, 1 (KD only), and α = 0 with class-balanced CE",
            lambda k, r: f"α = {k}",
        ),
    }
    out = {}
    for key, (title, label) in titles.items():
        if key in results and "privacy" in results[key]:  # one run stored unwrapped
            results = {**results, key: {key: results[key]}}
        if key in results:
            out[title] = _table(HEADER, [_row(label(k, r), r) for k, r in results[key].items()])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="results/Private-Gender/studies")
    parser.add_argument(
        "--only", nargs="*", default=["repeats", "epsilon", "ablation", "binary", "aux", "alpha"]
    )
    parser.add_argument("--extra", default="", help="overrides passed to both scripts")
    parser.add_argument(
        "--rows",
        nargs="*",
        help="rows of the epsilon/ablation studies to run "
        "(e.g. 0.5 None, or base +DSAF); the others keep their stored results",
    )
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--readme", default=str(RECIPE_DIR / "README.md"))
    parser.add_argument("--no_readme", action="store_true")
    args = parser.parse_args(argv)
    root, extra = Path(args.root), shlex.split(args.extra)
    real = any(arg.startswith("--data_folder") for arg in extra)
    message = TUNING_WARNING + (" This run passes --data_folder: a real D_priv?" if real else "")
    logging.getLogger(__name__).warning(message)
    warnings.warn(message, UserWarning, stacklevel=2)
    logging.getLogger().setLevel(logging.WARNING)
    store = root / "studies.json"
    results = json.loads(store.read_text(encoding="utf-8")) if store.is_file() else {}
    minutes = dict(results.pop("_minutes", {}))

    def save():  # after each study or seed: an interrupted run keeps the others
        with atomic_open(store) as handle:
            json.dump({**results, "_minutes": minutes}, handle, indent=2, default=float)

    for name in args.only:
        start = time.time()
        if name == "repeats":
            run_repeats(root, extra, args.seeds, results, save)
            minutes[name] = round(minutes.get(name, 0) + (time.time() - start) / 60, 1)
            save()
            continue
        new = run_study(name, root, extra, rows=args.rows)
        results[name] = {**results.get(name, {}), **new} if args.rows else new
        minutes[name] = round((time.time() - start) / 60, 1)
        save()
    if "repeats" in results and not args.no_readme:
        summary = write_repeats(results, Path(args.readme), minutes.get("repeats"))
        print(json.dumps(summary["claims"], indent=1))
    results = {k: v for k, v in results.items() if k != "repeats"}
    if not results:
        return
    built = tables(results)
    note = (
        "One run per row on the embedded corpus, written by `studies.py` (minutes per study: "
        + ", ".join(f"{k} {v}" for k, v in minutes.items())
        + "). Intervals: 95% speaker-level bootstrap over the test set, not over the training "
        "randomness (the DP noise and sampling come from the OS, so a rerun differs).\n"
    )
    if not args.no_readme:
        write_readme(built, Path(args.readme), note)
    for title, table in built.items():
        print(f"\n{title}\n{table}")


if __name__ == "__main__":
    main()
