#!/usr/bin/env python3
"""Studies of the Private-Gender recipe; writes the tables of this folder's README.

Runs ``train_teacher.py`` and ``distill_student.py`` (in this process, through their
``main``) for

* an epsilon sweep (0.5, 1, 2, 4, 8 and no DP) of the default pipeline;
* the ablation (base = no DSAF and no AW-DP, +DSAF, +AW-DP, +dropout, all) at epsilon = 1,
  for DP-direct and the student;
* the binary male/female variant (its own epsilon, AW-DP weights from a public prior);
* a |D_aux| sweep: students distilled from one teacher's outputs on subsets of D_aux,

then writes ``<root>/studies.json`` and replaces the block between ``<!-- studies:begin -->``
and ``<!-- studies:end -->`` of ``README.md`` with the tables. Each row is ONE run (the DP
noise and the Poisson sampling come from the OS, so a rerun gives other figures): read the
95% bootstrap intervals, which cover the test-set sampling only, not the training randomness.

    > python recipes/Private-Gender/studies.py --root results/Private-Gender/studies
    > python recipes/Private-Gender/studies.py --only ablation --extra "--epochs 10"

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
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))

import distill_student  # noqa: E402
import train_teacher  # noqa: E402

from speechbrain_fl.atomic import atomic_open  # noqa: E402

BEGIN, END = "<!-- studies:begin -->", "<!-- studies:end -->"
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, None)
ABLATION = {
    "base": ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.0"],
    "+DSAF": ["--dsaf", "True", "--aw_dp", "False", "--modality_dropout", "0.0"],
    "+AW-DP": ["--dsaf", "False", "--aw_dp", "True", "--modality_dropout", "0.0"],
    "+dropout": ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.5"],
    "all": ["--dsaf", "True", "--aw_dp", "True", "--modality_dropout", "0.5"],
}
AUX_SIZES = (25, 50, 100, 200, None)


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


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _row(name, res):
    return [name, _eps(res["privacy"]["epsilon"]), _v(res["dp_direct"], "balanced_accuracy"),
            _v(res["dp_direct"], "majpred"), _v(res["test"], "balanced_accuracy"),
            _v(res["test"], "macro_f1"), _v(res["test"], "majpred")]  # fmt: skip


HEADER = ["Run", "ε", "DP-direct bal. acc.", "DP-direct MajPred", "Student bal. acc.",
          "Student macro-F1", "Student MajPred"]  # fmt: skip


def write_readme(tables: dict[str, str], readme: Path, note: str) -> None:
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no {BEGIN} ... {END} block")
    body = [note]
    for title, table in tables.items():
        body += [f"#### {title}", "", table, ""]
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with atomic_open(readme) as handle:
        handle.write(head + BEGIN + "\n" + "\n".join(body) + END + tail)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="results/Private-Gender/studies")
    parser.add_argument("--only", nargs="*", default=["epsilon", "ablation", "binary", "aux"])
    parser.add_argument("--extra", default="", help="overrides passed to both scripts")
    parser.add_argument("--readme", default=str(RECIPE_DIR / "README.md"))
    parser.add_argument("--no_readme", action="store_true")
    args = parser.parse_args(argv)
    root, extra = Path(args.root), shlex.split(args.extra)
    logging.getLogger().setLevel(logging.WARNING)
    start = time.time()
    out: dict = {}
    tables: dict[str, str] = {}
    if "epsilon" in args.only:
        rows = []
        for eps in EPSILONS:
            targs = ["--dp", "False"] if eps is None else ["--target_epsilon", str(eps)]
            res = pipeline(root / f"eps_{eps}", targs, extra=extra)
            out.setdefault("epsilon", {})[str(eps)] = res
            rows.append(_row(f"target ε = {_eps(eps)}", res))
        tables["Epsilon sweep (δ = 1e-5, all components)"] = _table(HEADER, rows)
    if "ablation" in args.only:
        rows = []
        for name, targs in ABLATION.items():
            sargs = ["--dsaf", "True" if "DSAF" in name or name == "all" else "False"]
            res = pipeline(root / f"ablation_{name.strip('+')}", targs, sargs, extra=extra)
            out.setdefault("ablation", {})[name] = res
            rows.append(_row(name, res))
        tables["Ablation at ε = 1 (DP-direct and student use the row's components)"] = _table(
            HEADER, rows
        )
    if "binary" in args.only:
        targs = [
            "--classes",
            "[male, female]",
            "--aw_source",
            "prior",
            "--aw_prior",
            "[0.74, 0.26]",
        ]
        res = pipeline(root / "binary", targs, extra=extra)
        out["binary"] = res
        tables["Binary variant (male / female, ε computed for this configuration)"] = _table(
            HEADER, [_row("binary, target ε = 1", res)])  # fmt: skip
    if "aux" in args.only:
        rows = []
        folder = root / "aux"
        train_teacher.main(["hparams/teacher.yaml", "--output_folder", str(folder), *extra])
        for size in AUX_SIZES:
            res = distill_student.main(["hparams/student.yaml", "--output_folder", str(folder),
                                        "--aux_subset", "null" if size is None else str(size), *extra])  # fmt: skip
            out.setdefault("aux", {})[str(size)] = res
            rows.append(_row(f"|D_aux| = {res['kd']['aux_records']}", res))
        tables["|D_aux| sweep (one teacher, students on subsets of its D_aux outputs)"] = _table(
            HEADER, rows
        )
    minutes = (time.time() - start) / 60
    with atomic_open(root / "studies.json") as handle:
        json.dump(out, handle, indent=2, default=float)
    note = (f"One run per row on the embedded corpus (written by `studies.py` in {minutes:.0f} min; "
            "intervals: 95% speaker-level bootstrap over the test set, not over training "
            "randomness).\n")  # fmt: skip
    if not args.no_readme:
        write_readme(tables, Path(args.readme), note)
    for title, table in tables.items():
        print(f"\n{title}\n{table}")


if __name__ == "__main__":
    main()
