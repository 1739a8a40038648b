"""The tiny speech-LLM's adaptation options: frozen LLM adapters, teacher-forced input noise."""

import tempfile

import pytest
import torch

from speechbrain_fl.models.presets import build_speech_llm


@pytest.fixture(scope="module")
def cache():
    with tempfile.TemporaryDirectory() as folder:
        yield folder


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_llm_lora_frozen_keeps_audio_side_trainable(cache):
    model = build_speech_llm("tiny", cache_dir=cache, seed=0, freeze_encoder=False, ctc_weight=0.5)
    frozen = build_speech_llm(
        "tiny", cache_dir=cache, seed=0, freeze_encoder=False, ctc_weight=0.5, train_llm_lora=False
    )
    names, kept = _trainable(model), _trainable(frozen)
    assert any(n.startswith("llm.") for n in names)
    assert not any(n.startswith("llm.") for n in kept)
    assert kept == {n for n in names if not n.startswith("llm.")}
    assert any("ctc_head" in n for n in kept) and any("connector" in n for n in kept)
    assert any(n.startswith("encoder.") and "lora_" in n for n in kept)
    # the frozen adapters exist (B = 0) and change nothing
    assert any(n.startswith("llm.") and "lora_B" in n for n, _ in frozen.named_parameters())


def test_input_token_noise_only_in_training_and_labels_untouched(cache):
    model = build_speech_llm("tiny", cache_dir=cache, seed=0, prompt="transcribe")
    wavs, lens = torch.randn(2, 16000), torch.ones(2)
    texts = ["hello world", "page seven"]
    model.eval()
    clean = model(wavs, lens, texts).ce_loss
    model.input_token_noise = 0.9
    assert torch.equal(model(wavs, lens, texts).ce_loss, clean)  # eval: no corruption
    model.train()
    torch.manual_seed(0)
    noisy = model(wavs, lens, texts)
    assert not torch.equal(noisy.ce_loss, clean)
    assert noisy.num_tokens == sum(len(t) + 1 for t in texts)  # same labels (+ EOS)
    with pytest.raises(ValueError, match="input_token_noise"):
        type(model)(
            encoder=model.encoder, connector=model.connector, llm=model.llm,
            tokenizer=model.tokenizer, feature_extractor=model.feature_extractor,
            input_token_noise=1.0,
        )  # fmt: skip


def test_corrupt_inputs_draws_only_ordinary_tokens(cache):
    model = build_speech_llm("tiny", cache_dir=cache, seed=0)
    ids = torch.full((8, 200), 10)
    out = model.corrupt_inputs(ids, 0.5)
    changed = out[out != ids]
    special = set(model.tokenizer.all_special_ids)
    assert changed.numel() > 0 and not (set(changed.tolist()) & special)
