"""The deep-exit probe's diagnostics: per-layer gradient norms and the frame cosine."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import Wav2Vec2Model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
sys.path[:0] = [str(RECIPE), str(RECIPE / "studies")]

from deep_exit_probe import frame_similarity, layer_grad_norms  # noqa: E402

from speechbrain_fl.models.multi_exit_wav2vec2 import (  # noqa: E402
    MultiExitWav2Vec2,
    create_tiny_wav2vec2,
)


def test_layer_grad_norms_group_the_gradients_by_layer(tmp_path):
    torch.manual_seed(0)
    model = MultiExitWav2Vec2(
        Wav2Vec2Model.from_pretrained(create_tiny_wav2vec2(tmp_path)), num_outputs=3
    ).train()
    logits = model(torch.randn(2, 8000), torch.ones(2), depth=6)
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2])).backward()
    norms = layer_grad_norms(model)
    # layers past the trained depth have no gradient, so no entry
    assert set(norms) == {"below", "head", *(str(layer) for layer in range(1, 7))}
    layer_4 = [p.grad for n, p in model.named_parameters() if ".encoder.layers.3." in n]
    assert norms["4"] == pytest.approx(math.sqrt(sum(float(g.pow(2).sum()) for g in layer_4)))
    head = model.heads["6"].linear
    assert norms["head"] == pytest.approx(
        math.sqrt(float(head.weight.grad.pow(2).sum() + head.bias.grad.pow(2).sum()))
    )
    # the whole: every group's squares add up to the global norm clip_grad_norm_ sees
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert math.sqrt(sum(v**2 for v in norms.values())) == pytest.approx(float(total), rel=1e-5)


def test_frame_similarity_by_hand():
    # utterance 1: frames (1, 0), (0, 1), (1, 1) -> cosines 0, 1/sqrt2, 1/sqrt2 -> mean sqrt2/3
    # utterance 2: two valid frames pointing the same way (1) and one padded frame (ignored)
    frames = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [[2.0, 0.0], [3.0, 0.0], [0, 9]]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    expected = (math.sqrt(2) / 3 + 1.0) / 2
    assert frame_similarity(frames, mask) == pytest.approx(expected)
    # an utterance with one valid frame has no pair: left out
    assert math.isnan(frame_similarity(frames[:1, :1], mask[:1, :1]))
