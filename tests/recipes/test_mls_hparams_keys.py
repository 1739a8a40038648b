"""No dead keys: every top-level key of every MLS hparams file is used by the recipe or referenced.

A key counts as used by train_fl.py when the script names it or when
``FLConfig.from_hparams`` (which the script calls) reads it.

The same check SpeechBrain's ``tests/consistency/test_yaml.py`` runs upstream, for base.yaml, each
method file and each model preset (a layer's key must be a base key, so it is used too), plus: each
method file includes the privacy keys, and the objects swap as HyperPyYAML objects.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from hyperpyyaml import load_hyperpyyaml, resolve_references

from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy.methods import AlphaSplit, PFLDim
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


def _plain(path: Path) -> dict:
    """A file's plain values (HyperPyYAML tags such as !ref / !new / !name read as None)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load(path.read_text(), Loader=Loader) or {}


ALL_FILES = sorted([*HPARAMS.glob("*.yaml"), *(HPARAMS / "models").glob("*.yaml")])


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(HPARAMS)))
def test_every_key_is_used(path):
    """Each top-level key is read by the recipe's Python code (``"key"``), referenced by
    another key (``<key>``), read by the engine config, or a base.yaml key (a layer's value
    replaces the base's, which must then be used)."""
    base_text = (HPARAMS / "base.yaml").read_text()
    unused = [
        key
        for key in top_level_keys(path)
        if not key.startswith("__")
        and f'"{key}"' not in SCRIPT
        and f"<{key}>" not in base_text
        and key not in FLConfig.yaml_keys()
    ]
    assert unused == [], f"keys of {path.name} used nowhere: {unused}"
    assert set(top_level_keys(path)) <= set(top_level_keys(HPARAMS / "base.yaml")), path.name


def test_objects_are_built_from_the_hparams(tmp_path):
    """The model factory, optimizer, lr schedule, WER computer and train logger are objects of
    the hparams file; a real preset swaps the optimizer class with its own object."""
    hp, _, _ = load_layered_hparams(
        HPARAMS / "flat.yaml", {"output_folder": str(tmp_path)}, recipe_dir=HPARAMS.parent
    )
    assert hp["opt_class"].func.__name__ == "AdamW"
    assert hp["opt_class"].keywords == {"weight_decay": 0.0}
    assert hp["speech_llm"].keywords["lora_r"] == hp["lora_r"]
    assert hp["error_stats"]().__class__.__name__ == "ErrorRateStats"
    assert hp["lr_schedule"](1, 10) == hp["lr"]
    hp, _, _ = load_layered_hparams(
        HPARAMS / "flat.yaml",
        {"model": "voxtral", "output_folder": str(tmp_path)},
        recipe_dir=HPARAMS.parent,
    )
    assert hp["opt_class"].func.__name__ == "AdamW"
    assert hp["opt_class"].keywords == {"weight_decay": 0.0}
    assert hp["lr_schedule"](1, 40) == hp["lr"] == 0.0001


@pytest.mark.parametrize("path", sorted(HPARAMS.glob("*.yaml")), ids=lambda p: p.name)
def test_method_files_only_override_base_keys(path):
    if path.name == "base.yaml":
        return
    values = _plain(path)
    assert set(values) <= set(top_level_keys(HPARAMS / "base.yaml"))
    assert {"method", "experiment_name", "noise_multiplier"} <= set(values)
    assert values["experiment_name"] == path.stem  # the run's folder name, as before
    # C is resolved in base.yaml and the model preset only (fedavg.yaml's null turns it off), so
    # a method file cannot override the preset's C
    assert "clip" not in values or (path.stem == "fedavg" and values["clip"] is None)


METHOD_CLASSES = {
    "fedavg": "FedAvg", "flat": "Flat", "pfl_uniform": "PFLUniform", "pfl_dim": "PFLDim",
    "pfl_dim_ema": "PFLDimEMA", "pfl_unif_ema": "PFLUnifEMA", "alpha_split": "AlphaSplit",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(METHOD_CLASSES))
def test_each_method_file_builds_its_method_object_from_the_privacy_keys(tmp_path, name):
    """The method file's ``method`` is its class, holding the file's clip, noise, alpha and EMA
    keys (a command-line override of a key reaches the object); the output folder is the
    method's name as before; FLConfig reads the object."""
    hp, _, _ = load_layered_hparams(HPARAMS / f"{name}.yaml", recipe_dir=HPARAMS.parent)
    method = hp["method"]
    assert type(method).__name__ == METHOD_CLASSES[name] and method.name == name
    assert (method.clip, method.noise_multiplier) == (hp["clip"], hp["noise_multiplier"])
    for key in ("alpha", "ema_beta", "ema_gamma", "ema_warmup_rounds", "ema_signal"):
        assert getattr(method, key, hp[key]) == hp[key], key
    assert hp["output_folder"] == f"results/MLS/tiny/{name}/freeze_encoder_False/1234"
    cfg = FLConfig.from_hparams(engine_hparams(hp))
    assert cfg.noise_multiplier == hp["noise_multiplier"]
    assert cfg.clip is None if name == "fedavg" else cfg.method == name
    overrides = {"noise_multiplier": 0.3, "alpha": 0.2, "ema_warmup_rounds": 1, "clip": 0.5}
    if name == "fedavg":
        overrides = {"noise_multiplier": 0.0}
    hp, _, _ = load_layered_hparams(
        HPARAMS / f"{name}.yaml", {**overrides, "output_folder": str(tmp_path)},
        recipe_dir=HPARAMS.parent,
    )  # fmt: skip
    for key, value in overrides.items():
        assert getattr(hp["method"], key, value) == value, key


def test_a_method_name_on_the_command_line_becomes_its_class(tmp_path):
    """``--method pfl_dim`` on alpha_split.yaml: the registered class, built from the privacy
    keys where the hparams are loaded; the folder follows ``--experiment_name``."""
    hp, _, _ = load_layered_hparams(
        HPARAMS / "alpha_split.yaml",
        {"method": "pfl_dim", "experiment_name": "pfl_dim", "noise_multiplier": 0.2},
        recipe_dir=HPARAMS.parent,
    )
    assert hp["method"] == PFLDim(clip=0.25, noise_multiplier=0.2)
    assert "/pfl_dim/" in hp["output_folder"]
    cfg = FLConfig.from_hparams(engine_hparams(hp))
    assert (cfg.method, cfg.clip, cfg.noise_multiplier, cfg.alpha) == ("pfl_dim", 0.25, 0.2, None)


@pytest.mark.parametrize("path", sorted((HPARAMS / "models").glob("*.yaml")), ids=lambda p: p.name)
def test_model_presets_only_override_base_keys(path):
    values = _plain(path)
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
        assert _plain(path)["clip"] == PRESET_CLIP[path.stem], path.name


def _readme_defaults(readme: str) -> list[tuple[str, str]]:
    """``(key, literal)`` of every default the README's hyperparameter table states.

    A row states its defaults as `` `key: value` `` pairs in its Default cell (several related
    keys may share a row), or names one key first (`` | `key`: what it is | `value` | ``).
    """
    section = readme[readme.index("# Hyperparameters") :]
    pairs = []
    for description, default in re.findall(r"^\| (.*) \| (.*) \|$", section, flags=re.M):
        found = re.findall(r"`([a-z_]+): ([^`]*)`", default)
        single = re.fullmatch(r"`([a-z_]+)`: .*", description)
        if not found and single and re.fullmatch(r"`[^`]*`", default.split(" (")[0].strip()):
            found = [(single.group(1), default.split(" (")[0].strip().strip("`"))]
        pairs += found
    return pairs


def test_readme_hyperparameter_table_matches_base_yaml():
    """Every default the recipe README's hyperparameter table states names a base.yaml key, and
    a plain literal default equals the key's value in base.yaml."""
    readme = (HPARAMS.parent / "README.md").read_text()
    base = _plain(HPARAMS / "base.yaml")
    rows = _readme_defaults(readme)
    assert len(rows) > 40, "the README's hyperparameter table was not found"
    wrong = []
    for key, literal in rows:
        assert key in base, f"README documents {key!r}, which base.yaml does not have"
        if base[key] is None and literal != "null" or ":" in literal:
            continue  # a !ref/!new value or a mapping, described in words
        if yaml.safe_load(literal) != base[key]:
            wrong.append((key, literal, base[key]))
    assert wrong == [], f"README default != base.yaml value (key, README, base.yaml): {wrong}"


@pytest.mark.parametrize("model", ["tiny", "voxtral"])
def test_the_saved_hyperparams_yaml_builds_the_same_method(tmp_path, model):
    """SpeechBrain saves ``hyperparams.yaml`` as ``resolve_references(base, overrides)``, the
    overrides being the merged layers: the method file's object (and a preset's optimizer)
    are written as tagged YAML, so the saved file loads and builds the same method."""
    _, base, merged = load_layered_hparams(
        HPARAMS / "alpha_split.yaml", {"model": model, "output_folder": str(tmp_path)},
        recipe_dir=HPARAMS.parent,
    )  # fmt: skip
    with open(base, encoding="utf-8") as handle:
        saved = resolve_references(handle, merged).getvalue()
    hp = load_hyperpyyaml(saved)
    assert hp["method"] == AlphaSplit(clip=PRESET_CLIP[model], noise_multiplier=1.0, alpha=0.05)
    assert hp["opt_class"].func.__name__ == "AdamW"
