#!/usr/bin/env python3
"""The canaries' effect on utility: paired teacher runs with and without the DP-SGD audit.

For each seed ``s``, two teacher runs (then a student of each) that differ only in
``audit_canaries`` (0 and ``--canaries``): ``--seed s`` fixes the initialisation and
``--dp_seed s`` the Poisson sampler and the DP noise (tests-only seeding, it warns), so both
runs draw the same batches and the same noise and the paired difference is the canaries' own
effect (the canaries' directions and split still come from the OS). DP-direct is skipped
(``train_dp_direct: False``): it has no canaries. Writes ``<root>/audit_cost.json`` and prints
the markdown table (per metric: mean ± sd with canaries, without, and the paired difference
with its 95% t-interval over the seeds, ``gender_stats.paired``).

    > python recipes/Private-Gender/studies/audit_cost.py --seeds 1 2 3 4 5 --root results/audit_cost

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

STUDIES_DIR = Path(__file__).resolve().parent
RECIPE_DIR = STUDIES_DIR.parent  # the recipe scripts and their hparams/
sys.path[:0] = [str(STUDIES_DIR), str(RECIPE_DIR)]

import distill_student  # noqa: E402
import train_teacher  # noqa: E402
from gender_stats import paired, spread  # noqa: E402

from speechbrain_fl.recipe import run_recipe  # noqa: E402

#: (label, results file, dotted path to the value)
METRICS = (
    ("teacher balanced acc.", "teacher", "teacher.test.balanced_accuracy.value"),
    ("teacher macro-F1", "teacher", "teacher.test.macro_f1.value"),
    ("teacher recall other", "teacher", "teacher.test.per_class_recall.other.value"),
    ("student balanced acc.", "student", "test.balanced_accuracy.value"),
    ("student MajPred", "student", "test.majpred.value"),
)


def _get(results: dict, dotted: str):
    for key in dotted.split("."):
        results = results[key]
    return float(results)


def run(seeds, root: Path, canaries: int, extra: list[str]) -> dict:
    """Both runs per seed; returns ``{"runs": {seed: {arm: values}}, "summary": ...}``."""
    runs = {}
    for seed in seeds:
        runs[str(seed)] = {}
        for arm, m in (("with canaries", canaries), ("without", 0)):
            folder = root / f"seed{seed}" / ("audit" if m else "plain")
            common = ["--output_folder", str(folder), "--seed", str(seed), *extra]
            teacher = run_recipe(
                train_teacher,
                [
                    "hparams/teacher.yaml",
                    *common,
                    "--dp_seed",
                    str(seed),
                    "--train_dp_direct",
                    "False",
                    "--audit_canaries",
                    str(m),
                ],  # fmt: skip
            )
            student = run_recipe(distill_student, ["hparams/student.yaml", *common])
            found = {"teacher": teacher, "student": student}
            values = {label: _get(found[src], path) for label, src, path in METRICS}
            audit = teacher["privacy"].get("audit")
            if audit:
                values["epsilon_one_shot"] = audit["epsilon_one_shot"]
                values["epsilon_lower_bound"] = audit["epsilon_lower_bound"]
            values["epsilon"] = teacher["privacy"]["epsilon"]
            runs[str(seed)][arm] = values
    return {"canaries": canaries, "runs": runs, "summary": summarise(runs)}


def summarise(runs: dict) -> dict:
    """Per metric: spread of each arm and the paired difference (with - without)."""
    out = {}
    for label, _, _ in METRICS:
        a = [r["with canaries"][label] for r in runs.values()]
        b = [r["without"][label] for r in runs.values()]
        out[label] = {"with canaries": spread(a), "without": spread(b), "paired": paired(a, b)}
    return out


def table(summary: dict, seeds) -> str:
    """The markdown table of :func:`summarise`."""
    lines = [
        f"| metric (seeds {', '.join(map(str, seeds))}) | with canaries | without | "
        "difference [95% CI] |",
        "|---|---|---|---|",
    ]
    for label, s in summary.items():
        w, o, p = s["with canaries"], s["without"], s["paired"]
        lines.append(
            f"| {label} | {w['mean']:.3f} ± {w['sd']:.3f} | {o['mean']:.3f} ± {o['sd']:.3f} | "
            f"{p['mean']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--root", type=Path, default=Path("results/Private-Gender/audit_cost"))
    parser.add_argument("--canaries", type=int, default=1000)
    args, extra = parser.parse_known_args(argv)  # the rest: overrides for both scripts
    if len(args.seeds) < 2:
        parser.error("--seeds: a paired comparison needs at least 2 seeds")
    root = args.root.resolve()  # before the chdir: relative to where it was run
    os.chdir(RECIPE_DIR)  # hparams/ paths are relative to the recipe
    result = run(args.seeds, root, args.canaries, extra)
    root.mkdir(parents=True, exist_ok=True)
    (root / "audit_cost.json").write_text(json.dumps(result, indent=2))
    print(table(result["summary"], args.seeds))
    return result


if __name__ == "__main__":
    main()
