"""Depth selection under memory budgets (fake measurements) and the per-exit memory probe."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from speechbrain_fl.models.exit_memory import choose_depth

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"))

FAKE = {3: 100.0, 6: 150.0, 9: 200.0, 12: 250.0}


def test_choose_depth_measures_once_and_caches(tmp_path):
    calls = []

    def measure(depth):
        calls.append(depth)
        return FAKE[depth]

    cache = tmp_path / "mem.json"
    kwargs = dict(exits=[3, 6, 9, 12], cap=9, measure=measure, cache_file=cache, cache_key="k")
    assert choose_depth(budget_mb=160, **kwargs) == 6
    assert calls == [3, 6, 9]  # stops at the first exit that does not fit
    assert choose_depth(budget_mb=1000, **kwargs) == 9  # the task cap
    assert choose_depth(budget_mb=10, **kwargs) is None
    assert calls == [3, 6, 9]  # later decisions (e.g. each round) read the cache
    assert json.loads(cache.read_text())["k"] == {"3": 100.0, "6": 150.0, "9": 200.0}


def test_recipe_budget_policy_excludes_or_falls_back(tmp_path, caplog):
    from superb_task import apply_memory_budgets, budget_cache_key, budget_settings_for

    hparams = {
        "client_memory_budgets_mb": [50, 120, 400],
        "batch_size": 4,
        "task": "kws12",
        "exit": None,
        "best_exit": 6,
        "cache_folder": str(tmp_path),
        "budget_fallback": "exclude",
    }
    model = {
        "source": "fake",
        "head": "utterance",
        "num_outputs": 12,
        "freeze_feature_encoder": False,
        "exits": [3, 6, 9, 12],
    }

    def settings():
        return {"model": dict(model), "run_opts": {}, "clients": ["a.csv", "b.csv", "c.csv"]}

    # pre-fill the measurement cache with fake figures under the key the recipe will use
    key = budget_cache_key(budget_settings_for(hparams, settings()))
    (tmp_path / "exit_memory.json").write_text(
        json.dumps({key: {str(k): v for k, v in FAKE.items()}})
    )
    s = settings()
    with caplog.at_level(logging.WARNING):
        decisions = apply_memory_budgets(hparams, s)
    assert s["clients"] == ["b.csv", "c.csv"] and s["depths"] == [3, 6]  # cap = best_exit 6
    assert decisions[0] == {"client": 0, "budget_mb": 50.0, "exit": None, "action": "exclude"}
    assert "fits no exit" in caplog.text and s["eval_exits"] == [3, 6]
    s = settings()
    apply_memory_budgets({**hparams, "budget_fallback": "shallowest"}, s)
    assert s["depths"] == [3, 3, 6]
    with pytest.raises(ValueError, match="fits any exit"):
        apply_memory_budgets({**hparams, "client_memory_budgets_mb": [1]}, settings())


# --- training memory counted from tensors -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone

    return resolve_backbone("tiny", cache_dir=tmp_path_factory.mktemp("tiny"))


def _tiny_step(source, *, depth, seconds=0.5, freeze=False):
    """The multi-exit tiny model, the bytes of one step at ``depth``, and the model."""
    import torch

    from speechbrain_fl.models.exit_memory import count_step_memory
    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit

    torch.manual_seed(0)
    model = build_multi_exit(
        source, num_outputs=12, cache_dir=".", freeze_feature_encoder=freeze,
        config_overrides={"layerdrop": 0.0},
    )  # fmt: skip
    model.train()
    wavs, lens = torch.randn(2, int(seconds * 16000)), torch.ones(2)
    return count_step_memory(model, lambda: model(wavs, lens, depth=depth)), model


def test_activations_grow_with_depth_and_input_length(tiny_source):
    acts = {d: _tiny_step(tiny_source, depth=d)[0]["activations"] for d in (3, 6, 12)}
    assert 0 < acts[3] < acts[6] < acts[12]
    longer = _tiny_step(tiny_source, depth=3, seconds=1.0)[0]["activations"]
    assert longer > 1.8 * acts[3]  # about proportional to the samples


def test_weights_gradients_optimizer_match_the_parameter_counts(tiny_source):
    from speechbrain_fl.models.multi_exit_wav2vec2 import layer_of

    for depth in (3, 12):
        counted, model = _tiny_step(tiny_source, depth=depth)
        trained = set(model.trained_parameter_names(depth))
        used = 0
        for name, param in model.named_parameters():
            kind, index = layer_of(name)
            if not ((kind == "layer" and index > depth) or (kind == "exit" and index != depth)):
                used += param.numel()
        n_train = sum(p.numel() for n, p in model.named_parameters() if n in trained)
        assert counted["weights"] == 4 * used
        assert counted["gradients"] == 4 * n_train
        assert counted["optimizer"] == 8 * n_train  # AdamW: two fp32 moments
        parts = ("weights", "gradients", "optimizer", "activations")
        assert counted["total"] == sum(counted[k] for k in parts)


def test_frozen_part_has_no_gradient_or_optimizer_bytes(tiny_source):
    trained, _ = _tiny_step(tiny_source, depth=3)
    frozen, model = _tiny_step(tiny_source, depth=3, freeze=True)
    cnn = sum(p.numel() for p in model.backbone.feature_extractor.parameters())
    assert cnn > 0 and frozen["weights"] == trained["weights"]  # still used, still held
    assert trained["gradients"] - frozen["gradients"] == 4 * cnn
    assert trained["optimizer"] - frozen["optimizer"] == 8 * cnn
    assert frozen["activations"] < trained["activations"]  # the CNN saves nothing for backward


def test_training_memory_reports_mib_by_part_and_shallow_exit_saves(tiny_source):
    from speechbrain_fl.models.exit_memory import training_memory

    m3, m12 = (training_memory(tiny_source, depth=d, batch_size=2, seconds=0.5) for d in (3, 12))
    assert m3["method"] == "tensors"
    for m in (m3, m12):
        parts = m["weights"] + m["gradients"] + m["optimizer"] + m["activations"]
        assert m["total"] == pytest.approx(parts)
    assert m3 == training_memory(tiny_source, depth=3, batch_size=2, seconds=0.5)  # deterministic
    assert m3["total"] < m12["total"] and m3["weights"] < m12["weights"]
