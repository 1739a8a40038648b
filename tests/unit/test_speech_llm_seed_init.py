"""The tiny seed's initialisation: encoder and LLM pretrained apart, connector drawn fresh.

``pretrain_text_lm`` trains the LLM alone on text; a seed folder saved without its connector
(the MLS recipe's seed) loads through ``build_speech_llm`` with a connector drawn from the
seed, as the hub checkpoints do.
"""

from __future__ import annotations

import pytest
import torch

from speechbrain_fl.models.presets import build_speech_llm
from speechbrain_fl.models.pretrain import pretrain_text_lm

TEXTS = [("hello world", "english"), ("guten tag", "german"), ("dzień dobry", "polish")]


def _tiny(cache, **options):
    return build_speech_llm(
        "tiny", cache_dir=cache, lora_r=0, seed=0, prompt="transcribe {language}", **options
    )


def test_text_lm_trains_the_llm_alone(tmp_path):
    model = _tiny(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = pretrain_text_lm(model, TEXTS, steps=30, lr=1e-2, batch_size=3, seed=0)
    assert out["loss"][-1] < 0.5 * out["loss"][0]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("llm.") for n in changed)
    assert not any(n.startswith(("encoder.", "connector.")) for n in changed)


def test_text_lm_refuses_lora_and_empty_input(tmp_path):
    with pytest.raises(ValueError, match="lora_r=0"):
        pretrain_text_lm(build_speech_llm("tiny", cache_dir=tmp_path, seed=0), TEXTS, steps=1)
    with pytest.raises(ValueError, match="no texts"):
        pretrain_text_lm(_tiny(tmp_path), [], steps=1)


def test_seed_without_connector_loads_a_fresh_connector(tmp_path):
    """The saved encoder and LLM come back as saved; the connector is the one a hub checkpoint
    would get from the same seed (drawn at load time, not the saved model's)."""
    model = _tiny(tmp_path / "cache", ctc_weight=1.0)
    pretrain_text_lm(model, TEXTS, steps=2, batch_size=2)
    with torch.no_grad():
        model.connector.linear.weight.fill_(0.5)  # a pretraining connector, to be discarded
    folder = model.save_pretrained(tmp_path / "seed")
    (folder / "extra.safetensors").unlink()
    loaded = build_speech_llm(folder, lora_r=8, freeze_encoder=False, seed=3)
    again = build_speech_llm(folder, lora_r=8, freeze_encoder=False, seed=3)
    other = build_speech_llm(folder, lora_r=8, freeze_encoder=False, seed=4)
    saved = model.llm.state_dict()
    for name, value in loaded.llm.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, saved[name.replace(".base_layer", "")]), name
    weight = loaded.connector.linear.weight
    assert not torch.all(weight == 0.5)
    assert torch.equal(weight, again.connector.linear.weight)
    assert not torch.equal(weight, other.connector.linear.weight)
    assert loaded.connector.linear.weight.requires_grad
