"""No dead keys in the Private-Gender hparams, and the objects they build.

Every top-level key of ``teacher.yaml`` and ``student.yaml`` is used: referenced by another key
(``<key>``) or read by the recipe's Python (``hparams["key"]``), as SpeechBrain's
``tests/consistency/test_yaml.py`` checks upstream. ``gender_checks.py`` is left out of the
readers: it looks at every value it is given, so it would count any key as used. The objects
(model factory, optimizer, metrics, logger) are built from the YAML, and the numbers they hold
are the YAML's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "Private-Gender"
sys.path.insert(0, str(RECIPE))

from speechbrain_fl.recipe import load_run_hparams  # noqa: E402

READERS = "\n".join(
    p.read_text(encoding="utf-8")
    for p in [*RECIPE.glob("*.py"), *(ROOT / "speechbrain_fl" / "recipe").glob("*.py")]
    if p.name != "gender_checks.py"
)


def top_level_keys(path: Path) -> list[str]:
    return [
        m.group(1)
        for line in path.read_text(encoding="utf-8").splitlines()
        if (m := re.match(r"^([A-Za-z_][A-Za-z0-9_]*):", line))
    ]


@pytest.mark.parametrize("name", ["teacher.yaml", "student.yaml"])
def test_every_top_level_key_is_used(name):
    path = RECIPE / "hparams" / name
    text = path.read_text(encoding="utf-8")
    unused = [
        key
        for key in top_level_keys(path)
        if not key.startswith("__") and f"<{key}>" not in text and f'"{key}"' not in READERS
    ]
    assert unused == [], f"{name}: top-level keys used nowhere: {unused}"


def test_the_yaml_builds_the_models_optimizers_and_metrics(tmp_path):
    """The factories hold the YAML's numbers; the scripts only add the class count and the
    modality (teacher: multimodal, DP-direct and student: audio-only)."""
    from speechbrain_fl.distill.dp_training import make_model

    teacher, _, _ = load_run_hparams(
        RECIPE / "hparams" / "teacher.yaml", {"output_folder": str(tmp_path)}, recipe_dir=RECIPE
    )
    student, _, _ = load_run_hparams(
        RECIPE / "hparams" / "student.yaml",
        {"output_folder": str(tmp_path), "lr": 0.01, "epochs": 3},
        recipe_dir=RECIPE,
    )
    model = make_model(teacher["model"], num_classes=3, privileged=True, init_seed=1)
    again = make_model(teacher["model"], num_classes=3, privileged=True, init_seed=1)
    assert (
        model.is_multimodal and model.head.in_features == teacher["emb_dim"] + teacher["priv_dim"]
    )
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=False)
    )
    audio = make_model(student["model"], num_classes=3, privileged=False, init_seed=1)
    assert not audio.is_multimodal and audio.head.in_features == student["emb_dim"]
    opt = teacher["opt_class"](model.parameters())
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["lr"] == teacher["lr"] == 0.03
    assert student["opt_class"](audio.parameters()).defaults["lr"] == 0.01  # override reaches it
    assert student["epoch_counter"].limit == 3
    assert teacher["metrics"].keywords == {"num_resamples": teacher["bootstrap_resamples"]}
