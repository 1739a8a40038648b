"""Models of the Private-Gender recipe: building, prediction and the DSAF gradient diagnostic.

* :func:`build_model`: a :class:`~speechbrain_fl.models.gender_classifier.GenderClassifier`
  from the hparams, its initial weights drawn from ``init_seed``.
* :func:`predict_logits`: eval-mode logits in batches.
* :func:`per_sample_grad_norms`: the DSAF diagnostic (Opacus ``GradSampleModule``).

Seeding. The YAML seeds the process once (``seed_everything``). :func:`build_model` reseeds
the global generator with ``init_seed`` on purpose: each model's initialisation (teacher,
DP-direct at ``seed + 1``, student, the two DSAF-diagnostic models) is then a function of the
seed alone, whatever ran before it in the process (cached or computed features, the diagnostic,
``train_dp_direct``, several runs of ``studies.py`` in one process), and the two diagnostic
models start from the same draw so that their gradient norms are a paired comparison.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from speechbrain_fl.models.gender_classifier import GenderClassifier

__all__ = ["build_model", "model_is_multimodal", "per_sample_grad_norms", "predict_logits"]


def build_model(
    hparams: dict, *, num_classes: int, privileged: bool, init_seed: int | None = None
) -> GenderClassifier:
    """A :class:`GenderClassifier` from the hparams (``torch.manual_seed(init_seed)`` first)."""
    if init_seed is not None:
        torch.manual_seed(init_seed)
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


def model_is_multimodal(model) -> bool:
    """Whether ``model`` (or the module an Opacus wrapper holds) takes privileged tokens."""
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
    """L2 norms ``||grad_theta CE(f(x_i), y_i)||_2`` of per-sample gradients (Opacus hooks).

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
        per = [
            p.grad_sample.reshape(p.grad_sample.shape[0], -1)
            for p in gsm.parameters()
            if p.requires_grad and p.grad_sample is not None
        ]
        norms.append(torch.cat(per, dim=1).norm(dim=1))
    gsm._close()
    return torch.cat(norms).numpy()
