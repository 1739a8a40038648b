"""The repeated study of the Private-Gender recipe: the paper's claims, paired over seeds.

For each seed s (``--seed s``: the models' initialisation, the labelled D_aux subset; the DP
noise and the Poisson sampling come from the OS) five teacher runs share the corpus and the
features:

* ``default``: the stabilised pipeline (DSAF, AW-DP, modality dropout) at epsilon = 1, with
  its DP-direct, and four students of its outputs: KD (alpha = 0.5, the 30 D_aux labels),
  the label-only control (alpha = 0, the same 30 labels, no teacher), the label-only control
  with class-balanced CE, and the all-labels upper bound (alpha = 0, every D_aux label);
* ``plain``: plain DP-SGD (no DSAF, no AW-DP, no dropout) at the same epsilon and steps;
* ``plain_nodp``: the same without DP (the control: is a lost minority caused by DP?);
* ``median_dsaf`` / ``median_nodsaf``: all components but the clip set to the median
  per-sample gradient norm at initialisation on D_aux (``clip_median_factor: 1``), with and
  without DSAF, so that clipping binds for about half the records in both.

:func:`summarise` gives mean and spread per model, how many seeds collapsed
(``gender_stats.collapsed``: MajPred >= 0.9 or a class recall of 0), and the paired differences
(``gender_stats.paired``) behind each claim with the seeds a paired t-interval needs to lie above
0 with 80% power at that effect size (``gender_stats.seeds_for_power``); :func:`tables` renders
them.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
from pathlib import Path

from gender_stats import collapsed, exact_mcnemar, paired, seeds_for_power, spread

from speechbrain_fl.recipe import run_recipe

__all__ = [
    "CLAIMS",
    "RUNS",
    "STUDENTS",
    "add_students",
    "audits",
    "compact",
    "run_seed",
    "summarise",
    "tables",
]

PLAIN = ["--dsaf", "False", "--aw_dp", "False", "--modality_dropout", "0.0"]
#: Teacher runs per seed: name -> overrides of teacher.yaml.
RUNS = {
    "default": [],
    "plain": PLAIN,
    "plain_nodp": [*PLAIN, "--dp", "False"],
    "median_dsaf": ["--clip_median_factor", "1.0"],
    "median_nodsaf": ["--clip_median_factor", "1.0", "--dsaf", "False"],
}
#: Students of the default teacher: name -> overrides of student.yaml.
STUDENTS = {
    "KD": [],
    "label-only": ["--alpha", "0.0"],
    "label-only, balanced CE": ["--alpha", "0.0", "--ce_class_weight", "balanced"],
    "all labels": ["--alpha", "0.0", "--aux_labels", "null"],
    "KD, α = 1": ["--alpha", "1.0"],
    "KD, all labels": ["--aux_labels", "null"],
}


def _block(report: dict | None) -> dict | None:
    if not report:
        return None
    return {
        "balanced_accuracy": report["balanced_accuracy"]["value"],
        "macro_f1": report["macro_f1"]["value"],
        "majpred": report["majpred"]["value"],
        "recall": {c: v["value"] for c, v in report["per_class_recall"].items()},
    }


def compact(teacher: dict, students: dict[str, dict]) -> dict:
    """The figures the study keeps of one teacher run and its students."""
    clip_rules = teacher["method"].get("clip_rules") or {}
    return {
        "epsilon": teacher["privacy"]["epsilon"],
        "epsilon_joint": (teacher.get("privacy_joint") or {}).get("epsilon"),
        "accountant": teacher["privacy"]["accountant"],
        "clip": {k: v["clip"] for k, v in clip_rules.items()} or teacher["privacy"]["clip"],
        "teacher": _block(teacher["teacher"]["test"]),
        "dp_direct": _block(teacher["dp_direct"]),
        "students": {name: _block(res["test"]) for name, res in students.items()},
    }


def run_seed(seed: int, root: Path, extra: list[str], train_teacher, distill_student) -> dict:
    """The five teacher runs of one seed (and the default teacher's four students)."""
    out = {}
    for name, targs in RUNS.items():
        folder = root / f"seed_{seed}" / name
        common = ["--output_folder", str(folder), "--seed", str(seed), *extra]
        teacher = run_recipe(train_teacher, ["hparams/teacher.yaml", *common, *targs])
        students = {}
        if name == "default":
            for sname, sargs in STUDENTS.items():
                students[sname] = run_recipe(
                    distill_student, ["hparams/student.yaml", *common, *sargs]
                )
        elif name == "plain":  # the student of the plain teacher (its front-end: no DSAF)
            students["KD"] = run_recipe(
                distill_student, ["hparams/student.yaml", *common, "--dsaf", "False"]
            )
        out[name] = compact(teacher, students)
    return out


def add_students(seed: int, root: Path, extra: list[str], stored: dict, distill_student) -> bool:
    """Run the :data:`STUDENTS` of a stored seed's default teacher that ``stored`` lacks (its
    outputs are still in ``root``); returns whether any ran."""
    have = stored["default"]["students"]
    folder = root / f"seed_{seed}" / "default"
    common = ["--output_folder", str(folder), "--seed", str(seed), *extra]
    ran = False
    for name, sargs in STUDENTS.items():
        if name not in have:
            res = run_recipe(distill_student, ["hparams/student.yaml", *common, *sargs])
            have[name] = _block(res["test"])
            ran = True
    return ran


def audits(root: Path, seeds) -> dict:
    """The DP teachers' audits and the default runs' DSAF diagnostic, read from the teacher
    ``results.json`` files of ``root`` (``<root>/seed_<s>/<run>/teacher``).

    Returns ``{"teachers", "verdicts": {verdict: count}, "lower_bound": [min, max],
    "one_shot": [min, max], "one_shot_above": count, "accountant_epsilon", "cv_dsaf": [min,
    max], "cv_raw": [min, max], "clipped_dsaf": [min, max], "clipped_raw": [min, max]}``; an
    empty dict when no file is there.
    """
    found, diag = [], []
    for seed in seeds:
        for run in RUNS:
            path = Path(root) / f"seed_{seed}" / run / "teacher" / "results.json"
            if not path.is_file():
                continue
            res = json.loads(path.read_text(encoding="utf-8"))
            if res["privacy"].get("audit"):
                found.append(res["privacy"]["audit"])
            if run == "default" and res.get("dsaf_diagnostic"):
                diag.append(res["dsaf_diagnostic"])
    if not found:
        return {}

    def span(values):
        return [round(min(values), 3), round(max(values), 3)]

    verdicts: dict[str, int] = {}
    for a in found:
        verdicts[a["verdict"]] = verdicts.get(a["verdict"], 0) + 1
    out = {
        "teachers": len(found),
        "verdicts": verdicts,
        "lower_bound": span([a["epsilon_lower_bound"] for a in found]),
        "one_shot": span([a["epsilon_one_shot"] for a in found]),
        "one_shot_above": sum(a["epsilon_one_shot"] > a["accountant_epsilon"] for a in found),
        "accountant_epsilon": span([a["accountant_epsilon"] for a in found]),
    }
    if diag:
        for key, side in (("dsaf", "with DSAF"), ("raw", "without DSAF")):
            out[f"cv_{key}"] = span([d[side]["cv"] for d in diag])
            out[f"clipped_{key}"] = span([d[side]["clipped_share"] for d in diag])
    return out


def audit_note(found: dict) -> str:
    """One paragraph of :func:`audits`' figures ("" without any)."""
    if not found:
        return ""
    verdicts = ", ".join(f"{n} {v}" for v, n in sorted(found["verdicts"].items()))
    lo, os_ = found["lower_bound"], found["one_shot"]
    text = (
        f"Audit of the {found['teachers']} DP teachers (1000 canaries each): {verdicts}; "
        f"lower bound on ε at 95% {lo[0]:.3f}-{lo[1]:.3f}; one-shot estimate "
        f"{os_[0]:.2f}-{os_[1]:.2f}, above the accountant's ε in {found['one_shot_above']}."
    )
    if "cv_dsaf" in found:
        text += (
            " DSAF diagnostic of the default teachers (per-sample gradient norms at "
            f"initialisation, 256 D_aux records): coefficient of variation "
            f"{found['cv_dsaf'][0]:.3f}-{found['cv_dsaf'][1]:.3f} with DSAF, "
            f"{found['cv_raw'][0]:.3f}-{found['cv_raw'][1]:.3f} without; share clipped at "
            f"C = 1 {found['clipped_dsaf'][0]:.3f}-{found['clipped_dsaf'][1]:.3f} with, "
            f"{found['clipped_raw'][0]:.3f}-{found['clipped_raw'][1]:.3f} without."
        )
    return text


def _find(seed: dict, run: str, path: str):
    """``seed[run]`` at the dotted ``path`` (student names contain no dot), None if absent."""
    value = seed.get(run)
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


#: Claims as paired differences: (title, (run, path) of A, (run, path) of B).
CLAIMS = [
    (
        "student (KD) - DP-direct, balanced accuracy",
        ("default", "students.KD.balanced_accuracy"),
        ("default", "dp_direct.balanced_accuracy"),
    ),
    (
        "student (KD) - label-only control (30 labels), balanced accuracy",
        ("default", "students.KD.balanced_accuracy"),
        ("default", "students.label-only.balanced_accuracy"),
    ),
    (
        "student (KD) - label-only, balanced CE, balanced accuracy",
        ("default", "students.KD.balanced_accuracy"),
        ("default", "students.label-only, balanced CE.balanced_accuracy"),
    ),
    (
        "student (KD, α = 1) - label-only control (30 labels), balanced accuracy",
        ("default", "students.KD, α = 1.balanced_accuracy"),
        ("default", "students.label-only.balanced_accuracy"),
    ),
    (
        "student (KD, α = 1) - DP-direct, balanced accuracy",
        ("default", "students.KD, α = 1.balanced_accuracy"),
        ("default", "dp_direct.balanced_accuracy"),
    ),
    (
        "student (KD, α = 1) - student (KD, α = 0.5), balanced accuracy",
        ("default", "students.KD, α = 1.balanced_accuracy"),
        ("default", "students.KD.balanced_accuracy"),
    ),
    (
        "student (KD, all labels) - all-labels upper bound (α = 0), balanced accuracy",
        ("default", "students.KD, all labels.balanced_accuracy"),
        ("default", "students.all labels.balanced_accuracy"),
    ),
    (
        'stabilised teacher - plain DP-SGD teacher, recall "other"',
        ("default", "teacher.recall.other"),
        ("plain", "teacher.recall.other"),
    ),
    (
        'stabilised DP-direct - plain DP-SGD DP-direct, recall "other"',
        ("default", "dp_direct.recall.other"),
        ("plain", "dp_direct.recall.other"),
    ),
    (
        'plain without DP - plain DP-SGD (teacher), recall "other"',
        ("plain_nodp", "teacher.recall.other"),
        ("plain", "teacher.recall.other"),
    ),
    (
        "DSAF - no DSAF at C = median norm, DP-direct balanced accuracy",
        ("median_dsaf", "dp_direct.balanced_accuracy"),
        ("median_nodsaf", "dp_direct.balanced_accuracy"),
    ),
    (
        "DSAF - no DSAF at C = median norm, teacher balanced accuracy",
        ("median_dsaf", "teacher.balanced_accuracy"),
        ("median_nodsaf", "teacher.balanced_accuracy"),
    ),
]

#: Collapse compared over the seeds (exact McNemar): (title, (run, path) of A, of B).
COLLAPSE = [
    ("DP-direct (stabilised) vs student (KD)",
     ("default", "dp_direct"), ("default", "students.KD")),
    ("DP-direct, plain vs DP-direct (stabilised)",
     ("plain", "dp_direct"), ("default", "dp_direct")),
]  # fmt: skip

#: Rows of the per-model table: (label, run, path of the block).
MODELS = [
    ("DP-direct (stabilised)", "default", "dp_direct"),
    ("teacher (stabilised, multimodal, not released)", "default", "teacher"),
    ("student (KD, α = 0.5, 30 labels)", "default", "students.KD"),
    ("label-only control (α = 0, 30 labels)", "default", "students.label-only"),
    ("label-only, balanced CE (α = 0, 30 labels)", "default", "students.label-only, balanced CE"),
    ("all-labels upper bound (α = 0, ~575 labels)", "default", "students.all labels"),
    ("student (KD, α = 1: teacher only)", "default", "students.KD, α = 1"),
    ("student (KD, α = 0.5, all ~575 labels)", "default", "students.KD, all labels"),
    ("DP-direct, plain DP-SGD", "plain", "dp_direct"),
    ("teacher, plain DP-SGD", "plain", "teacher"),
    ("student of the plain teacher", "plain", "students.KD"),
    ("DP-direct, plain, no DP (same steps)", "plain_nodp", "dp_direct"),
    ("teacher, plain, no DP (same steps)", "plain_nodp", "teacher"),
    ("DP-direct, C = median, DSAF", "median_dsaf", "dp_direct"),
    ("DP-direct, C = median, no DSAF", "median_nodsaf", "dp_direct"),
    ("teacher, C = median, DSAF", "median_dsaf", "teacher"),
    ("teacher, C = median, no DSAF", "median_nodsaf", "teacher"),
]


#: Models that read nothing of D_priv (no teacher): their own epsilon is 0.
NO_TEACHER = (
    "label-only control (α = 0, 30 labels)",
    "label-only, balanced CE (α = 0, 30 labels)",
    "all-labels upper bound (α = 0, ~575 labels)",
)


def summarise(seeds: dict[str, dict]) -> dict:
    """Mean and spread per model, paired differences per claim, over the seeds present."""
    keys = sorted(seeds, key=int)
    models = {}
    for label, run, path in MODELS:
        blocks = [_find(seeds[k], run, path) for k in keys]
        blocks = [b for b in blocks if b is not None]
        if not blocks:
            continue
        models[label] = {
            "balanced_accuracy": spread([b["balanced_accuracy"] for b in blocks]),
            "majpred": spread([b["majpred"] for b in blocks]),
            "recall_other": spread([b["recall"].get("other", float("nan")) for b in blocks]),
            "collapsed": sum(collapsed(b["majpred"], b["recall"].values()) for b in blocks),
        }
    claims = {}
    for title, (run_a, path_a), (run_b, path_b) in CLAIMS:
        usable = [
            k
            for k in keys
            if _find(seeds[k], run_a, path_a) is not None
            and _find(seeds[k], run_b, path_b) is not None
        ]
        if len(usable) >= 2:
            claims[title] = paired(
                [_find(seeds[k], run_a, path_a) for k in usable],
                [_find(seeds[k], run_b, path_b) for k in usable],
            )
            claims[title]["seeds_for_power"] = seeds_for_power(claims[title]["differences"])
    collapse = {}
    for title, (run_a, path_a), (run_b, path_b) in COLLAPSE:
        pairs = [(_find(seeds[k], run_a, path_a), _find(seeds[k], run_b, path_b)) for k in keys]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if pairs:
            flags = [[collapsed(m["majpred"], m["recall"].values()) for m in p] for p in pairs]
            collapse[title] = exact_mcnemar([f[0] for f in flags], [f[1] for f in flags])
    first = seeds[keys[0]]
    privacy = {
        run: {
            "epsilon": first[run]["epsilon"],
            "epsilon_joint": first[run]["epsilon_joint"],
            "accountant": first[run]["accountant"],
            "clip": first[run]["clip"],
        }
        for run in first
    }
    clips = {
        run: [seeds[k][run]["clip"] for k in keys if run in seeds[k]]
        for run in ("median_dsaf", "median_nodsaf")
    }
    return {"seeds": keys, "models": models, "claims": claims, "collapse": collapse,
            "privacy": privacy, "clips": clips}  # fmt: skip


def _ms(s: dict) -> str:
    return f"{s['mean']:.3f} ± {s['sd']:.3f} [{s['min']:.2f}, {s['max']:.2f}]"


def _eps(value) -> str:
    return "∞ (no DP)" if value is None else f"{value:.3f}"


def _power(n) -> str:
    return "– (mean ≤ 0)" if n is None else str(n)


def tables(summary: dict) -> dict[str, str]:
    """Markdown tables: models (mean ± sd [min, max] over seeds) and claims (paired)."""
    priv = summary["privacy"]
    run_of = {label: run for label, run, _ in MODELS}
    acct = (priv.get("default") or next(iter(priv.values())))["accountant"] or "RDP"
    lines = [
        f"| Model | ε own ({acct.upper()}) | ε joint, all releases of the run ({acct.upper()}) "
        '| Balanced acc. | MajPred | Recall "other" | Collapsed |',
        "|---|---|---|---|---|---|---|",
    ]
    for label, s in summary["models"].items():
        p = priv[run_of[label]]
        own = "0 (reads no D_priv)" if label in NO_TEACHER else _eps(p["epsilon"])
        lines.append(
            f"| {label} | {own} | {_eps(p['epsilon_joint'])} | {_ms(s['balanced_accuracy'])} "
            f"| {_ms(s['majpred'])} | {_ms(s['recall_other'])} "
            f"| {s['collapsed']}/{s['balanced_accuracy']['n']} |"
        )
    claims = [
        "| Paired difference (A − B) | Seeds | Mean | 95% CI (t) | p (t-test) | A > B in "
        "| Seeds for 80% power | Per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for title, c in summary["claims"].items():
        verdict = "**above 0**" if c["ci"][0] > 0 else ("below 0" if c["ci"][1] < 0 else "spans 0")
        claims.append(
            f"| {title} | {c['n']} | {c['mean']:+.3f} | [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] "
            f"({verdict}) | {c['p']:.3f} | {c['wins']}/{c['n']} "
            f"| {_power(c.get('seeds_for_power'))} | "
            + ", ".join(f"{d:+.2f}" for d in c["differences"])
            + " |"
        )
    if summary.get("collapse"):
        claims += [
            "",
            "| Collapse (MajPred ≥ 0.9 or a class recall of 0), A vs B | Seeds | A collapsed "
            "| B collapsed | only A | only B | exact McNemar p |",
            "|---|---|---|---|---|---|---|",
        ]
        for title, c in summary["collapse"].items():
            claims.append(
                f"| {title} | {c['n']} | {c['a']} | {c['b']} | {c['only_a']} | {c['only_b']} "
                f"| {c['p']:.3f} |"
            )
    return {"models": "\n".join(lines), "claims": "\n".join(claims)}
