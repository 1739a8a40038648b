"""Speech-LLM: tiny build and reload, loss mask, decoding, LoRA targeting, seed pretraining."""

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    VoxtralConfig,
    VoxtralForConditionalGeneration,
    WhisperConfig,
    WhisperFeatureExtractor,
)
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from speechbrain_fl.fl.params import load_trainable, trainable_state
from speechbrain_fl.models.connector import FrameStackConnector
from speechbrain_fl.models.presets import PRESETS, build_speech_llm, resolve_preset, split_voxtral
from speechbrain_fl.models.pretrain import pretrain_seed_model
from speechbrain_fl.models.speech_llm import (
    ENCODER_LORA_TARGETS,
    LLM_LORA_TARGETS,
    SpeechLLM,
    add_lora,
    causal_lm_loss,
)
from speechbrain_fl.models.tiny import TINY_ENCODER, TINY_LLM, build_char_tokenizer

TRANSCRIPTS = ["bonjour le monde", "guten tag", "dzień dobry", "hola amigos"]


def _toy_batch():
    t = torch.linspace(0, 3, 48000)
    gen = torch.Generator().manual_seed(0)
    wavs = torch.stack(
        [
            0.3 * torch.sin(2 * math.pi * 220 * t),
            0.3 * torch.sin(2 * math.pi * 440 * t),
            0.1 * torch.randn(48000, generator=gen),
            0.3 * torch.sin(2 * math.pi * 330 * t) * torch.sin(2 * math.pi * 3 * t),
        ]
    )
    return wavs, torch.tensor([1.0, 0.8, 0.6, 1.0]), list(TRANSCRIPTS)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("speech_llm_cache")


@pytest.fixture(scope="module")
def seed_model(cache, tmp_path_factory):
    """A tiny base model pretrained on the toy batch, saved, and its folder."""
    model = build_speech_llm(
        "tiny", cache_dir=cache, lora_r=0, freeze_encoder=False, ctc_weight=0.3, seed=0
    )
    torch.manual_seed(0)
    history = pretrain_seed_model(model, [_toy_batch()], steps=60, lr=3e-3)
    folder = model.save_pretrained(tmp_path_factory.mktemp("seed"))
    return model, history, folder


def _lora_numel(model, prefix, kind=""):
    return sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.startswith(prefix) and f"lora_{kind}" in n and p.requires_grad
    )


def _trainable_by_component(model):
    counts = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            label = model.component_of(name)
            counts[label] = counts.get(label, 0) + param.numel()
    return counts


# ---------------------------------------------------------------------- presets and building
def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="whisper_tinyllama"):
        build_speech_llm("whisper_tinylama")
    with pytest.raises(ValueError, match="conector"):
        resolve_preset({"preset": "whisper_eurollm", "conector": "mlp"})
    assert set(PRESETS) == {"whisper_tinyllama", "whisper_eurollm", "voxtral", "tiny"}


def test_save_and_reload_through_from_pretrained(seed_model):
    model, _, folder = seed_model
    reloaded = build_speech_llm(folder, lora_r=0, freeze_encoder=False, ctc_weight=0.3)
    original = model.state_dict()
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, original[name], msg=name)
    wavs, lens, text = _toy_batch()
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(wavs, lens, text).loss, reloaded(wavs, lens, text).loss)


# ---------------------------------------------------------------------- loss and gradients
def test_gradients_reach_only_trainable_parameters(cache):
    model = build_speech_llm("tiny", cache_dir=cache, freeze_encoder=False, ctc_weight=0.3, seed=1)
    wavs, lens, text = _toy_batch()
    out = model(wavs, lens, text)
    assert torch.isfinite(out.loss) and torch.isfinite(out.ctc_loss)
    out.loss.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
        else:
            assert param.grad is None, name
    # LoRA B starts at zero, so gradients flow into B (and later A) of every adapter.
    b_grads = [p.grad.abs().sum() for n, p in model.named_parameters() if "lora_B" in n]
    assert all(g > 0 for g in b_grads)
    assert model.connector.linear.weight.grad.abs().sum() > 0


def test_loss_counts_transcript_tokens_only(cache):
    model = build_speech_llm("tiny", cache_dir=cache, seed=2).eval()
    wavs, lens, text = _toy_batch()
    with torch.no_grad():
        loss = model(wavs, lens, text).ce_loss
        _, _, audio, audio_lens = model.encode(wavs, lens)
        targets = model.tokenize_transcripts(text)
        batch = model.assemble(audio, audio_lens, targets)
        logits = model.llm(
            inputs_embeds=batch.inputs_embeds,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits
    # Labels: every prefix (bos, audio, prompt, left padding) and right padding is -100.
    assert (batch.labels[:, : batch.prefix_len] == -100).all()
    assert int((batch.labels != -100).sum()) == sum(len(t) for t in targets)
    assert all(t[-1] == model.eos_id for t in targets)
    # Independent computation: -log p(y_s | ...) from the logit one position earlier.
    terms = [
        -F.log_softmax(logits[i, batch.prefix_len + s - 1], -1)[tok]
        for i, row in enumerate(targets)
        for s, tok in enumerate(row)
    ]
    torch.testing.assert_close(loss, torch.stack(terms).mean())
    # Scores at masked positions (prefix, padding) cannot change the loss.
    noisy = logits.clone()
    masked = (batch.labels == -100).roll(-1, dims=1)
    noisy[masked] += 5 * torch.randn_like(noisy[masked])
    torch.testing.assert_close(
        causal_lm_loss(noisy, batch.labels), causal_lm_loss(logits, batch.labels)
    )


def test_language_prompt_is_filled_per_utterance(cache):
    model = build_speech_llm("tiny", cache_dir=cache, seed=2, prompt="say {language}").eval()
    wavs, lens, text = _toy_batch()
    languages = ["french", "german", "polish", "spanish"]
    with torch.no_grad():
        _, _, audio, audio_lens = model.encode(wavs, lens)
        batch = model.assemble(audio, audio_lens, model.tokenize_transcripts(text), languages)
        embed = model.llm.get_input_embeddings()
        for i, language in enumerate(languages):
            ids = model.tokenizer(f"say {language}", add_special_tokens=False).input_ids
            # The prompt sits right before the transcript column, after that row's audio.
            row = batch.inputs_embeds[i, batch.prefix_len - len(ids) : batch.prefix_len]
            torch.testing.assert_close(row, embed(torch.tensor(ids)))
        # Same audio, another language named: another loss (the prompt is conditioning).
        french = model(wavs, lens, text, ["french"] * 4).ce_loss
        polish = model(wavs, lens, text, ["polish"] * 4).ce_loss
        assert not torch.equal(french, polish)
        assert len(model.transcribe(wavs, lens, max_new_tokens=3, languages=languages)) == 4
    with pytest.raises(ValueError, match="language"):
        model(wavs, lens, text)
    with pytest.raises(ValueError, match="3 languages for a batch of 4"):
        model(wavs, lens, text, languages[:3])


def test_loss_is_independent_of_batch_padding(cache):
    model = build_speech_llm("tiny", cache_dir=cache, seed=3).eval()
    wavs, lens, text = _toy_batch()
    with torch.no_grad():
        both = model(wavs[:3], lens[:3], text[:3])
        parts = [model(wavs[i : i + 1], lens[i : i + 1], text[i : i + 1]) for i in range(3)]
    summed = sum(p.ce_loss * p.num_tokens for p in parts)
    torch.testing.assert_close(both.ce_loss * both.num_tokens, summed, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- decoding
def test_greedy_decoding_matches_training_and_manual_argmax(seed_model):
    model, history, _ = seed_model
    wavs, lens, text = _toy_batch()
    decoded = model.transcribe(wavs, lens, max_new_tokens=24)
    assert all(isinstance(s, str) for s in decoded) and len(decoded) == 4
    # After 60 steps on one batch the seed model reproduces it.
    assert sum(d == t for d, t in zip(decoded, text, strict=True)) >= 3, decoded
    # Manual greedy decoding without KV cache gives the same strings as generate().
    with torch.no_grad():
        _, _, audio, audio_lens = model.encode(wavs, lens)
        generated = [[] for _ in text]
        for _ in range(24):
            batch = model.assemble(audio, audio_lens, generated if generated[0] else None)
            logits = model.llm(
                inputs_embeds=batch.inputs_embeds,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
            ).logits
            for row, token in zip(generated, logits[:, -1].argmax(-1).tolist(), strict=True):
                row.append(token)
    manual = []
    for row in generated:
        row = row[: row.index(model.eos_id)] if model.eos_id in row else row
        manual.append(model.tokenizer.decode(row, skip_special_tokens=True).strip())
    assert manual == decoded


def test_pretraining_reduces_loss(seed_model):
    _, history, _ = seed_model
    assert len(history["loss"]) == 60
    assert sum(history["ce"][-5:]) / 5 < 0.3 * history["ce"][0]
    assert history["ctc"][-1] < history["ctc"][0]


# ---------------------------------------------------------------------- LoRA targeting
def test_tiny_lora_counts_follow_config_formula(cache):
    r, k = 8, 4
    d, h = TINY_ENCODER["d_model"], TINY_LLM["hidden_size"]
    kv_out = h // TINY_LLM["num_attention_heads"] * TINY_LLM["num_key_value_heads"]
    vocab = len(build_char_tokenizer())
    for freeze in (True, False):
        model = build_speech_llm("tiny", cache_dir=cache, freeze_encoder=freeze, ctc_weight=0.5)
        counts = _trainable_by_component(model)
        llm = TINY_LLM["num_hidden_layers"] * (r * (h + h) + r * (h + kv_out))
        assert counts["llm"] == llm == _lora_numel(model, "llm.")
        assert counts["connector"] == k * d * h + h
        encoder = TINY_ENCODER["encoder_layers"] * 3 * r * (d + d)
        assert counts.get("encoder", 0) == (0 if freeze else encoder + d * (vocab + 1) + vocab + 1)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        patterns = model.component_patterns()
        for name in trainable:
            hits = [
                lab for lab, pats in patterns.items() if any(fnmatch.fnmatch(name, p) for p in pats)
            ]
            assert len(hits) == 1, (name, hits)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "encoder.layers.0.self_attn.q_proj.lora_A.default.weight" in names
    assert "llm.model.layers.1.self_attn.v_proj.lora_B.default.weight" in names


def _meta_speech_llm(encoder, llm, connector, *, freeze_encoder=False):
    """SpeechLLM around meta-device parts (no memory, no download) with the paper's LoRA."""
    model = SpeechLLM(
        encoder=encoder,
        connector=connector,
        llm=llm,
        tokenizer=build_char_tokenizer(),
        feature_extractor=WhisperFeatureExtractor(feature_size=encoder.config.num_mel_bins),
    )
    add_lora(model.llm, targets=LLM_LORA_TARGETS, r=8)
    if not freeze_encoder:
        add_lora(model.encoder, targets=ENCODER_LORA_TARGETS, r=8)
    model.set_trainable(train_encoder_lora=not freeze_encoder)
    return model


WHISPER_TURBO = WhisperConfig(
    d_model=1280,
    encoder_layers=32,
    encoder_attention_heads=20,
    encoder_ffn_dim=5120,
    num_mel_bins=128,
    max_source_positions=1500,
)
TINYLLAMA = LlamaConfig(
    hidden_size=2048,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
)
EUROLLM = LlamaConfig(
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=5632,
    vocab_size=128000,
)


@pytest.mark.parametrize("llm_config", [TINYLLAMA, EUROLLM], ids=["tinyllama", "eurollm"])
def test_real_whisper_llm_lora_counts_on_meta(llm_config):
    with torch.device("meta"):
        encoder = WhisperEncoder(WHISPER_TURBO)
        llm = AutoModelForCausalLM.from_config(llm_config)
        connector = FrameStackConnector(input_size=1280, output_size=2048, downsample_k=4)
    model = _meta_speech_llm(encoder, llm, connector)
    counts = _trainable_by_component(model)
    h, layers = llm_config.hidden_size, llm_config.num_hidden_layers
    kv_out = h // llm_config.num_attention_heads * llm_config.num_key_value_heads
    # Table I, encoder row: 32 layers x {q,k,v} x {A,B} tensors of r*1280 = 10,240 each.
    assert counts["encoder"] == 32 * 3 * 2 * 10_240 == 1_966_080
    assert counts["llm"] == layers * (8 * (h + h) + 8 * (h + kv_out))
    assert counts["connector"] == 4 * 1280 * 2048 + 2048
    if llm_config is TINYLLAMA:
        # Table I, LLM row: 44 = 22 layers x {q,v}; 16,384 = r*2048; its total 720,896 equals
        # the sum of the lora_A tensors only (v_proj's B is 256x8 under grouped-query attention).
        assert _lora_numel(model, "llm.", "A") == 44 * 16_384 == 720_896
        assert counts["llm"] == 1_126_400
    frozen = _meta_speech_llm(*_meta_parts(llm_config), freeze_encoder=True)
    assert "encoder" not in _trainable_by_component(frozen)


def _meta_parts(llm_config):
    with torch.device("meta"):
        return (
            WhisperEncoder(WHISPER_TURBO),
            AutoModelForCausalLM.from_config(llm_config),
            FrameStackConnector(input_size=1280, output_size=2048, downsample_k=4),
        )


def test_voxtral_split_and_lora_counts_on_meta():
    config = VoxtralConfig(
        audio_config={"model_type": "voxtral_encoder"},
        text_config={"model_type": "llama", "vocab_size": 131072},
        audio_token_id=24,
    )
    with torch.device("meta"):
        vox = VoxtralForConditionalGeneration(config)
    encoder, connector, llm = split_voxtral(vox)
    assert connector.downsample_k == 4 and connector.kind == "mlp"
    assert llm.model is vox.model.language_model and llm.lm_head is vox.lm_head
    model = _meta_speech_llm(encoder, llm, connector)
    counts = _trainable_by_component(model)
    text = config.text_config  # 30 layers, hidden 3072, 32 heads of 128, 8 kv heads
    q_out, kv_out = (
        text.num_attention_heads * text.head_dim,
        text.num_key_value_heads * text.head_dim,
    )
    assert counts["encoder"] == 32 * 3 * 8 * (1280 + 1280)
    assert counts["llm"] == 30 * (8 * (3072 + q_out) + 8 * (3072 + kv_out)) == 2_703_360
    assert counts["connector"] == 5120 * 3072 + 3072 * 3072


# ---------------------------------------------------------------------- optimiser and wire format
def test_param_groups_and_trainable_state_roundtrip(cache):
    model = build_speech_llm("tiny", cache_dir=cache, freeze_encoder=False, seed=4)
    groups = {g["name"]: g for g in model.param_groups(1e-3, encoder_lr_multiplier=0.02)}
    assert groups["encoder"]["lr"] == pytest.approx(2e-5) and groups["llm_connector"]["lr"] == 1e-3
    n_trainable = sum(p.requires_grad for p in model.parameters())
    assert sum(len(g["params"]) for g in groups.values()) == n_trainable
    state = trainable_state(model)
    assert len(state) == n_trainable
    other = build_speech_llm("tiny", cache_dir=cache, freeze_encoder=False, seed=5)
    load_trainable(other, state, strict=True)
    for name, value in trainable_state(other).items():
        torch.testing.assert_close(value, state[name])
    with pytest.raises(ValueError, match="missing"):
        load_trainable(other, {k: v for k, v in state.items() if "connector" not in k}, strict=True)
