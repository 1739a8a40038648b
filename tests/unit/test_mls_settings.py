"""recipes/MLS/mls_settings.py: the local optimizer, the trainable-set keys, alpha-split frozen."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "MLS"))
import mls_settings  # noqa: E402

from speechbrain_fl.privacy.methods import PFLDim, method_name  # noqa: E402
from speechbrain_fl.recipe.hparams import load_layered_hparams  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "MLS"


def _hparams(method_file="flat", /, **overrides):
    hparams, _, _ = load_layered_hparams(
        f"hparams/{method_file}.yaml", overrides or None, recipe_dir=RECIPE
    )
    return hparams


@pytest.mark.parametrize("model", ["tiny", "voxtral"])
def test_opt_class_is_adamw_which_erases_the_gradient_imbalance(model):
    """One step of each preset's ``opt_class`` (the paper's AdamW) on two tensors whose
    gradients differ 10x: both move by ~lr per coordinate, so the update norms do not keep the
    gradients' 10x imbalance."""
    opt_class = _hparams(model=model)["opt_class"]
    small, large = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    opt = opt_class([{"params": [small, large]}], lr=0.1)
    assert type(opt).__name__ == "AdamW" and opt.defaults["weight_decay"] == 0.0
    small.grad, large.grad = torch.full((4,), 0.01), torch.full((4,), 0.1)
    opt.step()
    assert float(large.norm() / small.norm()) == pytest.approx(1.0, rel=1e-3)


def test_round_cosine_lr_decays_to_its_floor():
    schedule = _hparams()["lr_schedule"]
    assert schedule(1, 10) == pytest.approx(0.003)
    assert schedule(11, 10) == pytest.approx(0.0003)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("connector_treatment", "own", "connector_treatment: 'own' must be one of"),
        ("ctc_treatment", "drop", "ctc_treatment: 'drop' must be one of"),
        ("group_by", "layer", "group_by: 'layer' must be one of"),
        ("scenario", "central", "scenario: 'central' must be federated or centralized"),
        ("central_steps", 0, "central_steps: 0 must be a positive integer or null"),
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
    # the YAML's AlphaSplit object becomes PFL-Dim with its clip and noise
    assert frozen["method"] == PFLDim(clip=0.25, noise_multiplier=1.0)
    assert frozen["alpha"] is None
    unfrozen = mls_settings.engine_hparams(_hparams("alpha_split"))
    assert method_name(unfrozen["method"]) == "alpha_split" and unfrozen["alpha"] == 0.05
    # a name on the command line: the name is swapped
    named = mls_settings.engine_hparams(_hparams("alpha_split", method="alpha_split",
                                                 freeze_encoder=True))  # fmt: skip
    assert named["method"] == "pfl_dim" and named["alpha"] is None


def test_alpha_auto_is_checked_with_a_stand_in_alpha_for_the_object_and_the_name():
    """alpha: auto reaches the AlphaSplit object by its !ref; the check stands in a valid
    alpha for the object's as for the key, so it passes before the profiling resolves it."""
    hparams = _hparams("alpha_split", alpha="auto", profile_rounds=1)
    assert hparams["method"].alpha == "auto"
    mls_settings.check_hparams(hparams)
    mls_settings.check_hparams(_hparams("alpha_split", alpha="auto", profile_rounds=1,
                                        method="alpha_split"))  # fmt: skip


def test_frozen_alpha_split_budgets_are_eq13_at_alpha_zero_and_use_all_of_c():
    """The engine's frozen alpha-split budgets are the paper's Eq. 13 with alpha = 0.

    The layout is the tiny model's frozen-encoder update (LLM LoRA: 6 tensors of 1,024 and 2 of
    512 values, from a run's group_norms.csv): C_l = C sqrt(p_l / sum p), sqrt(sum C_l^2) = C.
    alpha-split taken literally at alpha = 0.05 would leave alpha C^2 unused (sqrt(0.95) C).
    """
    from speechbrain_fl.privacy.budgets import compute_budgets
    from speechbrain_fl.privacy.layout import Group, Layout

    sizes = [1024] * 6 + [512] * 2
    layout = Layout([Group(f"llm.{i}", "llm", p) for i, p in enumerate(sizes)])
    hparams = mls_settings.engine_hparams(_hparams("alpha_split", freeze_encoder=True))
    clip = 0.25
    method = method_name(hparams["method"])
    budgets = compute_budgets(layout, method=method, clip=clip, alpha=hparams["alpha"])
    for i, p in enumerate(sizes):
        assert budgets[f"llm.{i}"] == pytest.approx(clip * (p / sum(sizes)) ** 0.5)
    assert sum(b**2 for b in budgets.values()) ** 0.5 == pytest.approx(clip)
    with pytest.warns(UserWarning, match="unused"):
        literal = compute_budgets(layout, method="alpha_split", clip=clip, alpha=0.05)
    assert sum(b**2 for b in literal.values()) ** 0.5 == pytest.approx(clip * 0.95**0.5)


def test_default_trains_both_adapters_and_the_connector_not_the_ctc_head():
    """The paper's federated set: encoder LoRA, LLM LoRA and the connector (from scratch)."""
    options = mls_settings.model_options(_hparams())
    assert options["train_llm_lora"] and not options["freeze_encoder"]
    assert options["connector_treatment"] == "train" and options["ctc_treatment"] == "off"
