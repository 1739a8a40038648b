"""The Private-Gender recipe end to end in ``--debug`` mode on a tiny embedded corpus.

Both hparams files run through the real scripts (Opacus DP-SGD, the teacher-output store, the
KD student); the student runs after the teacher's checkpoint is deleted, so it demonstrably
needs only the teacher-output file.
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
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pg_cache")


def test_teacher_then_student(tmp_path, cache):
    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        *TINY,
    )
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    assert teacher["privacy"]["accountant"] == "rdp" and teacher["privacy"]["delta"] == 1e-3
    assert 0 < teacher["privacy"]["epsilon"] <= 1.0 + 1e-6
    for key in ("accuracy", "balanced_accuracy", "macro_f1", "majpred", "top_share"):
        assert len(teacher["dp_direct"][key]["ci"]) == 2
    assert set(teacher["dsaf_diagnostic"]) >= {"with DSAF", "without DSAF"}
    assert teacher["method"]["aw_dp"]["weights"][-1] == 1.0
    for plot in ("confusion_dp_direct.png", "grad_norms_dsaf.png"):
        assert (out / "teacher" / "plots" / plot).is_file()
    teacher_state = torch.load(out / "teacher" / "teacher.ckpt")
    (out / "teacher" / "teacher.ckpt").unlink()  # the student must not need it
    (out / "teacher" / "dp_direct.ckpt").unlink()
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
    )  # also from the recipe folder
    assert "student (KD)" in proc.stdout and "DP-direct" in proc.stdout
    student = json.loads((out / "student" / "results.json").read_text())
    assert student["privacy"]["guarantee"] == "inherited by post-processing"
    assert student["privacy"]["epsilon"] == teacher["privacy"]["epsilon"]
    assert student["privacy"]["delta"] == teacher["privacy"]["delta"]
    # Two DP-SGD releases from D_priv (teacher and DP-direct): the joint figure composes both.
    joint = teacher["privacy_joint"]
    assert [r["name"] for r in joint["releases"]] == ["teacher", "DP-direct"]
    assert joint["epsilon"] > teacher["privacy"]["epsilon"]
    assert student["privacy_joint"] == joint
    assert "all releases from D_priv, joint (teacher + DP-direct)" in proc.stdout
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


def test_bad_input_named_nothing_written(tmp_path, cache):
    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        *TINY,
    )
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
        *TINY,
    )
    teacher = json.loads((out / "teacher" / "results.json").read_text())
    adaptive = teacher["privacy"]["aw_batch_adaptive"]
    assert adaptive["floor"] == 2
    assert adaptive["sensitivity"] == pytest.approx(1.0 * max(adaptive["coefficients"]) * 2 / 3)
    assert teacher["method"]["aw_dp"]["mode"] == "batch_adaptive"
    assert 0 < teacher["privacy"]["epsilon"] <= 1.0 + 1e-6


def test_student_refuses_logits_the_teacher_results_do_not_describe(tmp_path, cache):
    """A teacher killed between its two writes (new non-private logits, old private results)."""
    import numpy as np

    from speechbrain_fl.distill.store import read_teacher_outputs, write_teacher_outputs

    out = tmp_path / "out"
    run(
        "train_teacher.py",
        "hparams/teacher.yaml",
        "--output_folder",
        str(out),
        "--cache_folder",
        str(cache),
        *TINY,
    )
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


BAD_INPUTS = Path(__file__).with_name("bad_inputs_private_gender.csv")


def _bad_input_rows():
    import csv

    with BAD_INPUTS.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and list(rows[0]) == ["recipe", "script", "hparams", "flags", "expected"]
    return rows


@pytest.mark.parametrize(
    "row", _bad_input_rows(), ids=lambda r: f"{Path(r['script']).stem}:{r['flags'].split()[0]}"
)
def test_bad_input_refused_before_any_work(row, tmp_path):
    """Each row of bad_inputs_private_gender.csv: one named error, nothing synthesised or written.

    Run in this process through the scripts' ``main`` (as studies.py does), so the 29 rows
    cost imports once; ``test_bad_input_named_nothing_written`` runs the command line itself.
    """
    import importlib
    import shlex

    sys.path.insert(0, str(RECIPE))
    script = importlib.import_module(Path(row["script"]).stem)
    output, cache = tmp_path / "out", tmp_path / "cache"
    flags = shlex.split(row["flags"].format(output=output, cache=cache))
    with pytest.raises((ValueError, OSError)) as error:
        script.main([str(ROOT / row["hparams"]), "--debug", *flags])
    assert row["expected"] in str(error.value)
    assert not cache.exists() and not output.exists()  # no corpus, feature or output folder


def test_second_run_on_the_same_output_folder_stops_at_once(tmp_path, cache):
    """While a run holds <output_folder>/teacher, another teacher run is refused naming it."""
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
    assert proc.returncode != 0 and "RunLockedError" in message
    assert str((out / "teacher").resolve()) in message and f"pid {os.getpid()}" in message
    assert not (out / "teacher" / "results.json").exists()
