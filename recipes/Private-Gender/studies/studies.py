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
``studies`` table block (``update_readme_table``). Outside ``repeats`` each row is one run per
``--study_seeds`` seed s (default 1, 2, 3) (``--seed s``: initialisations, the labelled D_aux subset; the DP noise
and the Poisson sampling come from the OS, so a rerun gives other figures). With one seed the
tables give the 95% bootstrap intervals, which cover the test-set sampling only, not the
training randomness; with several, mean ± sd over the seeds, and studies that compare methods
(ablation, alpha) also the paired differences to their reference row (``gender_stats.paired``).

    > python recipes/Private-Gender/studies/studies.py --only repeats --seeds 1 2 3 4 5
    > python recipes/Private-Gender/studies/studies.py --root results/Private-Gender/studies
    > python recipes/Private-Gender/studies/studies.py --only ablation alpha --study_seeds 1 2 3 4 5
    > python recipes/Private-Gender/studies/studies.py --only ablation --extra "--epochs 10"
    > python recipes/Private-Gender/studies/studies.py --only    # rewrite the tables, run nothing

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

STUDIES_DIR = Path(__file__).resolve().parent
RECIPE_DIR = STUDIES_DIR.parent  # the recipe scripts and their hparams/
sys.path[:0] = [str(STUDIES_DIR), str(RECIPE_DIR)]

import distill_student  # noqa: E402
import gender_repeats  # noqa: E402
import train_teacher  # noqa: E402
from gender_stats import paired, spread  # noqa: E402

from speechbrain_fl.recipe import run_recipe, update_readme_table  # noqa: E402
from speechbrain_fl.utils.atomic import atomic_open  # noqa: E402

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, None)
ABLATION = {
    "base": ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.0"],
    "+DSAF": ["--dsaf", "True", "--aw_dp", "False", "--modality_dropout", "0.0"],
    "+AW-DP": ["--dsaf", "False", "--aw_dp", "True", "--modality_dropout", "0.0"],
    "+dropout": ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.5"],
    "all": ["--dsaf", "True", "--aw_dp", "True", "--modality_dropout", "0.5"],
}
AUX_SIZES = (50, 100, 200, 400, None)
TUNING_WARNING = (
    "studies.py: each row is a separate DP training on the same D_priv and its epsilon covers "
    "that row alone; choosing settings by comparing rows on a real D_priv spends privacy that "
    "nothing here accounts. Tune on the embedded corpus or public data, then train once."
)


def pipeline(folder: Path, teacher_args, student_args=(), *, extra=()):
    """One teacher + student run into ``folder``; returns the student's results."""
    common = ["--output_folder", str(folder), *extra]
    run_recipe(train_teacher, ["hparams/teacher.yaml", *common, *teacher_args])
    return run_recipe(distill_student, ["hparams/student.yaml", *common, *student_args])


def _metric(block, key):
    """``{"value", "ci"}`` of ``key`` in a report block (``recall_other``: the recall of
    "other"), None when absent (no DP-direct, a binary run, results of an older version)."""
    if not block:
        return None
    if key == "recall_other":
        return (block.get("per_class_recall") or {}).get("other")
    return block.get(key)


def _v(block, key):
    m = _metric(block, key)
    if m is None:
        return "-"
    value, ci = m["value"], m["ci"]
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


#: The value columns of the sweep and ablation tables: (results block, metric).
COLUMNS = [
    ("dp_direct", "balanced_accuracy"),
    ("dp_direct", "majpred"),
    ("dp_direct", "recall_other"),
    ("test", "balanced_accuracy"),
    ("test", "macro_f1"),
    ("test", "majpred"),
    ("test", "recall_other"),
]


def seeded(stored: dict) -> dict[str, dict]:
    """The per-seed results of one stored row, ``{seed: student results}``; a row of one run
    without ``--seed`` (stored unwrapped, as before seeds existed) is ``{"-": results}``."""
    return stored["seeds"] if "seeds" in stored else {"-": stored}


def _mean_sd(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    s = spread(values)
    return f"{s['mean']:.3f} ± {s['sd']:.3f}" if s["n"] > 1 else f"{s['mean']:.3f}"


def _audit_cell(runs) -> str:
    """The teacher audits of a row's runs: verdicts and the largest lower bound on epsilon
    ("no audit" for runs without DP or without canaries)."""
    audits = [(r.get("privacy") or {}).get("audit") for r in runs]
    audits = [a for a in audits if a]
    if not audits:
        return "no audit"
    verdicts = sorted({a["verdict"] for a in audits})
    counts = ", ".join(f"{sum(a['verdict'] == v for a in audits)} {v}" for v in verdicts)
    return f"{counts}; lower bound ≤ {max(a['epsilon_lower_bound'] for a in audits):.2f}"


def _row(name, stored):
    """One table row: the bootstrap interval of a single run, mean ± sd over several seeds."""
    runs = list(seeded(stored).values())
    first = runs[0]
    # alpha = 0: the student's loss has no teacher term, so it reads nothing of D_priv.
    no_teacher = (first.get("kd") or {}).get("alpha") == 0
    own = "0 (reads no D_priv)" if no_teacher else _eps(first["privacy"]["epsilon"])
    head = [name, own, _joint_eps(first)]
    if len(runs) == 1:
        return head + [_v(first[block], key) for block, key in COLUMNS] + [_audit_cell(runs)]
    cells = []
    for block, key in COLUMNS:
        metrics = [_metric(r[block], key) for r in runs]
        cells.append(_mean_sd([m["value"] if m else None for m in metrics]))
    return head + cells + [_audit_cell(runs)]


HEADER = [
    "Run",
    "ε (student)",
    "ε joint (all releases)",
    "DP-direct bal. acc.",
    "DP-direct MajPred",
    'DP-direct recall "other"',
    "Student bal. acc.",
    "Student macro-F1",
    "Student MajPred",
    'Student recall "other"',
    "Teacher audit",
]

#: Studies that compare methods: reference row, and the metrics of the paired differences
#: (label, results block, metric), each row minus the reference, seed by seed.
PAIRED = {
    "ablation": (
        "base",
        [
            ("DP-direct bal. acc.", "dp_direct", "balanced_accuracy"),
            ('DP-direct recall "other"', "dp_direct", "recall_other"),
            ("student bal. acc.", "test", "balanced_accuracy"),
        ],
    ),
    "alpha": (
        "0.0",
        [
            ("student bal. acc.", "test", "balanced_accuracy"),
            ('student recall "other"', "test", "recall_other"),
        ],
    ),
}


def paired_rows(study: dict, reference: str, metrics, name=str) -> list[list[str]]:
    """Rows of the paired table: every row of ``study`` minus ``reference`` over the seeds both
    have (``gender_stats.paired``: mean, 95% t-interval, wins); empty below two seeds.
    ``name(row_key)`` labels a row."""
    if reference not in study:
        return []
    ref = seeded(study[reference])
    out = []
    for row, stored in study.items():
        runs = seeded(stored)
        keys = sorted(set(runs) & set(ref) - {"-"}, key=int)
        if row == reference or len(keys) < 2:
            continue
        for label, block, key in metrics:
            a = [_metric(runs[k][block], key) for k in keys]
            b = [_metric(ref[k][block], key) for k in keys]
            if any(m is None for m in a + b):
                continue
            c = paired([m["value"] for m in a], [m["value"] for m in b])
            if not any(c["differences"]):
                verdict = "no difference in any seed"
            elif c["ci"][0] > 0:
                verdict = "above 0"
            else:
                verdict = "below 0" if c["ci"][1] < 0 else "spans 0"
            out.append(
                [
                    f"{name(row)} − {name(reference)}, {label}",
                    str(c["n"]),
                    f"{c['mean']:+.3f}",
                    f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] ({verdict})",
                    f"{c['wins']}/{c['n']}",
                    ", ".join(f"{d:+.2f}" for d in c["differences"]),
                ]
            )
    return out


PAIRED_HEADER = ["Paired difference (A − B)", "Seeds", "Mean", "95% CI (t)", "A > B in", "Per seed"]


def _accountant(results: dict) -> str:
    """The accountant of the stored runs' epsilon (PLD, RDP or PRV; "RDP" for runs stored
    before the figure named it)."""
    for study in results.values():
        rows = [study] if "privacy" in study else list(study.values())  # one run unwrapped
        for stored in rows:
            for run in seeded(stored).values():
                name = (run.get("privacy") or {}).get("accountant")
                if name:
                    return name.upper()
    return "RDP"


def write_readme(tables: dict[str, str], readme: Path, note: str) -> None:
    """The sweep and ablation tables into the README's ``studies`` block."""
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


def write_repeats(store: dict, readme: Path, minutes, seeds=None, root=None) -> dict:
    """The repeated study's tables over the stored seeds (only ``seeds`` if given), with the
    audits of its teachers when their outputs are under ``root``."""
    runs = store["repeats"]
    if seeds:
        runs = {k: v for k, v in runs.items() if int(k) in seeds}
    summary = gender_repeats.summarise(runs)
    audited = {} if root is None else gender_repeats.audits(root / "repeats", summary["seeds"])
    built = gender_repeats.tables(summary)
    note = (
        f"Seeds {', '.join(summary['seeds'])} ({len(summary['seeds'])} runs of every row; "
        f"{minutes} min in all on the shared 2-core machine), written by `studies.py --only "
        "repeats`. Mean ± sd [min, max] over the seeds; every figure on the 394 labelled "
        "test clips (one per speaker). The label-only and all-labels students read nothing of "
        "D_priv; the joint ε is that of the teacher run they come with.\n\n"
    )
    note_after = gender_repeats.audit_note(audited)
    models = note + built["models"] + (f"\n\n{note_after}" if note_after else "")
    update_readme_table(readme, "repeats-models", models)
    update_readme_table(readme, "repeats-claims", built["claims"])
    return summary


ALPHAS = (0.0, 0.5, 0.7, 1.0)


def _at(folder: Path, seed) -> Path:
    return folder if seed is None else folder / f"seed_{seed}"


def _seed_args(seed) -> list[str]:
    return [] if seed is None else ["--seed", str(seed)]


def run_study(name: str, root: Path, extra: list[str], rows=None, seeds=(None,)) -> dict:
    """Run one study (only ``rows`` of the epsilon and ablation studies if given) once per
    seed in ``seeds`` (None: one run with the hparams' seed); returns ``{row_key: student
    results}`` for ``seeds=(None,)``, else ``{row_key: {"seeds": {seed: student results}}}``."""
    out = {}

    def put(row, seed, res):
        if seed is None:
            out[row] = res
        else:
            out.setdefault(row, {"seeds": {}})["seeds"][str(seed)] = res

    if name not in ("epsilon", "ablation", "binary", "aux", "alpha"):
        raise ValueError(f"unknown study {name!r}")
    for seed in seeds:
        sx = [*extra, *_seed_args(seed)]
        if name == "epsilon":
            for eps in EPSILONS:
                if rows and str(eps) not in rows:
                    continue
                targs = ["--dp", "False"] if eps is None else ["--target_epsilon", str(eps)]
                put(str(eps), seed, pipeline(_at(root / f"eps_{eps}", seed), targs, extra=sx))
        elif name == "ablation":
            for row, targs in ABLATION.items():
                if rows and row not in rows:
                    continue
                sargs = ["--dsaf", "True" if "DSAF" in row or row == "all" else "False"]
                folder = _at(root / f"ablation_{row.strip('+')}", seed)
                put(row, seed, pipeline(folder, targs, sargs, extra=sx))
        elif name == "binary":
            targs = ["--classes", "[male, female]", "--aw_source", "prior", "--aw_prior",
                     "[0.74, 0.26]"]  # fmt: skip
            put("binary", seed, pipeline(_at(root / "binary", seed), targs, extra=sx))
        else:  # aux, alpha: students of one teacher per seed
            folder = _at(root / "aux", seed)
            common = ["hparams/student.yaml", "--output_folder", str(folder), *sx]
            if not (folder / "teacher" / "aux_logits.npz").is_file():
                run_recipe(
                    train_teacher, ["hparams/teacher.yaml", "--output_folder", str(folder), *sx]
                )
            if name == "aux":
                for size in AUX_SIZES:
                    sargs = ["--aux_subset", "null" if size is None else str(size)]
                    put(str(size), seed, run_recipe(distill_student, [*common, *sargs]))
            else:  # alpha = 0: the same student without the teacher (CE on D_aux labels only)
                for alpha in ALPHAS:
                    put(
                        str(alpha),
                        seed,
                        run_recipe(distill_student, [*common, "--alpha", str(alpha)]),
                    )
                # The label-only control that also rebalances the classes (no teacher at all).
                sargs = ["--alpha", "0.0", "--ce_class_weight", "balanced"]
                put("0.0, balanced CE", seed, run_recipe(distill_student, [*common, *sargs]))
    return out


TITLES = {
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
        "|D_aux| sweep (one teacher per seed, students on subsets of its D_aux outputs, "
        "at most 30 of them labelled)",
        lambda k, r: f"\\|D_aux\\| = {r['kd']['aux_records']}",
    ),
    "alpha": (
        "What the teacher adds: one teacher per seed, students with α = 0 (no teacher: CE on "
        "the 30 D_aux labels only), 0.5, 0.7, 1 (KD only), and α = 0 with class-balanced CE",
        lambda k, r: f"α = {k}",
    ),
}


def _seeds_of(study: dict) -> str:
    keys = sorted({k for stored in study.values() for k in seeded(stored)} - {"-"}, key=int)
    if not keys:
        return "one run per row"
    return f"seed{'s' if len(keys) > 1 else ''} {', '.join(keys)}"


def tables(results: dict) -> dict[str, str]:
    """Markdown tables of the studies present in ``results`` (their seeds in the title), and
    for the studies of :data:`PAIRED` run with two seeds or more, the paired differences."""
    out = {}
    for key, (title, label) in TITLES.items():
        if key in results and "privacy" in results[key]:  # one run stored unwrapped
            results = {**results, key: {key: results[key]}}
        if key not in results:
            continue
        study = results[key]
        rows = [_row(label(k, next(iter(seeded(r).values()))), r) for k, r in study.items()]
        out[f"{title}; {_seeds_of(study)}"] = _table(HEADER, rows)
        if key in PAIRED:
            ref, metrics = PAIRED[key]

            def name(k, study=study, label=label):
                return label(k, next(iter(seeded(study[k]).values())))

            diffs = paired_rows(study, ref, metrics, name=name)
            if diffs:
                head = title.split(" (")[0].split(":")[0]
                out[f"{head}: paired differences to {name(ref)}"] = _table(PAIRED_HEADER, diffs)
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
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3, 4, 5],
                        help="seeds of the repeated study")  # fmt: skip
    parser.add_argument(
        "--study_seeds",
        nargs="*",
        type=int,
        default=[1, 2, 3],
        help="seeds of the other studies (each row once per seed; default 1 2 3); given "
        "without a value: one run per row with the hparams' seed",
    )
    parser.add_argument(
        "--summary_seeds",
        nargs="*",
        type=int,
        help="summarise only these stored seeds of the repeated study (e.g. the first five, "
        "for the power estimate that sized the study); default every stored seed",
    )
    parser.add_argument("--readme", default=str(STUDIES_DIR / "README.md"))
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
        seeds = tuple(args.study_seeds) if args.study_seeds else (None,)
        new = run_study(name, root, extra, rows=args.rows, seeds=seeds)
        results[name] = {**results.get(name, {}), **new} if args.rows else new
        minutes[name] = round((time.time() - start) / 60, 1)
        save()
    if "repeats" in results and not args.no_readme:
        summary = write_repeats(
            results, Path(args.readme), minutes.get("repeats"), seeds=args.summary_seeds,
            root=root,
        )  # fmt: skip
        print(json.dumps(summary["claims"], indent=1))
    results = {k: v for k, v in results.items() if k != "repeats"}
    if not results:
        return
    built = tables(results)
    note = (
        "On the embedded corpus, written by `studies.py` (minutes per study: "
        + ", ".join(f"{k} {v}" for k, v in minutes.items() if k != "repeats")
        + f"). ε from the {_accountant(results)} accountant. A row of one run gives the 95% "
        "speaker-level bootstrap interval over the test set, not over the training "
        "randomness (the DP noise and sampling come from the OS, so a rerun differs); a row "
        "of several seeds gives mean ± sd over the seeds (one teacher, DP-direct and student "
        "per seed), and the paired differences to a reference row use 95% t-intervals over "
        "the seeds.\n"
    )
    if not args.no_readme:
        write_readme(built, Path(args.readme), note)
    for title, table in built.items():
        print(f"\n{title}\n{table}")


if __name__ == "__main__":
    main()
