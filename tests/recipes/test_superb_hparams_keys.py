"""No dead keys in the SUPERB hparams files, and the objects they build are the ones used.

SpeechBrain's ``tests/consistency/test_yaml.py`` check, per file: every top-level key is
referenced by another key (``!ref <key>``) or read by the recipe's Python code (its modules,
its studies, or the recipe kit and ``FLConfig.from_hparams``, which read the engine keys). A
task file is applied on ``base.yaml``, so it may only override base keys.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from speechbrain_fl.fl.settings.config import FLConfig

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
HPARAMS = RECIPE / "hparams"
KIT = Path(__file__).resolve().parents[2] / "speechbrain_fl" / "recipe"
sys.path.insert(0, str(RECIPE))

CODE = "\n".join(
    p.read_text() for p in [*RECIPE.glob("*.py"), *RECIPE.glob("studies/*.py"), *KIT.glob("*.py")]
)
FILES = sorted(HPARAMS.glob("*.yaml"))


def top_level_keys(path: Path) -> list[str]:
    """The file's top-level keys, in order (``key:`` at the start of a line)."""
    return re.findall(r"^([A-Za-z_][A-Za-z0-9_]*):", path.read_text(), flags=re.M)


def read_by_code(key: str) -> bool:
    """The Python names the key: ``"key"`` (a lookup, or a tuple of keys) or ``hparams.key``."""
    return f'"{key}"' in CODE or re.search(rf"\b(hparams|hp)\.{key}\b", CODE) is not None


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_top_level_key_is_used(path):
    referenced = (HPARAMS / "base.yaml").read_text() + path.read_text()
    unused = [
        key
        for key in top_level_keys(path)
        if not key.startswith("__")
        and f"<{key}>" not in referenced
        and not read_by_code(key)
        and key not in FLConfig.yaml_keys()
    ]
    assert unused == [], f"{path.name}: keys used nowhere: {unused}"


@pytest.mark.parametrize("path", [p for p in FILES if p.name != "base.yaml"], ids=lambda p: p.name)
def test_task_files_only_override_base_keys(path):
    extra = set(top_level_keys(path)) - set(top_level_keys(HPARAMS / "base.yaml"))
    assert extra == set(), f"{path.name} sets keys base.yaml does not have: {sorted(extra)}"


def test_the_dead_key_check_finds_a_dead_key():
    assert not read_by_code("no_such_superb_key")
    assert read_by_code("centralized_epochs") and read_by_code("opt_class")


def test_base_yaml_builds_the_objects_the_brain_uses(tmp_path):
    """opt_class, lr_annealing, model_factory and the metric computers come from base.yaml,
    with the same numbers as the functions they wrap."""
    from speechbrain.utils.metric_stats import ErrorRateStats
    from superb_task import load_hparams

    from speechbrain_fl.models.multi_exit_optim import lr_factor
    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit

    hparams, _, _ = load_hparams("hparams/kws.yaml", {"output_folder": str(tmp_path)})
    assert hparams["opt_class"].func is torch.optim.AdamW
    assert hparams["opt_class"].keywords == {"weight_decay": hparams["weight_decay"]}
    assert hparams["model_factory"] is build_multi_exit
    assert isinstance(hparams["error_stats"](), ErrorRateStats)
    for step in (1, 4, 40):
        assert hparams["lr_annealing"](step, 40) == lr_factor(
            step, 40, warmup_fraction=0.1, min_ratio=0.05
        )
