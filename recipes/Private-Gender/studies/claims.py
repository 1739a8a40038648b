#!/usr/bin/env python3
"""The recipe's three distillation claims, paired over seeds, with the power they need.

Per seed s (``--seed s``: the models' initialisation and the labelled D_aux subset; the DP noise
and the Poisson sampling come from the OS) one default teacher run (``hparams/teacher.yaml``,
no audit canaries, with its DP-direct) and three students of its outputs: KD (alpha = 0.5 on
the 30 labelled D_aux clips), the label-only control (alpha = 0, the same 30 labels) and the
same with class-balanced CE. Every model is scored on the same test set, whatever the seed.

The claims, each a paired difference of balanced accuracy over the seeds
(``gender_stats.paired``): the student against DP-direct (the same epsilon, the same D_priv,
both trained the same way), against the label-only control, and against the label-only
control with balanced CE. Each gets its 95% t-interval, its paired t-test p, the Holm-adjusted
p over the three (``gender_stats.holm``) and the seeds 80% power would need at the effect and
spread measured (``gender_stats.seeds_for_power``, at level 0.05 and at 0.05 / 3). Per seed and claim the bootstrap sd of the
difference over the test records (``gender_stats.balanced_accuracy_difference_sd``; also on a
fixed random subset of ``SUBSET`` records, the size of a smaller test set) splits the spread
over seeds into the test sample's part and the training's (``gender_stats.variance_split``), and
widens each claim's interval by the test sample's error common to all seeds
(:func:`with_test_sample`).

Results go to ``claims.json`` (this folder; resumable: a stored seed is not rerun);
``--only`` runs nothing and writes the recipe README's ``claims`` block and the Private-Gender
row of the repository README from that file (:func:`readme_block`, :func:`root_row`).

    > python recipes/Private-Gender/studies/claims.py --seeds 1 2 3 4 5 --root results/claims
    > python recipes/Private-Gender/studies/claims.py --only

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

STUDIES_DIR = Path(__file__).resolve().parent
RECIPE_DIR = STUDIES_DIR.parent
ROOT_README = RECIPE_DIR.parents[1] / "README.md"
sys.path[:0] = [str(STUDIES_DIR), str(RECIPE_DIR)]

from gender_stats import (  # noqa: E402
    balanced_accuracy_difference_sd,
    collapsed,
    exact_mcnemar,
    holm,
    paired,
    seeds_for_power,
    spread,
    variance_split,
)

__all__ = ["CLAIMS", "MODELS", "readme_block", "root_row", "run_seed", "summarise"]

#: Students of each seed's teacher: name -> overrides of student.yaml.
STUDENTS = {
    "student": [],
    "label-only": ["--alpha", "0.0"],
    "label-only, balanced CE": ["--alpha", "0.0", "--ce_class_weight", "balanced"],
}
#: Models kept per seed, with their README names.
MODELS = {
    "dp_direct": "DP-direct (stabilised, audio-only)",
    "teacher": "teacher (multimodal, not released)",
    "student": "**student (KD, α = 0.5, 30 D_aux labels, released)**",
    "label-only": "label-only control (α = 0, same 30 labels)",
    "label-only, balanced CE": "label-only control, class-balanced CE",
}
#: The claims: (name, model A, model B); each reads A - B in balanced accuracy.
CLAIMS = [
    ("student − DP-direct", "student", "dp_direct"),
    ("student − label-only", "student", "label-only"),
    ("student − label-only, balanced CE", "student", "label-only, balanced CE"),
]
SUBSET = 400
RESAMPLES = 1000


def _model(report: dict) -> dict:
    recalls = {c: v["value"] for c, v in report["per_class_recall"].items()}
    return {
        "balanced_accuracy": report["balanced_accuracy"]["value"],
        "majpred": report["majpred"]["value"],
        "recall_other": recalls.get("other"),
        "collapsed": collapsed(report["majpred"]["value"], recalls.values()),
    }


def _subset_balanced_accuracy(labels, predictions, num_classes: int) -> float:
    """Balanced accuracy on the fixed ``SUBSET``-record subset (no resampling)."""
    import numpy as np
    from gender_stats import _balanced_accuracy

    y, p = np.asarray(labels), np.asarray(predictions)
    keep = np.random.default_rng(0).permutation(len(y))[:SUBSET]
    ones = np.ones((1, len(keep)))
    return float(
        _balanced_accuracy(ones, y[keep], (p[keep] == y[keep]).astype(float), num_classes)[0]
    )


def record(teacher: dict, students: dict[str, dict], seconds: float) -> dict:
    """What the study keeps of one seed: each model's figures, and per claim the difference on
    the whole test set and on the subset, with their bootstrap sds over the test records."""
    labels = teacher["data"]["test_labels"]
    classes = teacher["data"]["classes"]
    reports = {"dp_direct": teacher["dp_direct"], "teacher": teacher["teacher"]["test"]}
    reports.update({name: res["test"] for name, res in students.items()})
    out = {
        "epsilon": teacher["privacy"]["epsilon"],
        "epsilon_joint": teacher["privacy_joint"]["epsilon"],
        "audit_run": teacher["method"]["audit_run"],
        "test_records": len(labels),
        "seconds": round(seconds, 1),
        "models": {name: _model(rep) for name, rep in reports.items()},
        "claims": {},
    }
    for name, a, b in CLAIMS:
        pa, pb = reports[a]["predictions"], reports[b]["predictions"]
        args = {"num_classes": len(classes), "resamples": RESAMPLES}
        out["claims"][name] = {
            "test_sd": balanced_accuracy_difference_sd(labels, pa, pb, **args),
            "subset_difference": round(
                _subset_balanced_accuracy(labels, pa, len(classes))
                - _subset_balanced_accuracy(labels, pb, len(classes)),
                4,
            ),
            "subset_test_sd": balanced_accuracy_difference_sd(
                labels, pa, pb, subset=SUBSET, **args
            ),
        }
    return out


def run_seed(seed: int, root: Path, extra: list[str]) -> dict:
    """One seed: the default teacher run (with DP-direct) and its three students."""
    import distill_student
    import train_teacher

    from speechbrain_fl.recipe import run_recipe

    start = time.time()
    common = ["--output_folder", str(root / f"seed_{seed}"), "--seed", str(seed), *extra]
    teacher = run_recipe(train_teacher, [str(RECIPE_DIR / "hparams" / "teacher.yaml"), *common])
    if teacher["method"]["audit_run"]:
        raise ValueError("claims.py: the claims compare models trained without audit canaries")
    students = {
        name: run_recipe(
            distill_student, [str(RECIPE_DIR / "hparams" / "student.yaml"), *common, *args]
        )
        for name, args in STUDENTS.items()
    }
    return record(teacher, students, time.time() - start)


def with_test_sample(d: dict, test_sds) -> list[float]:
    """The 95% interval of the mean difference widened for the test set's sampling error.

    The test set is the same for every seed, so part of its sampling error is shared by all
    seeds: the t-interval over seeds, ``mean +- h_t``, does not cover it, and more seeds do not
    shrink it. The sd of that shared part is at most the mean per-seed bootstrap sd s_bar (the
    sd of an average is at most the average of the sds), so
    ``mean +- sqrt(h_t^2 + (1.96 s_bar)^2)`` is a conservative interval for the difference on
    the population the test clips are drawn from.
    """
    half_t = d["ci"][1] - d["mean"]
    s_bar = sum(float(s) for s in test_sds) / len(test_sds)
    half = math.sqrt(half_t**2 + (1.96 * s_bar) ** 2)
    return [round(d["mean"] - half, 4), round(d["mean"] + half, 4)]


def summarise(store: dict) -> dict:
    """Spread per model, and per claim the paired difference, its Holm-adjusted p, the seeds
    for 80% power and the split of its spread into test sample and training."""
    seeds = sorted(store["seeds"], key=int)
    runs = [store["seeds"][s] for s in seeds]
    models = {}
    for name in MODELS:
        models[name] = {
            "balanced_accuracy": spread(r["models"][name]["balanced_accuracy"] for r in runs),
            "majpred": spread(r["models"][name]["majpred"] for r in runs),
            "recall_other": spread(r["models"][name]["recall_other"] for r in runs),
            "collapsed": sum(r["models"][name]["collapsed"] for r in runs),
        }
    claims = {}
    for name, a, b in CLAIMS:
        d = paired(
            [r["models"][a]["balanced_accuracy"] for r in runs],
            [r["models"][b]["balanced_accuracy"] for r in runs],
        )
        sub = [r["claims"][name] for r in runs]
        claims[name] = {
            **d,
            "ci_with_test": with_test_sample(d, [c["test_sd"] for c in sub]),
            "seeds_for_power": seeds_for_power(d["differences"]),
            "seeds_for_power_bonferroni": seeds_for_power(
                d["differences"], alpha=0.05 / len(CLAIMS)
            ),
            "variance": variance_split(d["differences"], [c["test_sd"] for c in sub]),
            "variance_subset": variance_split(
                [c["subset_difference"] for c in sub], [c["subset_test_sd"] for c in sub]
            ),
        }
    for (name, _, _), p in zip(CLAIMS, holm([c["p"] for c in claims.values()]), strict=True):
        claims[name]["p_holm"] = p
    collapse = exact_mcnemar(
        [r["models"]["dp_direct"]["collapsed"] for r in runs],
        [r["models"]["student"]["collapsed"] for r in runs],
    )
    return {
        "seeds": seeds,
        "n": len(seeds),
        "collapse": collapse,
        "epsilon": runs[0]["epsilon"],
        "epsilon_joint": runs[0]["epsilon_joint"],
        "test_records": runs[0]["test_records"],
        "cpu_minutes": round(sum(r["seconds"] for r in runs) / 60, 1),
        "models": models,
        "claims": claims,
    }


def _ms(block: dict) -> str:
    return f"{block['mean']:.3f} ± {block['sd']:.3f}"


def verdict(claim: dict) -> str:
    """``holds`` when the 95% interval lies above 0 and the Holm-adjusted p is below 0.05,
    ``not established`` otherwise (``reversed`` when the interval lies below 0)."""
    if claim["ci"][0] > 0 and claim["p_holm"] < 0.05:
        return "holds"
    if claim["ci"][1] < 0 and claim["p_holm"] < 0.05:
        return "reversed"
    return "not established"


def _p(p: float, equals: str = "") -> str:
    """A p-value as printed: 4 decimals, ``< 0.0001`` below that."""
    if p < 1e-4:
        return "< 0.0001"
    return f"{equals} {p:.4f}".strip()


def _seed_list(seeds: list[str]) -> str:
    return ", ".join(seeds) if len(seeds) <= 5 else f"{', '.join(seeds[:3])}, …, {seeds[-1]}"


def _share(split: dict) -> str:
    return "-" if split["test_share"] is None else f"{100 * split['test_share']:.0f}%"


def _power_note(claim: dict, n: int) -> str:
    """Seeds for 80% power at level 0.05 and at 0.05 / #claims, and whether ``n`` reaches
    the latter."""
    need, strict = claim["seeds_for_power"], claim["seeds_for_power_bonferroni"]
    if need is None:
        return "no positive effect"
    at_strict = "> 1000" if strict is None else str(strict)
    reached = strict is not None and n >= strict
    return f"{need} / {at_strict} ({'reached' if reached else 'not reached'})"


def readme_block(summary: dict) -> str:
    """The recipe README's ``claims`` block: models, claims, and the test sample's share."""
    n, eps = summary["n"], summary["epsilon"]
    lines = [
        f"Written by `studies/claims.py --only` from `studies/claims.json`: {n} seeds "
        f"({_seed_list(summary['seeds'])}), every model on the same "
        f"{summary['test_records']} labelled test clips (one per speaker), no audit canaries in "
        f"any training; ε = {eps:.3f} (PLD) per released model, {summary['epsilon_joint']:.3f} "
        f"for teacher and DP-direct together; {summary['cpu_minutes']} min of training and "
        "evaluation in all (wall, one process with one thread on a shared 2-core machine). "
        "Mean ± sd over the seeds; collapsed: MajPred ≥ 0.9 or a class recall of 0.",
        "",
        '| Model | Balanced acc. | MajPred | Recall "other" | Collapsed |',
        "|---|---|---|---|---|",
    ]
    for key, label in MODELS.items():
        m = summary["models"][key]
        lines.append(
            f"| {label} | {_ms(m['balanced_accuracy'])} | {_ms(m['majpred'])} | "
            f"{_ms(m['recall_other'])} | {m['collapsed']}/{n} |"
        )
    lines += [
        "",
        "| Claim (balanced acc., A − B) | Mean [95% CI] | CI with the test sample | p | "
        "p, Holm (3 claims) | A > B in | "
        f"Seeds for 80% power, level 0.05 / 0.05/{len(CLAIMS)} | Verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in summary["claims"].items():
        wide = c["ci_with_test"]
        lines.append(
            f"| {name} | {c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] | "
            f"[{wide[0]:+.3f}, {wide[1]:+.3f}] | {_p(c['p'])} | "
            f"{_p(c['p_holm'])} | {c['wins']}/{n} | {_power_note(c, n)} | **{verdict(c)}** |"
        )
    mc = summary["collapse"]
    lines += [
        "",
        f"Collapse over the same seeds: DP-direct {mc['a']}/{n}, the student {mc['b']}/{n} "
        f"(exact McNemar p = {_p(mc['p'])}).",
    ]
    lines += [
        "",
        f"| Claim: sd of A − B over seeds | {summary['test_records']} test clips: total | "
        f"test sample (bootstrap, at most) | training (at least) | {SUBSET} of them: total | "
        "test sample | training |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in summary["claims"].items():
        v, s = c["variance"], c["variance_subset"]
        lines.append(
            f"| {name} | {v['sd_total']:.3f} | {v['sd_test']:.3f} ({_share(v)} of the variance) "
            f"| {v['sd_training']:.3f} | {s['sd_total']:.3f} | {s['sd_test']:.3f} ({_share(s)}) "
            f"| {s['sd_training']:.3f} |"
        )
    return "\n".join(lines)


def root_row(summary: dict) -> str:
    """The Private-Gender row of the repository README's results table."""
    m, c = summary["models"], summary["claims"]["student − DP-direct"]
    label = summary["claims"]["student − label-only"]
    return (
        f"| Private-Gender | Student balanced accuracy {_ms(m['student']['balanced_accuracy'])} vs "
        f"DP-direct {_ms(m['dp_direct']['balanced_accuracy'])} at ε = {summary['epsilon']:.3f} "
        f"({summary['n']} paired seeds, no canaries in training; {c['mean']:+.3f} "
        f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}], Holm p {_p(c['p_holm'], '=')}: {verdict(c)}); "
        f"vs the label-only control {label['mean']:+.3f} [{label['ci'][0]:+.3f}, "
        f"{label['ci'][1]:+.3f}]: {verdict(label)} | Tables lost from the paper's text; no paper "
        "column |"
    )


def write_root_row(readme: Path, row: str) -> None:
    """Replace the one line of ``readme`` that starts with ``| Private-Gender |`` by ``row``."""
    lines = readme.read_text(encoding="utf-8").split("\n")
    hits = [i for i, line in enumerate(lines) if line.startswith("| Private-Gender |")]
    if len(hits) != 1:
        raise ValueError(f"{readme}: {len(hits)} lines start with '| Private-Gender |', need 1")
    lines[hits[0]] = row
    readme.write_text("\n".join(lines), encoding="utf-8")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="*", type=int, default=[])
    parser.add_argument("--root", default="results/Private-Gender/claims")
    parser.add_argument("--store", default=str(STUDIES_DIR / "claims.json"))
    parser.add_argument("--extra", default="", help="overrides passed to both scripts")
    parser.add_argument("--only", action="store_true", help="run nothing, write the READMEs")
    parser.add_argument("--readme", default=str(RECIPE_DIR / "README.md"))
    parser.add_argument("--root_readme", default=str(ROOT_README))
    parser.add_argument("--until", help="stop starting seeds after this UTC time (HH:MM)")
    args = parser.parse_args(argv)
    from speechbrain_fl.recipe import update_readme_table
    from speechbrain_fl.utils.atomic import atomic_open

    store_path = Path(args.store)
    store = json.loads(store_path.read_text("utf-8")) if store_path.is_file() else {"seeds": {}}
    for seed in [] if args.only else args.seeds:
        if str(seed) in store["seeds"]:
            continue
        if args.until and time.strftime("%H:%M", time.gmtime()) >= args.until:
            print(f"claims.py: {args.until} UTC reached, seed {seed} and later not started")
            break
        store["seeds"][str(seed)] = run_seed(seed, Path(args.root), shlex.split(args.extra))
        with atomic_open(store_path) as handle:
            json.dump(store, handle, indent=1)
    summary = summarise(store)
    if args.only:
        update_readme_table(args.readme, "claims", readme_block(summary))
        write_root_row(Path(args.root_readme), root_row(summary))
    print(readme_block(summary))
    return summary


if __name__ == "__main__":
    main()
