"""No dead keys: every top-level key of the MLS base.yaml is used by train_fl.py or referenced.

The same check SpeechBrain's ``tests/consistency/test_yaml.py`` runs upstream, plus: each method
file holds only keys of the base (it is applied on top of it) and includes the privacy keys.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

HPARAMS = Path(__file__).resolve().parents[2] / "recipes" / "MLS" / "hparams"
SCRIPT = (HPARAMS.parent / "train_fl.py").read_text()


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
        if not key.startswith("__") and f'"{key}"' not in SCRIPT and f"<{key}>" not in text
    ]
    assert unused == [], f"keys of base.yaml used nowhere: {unused}"


@pytest.mark.parametrize("path", sorted(HPARAMS.glob("*.yaml")), ids=lambda p: p.name)
def test_method_files_only_override_base_keys(path):
    if path.name == "base.yaml":
        return
    values = yaml.safe_load(path.read_text())
    assert set(values) <= set(top_level_keys(HPARAMS / "base.yaml"))
    assert {"method", "clip", "noise_multiplier"} <= set(values)


@pytest.mark.parametrize("path", sorted((HPARAMS / "models").glob("*.yaml")), ids=lambda p: p.name)
def test_model_presets_only_override_base_keys(path):
    values = yaml.safe_load(path.read_text()) or {}
    assert set(values) <= set(top_level_keys(HPARAMS / "base.yaml"))
