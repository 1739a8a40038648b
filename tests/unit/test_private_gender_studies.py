"""The studies script's tables and README rewriting (no training: synthetic results)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT / "recipes" / "Private-Gender" / "studies"),
    str(ROOT / "recipes" / "Private-Gender"),
]

import studies  # noqa: E402


def _res(bacc, majpred, eps=0.99, aux=380):
    block = {"balanced_accuracy": {"value": bacc, "ci": [bacc - 0.1, bacc + 0.1]},
             "macro_f1": {"value": bacc, "ci": [0.0, 1.0]},
             "majpred": {"value": majpred, "ci": [majpred, majpred]}}  # fmt: skip
    return {"privacy": {"epsilon": eps}, "dp_direct": block, "test": block,
            "kd": {"aux_records": aux}}  # fmt: skip


def test_tables_and_readme_block(tmp_path):
    results = {
        "epsilon": {"1.0": _res(0.4, 1.0), "None": _res(0.9, 0.7, eps=None)},
        "binary": _res(0.9, 0.7),  # one run stored unwrapped
        "aux": {"25": _res(0.6, 0.8, aux=25)},
    }
    built = studies.tables(results)
    assert len(built) == 3
    eps_table = next(t for k, t in built.items() if k.startswith("Epsilon"))
    # Results written before the joint figure existed show "-" in the joint column.
    assert "| target ε = ∞ (no DP) | ∞ (no DP) | - | 0.900 [0.80, 1.00]" in eps_table
    joint = {**_res(0.4, 1.0), "privacy_joint": {"epsilon": 1.43}}
    assert studies._row("r", joint)[:3] == ["r", "0.99", "1.43"]
    assert "\\|D_aux\\| = 25" in next(t for k, t in built.items() if k.startswith("|D_aux|"))
    assert eps_table.count("| no audit |") == 2 and studies._accountant(results) == "RDP"
    audited = {**_res(0.4, 1.0), "privacy": {"epsilon": 0.99, "accountant": "pld", "audit": {
        "verdict": "consistent", "epsilon_lower_bound": 0.26}}}  # fmt: skip
    assert studies._audit_cell([audited, audited]) == "2 consistent; lower bound ≤ 0.26"
    assert studies._accountant({"binary": audited}) == "PLD"
    readme = tmp_path / "README.md"
    readme.write_text("head\n<!-- studies:start -->\nold\n<!-- studies:end -->\ntail\n")
    studies.write_readme(built, readme, "note\n")
    text = readme.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text
    assert text.count("####") == 3
    with pytest.raises(ValueError, match=r"other\.md.*<!-- studies:start -->"):
        (tmp_path / "other.md").write_text("nothing")
        studies.write_readme(built, tmp_path / "other.md", "note")


def test_paired_interval_matches_scipy_ttest_rel():
    from gender_stats import paired, spread
    from scipy.stats import ttest_rel

    a, b = [0.81, 0.77, 0.90, 0.72, 0.85], [0.70, 0.74, 0.80, 0.73, 0.71]
    got = paired(a, b)
    ci = ttest_rel(a, b).confidence_interval(0.95)
    assert got["ci"] == pytest.approx([ci.low, ci.high], abs=1e-4)
    assert got["p"] == pytest.approx(ttest_rel(a, b).pvalue, abs=1e-4)
    assert got["wins"] == 4 and got["n"] == 5
    assert spread([1.0, 3.0]) == {"n": 2, "mean": 2.0, "sd": 1.4142, "min": 1.0, "max": 3.0}
    with pytest.raises(ValueError, match="equal-length"):
        paired([1.0], [2.0])


def _block(bacc, other):
    return {"balanced_accuracy": bacc, "macro_f1": bacc, "majpred": 0.7,
            "recall": {"male": 0.9, "female": 0.9, "other": other}}  # fmt: skip


def _seed(kd, direct, label_only, plain_other):
    run = {"epsilon": 0.99, "epsilon_joint": 1.43, "accountant": "rdp", "clip": 1.0,
           "teacher": _block(0.85, 0.8), "dp_direct": _block(direct, 0.5), "students": {}}  # fmt: skip
    students = {"KD": _block(kd, 0.6), "label-only": _block(label_only, 0.3),
                "label-only, balanced CE": _block(label_only, 0.4),
                "all labels": _block(0.95, 0.9)}  # fmt: skip
    plain = {**run, "teacher": _block(0.6, plain_other), "dp_direct": _block(0.6, plain_other),
             "students": {"KD": _block(0.6, 0.0)}}  # fmt: skip
    return {
        "default": {**run, "students": students},
        "plain": plain,
        "plain_nodp": {**plain, "epsilon": None, "epsilon_joint": None},
        "median_dsaf": {**run, "clip": {"teacher": 1.2, "DP-direct": 1.1}},
        "median_nodsaf": {**run, "clip": {"teacher": 15.0, "DP-direct": 14.0}},
    }


def test_repeats_summary_claims_and_tables():
    import gender_repeats

    seeds = {str(k): _seed(0.8 + 0.01 * k, 0.7, 0.65 + 0.02 * k, 0.0) for k in range(1, 6)}
    summary = gender_repeats.summarise(seeds)
    claim = summary["claims"]["student (KD) - DP-direct, balanced accuracy"]
    assert claim["n"] == 5 and claim["mean"] == pytest.approx(0.13) and claim["ci"][0] > 0
    other = summary["claims"]['stabilised teacher - plain DP-SGD teacher, recall "other"']
    assert other["differences"] == [0.8] * 5
    assert summary["models"]["all-labels upper bound (α = 0, ~575 labels)"][
        "balanced_accuracy"]["mean"] == 0.95  # fmt: skip
    assert summary["clips"]["median_nodsaf"][0] == {"teacher": 15.0, "DP-direct": 14.0}
    built = gender_repeats.tables(summary)
    assert "| student (KD) - DP-direct, balanced accuracy | 5 | +0.130 |" in built["claims"]
    assert "(**above 0**)" in built["claims"]
    assert "| teacher, plain, no DP (same steps) | ∞ (no DP) | ∞ (no DP) |" in built["models"]
    assert "| label-only control (α = 0, 30 labels) | 0 (reads no D_priv) |" in built["models"]
    # plain models lose "other" (recall 0) in every seed: collapsed 5 of 5; the default's don't
    assert summary["models"]["DP-direct, plain DP-SGD"]["collapsed"] == 5
    assert summary["models"]["DP-direct (stabilised)"]["collapsed"] == 0
    assert "| 0.700 ± 0.000 [0.70, 0.70] | 0.500 ± 0.000 [0.50, 0.50] | 0/5 |" in built["models"]
    plain_vs = summary["collapse"]["DP-direct, plain vs DP-direct (stabilised)"]
    assert plain_vs == {"n": 5, "a": 5, "b": 0, "only_a": 5, "only_b": 0, "p": 0.0625}
    assert (
        "| DP-direct, plain vs DP-direct (stabilised) | 5 | 5 | 0 | 5 | 0 | 0.062 |"
        in (built["claims"])
    )
    # identical differences in every seed: two seeds suffice; a mean <= 0 has no power
    assert other["seeds_for_power"] == 2 and "| 0.000 | 5/5 | 2 |" in built["claims"]


def test_seeds_for_power_matches_a_simulated_paired_t_test():
    """The estimate n reaches the target power in simulation, n - 1 does not (noncentral t)."""
    import numpy as np
    from gender_stats import collapsed, seeds_for_power
    from scipy.stats import t

    diffs = [0.27, 0.06, 0.22, 0.13, -0.02]  # mean 0.132, sd 0.116: effect size 1.14
    n = seeds_for_power(diffs)
    mean, sd = np.mean(diffs), np.std(diffs, ddof=1)
    rng = np.random.default_rng(0)

    def simulated_power(k, reps=40_000):
        d = rng.normal(mean, sd, size=(reps, k))
        low = d.mean(1) - t.ppf(0.975, k - 1) * d.std(1, ddof=1) / np.sqrt(k)
        return float((low > 0).mean())

    assert n == 9
    assert simulated_power(n) >= 0.8 - 0.01 and simulated_power(n - 1) < 0.8
    assert seeds_for_power(diffs, power=0.9) > n and seeds_for_power(diffs, alpha=0.1) < n
    assert seeds_for_power([-0.1, 0.05, -0.02]) is None
    with pytest.raises(ValueError, match=">= 2"):
        seeds_for_power([0.1])
    assert collapsed(0.9, [0.5, 0.5]) and collapsed(0.5, [0.0, 1.0])
    assert not collapsed(0.89, [0.01, 0.5])


def _recall(res, other):
    for block in ("dp_direct", "test"):
        res[block]["per_class_recall"] = {"other": {"value": other, "ci": [0.0, 1.0]}}
    return res


def test_seeded_rows_mean_sd_and_paired_differences():
    base = {"seeds": {"1": _recall(_res(0.60, 0.8), 0.0), "2": _recall(_res(0.70, 0.8), 0.2),
                      "3": _recall(_res(0.50, 0.8), 0.1)}}  # fmt: skip
    full = {"seeds": {"1": _recall(_res(0.70, 0.7), 0.5), "2": _recall(_res(0.90, 0.7), 0.4),
                      "3": _recall(_res(0.80, 0.7), 0.6)}}  # fmt: skip
    results = {"ablation": {"base": base, "all": full}, "binary": {"binary": {"seeds": {
        "1": _res(0.9, 0.6)}}}}  # fmt: skip
    built = studies.tables(results)
    titles = list(built)
    assert titles[0].endswith("; seeds 1, 2, 3") and titles[2].endswith("; seed 1")
    # Mean ± sd (n - 1) over the seeds in every value column; no bootstrap interval.
    row = studies._row("all", full)
    assert row[3] == "0.800 ± 0.100" and row[5] == "0.500 ± 0.100" and row[4] == "0.700 ± 0.000"
    assert studies._row("one", results["binary"]["binary"])[3] == "0.900 [0.80, 1.00]"
    # Paired differences to the reference row, seed by seed: (0.1, 0.2, 0.3) on bal. acc.
    paired_table = built[titles[1]]
    assert titles[1] == "Ablation at ε = 1: paired differences to base"
    line = next(x for x in paired_table.splitlines() if "DP-direct bal. acc." in x)
    want = studies.paired([0.7, 0.9, 0.8], [0.6, 0.7, 0.5])
    assert f"| all − base, DP-direct bal. acc. | 3 | {want['mean']:+.3f} |" in line
    assert "3/3 | +0.10, +0.20, +0.30 |" in line
    # +0.50, +0.20, +0.50: 95% t-interval [-0.030, +0.830] spans 0 with 3 seeds.
    assert "[-0.030, +0.830] (spans 0)" in paired_table
    # Rows of one unseeded run are not paired; a missing reference gives no paired table.
    assert studies.paired_rows({"base": _res(0.5, 0.8), "all": _res(0.6, 0.7)}, "base", [
        ("x", "test", "balanced_accuracy")]) == []  # fmt: skip
    assert studies.paired_rows({"all": full}, "base", []) == []


def test_paired_rows_name_a_difference_of_zero_in_every_seed():
    same = {"seeds": {k: _recall(_res(0.6, 0.8), 0.0) for k in ("1", "2")}}
    rows = studies.paired_rows({"base": same, "x": same}, "base", [("y", "test", "recall_other")])
    assert rows[0][3] == "[+0.000, +0.000] (no difference in any seed)"


def test_label_only_student_row_states_no_privacy_cost():
    res = _res(0.7, 0.7)
    res["kd"]["alpha"] = 0.0
    assert studies._row("a0", res)[1] == "0 (reads no D_priv)"
    res["kd"]["alpha"] = 0.5
    assert studies._row("a5", res)[1] == "0.99"


def test_audit_cost_pairs_the_arms_seed_by_seed():
    """audit_cost.py: per metric, each arm's spread and the paired difference (with - without)."""
    import audit_cost

    labels = [label for label, _, _ in audit_cost.METRICS]
    runs = {
        str(seed): {
            "with canaries": {label: 0.5 + 0.1 * seed + 0.01 for label in labels},
            "without": {label: 0.5 + 0.1 * seed for label in labels},
        }
        for seed in (1, 2, 3)
    }
    summary = audit_cost.summarise(runs)
    first = summary[labels[0]]
    assert first["paired"]["mean"] == pytest.approx(0.01) and first["paired"]["wins"] == 3
    assert first["paired"]["sd"] == pytest.approx(0.0, abs=1e-9)  # the seed effect cancels
    assert first["with canaries"]["sd"] == pytest.approx(0.1)
    table = audit_cost.table(summary, [1, 2, 3])
    assert table.splitlines()[0].startswith("| metric (seeds 1, 2, 3)")
    assert f"| {labels[0]} | 0.710 ± 0.100 | 0.700 ± 0.100 | +0.010 [+0.010, +0.010] |" in table
    assert audit_cost._get({"a": {"b": {"value": 0.25}}}, "a.b.value") == 0.25


def test_speaker_unit_tables_pair_the_settings_seed_by_seed(tmp_path):
    import speaker_unit

    def run(seed, teacher, direct):
        return {"seed": seed, "teacher": teacher, "dp_direct": direct, "epsilon": 0.99,
                "sigma": 5.06, "q": 0.167, "steps": 60, "unit": "speaker"}  # fmt: skip

    results = {
        "speaker, mean": [run(1, 0.50, 0.45), run(2, 0.40, 0.50), run(3, 0.45, 0.40)],
        "speaker, sum": [run(2, 0.60, 0.55), run(1, 0.70, 0.55), run(3, 0.65, 0.50)],
        "one clip": [run(1, 0.58, 0.50), run(2, 0.57, 0.52)],
    }
    rows = speaker_unit.paired_table(results)
    # seed by seed, not list position: sum - mean on the teacher is +0.20 in each seed
    assert "| speaker, sum − speaker, mean, teacher bal. acc. | 3 | +0.200 |" in rows
    assert "+0.20, +0.20, +0.20" in rows
    # one clip has seeds 1 and 2 only: those pairs use two seeds
    assert "| speaker, mean − one clip, teacher bal. acc. | 2 | -0.125 |" in rows
    assert speaker_unit.slug("clip (reference)") == "clip_reference"
    assert "| speaker, sum | 3 | 0.99 | speaker |" in speaker_unit.table(results, 4)


def test_repeats_audits_read_every_dp_teacher_of_the_seeds(tmp_path):
    import json

    import gender_repeats

    def write(seed, run, lower, one_shot, verdict="consistent", diag=None):
        folder = tmp_path / f"seed_{seed}" / run / "teacher"
        folder.mkdir(parents=True)
        audit = {"verdict": verdict, "epsilon_lower_bound": lower, "epsilon_one_shot": one_shot,
                 "accountant_epsilon": 0.995}  # fmt: skip
        res = {"privacy": {"audit": audit if lower is not None else None}}
        if diag:
            res["dsaf_diagnostic"] = diag
        (folder / "results.json").write_text(json.dumps(res))

    side = {"cv": 0.1, "clipped_share": 1.0}
    write(1, "default", 0.2, 1.1, diag={"with DSAF": side, "without DSAF": {**side, "cv": 0.5}})
    write(1, "plain", 0.0, 0.5)
    write(1, "plain_nodp", None, None)  # no DP: no audit
    write(2, "default", 0.1, 0.9, verdict="suspect")
    write(3, "default", 9.0, 9.0)  # seed 3 is not asked for
    found = gender_repeats.audits(tmp_path, ["1", "2"])
    assert found["teachers"] == 3 and found["verdicts"] == {"consistent": 2, "suspect": 1}
    assert found["lower_bound"] == [0.0, 0.2] and found["one_shot_above"] == 1
    assert found["cv_dsaf"] == [0.1, 0.1] and found["cv_raw"] == [0.5, 0.5]
    note = gender_repeats.audit_note(found)
    assert "3 DP teachers" in note and "2 consistent, 1 suspect" in note
    assert gender_repeats.audits(tmp_path / "none", ["1"]) == {}
