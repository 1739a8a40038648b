"""fl/params.py (one copy loop, fingerprint) and the federated model checkpoint round trip."""

import json

import pytest
import torch

from speechbrain_fl.fl.params import (
    load_trainable,
    params_fingerprint,
    trainable_parameters,
    trainable_state,
)
from speechbrain_fl.models.checkpoint import load_federated_model, save_federated_model
from speechbrain_fl.models.presets import build_speech_llm

OPTIONS = {"freeze_encoder": False, "lora_r": 4, "lora_alpha": 8, "ctc_weight": 0.5}


def test_load_trainable_names_unknown_missing_and_shape():
    lin = torch.nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    assert list(trainable_parameters(lin)) == ["weight"]
    with pytest.raises(ValueError, match="unexpected \\['bias'\\]"):
        load_trainable(lin, {"bias": torch.zeros(2)})
    with pytest.raises(ValueError, match="missing \\['weight'\\]"):
        load_trainable(lin, {}, strict=True)
    with pytest.raises(ValueError, match="weight: shape"):
        load_trainable(lin, {"weight": torch.zeros(3, 2)})
    load_trainable(lin, {"weight": torch.ones(2, 3, dtype=torch.float64)})
    assert lin.weight.dtype == torch.float32 and float(lin.weight.sum()) == 6.0
    assert params_fingerprint(trainable_state(lin)) == params_fingerprint({"weight": lin.weight})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiny")
    model = build_speech_llm("tiny", cache_dir=cache, seed=0, **OPTIONS)
    gen = torch.Generator().manual_seed(1)
    load_trainable(  # stand-in for federated training: every trainable tensor changed
        model,
        {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in
         trainable_parameters(model).items()},
    )  # fmt: skip
    return model, cache


def test_checkpoint_round_trip_reproduces_tensors_and_transcripts(trained, tmp_path):
    model, cache = trained
    folder = save_federated_model(
        model, tmp_path / "final", base="tiny", options=OPTIONS, info={"rounds": 2}
    )
    spec = json.loads((folder / "federated_model.json").read_text())
    assert sorted(spec["adapters"]) == ["encoder", "llm"] and spec["info"] == {"rounds": 2}
    assert (folder / "adapters" / "llm" / "adapter_config.json").is_file()
    loaded = load_federated_model(folder, cache_dir=str(cache))
    for name, value in trainable_state(model).items():
        torch.testing.assert_close(trainable_state(loaded)[name], value, rtol=0, atol=0)
    wav = torch.randn(1, 16000, generator=torch.Generator().manual_seed(2))
    lens = torch.ones(1)
    model.eval()
    kwargs = {"max_new_tokens": 5, "languages": ["english"]}
    assert loaded.transcribe(wav, lens, **kwargs) == model.transcribe(wav, lens, **kwargs)


def test_checkpoint_with_a_missing_adapter_is_refused(trained, tmp_path):
    model, cache = trained
    folder = save_federated_model(model, tmp_path / "final", base="tiny", options=OPTIONS)
    spec = json.loads((folder / "federated_model.json").read_text())
    spec["adapters"] = ["llm"]  # the encoder adapter is not loaded: fingerprint differs
    (folder / "federated_model.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        load_federated_model(folder, cache_dir=str(cache))
    with pytest.raises(OSError, match="federated_model.json missing"):
        load_federated_model(tmp_path, cache_dir=str(cache))


def test_llm_adapter_loads_with_peft(trained, tmp_path):
    """The adapter folder is peft's own layout: PeftModel.from_pretrained reads it."""
    from peft import PeftModel

    model, cache = trained
    folder = save_federated_model(model, tmp_path / "final", base="tiny", options=OPTIONS)
    base = build_speech_llm("tiny", cache_dir=cache, seed=0, lora_r=0).llm
    peft_llm = PeftModel.from_pretrained(base, str(folder / "adapters" / "llm"))
    theirs = {
        n.replace("base_model.model.", ""): p
        for n, p in peft_llm.named_parameters()
        if "lora_" in n
    }
    ours = {n[len("llm.") :]: p for n, p in model.named_parameters() if n.startswith("llm.")
            and "lora_" in n}  # fmt: skip
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        torch.testing.assert_close(theirs[name], value.detach())
