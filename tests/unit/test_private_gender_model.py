"""Model parts of the Private-Gender recipe: DSAF, privileged input, modality dropout, Opacus."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator

from speechbrain_fl.models.gender_classifier import (
    DSAF,
    GenderClassifier,
    ModalityDropout,
    hash_tokens,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "Private-Gender"))


def test_dsaf_normalises_compresses_and_crops():
    feats = torch.randn(3, 100, 8) * 20 - 60  # raw dB-like scale
    lengths = torch.tensor([100, 40, 10])
    dsaf = DSAF(crop_frames=30, compress_scale=2.0).eval()
    x, n = dsaf(feats, lengths)
    assert x.shape == (3, 30, 8) and n.tolist() == [30, 30, 30]
    assert x.abs().max() < 1.0
    # Scale invariance of the per-utterance normalisation: 10 dB louder, same input.
    y, _ = dsaf(feats + 10.0, lengths)
    assert torch.allclose(x, y, atol=1e-5)
    # A record shorter than the crop is tiled from its valid frames only.
    short = dsaf(
        torch.cat([torch.ones(1, 10, 8), torch.full((1, 90, 8), 1e6)], 1), torch.tensor([10])
    )[0]
    assert torch.isfinite(short).all() and short.abs().max() < 1.0
    dsaf.train()
    a, _ = dsaf(feats, lengths)
    assert a.shape == (3, 30, 8)


@pytest.mark.parametrize("dsaf", [True, False])
@pytest.mark.parametrize("privileged", [True, False])
def test_models_are_opacus_valid(dsaf, privileged):
    model = GenderClassifier(n_mels=8, num_classes=3, dsaf=dsaf, crop_frames=20, channels=8,
                             emb_dim=8, privileged=privileged, priv_buckets=32, priv_dim=4)  # fmt: skip
    assert ModuleValidator.validate(model, strict=False) == []
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_per_sample_gradients_are_exact():
    """No record influences another's gradient: Opacus's per-sample gradients equal the
    gradients of each record alone (no DSAF crop and no dropout: the forward is deterministic;
    Opacus records activations in training mode only)."""
    torch.manual_seed(0)
    model = GenderClassifier(n_mels=8, num_classes=3, dsaf=False, channels=8, emb_dim=8,
                             privileged=True, priv_buckets=32, priv_dim=4)  # fmt: skip
    feats, lengths = torch.randn(4, 30, 8), torch.tensor([30, 25, 12, 30])
    tokens = hash_tokens([["a"], ["b", "c"], [], ["a", "d"]], buckets=32, max_tokens=3)
    y = torch.tensor([0, 1, 2, 1])
    import copy

    reference = copy.deepcopy(model)
    gsm = GradSampleModule(model, loss_reduction="sum").train()
    torch.nn.functional.cross_entropy(gsm(feats, lengths, tokens), y, reduction="sum").backward()
    for i in range(4):
        one = slice(i, i + 1)
        loss = torch.nn.functional.cross_entropy(
            reference(feats[one], lengths[one], tokens[one]), y[one]
        )
        ref = torch.autograd.grad(loss, list(reference.parameters()))
        for p, g in zip(model.parameters(), ref, strict=True):
            assert torch.allclose(p.grad_sample[i].reshape(g.shape), g, atol=1e-5)


def test_modality_dropout_is_per_record():
    torch.manual_seed(0)
    drop = ModalityDropout(0.5).train()
    out = drop(torch.ones(2000, 3))
    kept = (out.sum(dim=1) > 0).float()
    assert 0.45 < kept.mean().item() < 0.55
    assert set(out.sum(dim=1).tolist()) <= {0.0, 3.0}  # whole records dropped, no rescaling
    assert torch.equal(drop.eval()(torch.ones(5, 3)), torch.ones(5, 3))
    with pytest.raises(ValueError):
        ModalityDropout(1.5)


def test_multimodal_model_needs_tokens():
    model = GenderClassifier(n_mels=8, num_classes=3, privileged=True, crop_frames=10)
    with pytest.raises(ValueError, match="privileged tokens"):
        model(torch.randn(1, 20, 8), torch.tensor([20]))


def test_privileged_tokens_refuse_label_fields():
    import gender_data

    rows = [{"sentence": "Hello there", "age": "twenties", "accent": "x", "label": "male",
             "gender_raw": "male_masculine"}]  # fmt: skip
    tokens = gender_data.privileged_tokens(
        rows, fields=["sentence", "age"], buckets=64, max_tokens=5
    )
    assert (tokens[0] > 0).sum().item() == 3
    for field in ("label", "gender_raw", "spk_id"):
        with pytest.raises(ValueError, match="never inputs"):
            gender_data.privileged_tokens(rows, fields=[field], buckets=64, max_tokens=5)
    with pytest.raises(ValueError, match="unknown privileged_fields"):
        gender_data.privileged_tokens(rows, fields=["mood"], buckets=64, max_tokens=5)
