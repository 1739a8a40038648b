"""Reports of the Private-Gender recipe: the privacy figures, the tables, ``results.json`` and
the figures.

**Privacy of every release from D_priv, composed** (:func:`joint_privacy`,
:func:`history_epsilon`, :func:`speaker_level`, :data:`UNIT_OF_PRIVACY`).

A default run releases two DP-SGD models trained on the same D_priv: the teacher (through its
logits on D_aux, and everything computed from them, the student included) and the DP-direct
baseline. Each alone satisfies its own (epsilon, delta); released together they satisfy only
their composition. RDP composes additively (Mironov 2017, Prop. 1): for releases ``r`` with
sampling rate ``q_r``, noise multiplier ``sigma_r`` and ``T_r`` steps,

    RDP_joint(alpha) = sum_r T_r * RDP_SGM(alpha; q_r, sigma_r),

and the joint epsilon is the conversion of that curve at ``delta`` (Balle et al. 2020, Thm 21,
as Opacus converts):

    epsilon = min_alpha [ RDP_joint(alpha) - (log delta + log alpha) / (alpha - 1)
                          + log((alpha - 1) / alpha) ].

:func:`joint_privacy` evaluates this with the accountant itself: one Opacus accountant whose
history holds every release's ``(sigma, q, T)`` (the histories of the releases' own
accountants, concatenated), so the joint figure and each release's figure come from the same
code. With the PRV accountant the same history is composed numerically by Opacus. With the PLD
accountant (the default, the tightest here) dp-accounting composes the privacy loss
distributions of the same events,

    PLD_joint = *_r PLD(SelfComposed(PoissonSampled(q_r, Gaussian(sigma_r)), T_r)),

(``*`` the convolution of privacy-loss distributions, add/remove adjacency, pessimistic grid
:data:`~speechbrain_fl.privacy.accounting.PLD_DISCRETIZATION`), and the RDP figure of the same
history is reported beside it (``epsilon_rdp``).

**Unit of privacy.** DP-SGD here protects one *clip* (one record of D_priv). A speaker with
``k`` clips in D_priv is protected only at group level ``k``: (k epsilon, k e^((k-1) epsilon)
delta) (group privacy, Dwork and Roth 2014, Thm 2.2 for approximate DP), which
:func:`speaker_level` reports. The key ``max_clips_per_speaker`` (``train_teacher.py``) caps
each speaker's clips in D_priv (a random subset, drawn from the recipe seed before training);
``max_clips_per_speaker: 1`` makes the clip-level guarantee a speaker-level one. Default
``null``: no cap, the guarantee is clip-level, which is what Common Voice's many-clip speakers
need to know.

**Tables and results** (what the two scripts print and write): the sections of the teacher's
``results.json`` (:func:`teacher_privacy`, :func:`joint_release_privacy`,
:func:`dp_direct_privacy`, :func:`teacher_block`, :func:`data_block`), and

* :func:`results_table`: an aligned text table, one row per model: epsilon, accuracy, balanced
  accuracy, macro-F1, MajPred and top share with their 95% speaker-level bootstrap intervals,
  then the per-class recall; :func:`joint_row` adds the joint figure.
* :func:`audit_table`: the teacher's DP-SGD audit beside the accountant's epsilon (PLD and RDP).
* :func:`write_json`: ``results.json`` written atomically
  (:func:`speechbrain_fl.utils.atomic.atomic_open`).

The shared :func:`speechbrain_fl.run_outputs.format_results_table` tabulates the federated
recipes' ``test.WER`` and privacy columns; this recipe's metrics are classification metrics
with intervals per cell, so it keeps its own table.

**Figures**, drawn on ``matplotlib.figure.Figure`` objects (no pyplot, nothing global touched)
and saved by the package's save helper (:func:`speechbrain_fl.plots._save`: Agg canvas, 120
dpi, tight bounding box), so every figure of the repository is written the same way:

* :func:`plot_confusion`: a confusion matrix with counts and row-normalised shares
  (``plots/confusion_<model>.png``).
* :func:`plot_grad_norms`: histograms of per-sample gradient L2 norms with the clip ``C``
  (``plots/grad_norms_dsaf.png``, the DSAF diagnostic), titled with their coefficient of
  variation ``CV = std / mean``.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from speechbrain_fl.distill.dp_training import RAW_LOSS_KEY
from speechbrain_fl.plots import _save as save_figure
from speechbrain_fl.utils.atomic import atomic_open

logger = logging.getLogger(__name__)

__all__ = [
    "UNIT_OF_PRIVACY",
    "UNIT_SPEAKER",
    "data_block",
    "dp_direct_privacy",
    "joint_release_privacy",
    "teacher_block",
    "teacher_privacy",
    "audit_table",
    "eps_str",
    "history_epsilon",
    "joint_privacy",
    "joint_row",
    "plot_confusion",
    "plot_grad_norms",
    "results_table",
    "speaker_level",
    "write_json",
]


# Privacy

UNIT_OF_PRIVACY = (
    "clip: example-level (epsilon, delta)-DP with respect to one record (clip) of D_priv; a "
    "speaker with k clips in D_priv has group-level protection (k epsilon, k e^((k-1) epsilon) "
    "delta); see privacy.speaker_level and the key max_clips_per_speaker"
)


def joint_privacy(releases: Sequence[dict], *, delta: float, accountant: str) -> dict:
    """Joint (epsilon, delta) of several DP-SGD releases from the same D_priv (module docstring).

    Arguments
    ---------
    releases : sequence of dict
        One per release: ``{"name": str, "history": [[sigma, q, steps], ...]}`` (an Opacus
        accountant's history).
    delta : float
        The delta of the joint guarantee.
    accountant : str
        ``"pld"`` (dp-accounting), ``"rdp"`` or ``"prv"`` (Opacus's).

    Returns
    -------
    dict
        ``{"epsilon", "epsilon_rdp", "delta", "accountant", "releases": [{"name", "history"}],
        "note"}``.

    Example
    -------
    >>> one = {"name": "teacher", "history": [[6.72, 0.25, 40]]}
    >>> two = {"name": "DP-direct", "history": [[6.72, 0.25, 40]]}
    >>> a = joint_privacy([one], delta=1e-5, accountant="rdp")["epsilon"]
    >>> b = joint_privacy([one, two], delta=1e-5, accountant="rdp")["epsilon"]
    >>> round(a, 2), round(b, 2)
    (0.99, 1.43)
    """
    if not releases:
        raise ValueError("joint_privacy: no release to compose")
    history = []
    for release in releases:
        for sigma, q, steps in release["history"]:
            history.append((float(sigma), float(q), int(steps)))
    epsilon = history_epsilon(history, delta=delta, accountant=accountant)
    names = [r["name"] for r in releases]
    return {
        "epsilon": epsilon,
        "epsilon_rdp": epsilon
        if accountant == "rdp"
        else history_epsilon(history, delta=delta, accountant="rdp"),
        "delta": delta,
        "accountant": accountant,
        "releases": [
            {"name": r["name"], "history": [list(h) for h in r["history"]]} for r in releases
        ],
        "note": f"joint guarantee of everything released from D_priv ({' + '.join(names)}), "
        f"by composition in the {accountant.upper()} accountant (RDP beside it: epsilon_rdp)",
    }


def history_epsilon(history: Sequence[Sequence], *, delta: float, accountant: str) -> float:
    """Epsilon at ``delta`` of an Opacus-style history ``[(sigma, q, steps), ...]`` composed.

    ``"rdp"`` / ``"prv"``: an Opacus accountant given the history; ``"pld"``: dp-accounting's
    ``PLDAccountant`` (add/remove adjacency, grid ``PLD_DISCRETIZATION``) composing
    ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)`` per entry (module docstring).

    Example
    -------
    >>> pld = history_epsilon([(6.72, 0.25, 40)], delta=1e-5, accountant="pld")
    >>> rdp = history_epsilon([(6.72, 0.25, 40)], delta=1e-5, accountant="rdp")
    >>> pld < rdp, round(rdp, 2)
    (True, 0.99)
    """
    if accountant == "pld":
        import dp_accounting
        from dp_accounting.pld import pld_privacy_accountant

        from speechbrain_fl.privacy.accounting import PLD_DISCRETIZATION

        acc = pld_privacy_accountant.PLDAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            value_discretization_interval=PLD_DISCRETIZATION,
        )
        for sigma, q, steps in history:
            step = dp_accounting.PoissonSampledDpEvent(
                float(q), dp_accounting.GaussianDpEvent(float(sigma))
            )
            acc.compose(dp_accounting.SelfComposedDpEvent(step, int(steps)))
        return float(acc.get_epsilon(delta))
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history]
    return float(acc.get_epsilon(delta=delta))


def speaker_level(*, epsilon: float | None, delta: float | None, max_clips: int | None) -> dict:
    """Speaker-level figures by group privacy: ``(k eps, k e^((k-1) eps) delta)``, ``k`` the cap.

    Example
    -------
    >>> speaker_level(epsilon=1.0, delta=1e-5, max_clips=1)["epsilon"]
    1.0
    >>> round(speaker_level(epsilon=0.5, delta=1e-5, max_clips=2)["delta"], 8)
    3.297e-05
    """
    if epsilon is None:
        return {"max_clips_per_speaker": max_clips, "epsilon": None, "delta": None}
    if max_clips is None:
        return {
            "max_clips_per_speaker": None,
            "epsilon": None,
            "delta": None,
            "note": "no cap on clips per speaker in D_priv: the guarantee is clip-level only "
            "(set max_clips_per_speaker for a speaker-level one)",
        }
    k = int(max_clips)
    return {
        "max_clips_per_speaker": k,
        "epsilon": k * epsilon,
        "delta": k * math.exp((k - 1) * epsilon) * delta,
        "note": "group privacy over the at most max_clips_per_speaker clips of one speaker",
    }


# Sections of the teacher's results.json


UNIT_SPEAKER = (
    "speaker: user-level (epsilon, delta)-DP with respect to all clips of one speaker of D_priv "
    "(speakers Poisson-sampled, each speaker's mean or summed gradient clipped, "
    "speaker_reduction; privacy_unit: speaker)"
)


def _speaker_unit(info, delta) -> dict:
    """The speaker-level block of a speaker-level DP-SGD run: its own (epsilon, delta)."""
    return {
        "max_clips_per_speaker": None,
        "epsilon": info["epsilon"],
        "delta": delta,
        "speakers": info["speakers"],
        "expected_speakers_per_step": info["expected_speakers_per_step"],
        "reduction": info.get("speaker_reduction"),
        "note": "user-level DP-SGD: the accountant's figure holds per speaker, every clip trains",
    }


def teacher_privacy(hparams, info) -> dict:
    """The teacher's (epsilon, delta) and mechanism, its audit and the unit of privacy."""
    dp = hparams["dp"]
    out = {
        "epsilon": info["epsilon"],
        "epsilon_rdp": info.get("epsilon_rdp"),
        "delta": hparams["delta"] if dp else None,
        "accountant": hparams["accountant"] if dp else None,
        "sigma_calibrated_with": info.get("sigma_calibrated_with"),
        **{
            k: info.get(k)
            for k in ("noise_multiplier", "sampling_rate", "clip", "steps", "aw_batch_adaptive")
        },
        "audit": info.get("audit"),
        "unit": UNIT_OF_PRIVACY,
        "speaker_level": speaker_level(
            epsilon=info["epsilon"],
            delta=hparams["delta"] if dp else None,
            max_clips=hparams["max_clips_per_speaker"],
        ),
    }
    if info.get("privacy_unit") == "speaker":
        out.update(unit=UNIT_SPEAKER, speaker_level=_speaker_unit(info, hparams["delta"]))
    return out


def joint_release_privacy(hparams, teacher_info, direct_info):
    """The joint (epsilon, delta) of everything the run releases from D_priv: the teacher (its
    logits) and DP-direct when it is a separate training (``None`` without DP)."""
    if not hparams["dp"]:
        return None
    releases = [{"name": "teacher", "history": teacher_info["accountant_history"]}]
    if direct_info is not None and direct_info is not teacher_info:
        releases.append({"name": "DP-direct", "history": direct_info["accountant_history"]})
    joint = joint_privacy(releases, delta=hparams["delta"], accountant=hparams["accountant"])
    logger.info("Joint privacy of the run's releases from D_priv: %s", joint)
    return joint


def dp_direct_privacy(hparams, info):
    """DP-direct's own figures (``None`` when it was not trained)."""
    if info is None:
        return None
    return {
        "epsilon": info["epsilon"],
        "epsilon_rdp": info.get("epsilon_rdp"),
        "delta": hparams["delta"] if hparams["dp"] else None,
        "noise_multiplier": info.get("noise_multiplier"),
        "clip": info.get("clip"),
        "steps": info["steps"],
        "note": "a separate release at the same budget (alternative to the teacher-student pipeline)",
    }


def teacher_block(hparams, info, evaluation) -> dict:
    """The teacher's section of results.json (not released)."""
    multimodal = hparams["teacher_modality"] == "multimodal"
    return {
        "modality": hparams["teacher_modality"],
        "privileged_fields": hparams["privileged_fields"] if multimodal else [],
        "modality_dropout": hparams["modality_dropout"] if multimodal else None,
        "test": evaluation["test"],
        "aux_agreement": evaluation["aux"],
        "losses": info["losses"],
        "losses_note": RAW_LOSS_KEY,
        "note": "not released; its test metrics use the test set's privileged inputs",
    }


def data_block(hparams, data) -> dict:
    """The data section of results.json, its raw D_priv statistics labelled as such."""
    prep, classes = data["prep"], data["classes"]
    return {
        "data_folder": str(data["data_folder"]),
        "embedded_corpus": hparams["data_folder"] is None,
        "manifests": str(data["manifests"]),
        "classes": classes,
        "counts": prep.get("counts"),
        "excluded": prep.get("excluded"),
        # clips left out at preparation (libsndfile could not open them), with the error
        **(
            {k: prep[k] for k in ("unreadable_audio", "unreadable_note") if k in prep}
            if prep.get("unreadable_audio")
            else {}
        ),  # fmt: skip
        "speakers": prep.get("speakers"),
        "gender_map": prep.get("gender_map"),
        "sources": prep.get("sources"),
        "priv_counts": data["priv_counts"],
        "aux_counts": data["aux_counts"],
        "majority_class": classes[data["majority"]],
        "majority_class_note": "D_priv label counts: evaluation-only statistic, outside the DP guarantee",
        "capped_clips": data["priv"].get("capped_clips"),
        "outside_guarantee": "raw D_priv statistics, released without noise and outside the "
        "DP guarantee: counts.priv, excluded.priv, speakers.priv, priv_counts, "
        "majority_class, capped_clips (and teacher.losses)",
    }


# Tables and results.json

METRIC_COLUMNS = (
    ("accuracy", "Accuracy"),
    ("balanced_accuracy", "Balanced acc."),
    ("macro_f1", "Macro-F1"),
    ("majpred", "MajPred"),
    ("top_share", "Top share"),
)


def _fmt(block: dict | None, key: str) -> str:
    if not block or key not in block:
        return "-"
    value, ci = block[key]["value"], block[key]["ci"]
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def results_table(rows: list[tuple[str, dict | None, str]], classes) -> str:
    """Aligned text table of ``(model name, collapse report or None, epsilon string)`` rows.

    Example
    -------
    >>> block = {"accuracy": {"value": 0.5, "ci": [0.25, 0.75]},
    ...          "per_class_recall": {"m": {"value": 1.0}}}
    >>> print(results_table([("DP-direct", block, "0.990")], ["m"]))
    Model      ε      Accuracy              Balanced acc.  Macro-F1  MajPred  Top share  Recall m
    DP-direct  0.990  0.500 [0.250, 0.750]  -              -         -        -          1.000
    """
    header = ["Model", "ε", *[title for _, title in METRIC_COLUMNS]]
    header += [f"Recall {c}" for c in classes]
    lines = [header]
    for name, block, eps in rows:
        recall = (block or {}).get("per_class_recall", {})
        lines.append(
            [
                name,
                eps,
                *[_fmt(block, key) for key, _ in METRIC_COLUMNS],
                *[f"{recall[c]['value']:.3f}" if c in recall else "-" for c in classes],
            ]
        )
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines
    )


def joint_row(privacy_joint: dict) -> tuple[str, None, str]:
    """The table row of the joint epsilon of every release from D_priv (no metrics).

    Example
    -------
    >>> joint_row({"epsilon": 1.43, "releases": [{"name": "teacher"}, {"name": "DP-direct"}]})
    ('all releases from D_priv, joint (teacher + DP-direct)', None, '1.430')
    """
    names = " + ".join(r["name"] for r in privacy_joint["releases"])
    return (f"all releases from D_priv, joint ({names})", None, eps_str(privacy_joint["epsilon"]))


def write_json(path, content) -> None:
    """Write ``content`` as indented JSON to ``path`` atomically (numbers as floats)."""
    with atomic_open(path) as handle:
        json.dump(content, handle, indent=2, default=float)


def eps_str(epsilon) -> str:
    """``"∞ (no DP)"`` for ``None``, else epsilon to 3 decimals."""
    return "∞ (no DP)" if epsilon is None else f"{epsilon:.3f}"


#: How :func:`audit_table` words ``audit["verdict"]`` (speechbrain_fl.privacy.dpsgd_audit).
VERDICTS = {
    "bug": "LOWER BOUND ABOVE THE ACCOUNTANT'S EPSILON: a bug in clipping, noise or sampling "
    "(proven at the stated confidence)",
    "suspect": "ONE-SHOT INTERVAL ABOVE THE ACCOUNTANT'S EPSILON: an estimate, not a proof; "
    "rerun, and if it recurs look for a bug",
    "consistent": "consistent with the accountant (which does not prove the code correct)",
}


def audit_table(audit: dict) -> str:
    """The canary audit's figures beside the accountant's, as printed after a teacher run.

    Example
    -------
    >>> print(audit_table({"accountant": "pld", "accountant_epsilon": 1.0,
    ...     "accountant_epsilon_rdp": 1.1, "epsilon_one_shot": 0.2, "epsilon_lower_bound": 0.0,
    ...     "confidence": 0.95, "canaries": 10, "inserted": 4, "insertions": 9, "steps": 3,
    ...     "exceeds_accountant": False}).splitlines()[1])
      accountant epsilon (PLD)                  1.000   (RDP 1.100)
    """
    one_shot = audit["epsilon_one_shot"]
    bound = f"lower bound (Steinke et al. 2023), {100 * audit['confidence']:.0f}%"
    lines = [
        "Privacy audit of the teacher (gradient canaries; adversary sees the final model only):",
        f"  {'accountant epsilon (' + audit['accountant'].upper() + ')':<40}  "
        f"{audit['accountant_epsilon']:.3f}   (RDP {audit['accountant_epsilon_rdp']:.3f})",
        f"  {'one-shot estimate (Andrew et al. 2024)':<40}  "
        + ("n/a" if one_shot is None else f"{one_shot:.3f}")
        + (
            ""
            if not audit.get("one_shot_ci")
            else f"   [{audit['one_shot_ci'][0]:.3f}, {audit['one_shot_ci'][1]:.3f}] over the canaries"
        ),
        f"  {bound:<40}  {audit['epsilon_lower_bound']:.3f}",
        f"  {audit['canaries']} canaries ({audit['inserted']} inserted; {audit['insertions']} "
        f"insertions over {audit['steps']} steps): " + VERDICTS[audit.get("verdict", "consistent")],
        "  a lower bound for this run's threat model (one clip, add/remove, final model); "
        "canaries are not training examples of any person",
    ]
    return "\n".join(lines)


# Figures


def plot_confusion(confusion, classes, path: str | os.PathLike, *, title: str) -> Path:
    """Confusion matrix: cell ``(i, j)`` = count of true ``i`` predicted ``j`` and its share
    of row ``i`` (``n_ij / sum_k n_ik``, the colour)."""
    cm = np.asarray(confusion, dtype=float)
    norm = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    fig = Figure(figsize=(4, 3.6), layout="tight")
    ax = fig.subplots()
    ax.imshow(norm, vmin=0, vmax=1, cmap="Blues")
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(
                j,
                i,
                f"{int(cm[i, j])}\n{norm[i, j]:.2f}",
                ha="center",
                va="center",
                color="white" if norm[i, j] > 0.5 else "black",
                fontsize=8,
            )
    ax.set_xticks(range(len(classes)), classes)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, integer_x=False)


def plot_grad_norms(norms: dict[str, np.ndarray], path: str | os.PathLike, *, clip: float) -> Path:
    """One histogram per entry of ``norms`` (name -> per-sample norms), ``C`` dashed."""
    fig = Figure(figsize=(4.2 * len(norms), 3.2), layout="tight")
    axes = fig.subplots(1, len(norms))
    for ax, (name, values) in zip(np.atleast_1d(axes), norms.items(), strict=True):
        cv = float(np.std(values) / np.mean(values))
        ax.hist(values, bins=40, color="tab:orange" if name.startswith("without") else "tab:blue")
        ax.axvline(clip, color="k", ls="--", lw=1, label=f"C = {clip:g}")
        ax.set_title(f"{name}: CV = {cv:.2f}", fontsize=9)
        ax.set_xlabel("per-sample gradient L2 norm")
        ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, integer_x=False)
