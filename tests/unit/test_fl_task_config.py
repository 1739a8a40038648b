"""FLConfig.from_hparams (one vocabulary, one 'private'), the pool privacy report, run options,
and task specs (script factories loaded once per process)."""

from __future__ import annotations

import logging
import math

import pytest

from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.task import TaskSpec, import_factory, load_task
from speechbrain_fl.privacy import Group, Layout, compute_epsilon
from speechbrain_fl.privacy.accounting import effective_noise_multiplier, privacy_report
from speechbrain_fl.recipe import federated_run_options, split_overrides

BASE = {"output_folder": "o", "number_of_rounds": 3, "sampling_rate": 0.5, "seed": 1,
        "lr": 0.1, "model": "tiny"}  # fmt: skip


def test_from_hparams_maps_the_yaml_vocabulary():
    cfg = FLConfig.from_hparams(
        {**BASE, "method": "pfl_dim", "clip": 2.0, "noise_multiplier": 0.7, "alpha": 0.3}
    )
    assert (cfg.num_rounds, cfg.method, cfg.clip, cfg.noise_multiplier) == (
        3,
        "pfl_dim",
        2.0,
        0.7,
    )
    assert cfg.alpha is None  # alpha only means something for alpha_split
    assert cfg.private and cfg.aggregation_rule_name == "uniform" and cfg.seed == 1


def test_unknown_method_and_bad_alpha_name_the_key():
    with pytest.raises(ValueError, match="method: 'flatt' is not one of"):
        FLConfig.from_hparams({**BASE, "method": "flatt", "clip": 1.0})
    for alpha in (None, 1.0, "auto"):
        with pytest.raises(ValueError, match="alpha: .* for alpha_split"):
            FLConfig.from_hparams({**BASE, "method": "alpha_split", "clip": 1.0, "alpha": alpha})


def test_fedavg_is_not_private_and_refuses_noise():
    cfg = FLConfig.from_hparams({**BASE, "method": "fedavg", "clip": 1.0})
    assert not cfg.private and cfg.clip is None and cfg.aggregation_rule_name == "weighted"
    with pytest.raises(ValueError, match="method: fedavg clips nothing"):
        FLConfig.from_hparams({**BASE, "method": "fedavg", "noise_multiplier": 0.5})


def test_clipping_method_without_noise_is_a_non_private_run(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = FLConfig.from_hparams({**BASE, "method": "flat", "clip": 1.0, "noise_multiplier": 0})
    assert not cfg.private and cfg.clip == 1.0 and cfg.method == "flat"
    assert "non-private run" in caplog.text
    with pytest.raises(ValueError, match="clip: None must be > 0 for method flat"):
        FLConfig.from_hparams({**BASE, "method": "flat", "noise_multiplier": 1.0})


LAYOUT = Layout([Group("e", "encoder", 8), Group("c", "connector", 4), Group("l", "llm", 8)])
MECH = {"noise_multiplier": 0.5, "clip": 1.0, "sampling_rate": 0.25, "rounds": 3, "delta": 1e-5}


def test_privacy_report_flat_budget_gives_every_pool_sigma():
    report = privacy_report(LAYOUT, [{}, {}, {}], **MECH)
    joint = compute_epsilon(sampling_rate=0.25, noise_multiplier=0.5, rounds=3, delta=1e-5)
    assert report["epsilon"] == pytest.approx(joint)
    assert report["sigma_eff"] == {"encoder": 0.5, "llm": 0.5}
    assert report["epsilon_per_component"]["llm"] == pytest.approx(joint)
    assert report["pools"] == {"encoder": ["encoder"], "llm": ["llm", "connector"]}


def test_privacy_report_takes_each_pools_largest_budget_over_rounds():
    rounds = [
        {"encoder": 0.2, "connector": 0.6, "llm": 0.7},
        {"encoder": 0.4, "connector": 0.5, "llm": 0.7},
    ]
    report = privacy_report(LAYOUT, rounds, **MECH)
    assert report["sigma_eff"]["encoder"] == pytest.approx(0.5 / 0.4)
    llm_budget = max(math.hypot(0.6, 0.7), math.hypot(0.5, 0.7))
    assert report["sigma_eff"]["llm"] == pytest.approx(0.5 / llm_budget)
    assert report["sigma_eff"]["encoder"] == effective_noise_multiplier(
        noise_multiplier=0.5, clip=1.0, budget=0.4
    )
    assert all(math.isfinite(v) for v in report["epsilon_per_component"].values())


def test_privacy_report_of_a_frozen_encoder_has_no_encoder_pool():
    layout = Layout([Group("c", "connector", 4), Group("l", "llm", 8)])
    report = privacy_report(layout, [{"connector": 0.6, "llm": 0.8}], **MECH)
    assert list(report["sigma_eff"]) == ["llm"]


def test_run_options_supported_refused_and_split():
    assert federated_run_options({"noprogressbar": True, "eval_precision": "bf16"}) == {
        "noprogressbar": True,
        "eval_precision": "bf16",
    }
    with pytest.raises(ValueError, match="--ckpt_interval_minutes is not supported.*--nope"):
        federated_run_options({"ckpt_interval_minutes": 5, "nope": 1})
    assert split_overrides({"grad-accumulation-factor": 2, "lr": 0.1}) == (
        {"lr": 0.1},
        {"grad_accumulation_factor": 2},
    )


def test_task_spec_imports_a_script_once_per_process(tmp_path):
    script = tmp_path / "recipe_script.py"
    script.write_text(
        "from speechbrain_fl.fl.toy import toy_task\n"
        "CALLS = []\n"
        "def task(hparams, overrides):\n"
        "    CALLS.append(overrides)\n"
        "    return toy_task(hparams, overrides)\n"
    )
    spec = TaskSpec(f"{script}:task", None, {"num_partitions": 3})
    first, second = (
        load_task(spec),
        load_task(TaskSpec(f"{script}:task", None, {"num_partitions": 3})),
    )
    assert first is second and first.num_partitions == 3
    module = import_factory(f"{script}:task").__globals__
    assert module["CALLS"] == [{"num_partitions": 3}]
    with pytest.raises(ValueError, match="cannot be imported"):
        import_factory(f"{tmp_path / 'missing.py'}:task")
    with pytest.raises(ValueError, match="must be"):
        import_factory("no_colon")


def test_run_config_overrides_are_one_yaml_mapping():
    spec = TaskSpec.from_run_config(
        {"task": "m:f", "hparams": "h.yaml", "overrides": "{languages: [en, de], debug: true}"},
        {"hparams": "/node/h.yaml"},
    )
    assert spec.hparams == "/node/h.yaml"
    assert dict(spec.overrides) == {"languages": ["en", "de"], "debug": True}
    with pytest.raises(ValueError, match="must be a YAML mapping"):
        TaskSpec.from_run_config({"overrides": "[1, 2]"})
