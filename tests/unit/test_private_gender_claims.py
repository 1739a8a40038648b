"""The claims study (``studies/claims.py``): its statistics, and the READMEs it writes agree
with its committed results file (no training: the stored results and synthetic runs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "recipes" / "Private-Gender" / "studies"
sys.path[:0] = [str(STUDIES), str(ROOT / "recipes" / "Private-Gender")]

import claims  # noqa: E402
from gender_stats import (  # noqa: E402
    balanced_accuracy_difference_sd,
    holm,
    paired,
    variance_split,
)

from speechbrain_fl.recipe.report import markers  # noqa: E402


def _between(text: str, name: str) -> str:
    start, end = markers(name)
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def test_readmes_agree_with_the_results_file():
    """The recipe README's claims block and the repository README's Private-Gender row are the
    ones ``claims.py --only`` writes from ``studies/claims.json``."""
    summary = claims.summarise(json.loads((STUDIES / "claims.json").read_text("utf-8")))
    readme = (ROOT / "recipes" / "Private-Gender" / "README.md").read_text("utf-8")
    assert _between(readme, "claims") == claims.readme_block(summary)
    rows = [
        line
        for line in (ROOT / "README.md").read_text("utf-8").splitlines()
        if line.startswith("| Private-Gender |")
    ]
    assert rows == [claims.root_row(summary)]
    assert not any(r["audit_run"] for r in json.loads(
        (STUDIES / "claims.json").read_text("utf-8"))["seeds"].values())  # fmt: skip


def test_holm_matches_its_definition():
    p = [0.01, 0.04, 0.03, 0.5]
    # sorted 0.01, 0.03, 0.04, 0.5 -> 4*0.01, 3*0.03, max(0.09, 2*0.04), max(0.09, 1*0.5)
    assert holm(p) == [0.04, 0.09, 0.09, 0.5]
    assert holm([0.9, 0.8]) == [1.0, 1.0]


def _balanced_accuracy(y, p):
    return np.mean([np.mean(p[y == c] == c) for c in np.unique(y)])


def test_bootstrap_sd_of_the_difference_matches_a_direct_resampling():
    rng = np.random.default_rng(3)
    y = rng.choice(3, size=600, p=[0.7, 0.25, 0.05])
    a = np.where(rng.random(600) < 0.8, y, rng.integers(0, 3, 600))
    b = np.where(rng.random(600) < 0.7, y, rng.integers(0, 3, 600))
    got = balanced_accuracy_difference_sd(y, a, b, num_classes=3, resamples=2000, seed=1)
    direct = []
    for _ in range(2000):
        i = rng.integers(0, 600, 600)
        direct.append(_balanced_accuracy(y[i], a[i]) - _balanced_accuracy(y[i], b[i]))
    assert got == pytest.approx(np.std(direct, ddof=1), rel=0.1)
    small = balanced_accuracy_difference_sd(y, a, b, num_classes=3, subset=150, seed=1)
    assert small > got  # a quarter of the records: about twice the sd
    with pytest.raises(ValueError, match="differ in length"):
        balanced_accuracy_difference_sd(y, a[:5], b, num_classes=3)


def test_variance_split_adds_up():
    d, s = [0.1, 0.3, 0.2, 0.4, 0.0], [0.05, 0.06, 0.04, 0.05, 0.05]
    v = variance_split(d, s)
    total = paired(d, [0.0] * 5)["sd"]
    assert v["sd_total"] == pytest.approx(total, abs=1e-4)
    assert v["sd_test"] ** 2 + v["sd_training"] ** 2 == pytest.approx(total**2, abs=1e-3)
    assert v["test_share"] == pytest.approx(v["sd_test"] ** 2 / total**2, abs=1e-3)


def test_interval_with_the_test_sample_widens_by_the_mean_bootstrap_sd():
    d = paired([0.1, 0.3, 0.2, 0.4], [0.0] * 4)
    half_t = d["ci"][1] - d["mean"]
    low, high = claims.with_test_sample(d, [0.02, 0.04, 0.03, 0.03])
    assert high - d["mean"] == pytest.approx(math.hypot(half_t, 1.96 * 0.03), abs=1e-4)
    assert low < d["ci"][0] and claims.with_test_sample(d, [0.0] * 4) == d["ci"]


def _report(bacc, predictions, recall_other=0.5):
    return {"balanced_accuracy": {"value": bacc}, "majpred": {"value": 0.7},
            "per_class_recall": {"male": {"value": 0.9}, "female": {"value": 0.8},
                                 "other": {"value": recall_other}},
            "predictions": predictions}  # fmt: skip


def _seed_record(rng, shift):
    y = rng.choice(3, size=500, p=[0.7, 0.25, 0.05]).tolist()
    noisy = [int(v) if rng.random() < 0.8 else int(rng.integers(3)) for v in y]
    teacher = {
        "data": {"test_labels": y, "classes": ["male", "female", "other"]},
        "privacy": {"epsilon": 0.99},
        "privacy_joint": {"epsilon": 1.44},
        "method": {"audit_run": False},
        "dp_direct": _report(0.7, noisy),
        "teacher": {"test": _report(0.85, y)},
    }
    students = {name: {"test": _report(0.7 + shift * (name == "student"), noisy)}
                for name in claims.STUDENTS}  # fmt: skip
    return claims.record(teacher, students, seconds=30.0)


def test_record_and_summary_pair_the_models_seed_by_seed(tmp_path):
    rng = np.random.default_rng(0)
    store = {"seeds": {str(s): _seed_record(rng, 0.05 + 0.01 * s) for s in range(1, 6)}}
    first = store["seeds"]["1"]
    # Identical predictions: no test-sample spread in the difference
    assert first["claims"]["student − DP-direct"]["test_sd"] == 0.0
    summary = claims.summarise(store)
    c = summary["claims"]["student − DP-direct"]
    assert c["differences"] == [0.06, 0.07, 0.08, 0.09, 0.1] and c["ci"][0] > 0
    ps = [summary["claims"][name]["p"] for name, _, _ in claims.CLAIMS]
    assert [summary["claims"][name]["p_holm"] for name, _, _ in claims.CLAIMS] == holm(ps)
    assert summary["models"]["student"]["collapsed"] == 0 and summary["n"] == 5
    assert claims.verdict(c) == "holds"
    assert summary["collapse"] == {"n": 5, "a": 0, "b": 0, "only_a": 0, "only_b": 0, "p": 1.0}
    assert claims._p(0.0) == "< 0.0001" and claims._p(0.01234, "=") == "= 0.0123"
    block = claims.readme_block(summary)
    assert "| student − DP-direct | +0.080 [" in block and "**holds**" in block
    row = claims.root_row(summary)
    assert row.startswith("| Private-Gender |") and "5 paired seeds" in row
    readme = tmp_path / "README.md"
    readme.write_text("| a |\n|---|\n| Private-Gender | old |\n| b |\n")
    claims.write_root_row(readme, row)
    assert readme.read_text().splitlines()[2] == row
    readme.write_text("no row\n")
    with pytest.raises(ValueError, match="0 lines start with"):
        claims.write_root_row(readme, row)
    assert math.isfinite(c["sd"])
