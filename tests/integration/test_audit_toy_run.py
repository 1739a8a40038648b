"""A private toy run with ``audit_canaries``: the audit beside the accountant in the results.

The whole engine (ServerApp, ClientApp, local backend): the privacy report carries the PLD
epsilon, Opacus's RDP figure beside it, and the audit's one-shot estimate and lower bound for
the same rounds; ``plots/audit_cosines.png`` is written; a run without canaries has no audit.
The fixed ``seed`` is the clients' training seed; cohorts, noise and canaries come from the OS.
"""

from __future__ import annotations

import math

from speechbrain_fl.fl import TaskSpec, run_simulation
from speechbrain_fl.fl.dp.disclosure import format_disclosure, privacy_disclosure
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.toy import toy_settings
from speechbrain_fl.privacy import compute_epsilon

SETTINGS = {
    "num_partitions": 4,
    "number_of_rounds": 3,
    "seed": 0,
    "eval_every": 0,
    "num_features": 64,
    "method": "flat",
    "clip": 0.5,
    "noise_multiplier": 1.0,
    "sampling_rate": 0.75,
}


def _run(tmp_path, name, **extra):
    out = tmp_path / name
    overrides = {**SETTINGS, **extra, "output_folder": str(out)}
    spec = TaskSpec("speechbrain_fl.fl.toy:toy_task", None, overrides)
    return out, run_simulation(spec, backend="local")


def test_private_toy_run_reports_the_audit_beside_the_accountant(tmp_path):
    out, result = _run(tmp_path, "audited", audit_canaries=64)
    privacy = result.privacy
    expected = compute_epsilon(sampling_rate=0.75, noise_multiplier=1.0, rounds=3, delta=1e-5)
    assert privacy["accountant"] == "pld" and math.isclose(privacy["epsilon"], expected)
    assert privacy["epsilon"] < privacy["epsilon_rdp"]
    audit = privacy["audit"]
    assert audit["canaries"] == 64 and audit["inserted"] + audit["held_out"] == 64
    assert audit["rounds"] == 3 and audit["accountant_epsilon"] == privacy["epsilon"]
    assert audit["epsilon_lower_bound"] <= privacy["epsilon"]  # provable, at 95%
    assert (out / "plots" / "audit_cosines.png").stat().st_size > 1000
    cfg = FLConfig.from_hparams(toy_settings(overrides={**SETTINGS, "audit_canaries": 64,
                                                        "output_folder": str(out)}))  # fmt: skip
    text = format_disclosure({**privacy, **privacy_disclosure(cfg)})
    assert "Audit (64 canaries" in text and "Opacus RDP gives" in text
    _, plain = _run(tmp_path, "plain")
    assert "audit" not in plain.privacy
