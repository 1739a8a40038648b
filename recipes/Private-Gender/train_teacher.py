#!/usr/bin/env python3
"""Recipe: DP-SGD teacher (DSAF, AW-DP, privileged-modality dropout) and the DP-direct baseline.

Stage 1 of "Private Speech Classification without Collapse: Stabilized DP Training and Offline
Distillation". A teacher is trained with example-level DP-SGD (Opacus ``PrivacyEngine``:
Poisson sampling, per-sample clipping, Gaussian noise; PLD accountant with RDP beside it,
delta <= 1/|D_priv|; the gradient-canary audit of ``audit_canaries``) on
the private set D_priv; it is audio-only or multimodal with a privileged input (transcript
and/or metadata, never the label). It is then queried ONCE on the public auxiliary set D_aux
and its logits are written to ``<output_folder>/teacher/aux_logits.npz``, all that
``distill_student.py`` will ever see of it. The DP-direct baseline (an audio-only model under
the same (epsilon, delta)) is trained and evaluated on the test set. The label space (male /
female / other) is a methodological benchmark of DP-SGD failure modes, not an endorsement of
gender inference.

To run this recipe (from the repository root or from recipes/Private-Gender/):

    > python recipes/Private-Gender/train_teacher.py hparams/teacher.yaml
    > python recipes/Private-Gender/distill_student.py hparams/student.yaml
    > python recipes/Private-Gender/train_teacher.py hparams/teacher.yaml \\
          --data_folder /data/cv-corpus-17.0/en --output_folder results/cv17

Outputs (``<output_folder>/teacher``): results.json (written last: it records the SHA-256,
run id and privacy settings of aux_logits.npz, which the student verifies), train_log.txt,
hyperparams.yaml, aux_logits.npz, teacher.ckpt and dp_direct.ckpt (never released),
manifests/, plots/.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import speechbrain as sb
import torch

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))

from gender_checks import check_teacher_hparams  # noqa: E402
from gender_data import load_set, prepare_data, privileged_tokens  # noqa: E402
from gender_report import (  # noqa: E402
    audit_table,
    data_block,
    dp_direct_privacy,
    eps_str,
    joint_release_privacy,
    joint_row,
    plot_confusion,
    plot_grad_norms,
    results_table,
    teacher_block,
    teacher_privacy,
    write_json,
)

from speechbrain_fl.distill.dp_training import (  # noqa: E402
    make_model,
    median_clip,
    per_sample_grad_norms,
    predict_logits,
    train_model,
)
from speechbrain_fl.distill.store import (  # noqa: E402
    teacher_outputs_record,
    write_teacher_outputs,
)
from speechbrain_fl.recipe import Recipe, run_recipe  # noqa: E402
from speechbrain_fl.utils.atomic import atomic_open  # noqa: E402

logger = logging.getLogger(__name__)


def dp_settings(hparams) -> dict | None:
    """The DP-SGD settings of ``train_model`` from the hparams (``None`` when ``dp`` is off)."""
    if not hparams["dp"]:
        return None
    return {
        "target_epsilon": hparams["target_epsilon"],
        "noise_multiplier": hparams["noise_multiplier"],
        "delta": hparams["delta"],
        "clip": hparams["clip"],
        "accountant": hparams["accountant"],
        "seed": hparams["dp_seed"],
        "speaker_reduction": hparams["speaker_reduction"],
    }


def with_clip(dp, rule):
    """The DP settings with the clip of a median rule (``rule`` None: unchanged)."""
    return dp if dp is None or rule is None else {**dp, "clip": rule["clip"]}


def audit_settings(hparams, plots: Path):
    """The teacher's canary audit (``audit_canaries`` > 0 with DP), else ``None``."""
    if not hparams["dp"] or not hparams["audit_canaries"]:
        return None
    return {
        "canaries": hparams["audit_canaries"],
        "confidence": hparams["audit_confidence"],
        "plot": plots / "audit_cosines.png",
    }


def aw_weights(hparams, aux_counts, classes):
    """AW-DP class weights ``w_c = (min_k n_k / n_c) ** aw_gamma`` from a privacy-free source
    (D_aux label counts or a prior); ``(None, None)`` when ``aw_dp`` is off.

    The keys were checked before any work (``gender_checks``); only the data-dependent
    condition (every class present in D_aux) is checked here.
    """
    from speechbrain_fl.privacy.weighted_dpsgd import class_weights_from_counts

    if not hparams["aw_dp"]:
        return None, None
    if hparams["aw_source"] == "aux_counts":
        source = [aux_counts[c] for c in classes]
        missing = [c for c in classes if aux_counts[c] == 0]
        if missing:
            raise ValueError(
                f"aw_source: aux_counts, but D_aux has no clip of class(es) {missing}; "
                "use aw_source: prior"
            )
    else:  # prior
        source = list(hparams["aw_prior"])
    weights = class_weights_from_counts(source, gamma=hparams["aw_gamma"])
    mode = hparams["aw_mode"]
    logger.info(
        "AW-DP (%s) weights from %s %s: %s",
        mode,
        hparams["aw_source"],
        source,
        dict(zip(classes, weights.tolist(), strict=True)),
    )
    return weights, {
        "mode": mode,
        "source": hparams["aw_source"],
        "counts": source,
        "gamma": hparams["aw_gamma"],
        "weights": weights.tolist(),
        "floor": hparams.get("aw_floor") if mode == "batch_adaptive" else None,
    }


def dsaf_diagnostic(hparams, aux, num_classes, plots):
    """CV = std / mean of the per-sample gradient norms at initialisation, with and without DSAF
    (the YAML's ``model`` with ``dsaf`` True and False, same initial draw, on D_aux)."""
    n = min(hparams["grad_norm_records"], aux["labels"].numel())
    norms = {}
    for name, flag in (("with DSAF", True), ("without DSAF", False)):
        model = make_model(
            hparams["model"],
            num_classes=num_classes,
            privileged=False,
            init_seed=hparams["seed"],
            dsaf=flag,
        )
        norms[name] = per_sample_grad_norms(
            model, aux["feats"][:n], aux["lengths"][:n], aux["labels"][:n]
        )
    stats = {
        name: {
            "cv": float(v.std() / v.mean()),
            "mean": float(v.mean()),
            "median": float(np.median(v)),
            "std": float(v.std()),
            "clipped_share": float((v > hparams["clip"]).mean()),
        }
        for name, v in norms.items()
    }
    plot_grad_norms(norms, plots / "grad_norms_dsaf.png", clip=hparams["clip"])
    logger.info(
        "Per-sample gradient-norm CV: with DSAF %.3f, without %.3f (%d D_aux records)",
        stats["with DSAF"]["cv"],
        stats["without DSAF"]["cv"],
        n,
    )
    return {"records": int(n), "set": "D_aux (public)", "at": "initialisation", **stats}


# --debug (SpeechBrain's: 2 epochs of 2 batches): a small embedded corpus in its own cache
# (<cache_folder>_debug) and outputs in <output_folder>_debug, never the real run's folders
DEBUG_CAPS = {
    "corpus_speakers": {"train": 24, "dev": 10, "test": 10, "validated_only": 2},
    "grad_norm_records": 8,
    "bootstrap_resamples": 50,
}
DEBUG_VALUES = {"corpus_clips_per_speaker": 2}  # 48 D_priv clips, 20 D_aux, 20 test


RECIPE = Recipe(
    recipe_dir=RECIPE_DIR,
    check=check_teacher_hparams,
    check_source=True,  # its messages name the file and the command-line values
    debug_caps=DEBUG_CAPS,
    debug_values=DEBUG_VALUES,
    lock_folders=lambda hparams: [Path(hparams["output_folder"]) / "teacher"],
)


def main(run):
    """The teacher run of the parsed, checked command line (its folder locked)."""
    out = Path(run.hparams["output_folder"]) / "teacher"
    return run_teacher(run.hparams, run.base_file, run.merged, run.run_opts, out, run.started)


def run_teacher(hparams, hparams_path, overrides, run_opts, out: Path, start_all: float) -> dict:
    """The teacher run proper (``main`` checks the hparams and holds the run lock): the data,
    the DSAF diagnostic, the teacher and its single query on D_aux, DP-direct, the report."""
    sb.create_experiment_directory(
        experiment_directory=str(out), hyperparams_to_save=str(hparams_path), overrides=overrides
    )
    debug = bool(run_opts.get("debug", False))
    timings = {}
    start = time.time()
    data = load_data(hparams)
    timings["data"] = time.time() - start

    plots = out / "plots"
    start = time.time()
    diagnostic = dsaf_diagnostic(hparams, data["aux"], len(data["classes"]), plots)
    timings["dsaf_diagnostic"] = time.time() - start
    weights, aw_info = aw_weights(hparams, data["aux_counts"], data["classes"])
    options = training_options(hparams, run_opts, weights=weights, aw_info=aw_info)
    clip_rules = {}
    start = time.time()
    teacher, teacher_info = train_teacher_model(hparams, data, options, clip_rules, plots)
    timings["teacher"] = time.time() - start
    # The single query of the teacher on D_aux (with D_aux's own privileged inputs).
    aux_logits = predict_logits(
        teacher, data["aux"]["feats"], data["aux"]["lengths"], split_tokens(hparams, data["aux"])
    )
    privacy = teacher_privacy(hparams, teacher_info)
    evaluation = evaluate_teacher(hparams, data, teacher, aux_logits)
    with atomic_open(out / "teacher.ckpt", "wb") as handle:
        torch.save(teacher.state_dict(), handle)

    direct = {"block": None, "info": None}
    if hparams["train_dp_direct"]:
        start = time.time()
        direct = dp_direct(hparams, data, options, clip_rules, (teacher, teacher_info), out)
        timings["dp_direct"] = time.time() - start
    plot_confusion(
        evaluation["test"]["confusion"],
        data["classes"],
        plots / "confusion_teacher.png",
        title=f"teacher ({hparams['teacher_modality']}, not released)",
    )
    privacy_joint = joint_release_privacy(hparams, teacher_info, direct["info"])
    timings["total"] = time.time() - start_all
    results = {
        "privacy": privacy,
        "privacy_joint": privacy_joint,
        "dp_direct": direct["block"],
        "dp_direct_privacy": dp_direct_privacy(hparams, direct["info"]),
        "teacher": teacher_block(hparams, teacher_info, evaluation),
        "method": {
            "dsaf": hparams["dsaf"],
            "aw_dp": aw_info,
            "dp": hparams["dp"],
            "target_epsilon": hparams["target_epsilon"] if hparams["dp"] else None,
            "clip_rules": clip_rules or None,
            # An audit run: the teacher's training held gradient canaries (audit_canaries)
            "audit_run": bool(privacy["audit"]),
        },
        "dsaf_diagnostic": diagnostic,
        "data": data_block(hparams, data),
        "debug": debug,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    # The test labels in the order of every model's ``predictions`` (a public split)
    results["data"]["test_labels"] = data["test"]["labels"].tolist()
    write_outputs(hparams, out, results, aux_ids=data["aux"]["ids"], aux_logits=aux_logits)
    print_summary(results, data["classes"], out, modality=hparams["teacher_modality"])
    return results


def load_data(hparams) -> dict:
    """D_priv (capped per speaker), D_aux and test, their label counts and D_priv's majority
    class (an evaluation-only statistic, outside the guarantee)."""
    classes = list(hparams["classes"])
    data_folder, manifests, prep = prepare_data(hparams)
    priv = load_set(
        "priv",
        manifests,
        data_folder,
        hparams,
        classes,
        max_clips_per_speaker=hparams["max_clips_per_speaker"],
    )
    aux = load_set("aux", manifests, data_folder, hparams, classes)
    test = load_set("test", manifests, data_folder, hparams, classes)
    priv_counts = {c: int((priv["labels"] == i).sum()) for i, c in enumerate(classes)}
    aux_counts = {c: int((aux["labels"] == i).sum()) for i, c in enumerate(classes)}
    logger.info(
        "|D_priv| = %d %s, |D_aux| = %d %s, |test| = %d",
        len(priv["ids"]),
        priv_counts,
        len(aux["ids"]),
        aux_counts,
        len(test["ids"]),
    )
    return {
        "classes": classes,
        "data_folder": data_folder,
        "manifests": manifests,
        "prep": prep,
        "priv": priv,
        "aux": aux,
        "test": test,
        "priv_counts": priv_counts,
        "aux_counts": aux_counts,
        "majority": int(np.argmax([priv_counts[c] for c in classes])),
    }


def split_tokens(hparams, split):
    """The privileged tokens of a split for the multimodal teacher (``None`` when audio-only)."""
    if hparams["teacher_modality"] != "multimodal":
        return None
    return privileged_tokens(
        split["rows"],
        fields=hparams["privileged_fields"],
        buckets=hparams["priv_buckets"],
        max_tokens=hparams["max_tokens"],
    )


def training_options(hparams, run_opts, *, weights, aw_info) -> dict:
    """The ``train_model`` keywords the teacher and DP-direct share (``--debug``: 2 epochs of 2
    batches unless ``--debug_epochs`` / ``--debug_batches`` say otherwise)."""
    debug = run_opts.get("debug", False)
    return {
        "epochs": run_opts.get("debug_epochs", 2) if debug else hparams["epochs"],
        "batch_size": hparams["batch_size"],
        "opt_class": hparams["opt_class"],
        "dp": dp_settings(hparams),
        "class_weights": weights,
        "max_steps": run_opts.get("debug_batches", 2) if debug else None,
        "train_logger": hparams["train_logger"],
        "batch_adaptive": {"shares": aw_info["counts"], "floor": aw_info["floor"]}
        if aw_info and aw_info["mode"] == "batch_adaptive"
        else None,
    }


def _train_on_priv(hparams, data, options, clip_rules, model, *, desc, tokens, audit=None):
    """``train_model`` on D_priv, with C from the median rule when ``clip_median_factor`` is
    set (recorded in ``clip_rules[desc]``)."""
    dp = options["dp"]
    if dp and hparams["clip_median_factor"] is not None:
        aux_tokens = None if tokens is None else split_tokens(hparams, data["aux"])
        clip_rules[desc] = median_clip(hparams, model, data["aux"], aux_tokens)
        logger.info("%s clip from the D_aux median rule: %s", desc, clip_rules[desc])
    priv = data["priv"]
    return train_model(
        model,
        feats=priv["feats"],
        lengths=priv["lengths"],
        tokens=tokens,
        labels=priv["labels"],
        desc=desc,
        audit=audit,
        speakers=priv["speakers"] if dp and hparams["privacy_unit"] == "speaker" else None,
        **{**options, "dp": with_clip(dp, clip_rules.get(desc))},
    )


def train_teacher_model(hparams, data, options, clip_rules, plots):
    """The teacher (multimodal or audio-only, ``seed``) trained with DP-SGD (with the canaries
    of an audit run when ``audit_canaries`` > 0)."""
    multimodal = hparams["teacher_modality"] == "multimodal"
    teacher = make_model(
        hparams["model"],
        num_classes=len(data["classes"]),
        privileged=multimodal,
        init_seed=hparams["seed"],
    )
    return _train_on_priv(
        hparams,
        data,
        options,
        clip_rules,
        teacher,
        desc="teacher",
        tokens=split_tokens(hparams, data["priv"]),
        audit=audit_settings(hparams, plots),
    )


def _report(hparams, data, split, logits) -> dict:
    """The YAML's ``metrics`` (collapse report) of ``logits`` on ``split``, with the predicted
    class of each record (``predictions``, in the split's order: the studies pair two models'
    errors record by record)."""
    predictions = logits.argmax(1).tolist()
    report = hparams["metrics"](
        speakers=split["speakers"],
        labels=split["labels"].tolist(),
        predictions=predictions,
        classes=data["classes"],
        majority_class=data["majority"],
    )
    return {**report, "predictions": predictions}


def evaluate_teacher(hparams, data, teacher, aux_logits) -> dict:
    """The teacher's agreement with D_aux's labels and its test metrics (not released)."""
    aux_report = _report(hparams, data, data["aux"], aux_logits)
    test = data["test"]
    logits = predict_logits(teacher, test["feats"], test["lengths"], split_tokens(hparams, test))
    return {"aux": aux_report, "test": _report(hparams, data, test, logits)}


def dp_direct(hparams, data, options, clip_rules, teacher_and_info, out: Path) -> dict:
    """DP-direct, the audio-only baseline at the same budget (``seed + 1``; an audio-only
    teacher *is* DP-direct), its test metrics, confusion plot and checkpoint."""
    if hparams["teacher_modality"] == "multimodal":
        direct = make_model(
            hparams["model"],
            num_classes=len(data["classes"]),
            privileged=False,
            init_seed=hparams["seed"] + 1,
        )
        direct, info = _train_on_priv(
            hparams, data, options, clip_rules, direct, desc="DP-direct", tokens=None
        )
    else:
        direct, info = teacher_and_info
    test = data["test"]
    block = _report(hparams, data, test, predict_logits(direct, test["feats"], test["lengths"]))
    plot_confusion(
        block["confusion"],
        data["classes"],
        out / "plots" / "confusion_dp_direct.png",
        title=f"DP-direct (ε = {eps_str(info['epsilon'])})",
    )
    with atomic_open(out / "dp_direct.ckpt", "wb") as handle:
        torch.save(direct.state_dict(), handle)
    return {"block": block, "info": info}


def write_outputs(hparams, out: Path, results, *, aux_ids, aux_logits) -> None:
    """The teacher's outputs as one unit: the logits first, then results.json (the manifest,
    with the logits' SHA-256, run id and privacy settings), which the student verifies; then
    the test stage of the train log."""
    privacy = results["privacy"]
    write_teacher_outputs(
        out / "aux_logits.npz",
        ids=aux_ids,
        logits=aux_logits.numpy(),
        classes=results["data"]["classes"],
        meta={
            **privacy,
            "teacher_modality": hparams["teacher_modality"],
            "run_id": uuid.uuid4().hex,
        },
    )
    results["teacher_outputs"] = teacher_outputs_record(out / "aux_logits.npz")
    write_json(out / "results.json", results)
    hparams["train_logger"].log_stats(
        stats_meta={"stage": "test"},
        test_stats={
            "dp_direct_balanced_accuracy": (results["dp_direct"] or {})
            .get("balanced_accuracy", {})
            .get("value"),
            "epsilon": privacy["epsilon"],
        },
    )


def print_summary(results, classes, out: Path, *, modality: str) -> None:
    """The results table (each model's epsilon, a last row for the joint one), the audit, the
    DSAF diagnostic and the timings."""
    privacy, diagnostic = results["privacy"], results["dsaf_diagnostic"]
    rows = [
        ("DP-direct", results["dp_direct"], eps_str((results["dp_direct_privacy"] or {}).get("epsilon"))),
        (f"teacher ({modality}, not released)", results["teacher"]["test"], eps_str(privacy["epsilon"])),
    ]  # fmt: skip
    if results["privacy_joint"] is not None:
        rows.append(joint_row(results["privacy_joint"]))
    print("\n" + results_table(rows, classes))
    if privacy["audit"] is not None:
        print(audit_table(privacy["audit"]))
    print(
        f"DSAF diagnostic (per-sample grad-norm CV at init, D_aux): with {diagnostic['with DSAF']['cv']:.3f}, "
        f"without {diagnostic['without DSAF']['cv']:.3f}"
    )
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(f"Results: {out / 'results.json'}; teacher outputs: {out / 'aux_logits.npz'}")


if __name__ == "__main__":
    run_recipe(__file__)
