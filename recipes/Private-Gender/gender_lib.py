"""Shared parts of ``train_teacher.py`` and ``distill_student.py`` (Private-Gender recipe).

* :func:`prepare_data`: the embedded corpus (when ``data_folder`` is null) and the manifests.
* :func:`load_features`: log-mel filterbanks (SpeechBrain ``Fbank``) of a manifest's clips,
  cached in ``cache_folder`` by the manifest's content; a clip that cannot be read is named.
* :func:`privileged_tokens`: the teacher's privileged input (transcript words and/or metadata
  fields as hashed tokens); fields derived from the label are refused.
* :func:`train_model`: one training run, DP-SGD with Opacus (Poisson sampling, per-sample
  clipping, Gaussian noise, RDP accountant, optional AW-DP weights) or non-private.
* :func:`per_sample_grad_norms`: the DSAF diagnostic (Opacus ``GradSampleModule``).
* plots of confusion matrices and gradient-norm histograms, and the results table.

The training loop is a plain PyTorch loop rather than ``sb.Brain.fit``: Opacus's
``PrivacyEngine.make_private`` replaces the model, the optimizer and the data loader (Poisson
sampler) at once, and the accountant counts every optimizer step, so the loop Opacus documents
is the one that keeps the accounting exact; SpeechBrain provides the features, the argument
parsing, the experiment folder and the train logger.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from speechbrain_fl.atomic import atomic_open
from speechbrain_fl.models.gender_classifier import GenderClassifier, hash_tokens

logger = logging.getLogger(__name__)

#: Fields allowed as privileged input. The label (``label``, ``gender_raw``) and the speaker
#: id are never inputs.
PRIVILEGED_FIELDS = ("sentence", "age", "accent")
FORBIDDEN_FIELDS = ("label", "gender", "gender_raw", "spk_id", "client_id")


# ##########################################################################################
# Data
# ##########################################################################################
def prepare_data(hparams: dict) -> tuple[str, str, dict]:
    """Embedded corpus if needed, then ``priv.csv``/``aux.csv``/``test.csv``.

    Returns ``(data_folder, manifest_folder, report)``.
    """
    from common_voice_prepare import prepare_common_voice

    data_folder = hparams["data_folder"]
    if data_folder is None:
        from speechbrain_fl.data.common_voice_synth import generate_common_voice_corpus

        data_folder = os.path.join(hparams["cache_folder"], "cv_synth")
        logger.info("No data_folder given: embedded espeak-ng corpus in %s", data_folder)
        info = generate_common_voice_corpus(
            data_folder,
            speakers=dict(hparams["corpus_speakers"]),
            clips_per_speaker=hparams["corpus_clips_per_speaker"],
            class_shares=tuple(hparams["corpus_class_shares"]),
            release_style=hparams["corpus_release_style"],
            audio_format=hparams["corpus_audio_format"],
            seed=hparams["corpus_seed"],
        )
        logger.info("Embedded corpus %s (%.1f s)", "cached" if info["cached"] else "generated",
                    info["seconds"])  # fmt: skip
    manifests = os.path.join(hparams["output_folder"], "teacher", "manifests")
    report = prepare_common_voice(
        data_folder,
        manifests,
        priv_split=hparams["priv_split"],
        aux_split=hparams["aux_split"],
        test_split=hparams["test_split"],
        classes=tuple(hparams["classes"]),
        gender_map=hparams["gender_map"],
        unlabeled_values=tuple(hparams["unlabeled_values"]),
        disjoint_by=hparams["disjoint_by"],
        max_aux=hparams["max_aux"],
        seed=hparams["seed"],
        skip_prep=hparams["skip_prep"],
    )
    return data_folder, manifests, report


def read_manifest(path: str | os.PathLike, data_folder: str) -> list[dict[str, str]]:
    """Rows of a manifest with ``$data_root`` replaced."""
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        row["wav"] = row["wav"].replace("$data_root", str(data_folder))
    return rows


def _fbank(n_mels: int):
    from speechbrain.lobes.features import Fbank

    return Fbank(n_mels=n_mels, sample_rate=16000)


def _read_clip(row) -> torch.Tensor:
    """Mono 16 kHz waveform of a manifest row; ``ValueError`` naming the clip if unreadable."""
    try:
        wav, sr = sf.read(row["wav"], dtype="float32", always_2d=True)
    except Exception as err:
        raise ValueError(f"clip {row['wav']} (record {row['ID']}) cannot be read: {err}") from err
    wav = torch.from_numpy(wav.mean(axis=1))
    if sr != 16000:
        import torchaudio

        wav = torchaudio.functional.resample(wav, sr, 16000)
    if wav.numel() < 400 or not torch.isfinite(wav).all():
        raise ValueError(f"clip {row['wav']} (record {row['ID']}) is empty or not finite")
    return wav


def load_features(rows, *, n_mels: int, max_frames: int, cache_folder: str,
                  desc: str = "features") -> dict:  # fmt: skip
    """Log-mel features of ``rows``: ``{"feats" (N, T, n_mels), "lengths" (N,)}``, cached.

    Clips longer than ``max_frames`` frames (10 ms hop) keep their first ``max_frames``.
    """
    key = hashlib.sha256(
        json.dumps(
            [[r["ID"], r["wav"], r["duration"]] for r in rows] + [n_mels, max_frames]
        ).encode()
    ).hexdigest()[:16]
    cache = Path(cache_folder) / "features" / f"{key}.pt"
    if cache.is_file():
        return torch.load(cache)
    fbank = _fbank(n_mels)
    feats = torch.zeros(len(rows), max_frames, n_mels)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    chunk = 32  # clips per Fbank call (zero padding leaves the valid frames unchanged)
    with torch.inference_mode():
        for start in tqdm(range(0, len(rows), chunk), desc=desc, unit="batch", leave=False):
            wavs = [_read_clip(row) for row in rows[start : start + chunk]]
            longest = max(w.numel() for w in wavs)
            batch = torch.stack([F.pad(w, (0, longest - w.numel())) for w in wavs])
            mel = fbank(batch)
            for k, w in enumerate(wavs):
                n = min(1 + w.numel() // 160, mel.shape[1], max_frames)
                feats[start + k, :n] = mel[k, :n]
                lengths[start + k] = n
    out = {"feats": feats, "lengths": lengths}
    with atomic_open(cache, "wb") as handle:
        torch.save(out, handle)
    return out


def privileged_tokens(rows, *, fields, buckets: int, max_tokens: int) -> torch.Tensor:
    """Hashed tokens of the privileged fields (``w=<word>`` per transcript word, ``age=...``).

    Raises ``ValueError`` for a field derived from the label or not in the manifests.
    """
    fields = list(fields)
    bad = [f for f in fields if f in FORBIDDEN_FIELDS]
    if bad:
        raise ValueError(f"privileged_fields {bad}: the label, anything derived from it and the "
                         f"speaker id are never inputs; allowed: {PRIVILEGED_FIELDS}")  # fmt: skip
    unknown = [f for f in fields if f not in PRIVILEGED_FIELDS]
    if unknown:
        raise ValueError(f"unknown privileged_fields {unknown}; allowed: {PRIVILEGED_FIELDS}")
    records = []
    for row in rows:
        tokens = []
        for field in fields:
            if field == "sentence":
                tokens += [f"w={w}" for w in row["sentence"].lower().split()]
            elif row[field]:
                tokens.append(f"{field}={row[field]}")
        records.append(tokens)
    return hash_tokens(records, buckets=buckets, max_tokens=max_tokens)


def build_model(hparams: dict, *, num_classes: int, privileged: bool) -> GenderClassifier:
    """A :class:`GenderClassifier` from the hparams."""
    return GenderClassifier(
        n_mels=hparams["n_mels"],
        num_classes=num_classes,
        dsaf=hparams["dsaf"],
        crop_frames=hparams["dsaf_crop_frames"],
        compress_scale=hparams["dsaf_compress_scale"],
        channels=hparams["channels"],
        layers=hparams["layers"],
        kernel_size=hparams["kernel_size"],
        stride=hparams["conv_stride"],
        emb_dim=hparams["emb_dim"],
        privileged=privileged,
        priv_buckets=hparams.get("priv_buckets", 1024),
        priv_dim=hparams.get("priv_dim", 32),
        modality_dropout=hparams.get("modality_dropout", 0.0) if privileged else 0.0,
    )


# ##########################################################################################
# Training
# ##########################################################################################
@functools.lru_cache(maxsize=32)
def _sigma_for(q: float, target_epsilon: float, steps: int, delta: float, accountant: str) -> float:
    """Noise multiplier for a target epsilon (Opacus's search), once per configuration: the
    teacher and DP-direct share q and the number of steps."""
    from speechbrain_fl.privacy.accounting import noise_multiplier_for_epsilon

    return noise_multiplier_for_epsilon(sampling_rate=q, target_epsilon=target_epsilon,
                                        rounds=steps, delta=delta, accountant=accountant)  # fmt: skip


def _delta_check(delta: float, n_priv: int) -> None:
    if not 0 < delta <= 1.0 / n_priv:
        raise ValueError(f"delta = {delta:g} must lie in (0, 1/|D_priv|] = (0, {1.0 / n_priv:.3g}] "
                         f"for |D_priv| = {n_priv}")  # fmt: skip


def train_model(
    model: torch.nn.Module,
    *,
    feats: torch.Tensor,
    lengths: torch.Tensor,
    tokens: torch.Tensor | None,
    labels: torch.Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    dp: dict | None,
    class_weights: torch.Tensor | None,
    desc: str,
    batch_adaptive: dict | None = None,
    max_steps: int | None = None,
    train_logger=None,
) -> tuple[torch.nn.Module, dict]:
    """Train ``model`` with DP-SGD (``dp`` given) or without; returns ``(model, info)``.

    ``dp`` keys: ``target_epsilon`` or ``noise_multiplier``, ``delta``, ``clip``,
    ``accountant``, ``seed`` (tests only). ``class_weights`` (AW-DP): in DP-SGD, applied to the
    clipped per-sample gradients (:class:`~speechbrain_fl.privacy.weighted_dpsgd.WeightedDPOptimizer`);
    without DP, as per-sample loss weights. ``info`` holds the privacy figures and the
    per-epoch losses. ``batch_adaptive`` (``{"shares", "floor"}``, with ``class_weights``):
    the batch-adaptive AW-DP form instead (:class:`~speechbrain_fl.privacy.weighted_dpsgd.BatchAdaptiveDPOptimizer`),
    coefficients ``a_c = E|B| * shares_c w_c / sum_k shares_k w_k`` (each class gets the
    update share the fixed weights give it in expectation; our choice) and count floor
    ``floor`` (null: the expected count of the rarest class in a batch, at least 1).
    ``max_steps`` (``--debug``) stops early; the accountant then counts only
    the steps taken.
    """
    from torch.utils.data import DataLoader, TensorDataset

    from speechbrain_fl.privacy.accounting import compute_epsilon

    n = labels.numel()
    toks = tokens if tokens is not None else torch.zeros(n, 1, dtype=torch.long)
    loader = DataLoader(TensorDataset(feats, lengths, toks, labels), batch_size=batch_size,
                        shuffle=True)  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    info: dict = {"dp": dp is not None, "epochs": epochs, "batch_size": batch_size, "lr": lr}
    engine = None
    if dp is not None:
        from opacus.validators import ModuleValidator

        from speechbrain_fl.privacy.weighted_dpsgd import DPSGDPrivacyEngine

        ModuleValidator.validate(model, strict=True)  # no BatchNorm, supported layers only
        _delta_check(dp["delta"], n)
        q = 1.0 / len(loader)
        steps = epochs * len(loader)
        sigma = dp.get("noise_multiplier")
        if sigma is None:
            sigma = _sigma_for(q, dp["target_epsilon"], steps, dp["delta"], dp["accountant"])
        adaptive = None
        if batch_adaptive is not None and class_weights is not None:
            expected = q * n
            shares = torch.as_tensor(batch_adaptive["shares"], dtype=torch.float64)
            shares = shares / shares.sum()
            mix = shares * class_weights.double()
            floor = batch_adaptive.get("floor")
            if floor is None:
                floor = max(1, math.floor(expected * float(shares.min())))
            adaptive = {"coefficients": (expected * mix / mix.sum()).float(), "floor": int(floor)}
            info["aw_batch_adaptive"] = {"coefficients": adaptive["coefficients"].tolist(),
                                         "floor": adaptive["floor"]}  # fmt: skip
        engine = DPSGDPrivacyEngine(accountant=dp["accountant"],
                                    class_weights=None if adaptive else class_weights,
                                    batch_adaptive=adaptive, seed=dp.get("seed"))  # fmt: skip
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=float(sigma),
            max_grad_norm=dp["clip"], poisson_sampling=True,
        )  # fmt: skip
        info.update({"sampling_rate": q, "noise_multiplier": float(sigma), "clip": dp["clip"],
                     "delta": dp["delta"], "accountant": dp["accountant"],
                     "planned_steps": steps, "aw_dp": class_weights is not None})  # fmt: skip
        if adaptive:
            info["aw_batch_adaptive"]["sensitivity"] = optimizer.sensitivity
        logger.info("%s: DP-SGD with q=%.4f, sigma=%.4f, C=%g, %d steps planned%s", desc, q, sigma,
                    dp["clip"], steps, f", batch-adaptive AW-DP {info['aw_batch_adaptive']}"
                    if adaptive else "")  # fmt: skip
    model.train()
    losses, steps_done, start = [], 0, time.time()
    for epoch in range(1, epochs + 1):
        total, count = 0.0, 0
        for x, lens, tok, y in tqdm(loader, desc=f"{desc} epoch {epoch}/{epochs}", leave=False):
            optimizer.zero_grad(set_to_none=True)
            if y.numel() == 0:  # empty Poisson batch: noise only, still a step of the accountant
                logits = model(x, lens, tok if model_is_multimodal(model) else None)
                loss = logits.sum() * 0.0
            else:
                logits = model(x, lens, tok if model_is_multimodal(model) else None)
                if dp is None and class_weights is not None:
                    loss = (F.cross_entropy(logits, y, reduction="none") * class_weights[y]).mean()
                else:
                    loss = F.cross_entropy(logits, y)
            loss.backward()
            if engine is not None and class_weights is not None:
                optimizer.set_labels(y)
            optimizer.step()
            total += float(loss.detach()) * y.numel()
            count += y.numel()
            steps_done += 1
            if max_steps is not None and steps_done >= max_steps:
                break
        losses.append(total / max(count, 1))
        stats = {"loss": losses[-1]}
        if engine is not None:  # the same RDP arithmetic, per-step RDP cached (accounting.py)
            stats["epsilon"] = compute_epsilon(sampling_rate=info["sampling_rate"],
                                               noise_multiplier=info["noise_multiplier"],
                                               rounds=steps_done, delta=dp["delta"],
                                               accountant=dp["accountant"])  # fmt: skip
        logger.info("%s epoch %d: %s", desc, epoch, stats)
        if train_logger is not None:
            train_logger.log_stats(stats_meta={"model": desc, "epoch": epoch}, train_stats=stats)
        if max_steps is not None and steps_done >= max_steps:
            break
    info.update({"losses": losses, "steps": steps_done, "seconds": round(time.time() - start, 1)})
    if engine is not None:
        info["epsilon"] = float(engine.get_epsilon(dp["delta"]))
        # Cross-check the Opacus accountant's history against an independent evaluation.
        check = compute_epsilon(sampling_rate=info["sampling_rate"], noise_multiplier=info["noise_multiplier"],
                                rounds=steps_done, delta=dp["delta"], accountant=dp["accountant"])  # fmt: skip
        if not math.isclose(check, info["epsilon"], rel_tol=1e-6):
            raise RuntimeError(f"accountant mismatch: {info['epsilon']} vs {check}")
        info["fixed_seed"] = dp.get("seed")
        model = model._module
    else:
        info["epsilon"] = None
    model.eval()
    return model, info


def model_is_multimodal(model) -> bool:
    inner = getattr(model, "_module", model)
    return bool(getattr(inner, "is_multimodal", False))


@torch.no_grad()
def predict_logits(model, feats, lengths, tokens=None, *, batch_size: int = 256) -> torch.Tensor:
    """Logits of ``model`` in eval mode, in batches."""
    model.eval()
    out = []
    for i in range(0, feats.shape[0], batch_size):
        tok = tokens[i : i + batch_size] if tokens is not None else None
        out.append(model(feats[i : i + batch_size], lengths[i : i + batch_size], tok))
    return torch.cat(out)


def per_sample_grad_norms(
    model, feats, lengths, labels, *, tokens=None, batch_size: int = 64
) -> np.ndarray:
    """L2 norms of per-sample gradients of the CE loss (Opacus ``GradSampleModule``).

    A diagnostic for DSAF, computed on the public D_aux (not on D_priv), in training mode (the
    records are cropped as in training).
    """
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum")
    gsm.train()
    norms = []
    for i in range(0, feats.shape[0], batch_size):
        gsm.zero_grad(set_to_none=True)
        tok = tokens[i : i + batch_size] if tokens is not None else None
        logits = gsm(feats[i : i + batch_size], lengths[i : i + batch_size], tok)
        F.cross_entropy(logits, labels[i : i + batch_size], reduction="sum").backward()
        per = [p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in gsm.parameters()
               if p.requires_grad and p.grad_sample is not None]  # fmt: skip
        norms.append(torch.cat(per, dim=1).norm(dim=1))
    gsm._close()
    return torch.cat(norms).numpy()


# ##########################################################################################
# Reports
# ##########################################################################################
def plot_confusion(confusion, classes, path: str | os.PathLike, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = np.asarray(confusion, dtype=float)
    norm = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(4, 3.6))
    ax.imshow(norm, vmin=0, vmax=1, cmap="Blues")
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(j, i, f"{int(cm[i, j])}\n{norm[i, j]:.2f}", ha="center", va="center",
                    color="white" if norm[i, j] > 0.5 else "black", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(classes)), classes)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_grad_norms(norms: dict[str, np.ndarray], path: str | os.PathLike, *, clip: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(norms), figsize=(4.2 * len(norms), 3.2))
    for ax, (name, values) in zip(np.atleast_1d(axes), norms.items(), strict=True):
        cv = float(np.std(values) / np.mean(values))
        ax.hist(values, bins=40, color="tab:orange" if name.startswith("without") else "tab:blue")
        ax.axvline(clip, color="k", ls="--", lw=1, label=f"C = {clip:g}")
        ax.set_title(f"{name}: CV = {cv:.2f}", fontsize=9)
        ax.set_xlabel("per-sample gradient L2 norm")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(block: dict | None, key: str) -> str:
    if not block or key not in block:
        return "-"
    value, ci = block[key]["value"], block[key]["ci"]
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def results_table(rows: list[tuple[str, dict | None, str]], classes) -> str:
    """Aligned text table: model, epsilon, metrics with 95% CIs, per-class recall."""
    header = ["Model", "ε", "Accuracy", "Balanced acc.", "Macro-F1", "MajPred", "Top share",
              *[f"Recall {c}" for c in classes]]  # fmt: skip
    lines = [header]
    for name, block, eps in rows:
        recall = (block or {}).get("per_class_recall", {})
        lines.append([name, eps, *[_fmt(block, k) for k in
                      ("accuracy", "balanced_accuracy", "macro_f1", "majpred", "top_share")],
                      *[f"{recall[c]['value']:.3f}" if c in recall else "-" for c in classes]])  # fmt: skip
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in lines)  # fmt: skip


def write_json(path, content) -> None:
    with atomic_open(path) as handle:
        json.dump(content, handle, indent=2, default=float)


def eps_str(epsilon) -> str:
    return "∞ (no DP)" if epsilon is None else f"{epsilon:.3f}"
