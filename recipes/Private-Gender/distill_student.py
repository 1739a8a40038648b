#!/usr/bin/env python3
"""Recipe: offline distillation of the DP teacher into the released audio-only student.

Stage 2 of "Private Speech Classification without Collapse". The student reads the teacher's
logits on D_aux from ``<output_folder>/teacher/aux_logits.npz`` (written once by
``train_teacher.py``; the temperature is applied on reading) and never loads the teacher's
weights. It first checks that the file is the one the teacher's results.json describes (its
SHA-256, run id and privacy settings; ``TeacherOutputMismatchError`` otherwise), so the
epsilon it reports belongs to the logits it learns from. It is trained without DP on the
public D_aux, through SpeechBrain's ``Brain`` (:class:`StudentBrain`), with the paper's objective

    alpha * tau^2 * KL(p_t^tau || p_s^tau) + (1 - alpha) * CE(y, p_s),

the CE over the ``aux_labels`` D_aux clips whose labels it may read (a mostly unlabelled D_aux;
the KL over every clip),
and evaluated on the test set next to the DP-direct baseline. By post-processing, releasing
the student costs nothing beyond the teacher's (epsilon, delta) with respect to D_priv; no DP
claim is made for D_aux (public or consented). The label space is a methodological benchmark,
not an endorsement of gender inference.

To run this recipe (after train_teacher.py, with the same output_folder):

    > python recipes/Private-Gender/distill_student.py hparams/student.yaml
    > python recipes/Private-Gender/distill_student.py hparams/student.yaml --temperature 4

Outputs (``<output_folder>/student``): results.json, train_log.txt, hyperparams.yaml,
student.ckpt (the released model: audio-only, no teacher tensor), plots/confusion_student.png.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import speechbrain as sb
import torch

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))

from gender_checks import check_student_hparams  # noqa: E402
from gender_data import load_set  # noqa: E402
from gender_report import (  # noqa: E402
    eps_str,
    joint_row,
    plot_confusion,
    results_table,
    write_json,
)

from speechbrain_fl.distill.dp_training import make_model, predict_logits  # noqa: E402
from speechbrain_fl.distill.labels import IGNORE_LABEL, hide_labels  # noqa: E402
from speechbrain_fl.distill.loss import kd_loss  # noqa: E402
from speechbrain_fl.distill.store import (  # noqa: E402
    read_teacher_outputs,
    verify_teacher_outputs,
)
from speechbrain_fl.recipe import Recipe, run_recipe  # noqa: E402
from speechbrain_fl.utils.atomic import atomic_open  # noqa: E402

logger = logging.getLogger(__name__)


def ce_class_weight(mode: str, labels: torch.Tensor, num_classes: int) -> torch.Tensor | None:
    """Weights of the CE term: ``none``, or ``balanced`` = n_lab / (K n_c) from the counts of
    the D_aux labels the student reads (public; hidden labels are not counted). Our choice:
    the label-only control that rebalances the classes without any teacher."""
    if mode == "none":
        return None
    if mode != "balanced":
        raise ValueError(f"ce_class_weight must be none or balanced, got {mode!r}")
    labels = labels[labels != IGNORE_LABEL]
    counts = torch.bincount(labels, minlength=num_classes).float()
    if (counts == 0).any():
        raise ValueError(
            "ce_class_weight: balanced needs a label of every class among the D_aux labels "
            f"read (aux_labels), counts {counts.tolist()}"
        )
    return labels.numel() / (num_classes * counts)


class StudentBrain(sb.Brain):
    """The non-private student on D_aux: SpeechBrain's ``Brain.fit`` over the KD objective.

    A batch is ``(feats, lengths, teacher_probs, labels)`` (hidden labels ``IGNORE_LABEL``);
    the per-epoch mean loss goes to ``self.losses`` and the train logger, the optimizer steps
    to ``self.steps``.
    """

    def compute_forward(self, batch, stage):
        feats, lengths, _, _ = batch
        return self.modules.student(feats.to(self.device), lengths.to(self.device))

    def compute_objectives(self, predictions, batch, stage):
        _, _, teacher_probs, labels = batch
        return kd_loss(
            predictions,
            teacher_probs.to(self.device),
            labels.to(self.device),
            temperature=self.hparams.temperature,
            alpha=self.hparams.alpha,
            class_weight=self.hparams.class_weight,
        )

    def on_fit_start(self):
        super().on_fit_start()
        self.losses, self.steps = [], 0

    def on_fit_batch_end(self, batch, outputs, loss, should_step):
        self.steps += int(should_step)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == sb.Stage.TRAIN:
            self.losses.append(float(stage_loss))
            self.hparams.train_logger.log_stats(
                stats_meta={"model": "student", "epoch": epoch}, train_stats={"loss": stage_loss}
            )


def train_student(model, *, feats, lengths, labels, teacher_probs, hparams, run_opts):
    """The YAML's ``opt_class`` on the KD objective through :class:`StudentBrain` for the
    YAML's ``epoch_counter`` (non-private: D_aux is public).

    ``run_opts`` (``sb.parse_arguments``): ``--debug`` limits the epochs and batches as in any
    SpeechBrain recipe. Returns ``(model, {"losses", "steps", "epochs"})``.
    """
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(
        TensorDataset(feats, lengths, teacher_probs, labels),
        batch_size=hparams["batch_size"],
        shuffle=True,
        generator=torch.Generator().manual_seed(hparams["seed"]),
    )
    brain = StudentBrain(
        modules={"student": model},
        opt_class=hparams["opt_class"],
        hparams={
            "temperature": hparams["temperature"],
            "alpha": hparams["alpha"],
            "class_weight": ce_class_weight(
                hparams["ce_class_weight"], labels, teacher_probs.shape[1]
            ),
            "train_logger": hparams["train_logger"],
        },
        run_opts={"device": "cpu", **dict(run_opts or {})},
    )
    brain.fit(hparams["epoch_counter"], train_set=loader)
    model.eval()
    return model, {"losses": brain.losses, "steps": brain.steps, "epochs": len(brain.losses)}


# --debug (SpeechBrain's: 2 epochs of 2 batches): reads the teacher's --debug run
# (<output_folder>_debug, the same rule as train_teacher.py) and writes there
DEBUG_CAPS = {"aux_labels": 6, "bootstrap_resamples": 50}


def check_student(hparams, hparams_path, overrides):
    """Every value the student uses, and the teacher's outputs present, before any work."""
    check_student_hparams(hparams, hparams_path, overrides)
    root = Path(hparams["output_folder"])
    teacher_results = root / "teacher" / "results.json"
    if not teacher_results.is_file():
        raise FileNotFoundError(
            f"{teacher_results} not found: run train_teacher.py with --output_folder {root} first"
        )


RECIPE = Recipe(
    recipe_dir=RECIPE_DIR,
    check=check_student,
    check_source=True,  # its messages name the file and the command-line values
    debug_caps=DEBUG_CAPS,
    # One run per output folder: the student's, and the teacher's while its outputs are read
    # (a teacher run on the same folder would rewrite them underneath).
    lock_folders=lambda hp: [
        Path(hp["output_folder"]) / "teacher",
        Path(hp["output_folder"]) / "student",
    ],
)


def main(run):
    """The student run of the parsed, checked command line (its folders locked)."""
    root = Path(run.hparams["output_folder"])
    return run_student(run.hparams, run.base_file, run.merged, run.run_opts, root, run.started)


def run_student(hparams, hparams_path, overrides, run_opts, root: Path, start_all: float):
    """The student run proper (``main`` checks the hparams and holds the run locks): the
    verified teacher outputs, D_aux and test, the student, its metrics and privacy."""
    out = root / "student"
    sb.create_experiment_directory(
        experiment_directory=str(out), hyperparams_to_save=str(hparams_path), overrides=overrides
    )
    teacher_run, outputs = read_teacher_run(hparams, root / "teacher" / "results.json")
    classes = teacher_run["data"]["classes"]
    majority = classes.index(teacher_run["data"]["majority_class"])
    start = time.time()
    data = load_student_data(hparams, teacher_run, outputs)
    timings = {"data": time.time() - start}

    start = time.time()
    student = make_model(
        hparams["model"], num_classes=len(classes), privileged=False, init_seed=hparams["seed"]
    )
    student, info = train_student(
        student,
        feats=data["aux"]["feats"],
        lengths=data["aux"]["lengths"],
        labels=data["aux_labels"],
        teacher_probs=data["teacher_probs"],
        hparams=hparams,
        run_opts=run_opts,
    )
    timings["student"] = time.time() - start
    test = data["test"]
    predictions = predict_logits(student, test["feats"], test["lengths"]).argmax(1).tolist()
    report = hparams["metrics"](
        speakers=test["speakers"],
        labels=test["labels"].tolist(),
        predictions=predictions,
        classes=classes,
        majority_class=majority,
    )
    # Each test record's predicted class, in the test set's order (the teacher run's order too)
    report["predictions"] = predictions
    with atomic_open(out / "student.ckpt", "wb") as handle:
        torch.save(student.state_dict(), handle)
    plot_confusion(
        report["confusion"],
        classes,
        out / "plots" / "confusion_student.png",
        title=f"student (KD, ε = {eps_str(teacher_run['privacy']['epsilon'])})",
    )
    timings["total"] = time.time() - start_all
    results = {
        "privacy": student_privacy(teacher_run),
        # The run released more from D_priv than the student (DP-direct, trained on it too):
        # the guarantee of everything released together is the teacher run's joint figure.
        "privacy_joint": teacher_run.get("privacy_joint"),
        "test": report,
        "dp_direct": teacher_run["dp_direct"],
        "teacher_outputs": str(hparams["teacher_outputs"]),
        "kd": kd_block(hparams, info, data),
        "method": teacher_run["method"],
        "majority_class": classes[majority],
        "majority_class_note": "from D_priv's label counts (teacher run): a raw D_priv "
        "statistic, outside the DP guarantee",
        "debug": bool(run_opts.get("debug", False)),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    write_json(out / "results.json", results)
    hparams["train_logger"].log_stats(
        stats_meta={"stage": "test"},
        test_stats={
            "balanced_accuracy": report["balanced_accuracy"]["value"],
            "majpred": report["majpred"]["value"],
        },
    )
    print_summary(results, teacher_run, classes, out)
    return results


def read_teacher_run(hparams, teacher_results: Path):
    """What the student may read of the teacher run: its public bookkeeping (privacy figures,
    DP-direct metrics, class names, D_aux/test manifests) and the teacher-output file, checked
    against it (SHA-256, run id, privacy settings, classes)."""
    teacher_run = json.loads(teacher_results.read_text(encoding="utf-8"))
    outputs = read_teacher_outputs(hparams["teacher_outputs"], temperature=hparams["temperature"])
    verify_teacher_outputs(
        hparams["teacher_outputs"],
        outputs,
        teacher_results=teacher_run,
        results_path=teacher_results,
    )
    classes = teacher_run["data"]["classes"]
    if outputs.classes != classes:
        raise ValueError(
            f"{hparams['teacher_outputs']} has classes {outputs.classes}, the teacher run {classes}"
        )
    return teacher_run, outputs


def load_student_data(hparams, teacher_run, outputs) -> dict:
    """D_aux (the ``aux_subset`` drawn from ``seed``), test, the teacher's probabilities on
    D_aux and the ``aux_labels`` D_aux labels the student may read (the others hidden)."""
    classes = teacher_run["data"]["classes"]
    data_folder, manifests = teacher_run["data"]["data_folder"], teacher_run["data"]["manifests"]
    aux = load_set("aux", manifests, data_folder, hparams, classes)
    test = load_set("test", manifests, data_folder, hparams, classes)
    if hparams["aux_subset"] is not None and hparams["aux_subset"] < len(aux["ids"]):
        if hparams["aux_subset"] < 1:
            raise ValueError(f"aux_subset must be >= 1 or null, got {hparams['aux_subset']}")
        keep = torch.randperm(
            len(aux["ids"]), generator=torch.Generator().manual_seed(hparams["seed"])
        )
        keep = keep[: hparams["aux_subset"]].sort().values
        aux = {k: [v[i] for i in keep] if isinstance(v, list) else v[keep] for k, v in aux.items()}
        logger.info("Distilling on %d of the D_aux records (aux_subset)", len(keep))
    if not aux["ids"]:
        raise ValueError(f"D_aux ({Path(manifests) / 'aux.csv'}) is empty: nothing to distil on")
    teacher_probs = torch.tensor(outputs.aligned(aux["ids"]), dtype=torch.float32)
    # A mostly unlabelled D_aux: the student reads aux_labels of its labels (the CE term skips
    # the others; the KL term uses every record).
    aux_labels = hide_labels(aux["labels"], count=hparams["aux_labels"], seed=hparams["seed"])
    labelled = aux_labels != IGNORE_LABEL
    label_counts = {c: int((aux_labels == i).sum()) for i, c in enumerate(classes)}
    logger.info("D_aux labels read by the student: %d of %d %s", int(labelled.sum()),
                len(aux_labels), label_counts)  # fmt: skip
    return {
        "aux": aux,
        "test": test,
        "teacher_probs": teacher_probs,
        "aux_labels": aux_labels,
        "labelled": int(labelled.sum()),
        "label_counts": label_counts,
    }


def student_privacy(teacher_run) -> dict:
    """The student's guarantee: the teacher's (epsilon, delta), inherited by post-processing."""
    teacher = teacher_run["privacy"]
    return {
        "epsilon": teacher["epsilon"],
        "epsilon_rdp": teacher.get("epsilon_rdp"),
        "delta": teacher["delta"],
        "accountant": teacher["accountant"],
        # the teacher's DP-SGD audit (figures only): the student is post-processing of it
        "audit": teacher.get("audit"),
        "guarantee": "inherited by post-processing",
        "scope": "example-level (epsilon, delta)-DP with respect to D_priv; no claim for D_aux",
        "covers": "the student alone (a function of the teacher's logits only)",
        "unit": teacher.get("unit"),
        "speaker_level": teacher.get("speaker_level"),
    }


def kd_block(hparams, info, data) -> dict:
    """The distillation section of results.json: settings, steps, losses and labels read."""
    return {
        "temperature": hparams["temperature"],
        "alpha": hparams["alpha"],
        "dsaf": hparams["dsaf"],
        "ce_class_weight": hparams["ce_class_weight"],
        "epochs": info["epochs"],
        "steps": info["steps"],
        "losses": info["losses"],
        "aux_records": len(data["aux"]["ids"]),
        "aux_labels": data["labelled"],
        "aux_label_counts": data["label_counts"],
    }


def print_summary(results, teacher_run, classes, out: Path) -> None:
    """The results table (DP-direct, the student, the joint figure) and the timings."""
    report, direct = results["test"], results["dp_direct"] or {}
    direct_eps = (teacher_run.get("dp_direct_privacy") or {}).get("epsilon")
    rows = [
        ("DP-direct", results["dp_direct"], eps_str(direct_eps)),
        ("student (KD)", report, eps_str(results["privacy"]["epsilon"])),
    ]
    if results["privacy_joint"] is not None:
        rows.append(joint_row(results["privacy_joint"]))
    print("\n" + results_table(rows, classes))
    dpd = direct.get("balanced_accuracy", {}).get("value", np.nan)
    print(
        f"Student balanced accuracy {report['balanced_accuracy']['value']:.3f} vs DP-direct {dpd:.3f}; "
        f"MajPred {report['majpred']['value']:.3f} vs {direct.get('majpred', {}).get('value', np.nan):.3f}"
    )
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(f"Results: {out / 'results.json'}")


if __name__ == "__main__":
    run_recipe(__file__)
