"""recipes/MLS/mls_settings.py: the local optimizer, the trainable-set keys, alpha-split frozen."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "MLS"))
import mls_settings  # noqa: E402

from speechbrain_fl.recipe.hparams import load_layered_hparams  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "MLS"


def _hparams(method="flat", **overrides):
    hparams, _, _ = load_layered_hparams(
        f"hparams/{method}.yaml", overrides or None, recipe_dir=RECIPE
    )
    return hparams


def test_sgd_keeps_the_gradient_imbalance_adamw_erases_it():
    """One step on two tensors whose gradients differ 10x: SGD moves them 10x apart, AdamW not."""
    small, large = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    for name, expected in (("sgd", 10.0), ("adamw", 1.0)):
        small.data.zero_()
        large.data.zero_()
        opt = mls_settings.make_local_optimizer(
            [{"params": [small, large]}], lr=0.1, name=name, momentum=0.9, weight_decay=0.0
        )
        small.grad, large.grad = torch.full((4,), 0.01), torch.full((4,), 0.1)
        opt.step()
        assert float(large.norm() / small.norm()) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("local_optimizer", "adam", "local_optimizer: 'adam' must be one of"),
        ("momentum", 1.0, r"momentum: 1.0 must be a number in \[0, 1\)"),
        ("connector_treatment", "own", "connector_treatment: 'own' must be one of"),
        ("ctc_treatment", "drop", "ctc_treatment: 'drop' must be one of"),
    ],
)
def test_bad_values_are_refused_naming_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        mls_settings.check_hparams(_hparams(**{key: value}))


def test_nothing_to_train_is_refused():
    hparams = _hparams(train_llm_lora=False, connector_treatment="freeze", freeze_encoder=True)
    with pytest.raises(ValueError, match="leave nothing to train"):
        mls_settings.check_hparams(hparams)


def test_alpha_split_with_the_encoder_frozen_runs_the_papers_alpha_zero_row():
    frozen = mls_settings.engine_hparams(_hparams("alpha_split", freeze_encoder=True))
    assert frozen["method"] == "pfl_dim" and frozen["alpha"] is None
    unfrozen = mls_settings.engine_hparams(_hparams("alpha_split"))
    assert unfrozen["method"] == "alpha_split" and unfrozen["alpha"] == 0.05


def test_default_trains_both_adapters_and_not_the_connector_or_ctc_head():
    options = mls_settings.model_options(_hparams())
    assert options["train_llm_lora"] and not options["freeze_encoder"]
    assert options["connector_treatment"] == "freeze" and options["ctc_treatment"] == "off"
