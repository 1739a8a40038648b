"""Multi-exit wav2vec 2.0: truncated forward, no gradient past L_max, heads, presets."""

from __future__ import annotations

import pytest
import torch
from transformers import Wav2Vec2Model

from speechbrain_fl.models.exit_heads import StatPoolHead
from speechbrain_fl.models.multi_exit_wav2vec2 import (
    MultiExitWav2Vec2,
    build_multi_exit,
    create_tiny_wav2vec2,
    layer_of,
    resolve_backbone,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return create_tiny_wav2vec2(tmp_path_factory.mktemp("w2v"), seed=0)


def _model(folder, **kwargs):
    torch.manual_seed(0)
    return MultiExitWav2Vec2(Wav2Vec2Model.from_pretrained(folder), num_outputs=5, **kwargs)


@pytest.mark.parametrize("depth", [3, 6, 9, 12])
def test_truncated_forward_equals_full_hidden_state(tiny_folder, depth):
    model = _model(tiny_folder).eval()
    wavs, lens = torch.randn(3, 12000), torch.tensor([1.0, 0.8, 0.5])
    mask = model._attention_mask(wavs, lens)
    with torch.no_grad():
        full = model.backbone(wavs, attention_mask=mask, output_hidden_states=True)
        frames, frame_mask, _ = model.hidden(wavs, lens, depth=depth)
    torch.testing.assert_close(frames, full.hidden_states[depth], rtol=0, atol=0)
    assert frame_mask.shape == frames.shape[:2]
    assert frame_mask[0].all() and not frame_mask[2].all()
    # the full layer stack is back in place afterwards
    assert len(model.backbone.encoder.layers) == 12


def test_forward_exits_match_single_exit_passes(tiny_folder):
    model = _model(tiny_folder).eval()
    wavs, lens = torch.randn(2, 8000), torch.tensor([1.0, 0.7])
    with torch.no_grad():
        together = model.forward_exits(wavs, lens, exits=[3, 6, 12])
        for depth in (3, 6, 12):
            torch.testing.assert_close(together[depth], model(wavs, lens, depth=depth))


@pytest.mark.parametrize("depth", [3, 9])
def test_no_deeper_parameter_gets_a_gradient(tiny_folder, depth):
    model = _model(tiny_folder).train()
    logits = model(torch.randn(2, 8000), torch.ones(2), depth=depth)
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1])).backward()
    trained = set(model.trained_parameter_names(depth))
    for name, param in model.named_parameters():
        kind, index = layer_of(name)
        deeper = (kind == "layer" and index > depth) or (kind == "exit" and index != depth)
        if deeper:
            assert param.grad is None, name
            assert name not in trained
        else:
            assert name in trained
    # the exit's own head and layer `depth` did get gradients
    assert model.heads[str(depth)].linear.weight.grad is not None
    assert (
        model.backbone.encoder.layers[depth - 1].feed_forward.output_dense.weight.grad.abs().sum()
        > 0
    )


def test_freeze_feature_encoder_key(tiny_folder):
    frozen = _model(tiny_folder, freeze_feature_encoder=True)
    names = frozen.trained_parameter_names(3)
    assert not any("feature_extractor" in n for n in names)
    assert any("feature_extractor" in n for n in _model(tiny_folder).trained_parameter_names(3))


def test_stat_pool_ignores_padding():
    frames = torch.randn(1, 6, 4)
    mask = torch.tensor([[True, True, True, False, False, False]])
    padded = frames.clone()
    padded[:, 3:] = 100.0
    torch.testing.assert_close(StatPoolHead.pool(frames, mask), StatPoolHead.pool(padded, mask))
    torch.testing.assert_close(StatPoolHead.pool(frames, mask)[0, :4], frames[0, :3].mean(0))


def test_ctc_head_and_bad_exit(tiny_folder):
    model = _model(tiny_folder, head="ctc", exits=(3, 6)).eval()
    out = model(torch.randn(2, 8000), torch.tensor([1.0, 0.5]), depth=6)
    assert (
        out.shape[-1] == 5
        and out.shape[1]
        == model.frame_lengths(torch.randn(2, 8000), torch.tensor([1.0, 0.5])).max()
    )
    with pytest.raises(ValueError, match="not one of the model's exits"):
        model(torch.randn(1, 8000), None, depth=9)
    with pytest.raises(ValueError, match="exits"):
        _model(tiny_folder, exits=(13,))


def test_presets_resolve(tmp_path):
    assert (
        resolve_backbone("wav2vec2-base-100h", cache_dir=tmp_path) == "facebook/wav2vec2-base-100h"
    )
    assert resolve_backbone("wav2vec2-base", cache_dir=tmp_path) == "facebook/wav2vec2-base"
    model = build_multi_exit("tiny", num_outputs=3, cache_dir=tmp_path)
    assert model.exits == [3, 6, 9, 12]
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_backbone("nope", cache_dir=tmp_path)


def test_mean_pooling_head_reads_the_masked_mean(tiny_folder):
    model = _model(tiny_folder, pooling="mean").eval()
    head = model.heads["3"]
    assert head.linear.in_features == model.backbone.config.hidden_size
    frames, mask = torch.randn(2, 5, 64), torch.tensor([[1, 1, 1, 0, 0], [1] * 5]).bool()
    expected = head.linear(frames[0, :3].mean(dim=0))
    torch.testing.assert_close(head(frames, mask)[0], expected)
    with pytest.raises(ValueError, match="pooling"):
        _model(tiny_folder, pooling="max")


def test_frozen_upstream_learns_a_weighted_sum_of_hidden_states(tiny_folder):
    model = _model(tiny_folder, upstream="frozen").train()
    assert not any(p.requires_grad for p in model.backbone.parameters())
    names = model.trained_parameter_names(6)
    assert names and all(n.startswith("heads.6.") for n in names)  # heads only travel
    assert model.heads["6"].weights.shape == (7,)  # hidden states 0..6
    wavs, lens = torch.randn(2, 8000), torch.ones(2)
    logits = model(wavs, lens, depth=6)
    logits.sum().backward()
    assert model.heads["6"].weights.grad is not None
    model.eval()
    with torch.no_grad():
        full = model.backbone(wavs, attention_mask=model._attention_mask(wavs, lens),
                              output_hidden_states=True)  # fmt: skip
        mask = model._attention_mask(wavs, lens)
        frame_mask = model.backbone._get_feature_vector_attention_mask(
            full.hidden_states[0].shape[1], mask
        ).bool()
        # zero weights: the plain mean of hidden states 0..3
        expected = model.heads["3"].head(torch.stack(full.hidden_states[:4]).mean(0), frame_mask)
        torch.testing.assert_close(model.forward_exits(wavs, lens, exits=[3, 6])[3], expected)


@pytest.fixture(scope="module")
def pre_ln_folder(tiny_folder, tmp_path_factory):
    """The tiny preset with a pre-LN encoder (``do_stable_layer_norm``; the deep-exit probe's)."""
    backbone = Wav2Vec2Model.from_pretrained(tiny_folder, do_stable_layer_norm=True)
    folder = tmp_path_factory.mktemp("w2v_pre_ln")
    backbone.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("depth", [3, 12])
def test_pre_ln_exit_reads_the_final_layer_norm_of_its_layer(pre_ln_folder, depth):
    model = _model(pre_ln_folder).eval()
    assert model.pre_ln
    wavs, lens = torch.randn(2, 8000), torch.tensor([1.0, 0.6])
    mask = model._attention_mask(wavs, lens)
    with torch.no_grad():
        full = model.backbone(wavs, attention_mask=mask, output_hidden_states=True)
        frames, _, _ = model.hidden(wavs, lens, depth=depth)
        # transformers' hidden_states[l] is the raw output of layer l (pre-LN or not)
        expected = model.backbone.encoder.layer_norm(full.hidden_states[depth])
    torch.testing.assert_close(frames, expected)
    if depth == 12:
        torch.testing.assert_close(frames, full.last_hidden_state)


def test_pre_ln_forward_exits_match_single_exit_passes(pre_ln_folder):
    model = _model(pre_ln_folder).eval()
    wavs, lens = torch.randn(2, 8000), torch.tensor([1.0, 0.7])
    with torch.no_grad():
        together = model.forward_exits(wavs, lens, exits=[3, 6, 12])
        for depth in (3, 6, 12):
            torch.testing.assert_close(together[depth], model(wavs, lens, depth=depth))


def test_pre_ln_frozen_upstream_refused(pre_ln_folder):
    with pytest.raises(ValueError, match="pre-LN"):
        _model(pre_ln_folder, upstream="frozen")
