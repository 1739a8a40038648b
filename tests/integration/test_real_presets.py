"""The real presets' architecture configs against the code, and one preset end to end offline.

Cheap tests (meta-device builds, no weights): the configs of ``speechbrain_fl/models/configs/``
give the published dimensions and parameter counts, and a config that disagrees with the code
(a dimension, a module name LoRA targets, the feature extractor's mel bins) fails with a
message naming the file and key.

The slow test runs ``benchmarks/real_presets.py`` for the smallest real preset
(``whisper_tinyllama``) in a subprocess: random weights written like the hub repositories,
loaded through the recipe's ``build_brain`` / ``from_pretrained`` path, one federated client
update (``train_round``: one AdamW step, delta, alpha-split clipping) and one greedy decode of an
espeak-ng utterance; by default with two layers per stack (see ``NUM_LAYERS`` below), at full
size with ``SBFL_REAL_PRESET_FULL_SIZE=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speechbrain_fl.models.configs import (
    CONFIG_ROOT,
    PresetConfigError,
    check_preset,
    config_folder,
    hub_ids,
    model_config,
    standin_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
R = 8  # the paper's LoRA rank


@pytest.fixture
def configs(tmp_path):
    """A writable copy of the configs folder."""
    root = tmp_path / "configs"
    shutil.copytree(CONFIG_ROOT, root, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return root


def _edit(root: Path, model_id: str, name: str, **changes) -> None:
    path = config_folder(model_id, root=root) / name
    values = json.loads(path.read_text())
    for key, value in changes.items():
        target = values
        *parents, last = key.split(".")
        for part in parents:
            target = target[part]
        target[last] = value
    path.write_text(json.dumps(values))


def test_published_sizes_of_the_real_presets_on_meta():
    """Parameter counts of the meta-device builds equal the published model sizes."""
    tl = check_preset("whisper_tinyllama")["unfrozen"]
    # Whisper large-v3-turbo encoder: 32 layers, d_model 1280; Table I: 32 x {q,k,v} x (A, B).
    assert tl["encoder"]["trainable"] == 32 * 3 * 2 * R * 1280 == 1_966_080
    assert tl["encoder"]["total"] - tl["encoder"]["trainable"] == 636_968_960
    # TinyLlama-1.1B: 1,100,048,384 base parameters; LoRA on 22 x {q, v} (v out 256, GQA).
    assert tl["llm"]["total"] - tl["llm"]["trainable"] == 1_100_048_384
    assert tl["llm"]["trainable"] == 22 * (R * (2048 + 2048) + R * (2048 + 256)) == 1_126_400
    assert tl["connector"]["trainable"] == 4 * 1280 * 2048 + 2048
    eu = check_preset("whisper_eurollm")["frozen"]
    assert "encoder" in eu and eu["encoder"]["trainable"] == 0
    # EuroLLM-1.7B: 1.657B parameters (untied 128,000 x 2048 embedding and head).
    assert eu["llm"]["total"] - eu["llm"]["trainable"] == 1_656_850_432
    vx = check_preset("voxtral")["frozen"]
    # Voxtral-Mini-3B: 4.68B = audio tower + pretrained projector (5120->3072->3072) + LM.
    assert vx["connector"]["trainable"] == 5120 * 3072 + 3072 * 3072
    total = sum(c["total"] - (c["trainable"] if k == "llm" else 0) for k, c in vx.items())
    assert total == 4_676_271_104


def test_standin_tokenizers_have_the_real_vocabulary_size():
    for preset in ("whisper_tinyllama", "whisper_eurollm", "voxtral"):
        ids = hub_ids(preset)
        llm_id = ids.get("llm", ids.get("model"))
        tokenizer = standin_tokenizer(llm_id)
        config = model_config(llm_id)
        vocab = getattr(config, "text_config", config).vocab_size
        assert len(tokenizer) == vocab
        assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1


def test_num_layers_reduces_only_the_depth():
    config = model_config("mistralai/Voxtral-Mini-3B-2507", num_layers=2)
    assert config.audio_config.num_hidden_layers == 2 and config.text_config.num_hidden_layers == 2
    assert config.audio_config.num_mel_bins == 128 and config.text_config.vocab_size == 131072
    counts = check_preset("whisper_tinyllama", num_layers=1)["unfrozen"]
    assert counts["encoder"]["trainable"] == 1 * 3 * 2 * R * 1280


@pytest.mark.parametrize("preset", ["whisper_tinyllama", "whisper_eurollm", "voxtral"])
def test_each_real_preset_trains_its_llm_lora(preset):
    """The recipe's hparams for a real preset build a layout with trainable LLM LoRA groups.

    The hparams are the recipe's own (base.yaml + hparams/models/<preset>.yaml, as train_fl.py
    loads them), the model is the preset's architecture on the meta device (one layer per stack).
    """
    sys.path.insert(0, str(ROOT / "recipes" / "MLS"))
    from mls_settings import model_options

    from speechbrain_fl.recipe.hparams import load_layered_hparams

    hparams, _, _ = load_layered_hparams(
        "hparams/flat.yaml", {"model": preset}, recipe_dir=ROOT / "recipes" / "MLS"
    )
    options = model_options(hparams)
    assert options["train_llm_lora"] is True
    counts = check_preset(
        preset,
        num_layers=1,
        train_llm_lora=options["train_llm_lora"],
        connector_treatment=options["connector_treatment"],
    )
    for variant in ("frozen", "unfrozen"):
        llm = counts[variant]["llm"]
        # 1 layer x {q_proj, v_proj} x {lora_A, lora_B}
        assert llm["trainable_lora_groups"] == 4 and llm["trainable"] > 0
    assert counts["unfrozen"]["encoder"]["trainable_lora_groups"] == 6  # {q, k, v} x {A, B}
    # Voxtral's pretrained projector stays fixed; the Whisper presets' connector from scratch trains
    connector = counts["unfrozen"]["connector"]["trainable"]
    assert (connector == 0) == (preset == "voxtral")


def test_a_wrong_dimension_fails_naming_the_key(configs):
    _edit(configs, "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "config.json", hidden_size=2560)
    with pytest.raises(
        PresetConfigError, match=r"TinyLlama-1\.1B-Chat-v1\.0/config\.json: hidden_size"
    ):
        check_preset("whisper_tinyllama", num_layers=1, root=configs)


def test_mel_bins_disagreeing_with_the_feature_extractor_fail(configs):
    _edit(configs, "mistralai/Voxtral-Mini-3B-2507", "preprocessor_config.json", feature_size=80)
    with pytest.raises(PresetConfigError, match="feature_size = 80 mel bins.*num_mel_bins = 128"):
        check_preset("voxtral", num_layers=1, root=configs)


def test_a_module_name_lora_targets_missing_fails_naming_it(configs):
    """An LLM whose attention fuses q/k/v (Phi-3: ``qkv_proj``) has no ``q_proj``/``v_proj``."""
    _edit(
        configs,
        "utter-project/EuroLLM-1.7B-Instruct",
        "config.json",
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
    )
    with pytest.raises(PresetConfigError, match=r"no module named \['q_proj', 'v_proj'\]"):
        check_preset("whisper_eurollm", num_layers=1, root=configs)


def test_a_tokenizer_of_another_size_fails(configs):
    _edit(
        configs, "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tokenizer_settings.json", vocab_size=32001
    )
    with pytest.raises(PresetConfigError, match="tokenizer_settings.json: vocab_size = 32001"):
        check_preset("whisper_tinyllama", num_layers=1, root=configs)


# The full-size run of this test took 474 s with a 4.9 GiB peak on the 2-core shared CPU it was
# written on (load average ~20; writing the 1.7B random weights alone takes 2-5 min), over the
# ~5 min a slow test may take. By default it therefore builds the real architecture with
# num_layers=2 (every width, head count, vocabulary size, the 128 mel bins and the 30 s window
# real; two layers per stack): set SBFL_REAL_PRESET_FULL_SIZE=1 for the full-size run. The
# full-size figures of all presets come from benchmarks/real_presets.py (recipes/MLS/README.md).
FULL_SIZE = os.environ.get("SBFL_REAL_PRESET_FULL_SIZE") == "1"
NUM_LAYERS = None if FULL_SIZE else 2


@pytest.mark.slow
@pytest.mark.heavy
def test_smallest_real_preset_end_to_end(tmp_path):
    """whisper_tinyllama, random weights: write, load, one client update, decode (offline)."""
    output = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "real_presets.py"),
        "--presets",
        "whisper_tinyllama",
        "--batch-sizes",
        "1",
        "--freeze-encoder",
        "true",
        "--max-new-tokens",
        "4",
        "--work-dir",
        str(tmp_path),
        "--output",
        str(output),
    ]
    if NUM_LAYERS is not None:
        cmd += ["--num-layers", str(NUM_LAYERS)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(output.read_text())["results"]
    assert result["num_layers"] == NUM_LAYERS
    (setting,) = result["settings"]
    counts = setting["counts"]
    # The model loaded through from_pretrained has exactly the meta-device build's parameters.
    assert counts == result["meta_counts"]["frozen"]
    assert counts["encoder"]["trainable"] == 0
    layers = NUM_LAYERS or 22
    assert counts["llm"]["trainable"] == layers * (R * (2048 + 2048) + R * (2048 + 256))
    assert counts["connector"]["trainable"] == 4 * 1280 * 2048 + 2048
    if FULL_SIZE:
        assert counts["encoder"]["total"] == 636_968_960
        assert counts["llm"]["total"] - counts["llm"]["trainable"] == 1_100_048_384
    (step,) = setting["steps"]
    assert step["finite"] and step["train_loss"] > 0
    # alpha-split: sqrt(sum_l C_l^2) = C, so the clipped update's L2 norm is at most C.
    assert step["post_clip_joint_norm"] <= step["clip"] * (1 + 1e-5)
    # The update sent is the fp32 trainable tensors (LLM LoRA + connector), plus a small
    # header per serialised array.
    trainable = sum(c["trainable"] for c in counts.values())
    assert 4 * trainable < step["wire_bytes"] < 4 * trainable + 1024 * 100
    assert isinstance(result["decode"]["text"], str)
    assert any("connector" in d for d in setting["layout"]["differences"])
