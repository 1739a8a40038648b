"""The Private-Gender recipe end to end in ``--debug`` mode on a tiny embedded corpus.

The default teacher and student runs are the ``Private-Gender/teacher`` and
``Private-Gender/student`` rows of ``tests/recipes/recipes.csv``, run once per session by the
``recipe_run`` fixture (``conftest.py``) and shared with the generic runner; this file checks
the recipe's own invariants on them. A copy of the teacher's folder without its checkpoints
shows that the student needs only the teacher-output file. The other tests run other
configurations, on the session's corpus and feature cache.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "Private-Gender"
TINY = [
    "--corpus_speakers",
    "{train: 24, dev: 10, test: 10, validated_only: 2}",
    "--corpus_clips_per_speaker",
    "2",
    "--grad_norm_records",
    "8",
    "--bootstrap_resamples",
    "50",
    "--delta",
    "1.0e-3",
]

pytestmark = pytest.mark.slow


def run(script, hparams, *args, cwd=ROOT, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(RECIPE / script), hparams, "--debug", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def cache(recipe_cache):
    """The session's Private-Gender cache (corpus and features of the recipes.csv rows)."""
    return recipe_cache("Private-Gender")


@pytest.fixture(scope="module")
def default_runs(recipe_run):
    """The recipes.csv teacher and student runs (one output folder)."""
    teacher = recipe_run("Private-Gender/teacher")
    student = recipe_run("Private-Gender/student")
    return teacher, student


def _copy_teacher(src: Path, dst: Path) -> Path:
    """``<dst>/teacher``: the teacher's outputs of ``src`` without its checkpoints."""
    shutil.copytree(src / "teacher", dst / "teacher", ignore=shutil.ignore_patterns("*.ckpt"))
    return dst


def test_teacher_then_student(default_runs):
    teacher_run, student_run = default_runs
    out = teacher_run.output_folder
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    assert teacher["privacy"]["accountant"] == "pld" and teacher["privacy"]["delta"] == 1e-3
    assert 0 < teacher["privacy"]["epsilon"] < teacher["privacy"]["epsilon_rdp"]
    assert teacher["privacy"]["sigma_calibrated_with"] == "pld"
    # No canaries in the default training: the audit is its own run (test_audit_run).
    assert teacher["privacy"]["audit"] is None and teacher["method"]["audit_run"] is False
    assert "Privacy audit" not in teacher_run.stdout
    assert not (out / "teacher" / "plots" / "audit_cosines.png").exists()
    # Every test record's prediction, in the order of the test labels (the studies pair them).
    labels = teacher["data"]["test_labels"]
    assert len(teacher["dp_direct"]["predictions"]) == len(labels)
    assert len(teacher["teacher"]["test"]["predictions"]) == len(labels)
    for key in ("accuracy", "balanced_accuracy", "macro_f1", "majpred", "top_share"):
        assert len(teacher["dp_direct"][key]["ci"]) == 2
    assert set(teacher["dsaf_diagnostic"]) >= {"with DSAF", "without DSAF"}
    assert "median" in teacher["dsaf_diagnostic"]["with DSAF"]
    assert teacher["method"]["aw_dp"]["weights"][-1] == 1.0
    for plot in ("confusion_dp_direct.png", "grad_norms_dsaf.png"):
        assert (out / "teacher" / "plots" / plot).is_file()
    teacher_state = torch.load(out / "teacher" / "teacher.ckpt")
    student = json.loads((out / "student" / "results.json").read_text())
    assert "student (KD)" in student_run.stdout and "DP-direct" in student_run.stdout
    assert student["privacy"]["guarantee"] == "inherited by post-processing"
    assert student["privacy"]["epsilon"] == teacher["privacy"]["epsilon"]
    assert student["privacy"]["delta"] == teacher["privacy"]["delta"]
    # A mostly unlabelled D_aux: the row passes --aux_labels 6, the others hidden.
    assert student["kd"]["aux_labels"] == 6 < student["kd"]["aux_records"]
    assert sum(student["kd"]["aux_label_counts"].values()) == 6
    # Through sb.Brain in --debug: 2 epochs of at most 2 batches (of 64), one loss per epoch.
    assert student["kd"]["epochs"] == 2 and len(student["kd"]["losses"]) == 2
    assert student["kd"]["steps"] == 2 * min(2, math.ceil(student["kd"]["aux_records"] / 64))
    # Two DP-SGD releases from D_priv (teacher and DP-direct): the joint figure composes both.
    joint = teacher["privacy_joint"]
    assert [r["name"] for r in joint["releases"]] == ["teacher", "DP-direct"]
    assert joint["epsilon"] > teacher["privacy"]["epsilon"]
    assert student["privacy_joint"] == joint
    assert "all releases from D_priv, joint (teacher + DP-direct)" in student_run.stdout
    assert teacher["privacy"]["unit"].startswith("clip")
    assert "outside the DP guarantee" in (out / "teacher" / "train_log.txt").read_text()
    assert "outside the DP guarantee" in student["majority_class_note"]
    for block in ("test", "dp_direct"):
        for key in ("accuracy", "balanced_accuracy", "macro_f1", "majpred"):
            assert 0.0 <= student[block][key]["value"] <= 1.0
    assert (out / "student" / "plots" / "confusion_student.png").is_file()
    # The released checkpoint: audio-only, and no tensor of the teacher in it.
    state = torch.load(out / "student" / "student.ckpt")
    assert not any(k.startswith(("privileged", "modality_dropout")) for k in state)
    for name, tensor in state.items():
        for tname, ttensor in teacher_state.items():
            assert not (tensor.shape == ttensor.shape and torch.equal(tensor, ttensor)), (
                name,
                tname,
            )


def test_audit_run(tmp_path, cache):
    """The DP-SGD audit, its own run: canaries in the teacher's training, the one-shot estimate
    and the lower bound beside the accountant's (PLD) epsilon, the run marked as an audit run."""
    proc = run(
        "train_teacher.py", "hparams/teacher.yaml", f"--cache_folder={cache}", *TINY,
        "--output_folder", str(tmp_path), "--audit_canaries", "1000", "--train_dp_direct", "False",
    )  # fmt: skip
    teacher = json.loads((tmp_path / "teacher" / "results.json").read_text())
    audit = teacher["privacy"]["audit"]
    assert teacher["method"]["audit_run"] is True
    assert (
        audit["canaries"] == 1000 and audit["accountant_epsilon"] == teacher["privacy"]["epsilon"]
    )
    assert audit["accountant_epsilon_rdp"] == teacher["privacy"]["epsilon_rdp"]
    assert audit["epsilon_lower_bound"] <= teacher["privacy"]["epsilon"]  # provable, at 95%
    assert audit["verdict"] in ("consistent", "suspect") and "Privacy audit" in proc.stdout
    assert (tmp_path / "teacher" / "plots" / "audit_cosines.png").is_file()


def test_student_needs_only_the_teacher_outputs(default_runs, cache, tmp_path):
    """No teacher.ckpt or dp_direct.ckpt, and run from the recipe folder."""
    out = _copy_teacher(default_runs[0].output_folder, tmp_path / "out")
    assert not list((out / "teacher").glob("*.ckpt"))
    proc = run(
        "distill_student.py",
        "hparams/student.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        "--bootstrap_resamples",
        "50",
        cwd=RECIPE,
    )
    assert "student (KD)" in proc.stdout
    assert (out / "student" / "student.ckpt").is_file()


def test_median_clip_rule_sets_each_models_clip(tmp_path, cache):
    """clip_median_factor: C = k * median per-sample norm at init on D_aux, per model."""
    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        "--clip_median_factor",
        "0.5",
        "--dsaf",
        "False",
        *TINY,
    )
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    rules = teacher["method"]["clip_rules"]
    assert set(rules) == {"teacher", "DP-direct"}
    for rule in rules.values():
        assert rule["clip"] == pytest.approx(0.5 * rule["median_norm"]) and rule["clip"] > 0
    assert teacher["privacy"]["clip"] == pytest.approx(rules["teacher"]["clip"])
    assert teacher["dp_direct_privacy"]["clip"] == pytest.approx(rules["DP-direct"]["clip"])


def test_audio_only_teacher_is_dp_direct_binary(tmp_path, cache):
    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        "--teacher_modality",
        "audio",
        "--classes",
        "[male, female]",
        "--aw_source",
        "prior",
        "--aw_prior",
        "[0.75, 0.25]",
        "--dsaf",
        "False",
        *TINY,
    )
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    assert teacher["dp_direct"] == teacher["teacher"]["test"]
    assert list(teacher["dp_direct"]["per_class_recall"]) == ["male", "female"]
    assert teacher["data"]["excluded"]["priv"]["other_class"] > 0


def test_no_dp_run_reports_infinite_budget(tmp_path, cache):
    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        "--dp",
        "False",
        *TINY,
    )
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    assert teacher["privacy"]["epsilon"] is None and teacher["privacy"]["delta"] is None


def test_bad_input_named_nothing_written(default_runs, tmp_path, cache):
    out = default_runs[0].output_folder  # its corpus is in the session cache
    corpus = tmp_path / "cv"
    shutil.copytree(cache / "cv_synth", corpus)
    tsv = (corpus / "dev.tsv").read_text().splitlines()
    fields = tsv[1].split("\t")
    fields[8] = "robot"  # the gender column of the 2024+ layout
    (corpus / "dev.tsv").write_text("\n".join([tsv[0], "\t".join(fields), *tsv[2:]]) + "\n")
    bad = tmp_path / "bad"
    proc = run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(bad),
        "--cache_folder",
        str(cache),
        "--data_folder",
        str(corpus),
        *TINY,
        check=False,
    )
    assert proc.returncode != 0
    assert "dev.tsv, line 2: unknown gender value 'robot'" in proc.stderr + proc.stdout
    assert not (bad / "teacher" / "results.json").exists()
    assert not (bad / "teacher" / "manifests").exists()
    # delta above 1/|D_priv| is refused, naming the key.
    proc = run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(bad),
        "--cache_folder",
        str(cache),
        *TINY,
        "--delta",
        "0.5",
        check=False,
    )
    assert (
        proc.returncode != 0
        and "delta = 0.5 must lie in (0, 1/|D_priv|]" in proc.stderr + proc.stdout
    )
    assert not (bad / "teacher" / "results.json").exists()
    # A student without the teacher's outputs.
    proc = run(
        "distill_student.py",
        "hparams/student.yaml",
        "--output_folder",
        str(tmp_path / "none"),
        check=False,
    )
    assert proc.returncode != 0 and "run train_teacher.py" in proc.stderr + proc.stdout
    assert math.isfinite(
        json.loads((out / "teacher" / "results.json").read_text())["privacy"]["epsilon"]
    )


def test_batch_adaptive_aw_dp_records_its_sensitivity(tmp_path, cache):
    """aw_mode batch_adaptive: the noise is calibrated to Delta = C max a 2 / (m + 1)."""
    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        "--aw_mode",
        "batch_adaptive",
        "--aw_floor",
        "2",
        "--train_dp_direct",
        "False",
        "--audit_canaries",
        "0",  # the audit is refused with batch-adaptive AW-DP (bad_inputs.csv)
        *TINY,
    )
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    adaptive = teacher["privacy"]["aw_batch_adaptive"]
    assert adaptive["floor"] == 2
    assert adaptive["sensitivity"] == pytest.approx(1.0 * max(adaptive["coefficients"]) * 2 / 3)
    assert teacher["method"]["aw_dp"]["mode"] == "batch_adaptive"
    assert 0 < teacher["privacy"]["epsilon"] <= 1.0 + 1e-6


def test_speaker_level_teacher_and_student(tmp_path, cache):
    """privacy_unit speaker: every clip trains, epsilon per speaker, the student reads it."""
    out = tmp_path / "out"
    run("train_teacher.py", "hparams/teacher.yaml", "--output_folder", str(out),
        "--cache_folder", str(cache), "--privacy_unit", "speaker", "--audit_canaries", "1000",
        *TINY)  # fmt: skip
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    privacy = teacher["privacy"]
    assert privacy["unit"].startswith("speaker:")
    assert privacy["speaker_level"]["epsilon"] == privacy["epsilon"] <= 1.0 + 1e-6
    manifest = (out / "teacher" / "manifests" / "priv.csv").read_text().splitlines()
    header = manifest[0].split(",")
    spk = {row.split(",")[header.index("spk_id")] for row in manifest[1:]}
    assert privacy["speaker_level"]["speakers"] == len(spk) > 1  # every D_priv speaker
    assert privacy["audit"]["steps"] == privacy["steps"]
    run("distill_student.py", "hparams/student.yaml", "--output_folder", str(out))
    proc = run("train_teacher.py", "hparams/teacher.yaml", "--output_folder", str(tmp_path / "b"),
               "--privacy_unit", "speaker", "--aw_mode", "batch_adaptive", "--audit_canaries",
               "0", check=False)  # fmt: skip
    assert proc.returncode != 0 and "privacy_unit = 'speaker'" in proc.stderr + proc.stdout


def test_student_refuses_logits_the_teacher_results_do_not_describe(default_runs, cache, tmp_path):
    """A teacher killed between its two writes (new non-private logits, old private results)."""
    import numpy as np

    from speechbrain_fl.distill.store import read_teacher_outputs, write_teacher_outputs

    out = _copy_teacher(default_runs[0].output_folder, tmp_path / "out")
    logits = out / "teacher" / "aux_logits.npz"
    old = read_teacher_outputs(logits, temperature=1.0)
    write_teacher_outputs(
        logits,
        ids=old.ids,
        logits=np.zeros_like(old.logits),
        classes=old.classes,
        meta={**old.meta, "epsilon": None},
    )
    proc = run(
        "distill_student.py",
        "hparams/student.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        "--bootstrap_resamples",
        "50",
        check=False,
    )
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert "TeacherOutputMismatchError" in message and "SHA-256" in message
    assert not (out / "student" / "results.json").exists()


def test_second_run_on_the_same_output_folder_stops_at_once(tmp_path, cache):
    """While a run holds <output_folder>/teacher, another teacher run is refused naming it, in
    one line (exit status 2, no traceback), as every recipe script's entry point does."""
    from speechbrain_fl.utils.run_lock import hold_run_lock

    out = tmp_path / "out"
    with hold_run_lock(out / "teacher"):
        proc = run(
            "train_teacher.py",
            "hparams/teacher.yaml",
            "--output_folder",
            str(out),
            "--cache_folder",
            str(cache),
            *TINY,
            check=False,
        )
    message = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "train_teacher.py: error:" in proc.stderr
    assert "Traceback" not in message
    assert str((out / "teacher").resolve()) in message and f"pid {os.getpid()}" in message
    assert not (out / "teacher" / "results.json").exists()
