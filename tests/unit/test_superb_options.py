"""SUPERB real-data options: lr schedule and groups, balanced sampling, LayerDrop/SpecAugment
keys, input normalisation as the checkpoint's feature extractor does, the deep-only baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
sys.path.insert(0, str(RECIPE))

from speechbrain_fl.models.multi_exit_optim import balanced_sampler, build_optimizer, lr_factor  # noqa: E402
from speechbrain_fl.models.multi_exit_wav2vec2 import (  # noqa: E402
    MultiExitWav2Vec2,
    build_multi_exit,
    checkpoint_normalizes,
    create_tiny_wav2vec2,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return create_tiny_wav2vec2(tmp_path_factory.mktemp("w2v"), seed=0)


def test_lr_factor_warmup_then_cosine_to_the_floor():
    # T = 10, W = 2: 1/2, 1, then cosine from 1 (step 3) towards m = 0.1
    f = [lr_factor(s, 10, warmup_fraction=0.2, min_ratio=0.1) for s in range(1, 11)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0) and f[2] == pytest.approx(1.0)
    expected = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 7 / 8))  # step 10: (10 - 2 - 1) / 8
    assert f[-1] == pytest.approx(expected)
    assert all(a >= b for a, b in zip(f[1:], f[2:], strict=False))  # non-increasing after warmup
    assert lr_factor(5, 10, min_ratio=1.0) == 1.0  # floor 1: constant
    assert lr_factor(99, 10) == lr_factor(10, 10)  # clamped past the end


def test_backbone_and_heads_get_their_own_lr(tiny_folder):
    from transformers import Wav2Vec2Model

    model = MultiExitWav2Vec2(Wav2Vec2Model.from_pretrained(tiny_folder), num_outputs=3)
    opt = build_optimizer(
        model, opt_class=torch.optim.AdamW, lr=1e-3, backbone_lr_multiplier=0.05, factor=0.5
    )
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["heads"]["lr"] == pytest.approx(5e-4)
    assert groups["backbone"]["lr"] == pytest.approx(2.5e-5)
    assert groups["heads"]["initial_lr"] == pytest.approx(1e-3)
    heads = {id(p) for p in model.heads.parameters()}
    assert {id(p) for p in groups["heads"]["params"]} == heads
    assert len(groups["backbone"]["params"]) + len(heads) == len(list(model.parameters()))


def test_balanced_sampler_draws_classes_equally(tmp_path):
    path = tmp_path / "train.csv"
    rows = ["ID,label"] + [f"u{i},_unknown_" for i in range(60)] + [f"y{i},yes" for i in range(20)]
    path.write_text("\n".join(rows) + "\n")
    torch.manual_seed(0)
    drawn = list(balanced_sampler(path, num_samples=4000))
    share_unknown = np.mean([i < 60 for i in drawn])
    assert abs(share_unknown - 0.5) < 0.03  # 75% of the clips, half of the draws
    (tmp_path / "asr.csv").write_text("ID,wrd\na,hello\n")
    with pytest.raises(ValueError, match="no 'label' column"):
        balanced_sampler(tmp_path / "asr.csv")


def test_normalisation_matches_the_feature_extractor():
    from transformers import Wav2Vec2FeatureExtractor

    rng = np.random.default_rng(0)
    a, b = rng.normal(0.3, 2.0, 1600), rng.normal(-0.1, 0.5, 1000)
    extractor = Wav2Vec2FeatureExtractor(do_normalize=True, return_attention_mask=True)
    ref = extractor([a, b], sampling_rate=16000, padding=True, return_tensors="pt")
    wavs = torch.zeros(2, 1600, dtype=torch.float64)
    wavs[0], wavs[1, :1000] = torch.from_numpy(a), torch.from_numpy(b)
    mask = torch.arange(1600)[None, :] < torch.tensor([1600, 1000])[:, None]
    ours = MultiExitWav2Vec2.normalize(wavs, mask).float()
    torch.testing.assert_close(ours, ref["input_values"], atol=1e-4, rtol=1e-4)


def test_config_overrides_and_normalisation_auto(tiny_folder, tmp_path):
    model = build_multi_exit(
        str(tiny_folder), num_outputs=2, cache_dir=tmp_path,
        config_overrides={"layerdrop": 0.0, "mask_time_length": 3, "mask_time_min_masks": 1},
    )  # fmt: skip
    config = model.backbone.config
    assert (config.layerdrop, config.mask_time_length, config.mask_time_min_masks) == (0.0, 3, 1)
    assert model.normalize_input is False  # the tiny preset has no preprocessor_config.json
    with pytest.raises(ValueError, match="not Wav2Vec2Config fields"):
        build_multi_exit(str(tiny_folder), num_outputs=2, cache_dir=tmp_path,
                         config_overrides={"layer_drop": 0.0})  # fmt: skip
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((Path(tiny_folder) / name).read_bytes())
    (folder / "preprocessor_config.json").write_text(json.dumps({"do_normalize": True}))
    assert checkpoint_normalizes(folder) is True
    assert build_multi_exit(str(folder), num_outputs=2, cache_dir=tmp_path).normalize_input


def test_layerdrop_key_reaches_training(tiny_folder, tmp_path):
    """LayerDrop 0 (the recipe's): every layer runs in training; a config default would skip."""
    model = build_multi_exit(
        str(tiny_folder), num_outputs=2, cache_dir=tmp_path, config_overrides={"layerdrop": 0.0}
    ).train()
    calls = []
    hooks = [layer.register_forward_hook(lambda *a: calls.append(1))
             for layer in model.backbone.encoder.layers]  # fmt: skip
    for _ in range(5):
        model(torch.randn(2, 8000), torch.ones(2), depth=12)
    for h in hooks:
        h.remove()
    assert len(calls) == 5 * 12


def test_deep_only_baseline_drops_the_shallow_group():
    from superb_settings import SuperbSettings, drop_shallow_clients, trained_exits

    settings = SuperbSettings(clients=["a", "b", "c", "d"], depths=[3, 6, 3, 6])
    drop_shallow_clients(settings, 3)
    assert settings.clients == ["b", "d"] and settings.depths == [6, 6]
    assert settings.num_clients == 2
    hp = {"exit": None, "best_exit": 6, "shallow_exit": 3, "scenario": "heterogeneous"}
    assert trained_exits({**hp, "shallow_clients": "drop"}) == [6]
    assert trained_exits({**hp, "shallow_clients": "train"}) == [3, 6]
