"""No dead keys: every top-level key of the MLS base.yaml is used by train_fl.py or referenced.

A key counts as used by train_fl.py when the script names it or when
``FLConfig.from_hparams`` (which the script calls) reads it.

The same check SpeechBrain's ``tests/consistency/test_yaml.py`` runs upstream, plus: each method
file holds only keys of the base (it is applied on top of it) and includes the privacy keys.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from speechbrain_fl.fl.config import FLConfig
from speechbrain_fl.recipe.hparams import load_layered_hparams

HPARAMS = Path(__file__).resolve().parents[2] / "recipes" / "MLS" / "hparams"
# The recipe's scripts and modules, and the kit they run on (the skeleton reads the engine keys)
KIT = Path(__file__).resolve().parents[2] / "speechbrain_fl" / "recipe"
sys.path.insert(0, str(HPARAMS.parent))
from mls_settings import engine_hparams  # noqa: E402

SCRIPT = "\n".join(p.read_text() for p in [*HPARAMS.parent.glob("*.py"), *KIT.glob("*.py")])


def top_level_keys(path: Path) -> list[str]:
    keys = []
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):", line)
        if match:
            keys.append(match.group(1))
    return keys


def test_every_base_key_is_used():
    text = (HPARAMS / "base.yaml").read_text()
    unused = [
        key
        for key in top_level_keys(HPARAMS / "base.yaml")
        if not key.startswith("__")
        and f'"{key}"' not in SCRIPT
        and f"<{key}>" not in text
        and key not in FLConfig.yaml_keys()
    ]
    assert unused == [], f"keys of base.yaml used nowhere: {unused}"


@pytest.mark.parametrize("path", sorted(HPARAMS.glob("*.yaml")), ids=lambda p: p.name)
def test_method_files_only_override_base_keys(path):
    if path.name == "base.yaml":
        return
    values = yaml.safe_load(path.read_text())
    assert set(values) <= set(top_level_keys(HPARAMS / "base.yaml"))
    assert {"method", "noise_multiplier"} <= set(values)
    # C is resolved in base.yaml and the model preset only (fedavg.yaml's null turns it off), so
    # a method file cannot override the preset's C
    assert "clip" not in values or (values["method"] == "fedavg" and values["clip"] is None)


@pytest.mark.parametrize("path", sorted((HPARAMS / "models").glob("*.yaml")), ids=lambda p: p.name)
def test_model_presets_only_override_base_keys(path):
    values = yaml.safe_load(path.read_text()) or {}
    assert set(values) <= set(top_level_keys(HPARAMS / "base.yaml"))


DP_METHODS = sorted(p.stem for p in HPARAMS.glob("*.yaml") if p.stem not in ("base", "fedavg"))
# The C each model preset states: the paper's 1.0 for the real presets (Sec. II-D), 0.25 for the
# tiny default (its joint update norm is ~1, as the paper's LLM norm ~4 is to C = 1)
PRESET_CLIP = {"tiny": 0.25, "whisper_tinyllama": 1.0, "whisper_eurollm": 1.0, "voxtral": 1.0}


@pytest.mark.parametrize("method", DP_METHODS)
@pytest.mark.parametrize("model", sorted(PRESET_CLIP))
def test_each_model_preset_resolves_its_own_clip(tmp_path, method, model):
    """Every DP method file resolves C from the model preset; --clip overrides it; FedAvg none."""
    hp, _, _ = load_layered_hparams(
        HPARAMS / f"{method}.yaml",
        {"model": model, "output_folder": str(tmp_path)},
        recipe_dir=HPARAMS.parent,
    )
    assert hp["clip"] == PRESET_CLIP[model]
    assert FLConfig.from_hparams(engine_hparams(hp)).clip == PRESET_CLIP[model]
    hp, _, _ = load_layered_hparams(
        HPARAMS / f"{method}.yaml",
        {"model": model, "clip": 0.5, "output_folder": str(tmp_path)},
        recipe_dir=HPARAMS.parent,
    )
    assert hp["clip"] == 0.5
    hp, _, _ = load_layered_hparams(
        HPARAMS / "fedavg.yaml",
        {"model": model, "output_folder": str(tmp_path)},
        recipe_dir=HPARAMS.parent,
    )
    assert hp["clip"] is None and FLConfig.from_hparams(hp).clip is None


def test_every_model_preset_states_its_clip():
    for path in (HPARAMS / "models").glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["clip"] == PRESET_CLIP[path.stem], path.name


def _base_values() -> dict:
    """base.yaml's plain values (HyperPyYAML tags such as !ref / !new read as None)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load((HPARAMS / "base.yaml").read_text(), Loader=Loader)


def test_readme_hyperparameter_table_matches_base_yaml():
    """Every ``| `key`: ... | `value` |`` row of the recipe README names a base.yaml key, and
    a single literal default in the value cell equals the key's value in base.yaml."""
    readme = (HPARAMS.parent / "README.md").read_text()
    base = _base_values()
    rows = re.findall(r"^\| `([a-z_]+)`: [^\n]*\| `([^`]*)`([^|]*)\|$", readme, flags=re.M)
    assert len(rows) > 40, "the README's hyperparameter table was not found"
    wrong = []
    for key, literal, _rest in rows:
        assert key in base, f"README documents {key!r}, which base.yaml does not have"
        if base[key] is None and literal != "null" or ":" in literal:
            continue  # a !ref/!new value or a mapping, described in words
        if yaml.safe_load(literal) != base[key]:
            wrong.append((key, literal, base[key]))
    assert wrong == [], f"README default != base.yaml value (key, README, base.yaml): {wrong}"
