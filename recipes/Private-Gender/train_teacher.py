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

import copy
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
from gender_model import build_model, per_sample_grad_norms, predict_logits  # noqa: E402
from gender_plots import plot_confusion, plot_grad_norms  # noqa: E402
from gender_privacy import UNIT_OF_PRIVACY, joint_privacy, speaker_level  # noqa: E402
from gender_report import (  # noqa: E402
    audit_table,
    eps_str,
    joint_row,
    results_table,
    write_json,
)
from gender_training import RAW_LOSS_KEY, train_model  # noqa: E402

from speechbrain_fl.utils.atomic import atomic_open  # noqa: E402
from speechbrain_fl.distill.metrics import collapse_report  # noqa: E402
from speechbrain_fl.distill.store import (  # noqa: E402
    teacher_outputs_record,
    write_teacher_outputs,
)
from speechbrain_fl.recipe import load_run_hparams  # noqa: E402
from speechbrain_fl.utils.run_lock import hold_run_lock  # noqa: E402

logger = logging.getLogger(__name__)


def aw_weights(hparams, aux_counts, classes):
    """AW-DP class weights from a privacy-free source (D_aux label counts or a prior).

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


def audit_settings(hparams, plots: Path):
    """The teacher's canary audit (``audit_canaries`` > 0 with DP), else ``None``."""
    if not hparams["dp"] or not hparams["audit_canaries"]:
        return None
    return {
        "canaries": hparams["audit_canaries"],
        "confidence": hparams["audit_confidence"],
        "plot": plots / "audit_cosines.png",
    }


def dp_settings(hparams):
    if not hparams["dp"]:
        return None
    return {
        "target_epsilon": hparams["target_epsilon"],
        "noise_multiplier": hparams["noise_multiplier"],
        "delta": hparams["delta"],
        "clip": hparams["clip"],
        "accountant": hparams["accountant"],
        "seed": hparams["dp_seed"],
    }


def _with_clip(dp, rule):
    """The DP settings with the clip of a median rule (``rule`` None: unchanged)."""
    return dp if dp is None or rule is None else {**dp, "clip": rule["clip"]}


def median_clip(hparams, model, aux, tokens) -> dict:
    """``C = clip_median_factor * median_i ||g_i||`` of ``model`` at initialisation on D_aux.

    The norms are those of the model about to be trained (its own front-end, DSAF or not), on
    the public D_aux, so the rule costs no privacy and C sits where clipping binds for about
    half the records, the regime where DSAF's lower norm dispersion can matter (with C far
    below every norm, every gradient is clipped with or without DSAF).
    """
    n = min(hparams["grad_norm_records"], aux["labels"].numel())
    norms = per_sample_grad_norms(
        copy.deepcopy(model),  # the model to be trained keeps its untouched initialisation
        aux["feats"][:n],
        aux["lengths"][:n],
        aux["labels"][:n],
        tokens=None if tokens is None else tokens[:n],
    )
    median = float(np.median(norms))
    return {
        "rule": "clip_median_factor * median per-sample gradient norm at init (D_aux)",
        "factor": hparams["clip_median_factor"],
        "median_norm": median,
        "records": int(n),
        "clip": hparams["clip_median_factor"] * median,
    }


def dsaf_diagnostic(hparams, aux, num_classes, plots):
    """CV of per-sample gradient norms at initialisation, with and without DSAF (on D_aux)."""
    n = min(hparams["grad_norm_records"], aux["labels"].numel())
    norms = {}
    for name, flag in (("with DSAF", True), ("without DSAF", False)):
        model = build_model(
            {**hparams, "dsaf": flag},
            num_classes=num_classes,
            privileged=False,
            init_seed=hparams["seed"],
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


def main(argv):
    start_all = time.time()
    hparams_file, run_opts, overrides = sb.parse_arguments(argv)
    hparams, hparams_path, overrides = load_run_hparams(
        hparams_file,
        overrides,
        recipe_dir=RECIPE_DIR,
        debug=bool(run_opts.get("debug")),
        debug_caps=DEBUG_CAPS,
        debug_values=DEBUG_VALUES,
    )
    check_teacher_hparams(hparams, hparams_path, overrides)  # before any work
    out = Path(hparams["output_folder"]) / "teacher"
    with hold_run_lock(out):  # one run per output folder, for the whole run
        return run_teacher(hparams, hparams_path, overrides, run_opts, out, start_all)


def run_teacher(hparams, hparams_path, overrides, run_opts, out: Path, start_all: float) -> dict:
    """The teacher run proper (``main`` checks the hparams and holds the run lock)."""
    sb.create_experiment_directory(
        experiment_directory=str(out), hyperparams_to_save=str(hparams_path), overrides=overrides
    )
    debug = run_opts.get("debug", False)
    max_steps = run_opts.get("debug_batches", 2) if debug else None
    epochs = run_opts.get("debug_epochs", 2) if debug else hparams["epochs"]
    classes = list(hparams["classes"])
    timings = {}

    start = time.time()
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
    timings["data"] = time.time() - start
    priv_counts = {c: int((priv["labels"] == i).sum()) for i, c in enumerate(classes)}
    aux_counts = {c: int((aux["labels"] == i).sum()) for i, c in enumerate(classes)}
    majority = int(np.argmax([priv_counts[c] for c in classes]))
    logger.info(
        "|D_priv| = %d %s, |D_aux| = %d %s, |test| = %d",
        len(priv["ids"]),
        priv_counts,
        len(aux["ids"]),
        aux_counts,
        len(test["ids"]),
    )

    plots = out / "plots"
    start = time.time()
    diagnostic = dsaf_diagnostic(hparams, aux, len(classes), plots)
    timings["dsaf_diagnostic"] = time.time() - start
    weights, aw_info = aw_weights(hparams, aux_counts, classes)
    dp = dp_settings(hparams)

    multimodal = hparams["teacher_modality"] == "multimodal"

    def tokens(split):
        if not multimodal:
            return None
        return privileged_tokens(
            split["rows"],
            fields=hparams["privileged_fields"],
            buckets=hparams["priv_buckets"],
            max_tokens=hparams["max_tokens"],
        )

    common = {
        "epochs": epochs,
        "batch_size": hparams["batch_size"],
        "lr": hparams["lr"],
        "dp": dp,
        "class_weights": weights,
        "max_steps": max_steps,
        "train_logger": hparams["train_logger"],
        "batch_adaptive": {"shares": aw_info["counts"], "floor": aw_info["floor"]}
        if aw_info and aw_info["mode"] == "batch_adaptive"
        else None,
    }
    start = time.time()
    teacher = build_model(
        hparams, num_classes=len(classes), privileged=multimodal, init_seed=hparams["seed"]
    )
    clip_rules = {}
    if dp and hparams["clip_median_factor"] is not None:
        clip_rules["teacher"] = median_clip(hparams, teacher, aux, tokens(aux))
        logger.info("teacher clip from the D_aux median rule: %s", clip_rules["teacher"])
    teacher, teacher_info = train_model(
        teacher,
        feats=priv["feats"],
        lengths=priv["lengths"],
        tokens=tokens(priv),
        labels=priv["labels"],
        desc="teacher",
        audit=audit_settings(hparams, plots),
        **{**common, "dp": _with_clip(dp, clip_rules.get("teacher"))},
    )
    timings["teacher"] = time.time() - start

    # The single query of the teacher on D_aux (with D_aux's own privileged inputs).
    aux_logits = predict_logits(teacher, aux["feats"], aux["lengths"], tokens(aux))
    privacy = {
        "epsilon": teacher_info["epsilon"],
        "epsilon_rdp": teacher_info.get("epsilon_rdp"),
        "delta": hparams["delta"] if dp else None,
        "accountant": hparams["accountant"] if dp else None,
        "sigma_calibrated_with": teacher_info.get("sigma_calibrated_with"),
        **{
            k: teacher_info.get(k)
            for k in ("noise_multiplier", "sampling_rate", "clip", "steps", "aw_batch_adaptive")
        },
        "audit": teacher_info.get("audit"),
        "unit": UNIT_OF_PRIVACY,
        "speaker_level": speaker_level(
            epsilon=teacher_info["epsilon"],
            delta=hparams["delta"] if dp else None,
            max_clips=hparams["max_clips_per_speaker"],
        ),
    }
    teacher_aux = collapse_report(
        speakers=aux["speakers"],
        labels=aux["labels"].tolist(),
        predictions=aux_logits.argmax(1).tolist(),
        classes=classes,
        majority_class=majority,
        num_resamples=hparams["bootstrap_resamples"],
    )
    teacher_test_logits = predict_logits(teacher, test["feats"], test["lengths"], tokens(test))
    teacher_test = collapse_report(
        speakers=test["speakers"],
        labels=test["labels"].tolist(),
        predictions=teacher_test_logits.argmax(1).tolist(),
        classes=classes,
        majority_class=majority,
        num_resamples=hparams["bootstrap_resamples"],
    )
    with atomic_open(out / "teacher.ckpt", "wb") as handle:
        torch.save(teacher.state_dict(), handle)

    dp_direct_block, dp_direct_info = None, None
    if hparams["train_dp_direct"]:
        start = time.time()
        if multimodal:
            direct = build_model(
                hparams, num_classes=len(classes), privileged=False, init_seed=hparams["seed"] + 1
            )
            if dp and hparams["clip_median_factor"] is not None:
                clip_rules["DP-direct"] = median_clip(hparams, direct, aux, None)
            direct, dp_direct_info = train_model(
                direct,
                feats=priv["feats"],
                lengths=priv["lengths"],
                tokens=None,
                labels=priv["labels"],
                desc="DP-direct",
                **{**common, "dp": _with_clip(dp, clip_rules.get("DP-direct"))},
            )
        else:  # an audio-only teacher *is* the DP-direct model
            direct, dp_direct_info = teacher, teacher_info
        timings["dp_direct"] = time.time() - start
        direct_logits = predict_logits(direct, test["feats"], test["lengths"])
        dp_direct_block = collapse_report(
            speakers=test["speakers"],
            labels=test["labels"].tolist(),
            predictions=direct_logits.argmax(1).tolist(),
            classes=classes,
            majority_class=majority,
            num_resamples=hparams["bootstrap_resamples"],
        )
        plot_confusion(
            dp_direct_block["confusion"],
            classes,
            plots / "confusion_dp_direct.png",
            title=f"DP-direct (ε = {eps_str(dp_direct_info['epsilon'])})",
        )
        with atomic_open(out / "dp_direct.ckpt", "wb") as handle:
            torch.save(direct.state_dict(), handle)
    plot_confusion(
        teacher_test["confusion"],
        classes,
        plots / "confusion_teacher.png",
        title=f"teacher ({hparams['teacher_modality']}, not released)",
    )

    # Everything this run releases from D_priv: the teacher (its logits) and DP-direct.
    privacy_joint = None
    if dp:
        releases = [{"name": "teacher", "history": teacher_info["accountant_history"]}]
        if dp_direct_info is not None and dp_direct_info is not teacher_info:
            releases.append({"name": "DP-direct", "history": dp_direct_info["accountant_history"]})
        privacy_joint = joint_privacy(
            releases, delta=hparams["delta"], accountant=hparams["accountant"]
        )
        logger.info("Joint privacy of the run's releases from D_priv: %s", privacy_joint)
    timings["total"] = time.time() - start_all
    results = {
        "privacy": privacy,
        "privacy_joint": privacy_joint,
        "dp_direct": dp_direct_block,
        "dp_direct_privacy": None
        if dp_direct_info is None
        else {
            "epsilon": dp_direct_info["epsilon"],
            "epsilon_rdp": dp_direct_info.get("epsilon_rdp"),
            "delta": hparams["delta"] if dp else None,
            "noise_multiplier": dp_direct_info.get("noise_multiplier"),
            "clip": dp_direct_info.get("clip"),
            "steps": dp_direct_info["steps"],
            "note": "a separate release at the same budget (alternative to the teacher-student pipeline)",
        },
        "teacher": {
            "modality": hparams["teacher_modality"],
            "privileged_fields": hparams["privileged_fields"] if multimodal else [],
            "modality_dropout": hparams["modality_dropout"] if multimodal else None,
            "test": teacher_test,
            "aux_agreement": teacher_aux,
            "losses": teacher_info["losses"],
            "losses_note": RAW_LOSS_KEY,
            "note": "not released; its test metrics use the test set's privileged inputs",
        },
        "method": {
            "dsaf": hparams["dsaf"],
            "aw_dp": aw_info,
            "dp": hparams["dp"],
            "target_epsilon": hparams["target_epsilon"] if dp else None,
            "clip_rules": clip_rules or None,
        },
        "dsaf_diagnostic": diagnostic,
        "data": {
            "data_folder": str(data_folder),
            "embedded_corpus": hparams["data_folder"] is None,
            "manifests": str(manifests),
            "classes": classes,
            "counts": prep.get("counts"),
            "excluded": prep.get("excluded"),
            "speakers": prep.get("speakers"),
            "gender_map": prep.get("gender_map"),
            "sources": prep.get("sources"),
            "priv_counts": priv_counts,
            "aux_counts": aux_counts,
            "majority_class": classes[majority],
            "majority_class_note": "D_priv label counts: evaluation-only statistic, outside the DP guarantee",
            "capped_clips": priv.get("capped_clips"),
            "outside_guarantee": "raw D_priv statistics, released without noise and outside the "
            "DP guarantee: counts.priv, excluded.priv, speakers.priv, priv_counts, "
            "majority_class, capped_clips (and teacher.losses)",
        },
        "debug": bool(debug),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    # The teacher's outputs are one unit: the logits first, then results.json (the manifest,
    # with the logits' SHA-256, run id and privacy settings), which the student verifies.
    run_id = uuid.uuid4().hex
    write_teacher_outputs(
        out / "aux_logits.npz",
        ids=aux["ids"],
        logits=aux_logits.numpy(),
        classes=classes,
        meta={**privacy, "teacher_modality": hparams["teacher_modality"], "run_id": run_id},
    )
    results["teacher_outputs"] = teacher_outputs_record(out / "aux_logits.npz")
    write_json(out / "results.json", results)
    hparams["train_logger"].log_stats(
        stats_meta={"stage": "test"},
        test_stats={
            "dp_direct_balanced_accuracy": (dp_direct_block or {})
            .get("balanced_accuracy", {})
            .get("value"),
            "epsilon": privacy["epsilon"],
        },
    )
    rows = [
        ("DP-direct", dp_direct_block, eps_str((dp_direct_info or {}).get("epsilon"))),
        (
            f"teacher ({hparams['teacher_modality']}, not released)",
            teacher_test,
            eps_str(privacy["epsilon"]),
        ),
    ]
    if privacy_joint is not None:
        rows.append(joint_row(privacy_joint))
    print("\n" + results_table(rows, classes))
    if privacy["audit"] is not None:
        print(audit_table(privacy["audit"]))
    print(
        f"DSAF diagnostic (per-sample grad-norm CV at init, D_aux): with {diagnostic['with DSAF']['cv']:.3f}, "
        f"without {diagnostic['without DSAF']['cv']:.3f}"
    )
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(f"Results: {out / 'results.json'}; teacher outputs: {out / 'aux_logits.npz'}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
