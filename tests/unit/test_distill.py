"""Offline KD: the teacher-output store, the KD loss and the collapse metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speechbrain_fl.distill.labels import IGNORE_LABEL, hide_labels
from speechbrain_fl.distill.loss import kd_loss
from speechbrain_fl.distill.metrics import collapse_report, confusion_matrix
from speechbrain_fl.distill.store import read_teacher_outputs, write_teacher_outputs


def test_store_round_trip_and_temperature_on_read(tmp_path):
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    path = tmp_path / "aux_logits.npz"
    write_teacher_outputs(
        path,
        ids=["x", "y"],
        logits=logits,
        classes=["m", "f", "o"],
        meta={"epsilon": 0.9, "delta": 1e-5},
    )
    for tau in (1.0, 4.0):
        out = read_teacher_outputs(path, temperature=tau)
        expected = torch.softmax(torch.tensor(logits) / tau, dim=1).numpy()
        assert np.allclose(out.probs, expected, atol=1e-6)
        assert out.meta == {"epsilon": 0.9, "delta": 1e-5}
    # A higher temperature flattens the distribution without a new query.
    assert read_teacher_outputs(path, temperature=4.0).probs[0].max() < out.probs[0].max() + 1e-9
    assert np.allclose(out.aligned(["y", "x"]), out.probs[[1, 0]])
    with pytest.raises(KeyError, match="no teacher output"):
        out.aligned(["z"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aux_logits.npz"]  # atomic, no temp


def test_store_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="logits must be"):
        write_teacher_outputs(tmp_path / "a.npz", ids=["x"], logits=np.zeros((2, 3)), classes="abc")
    with pytest.raises(ValueError, match="NaN"):
        write_teacher_outputs(tmp_path / "a.npz", ids=["x"], logits=[[np.nan, 0, 0]], classes="abc")
    with pytest.raises(FileNotFoundError, match="train_teacher.py"):
        read_teacher_outputs(tmp_path / "missing.npz", temperature=1.0)
    assert not list(tmp_path.iterdir())


def test_kd_loss_matches_formula():
    gen = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    y = torch.tensor([0, 1, 2, 0, 1])
    tau, alpha = 3.0, 0.6
    pt = torch.softmax(zt / tau, dim=1)
    ps = torch.softmax(zs / tau, dim=1)
    kl = (pt * (pt.log() - ps.log())).sum(dim=1).mean()
    expected = alpha * tau**2 * kl + (1 - alpha) * F.cross_entropy(zs, y)
    assert kd_loss(zs, pt, y, temperature=tau, alpha=alpha).item() == pytest.approx(
        expected.item(), rel=1e-5
    )
    assert kd_loss(zs, pt, y, temperature=tau, alpha=0.0).item() == pytest.approx(
        F.cross_entropy(zs, y).item()
    )
    with pytest.raises(ValueError):
        kd_loss(zs, pt, y, temperature=0.0, alpha=0.5)


def test_kd_loss_hidden_labels_enter_the_kl_term_only():
    """A mostly unlabelled D_aux: CE over the labelled records, weighted mean by hand; KL over
    all; a batch without labels is KL alone, and its CE part has no gradient."""
    gen = torch.Generator().manual_seed(1)
    zs, zt = torch.randn(6, 3, generator=gen), torch.randn(6, 3, generator=gen)
    tau, alpha = 2.0, 0.5
    pt = torch.softmax(zt / tau, dim=1)
    y = torch.tensor([0, IGNORE_LABEL, 2, IGNORE_LABEL, 1, IGNORE_LABEL])
    w = torch.tensor([0.5, 2.0, 4.0])
    logp = torch.log_softmax(zs, dim=1)
    lab = [0, 2, 4]
    ce = -sum(w[y[i]] * logp[i, y[i]] for i in lab) / sum(w[y[i]] for i in lab)
    kl = kd_loss(zs, pt, y, temperature=tau, alpha=1.0)
    got = kd_loss(zs, pt, y, temperature=tau, alpha=alpha, class_weight=w)
    assert got.item() == pytest.approx((alpha * kl + (1 - alpha) * ce).item(), rel=1e-5)
    hidden = torch.full((6,), IGNORE_LABEL)
    z = zs.clone().requires_grad_(True)
    loss = kd_loss(z, pt, hidden, temperature=tau, alpha=0.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(z.grad) == 0
    assert torch.isfinite(kd_loss(zs, pt, hidden, temperature=tau, alpha=0.5))


def test_hide_labels_keeps_a_stratified_seeded_subset():
    labels = torch.tensor([0] * 70 + [1] * 25 + [2] * 5)
    kept = hide_labels(labels, count=30, seed=3)
    shown = kept[kept != IGNORE_LABEL]
    assert shown.numel() == 30
    assert torch.bincount(shown, minlength=3).tolist() == [21, 7, 2]  # 30 * (0.7, 0.25, 0.05)
    assert (kept[kept != IGNORE_LABEL] == labels[kept != IGNORE_LABEL]).all()  # never altered
    assert torch.equal(kept, hide_labels(labels, count=30, seed=3))
    assert not torch.equal(kept, hide_labels(labels, count=30, seed=4))
    # a rare class keeps one label even when its share rounds to 0
    few = hide_labels(labels, count=5, seed=0)
    assert sorted(set(few[few != IGNORE_LABEL].tolist())) == [0, 1, 2]
    assert torch.equal(hide_labels(labels, count=None, seed=0), labels)
    with pytest.raises(ValueError, match="count must be >= 0"):
        hide_labels(labels, count=-1, seed=0)


def test_collapse_report_values_and_intervals():
    speakers = [f"s{i // 2}" for i in range(20)]
    labels = [0] * 14 + [1] * 5 + [2]
    collapsed = collapse_report(
        speakers=speakers,
        labels=labels,
        predictions=[0] * 20,
        classes=["m", "f", "o"],
        majority_class=0,
        num_resamples=300,
    )
    assert collapsed["majpred"]["value"] == 1.0 and collapsed["top_share"]["value"] == 1.0
    assert collapsed["accuracy"]["value"] == pytest.approx(0.7)  # accuracy hides the collapse
    assert collapsed["balanced_accuracy"]["value"] == pytest.approx(1 / 3)
    assert collapsed["per_class_recall"]["f"]["value"] == 0.0
    assert collapsed["macro_f1"]["value"] == pytest.approx((2 * 14 / (28 + 6)) / 3)
    good = collapse_report(
        speakers=speakers,
        labels=labels,
        predictions=labels,
        classes=["m", "f", "o"],
        majority_class=0,
        num_resamples=300,
    )
    assert good["balanced_accuracy"]["value"] == 1.0 and good["majpred"]["value"] == pytest.approx(
        0.7
    )
    for name in ("accuracy", "balanced_accuracy", "macro_f1", "majpred", "top_share"):
        lo, hi = collapsed[name]["ci"]
        assert lo <= collapsed[name]["value"] + 1e-12 and collapsed[name]["value"] <= hi + 1e-12
    assert collapsed["confusion"] == confusion_matrix(labels, [0] * 20, 3).tolist()
    again = collapse_report(
        speakers=speakers,
        labels=labels,
        predictions=[0] * 20,
        classes=["m", "f", "o"],
        majority_class=0,
        num_resamples=300,
    )
    assert again["accuracy"]["ci"] == collapsed["accuracy"]["ci"]


def test_collapse_report_bad_input():
    with pytest.raises(ValueError, match="no test records"):
        collapse_report(speakers=[], labels=[], predictions=[], classes=["a"], majority_class=0)
    with pytest.raises(ValueError, match="predictions outside"):
        collapse_report(
            speakers=["a"], labels=[0], predictions=[3], classes=["a", "b"], majority_class=0
        )


def _teacher_unit(folder, *, epsilon, run_id):
    """A teacher's two outputs as train_teacher.py writes them: logits, then results.json."""
    from speechbrain_fl.distill.store import teacher_outputs_record

    path = folder / "aux_logits.npz"
    privacy = {"epsilon": epsilon, "delta": 1e-5 if epsilon else None, "steps": 40}
    write_teacher_outputs(
        path,
        ids=["x", "y"],
        logits=np.eye(2),
        classes=["m", "f"],
        meta={**privacy, "run_id": run_id},
    )
    return path, {"privacy": privacy, "teacher_outputs": teacher_outputs_record(path)}


def test_student_refuses_logits_of_another_teacher_run(tmp_path):
    """A teacher killed between its two writes: new (non-private) logits, old private results."""
    from speechbrain_fl.distill.store import TeacherOutputMismatchError, verify_teacher_outputs

    path, private_results = _teacher_unit(tmp_path, epsilon=0.995, run_id="a")
    out = read_teacher_outputs(path, temperature=1.0)
    verify_teacher_outputs(path, out, teacher_results=private_results, results_path="r.json")
    assert private_results["teacher_outputs"]["privacy"]["epsilon"] == 0.995

    _teacher_unit(tmp_path, epsilon=None, run_id="b")  # the next run's logits only
    out = read_teacher_outputs(path, temperature=1.0)
    with pytest.raises(TeacherOutputMismatchError, match="SHA-256"):
        verify_teacher_outputs(path, out, teacher_results=private_results, results_path="r.json")
    # Results without the record (an older teacher run) are refused too.
    with pytest.raises(TeacherOutputMismatchError, match="no fingerprint"):
        verify_teacher_outputs(
            path, out, teacher_results={"privacy": private_results["privacy"]}, results_path="r"
        )


def test_student_refuses_privacy_settings_that_differ(tmp_path):
    """Same file and record, but a privacy block that says something else: refused by key."""
    from speechbrain_fl.distill.store import TeacherOutputMismatchError, verify_teacher_outputs

    path, results = _teacher_unit(tmp_path, epsilon=0.5, run_id="a")
    out = read_teacher_outputs(path, temperature=1.0)
    edited = {**results, "privacy": {**results["privacy"], "steps": 80}}
    with pytest.raises(TeacherOutputMismatchError, match="'steps' differs: 40"):
        verify_teacher_outputs(path, out, teacher_results=edited, results_path="r.json")
    other_run = {**results, "teacher_outputs": {**results["teacher_outputs"], "run_id": "b"}}
    with pytest.raises(TeacherOutputMismatchError, match="teacher run 'a'"):
        verify_teacher_outputs(path, out, teacher_results=other_run, results_path="r.json")
