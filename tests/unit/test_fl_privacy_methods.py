"""The privacy method as a YAML object (speechbrain_fl/privacy/methods.py) and by name."""

from __future__ import annotations

import dataclasses

import pytest
from hyperpyyaml import load_hyperpyyaml

from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy import AlphaSplit, budget_methods, privacy_method

YAML = """
output_folder: out
clip: 2.0
noise_multiplier: 0.3
method: !new:speechbrain_fl.privacy.methods.{cls}
    clip: !ref <clip>
    noise_multiplier: !ref <noise_multiplier>
{extra}
"""

CASES = {
    "Flat": ("flat", ""),
    "PFLUniform": ("pfl_uniform", ""),
    "PFLDim": ("pfl_dim", ""),
    "PFLDimEMA": ("pfl_dim_ema", "    ema_warmup_rounds: 1\n    ema_beta: 0.4"),
    "PFLUnifEMA": ("pfl_unif_ema", "    ema_gamma: 0.5"),
    "AlphaSplit": ("alpha_split", "    alpha: 0.05"),
}


@pytest.mark.parametrize("cls", sorted(CASES))
def test_a_method_object_configures_the_run_as_its_name_does(cls):
    name, extra = CASES[cls]
    hparams = load_hyperpyyaml(YAML.format(cls=cls, extra=extra))
    method = hparams["method"]
    assert str(method) == method.name == name and name in budget_methods()
    from_object = FLConfig.from_hparams(hparams)
    # the same run given by name, the method's settings as top-level keys
    by_name = FLConfig.from_hparams({**hparams, **dataclasses.asdict(method), "method": name})
    assert from_object == by_name
    assert (from_object.method, from_object.clip, from_object.noise_multiplier) == (name, 2.0, 0.3)


def test_the_object_s_settings_are_the_ones_read():
    hparams = {"output_folder": "o", "clip": 9.0, "alpha": 0.5,
               "method": AlphaSplit(clip=1.0, noise_multiplier=0.1, alpha=0.05)}  # fmt: skip
    cfg = FLConfig.from_hparams(hparams)
    assert (cfg.clip, cfg.alpha) == (1.0, 0.05)


def test_a_command_line_name_replaces_the_object():
    # `--method pfl_dim` on the command line: HyperPyYAML replaces the node by the string
    text = YAML.format(cls="AlphaSplit", extra="    alpha: 0.05")
    hparams = load_hyperpyyaml(text, overrides={"method": "pfl_dim"})
    assert hparams["method"] == "pfl_dim"
    assert FLConfig.from_hparams(hparams).method == "pfl_dim"


def test_fedavg_object_and_bad_values_are_named():
    cfg = FLConfig.from_hparams({"output_folder": "o", "method": privacy_method("fedavg")})
    assert not cfg.private and cfg.clip is None
    with pytest.raises(ValueError, match="alpha: None must be a number"):
        FLConfig.from_hparams({"output_folder": "o", "method": AlphaSplit(clip=1.0)})
    with pytest.raises(ValueError, match="method: 'pfl_foo' is not one of"):
        privacy_method("pfl_foo")
