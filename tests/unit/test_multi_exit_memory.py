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
