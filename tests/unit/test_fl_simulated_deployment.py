"""A simulated large deployment (``noise_cohort_size`` M, ``accounting_population`` N).

A toy run of the real engine with M and N set: the noise on the released mean has std
``sigma C / M`` (rounds.csv's ``noise_std``, the value the server added), the accountant's epsilon
is the real accountant's at ``q = M / N`` for the rounds run, and every place the epsilon shows
(the privacy report, its guarantee, the log lines, the text under a results table) labels it
as the simulated deployment's. The default run (options off) keeps ``sigma C / n`` and q.
"""

from __future__ import annotations

import csv
import functools
import json

import pytest

from speechbrain_fl.fl import FLConfig, FLTask, run_simulation
from speechbrain_fl.fl.dp.disclosure import format_disclosure, privacy_disclosure
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings
from speechbrain_fl.privacy.accounting import compute_epsilon

DELTA = 1e-6
SIGMA, CLIP, M, N = 0.8, 0.5, 1000, 100_000


def _run(tmp_path, **overrides):
    settings = toy_settings(
        overrides={
            "num_partitions": 2, "number_of_rounds": 3, "eval_every": 0, "method": "flat",
            "clip": CLIP, "noise_multiplier": SIGMA, "sampling_rate": 1.0, "delta": DELTA,
            "output_folder": str(tmp_path), **overrides,
        }
    )  # fmt: skip
    task = FLTask(
        build_client=functools.partial(toy_client, settings=settings),
        build_server=functools.partial(toy_server, settings=settings),
        num_partitions=2,
    )
    return run_simulation(task, backend="local")


def _rows(folder):
    with open(folder / "rounds.csv", newline="") as handle:
        return list(csv.DictReader(handle))[1:]  # trained rounds


def test_noise_and_epsilon_are_the_simulated_deployments(tmp_path, caplog):
    caplog.set_level("INFO")
    result = _run(tmp_path, noise_cohort_size=M, accounting_population=N)
    # the noise the server added: sigma C / M on the mean of the 2 clipped updates, not / 2
    assert [float(r["noise_std"]) for r in _rows(tmp_path)] == [SIGMA * CLIP / M] * 3
    # the accountant: q = M / N for the 3 rounds, the real accountant's figures
    q = M / N
    assert result.epsilon == compute_epsilon(
        sampling_rate=q, noise_multiplier=SIGMA, rounds=3, delta=DELTA
    )
    rdp = [compute_epsilon(sampling_rate=q, noise_multiplier=SIGMA, rounds=t, delta=DELTA,
                           accountant="rdp") for t in (1, 2, 3)]  # fmt: skip
    assert [float(r["epsilon"]) for r in _rows(tmp_path)] == rdp
    privacy = json.loads(json.dumps(result.privacy))  # what results.json gets
    assert privacy["epsilon"] == result.epsilon and privacy["sampling_rate"] == q
    simulated = privacy["simulated_deployment"]
    assert simulated["noise_cohort_size"] == M and simulated["population"] == N
    assert simulated["sampling_rate"] == q and simulated["run_sampling_rate"] == 1.0
    assert "does not bound what this run's clients leak" in simulated["note"]
    # the log lines that show the epsilon say it is the simulated deployment's
    lines = [m for m in caplog.messages if m.startswith("privacy: ")]
    assert len(lines) == 2 and all("[SIMULATED deployment: M=1000" in m for m in lines)


def test_default_run_keeps_the_real_mechanism(tmp_path):
    result = _run(tmp_path, number_of_rounds=1)
    assert [float(r["noise_std"]) for r in _rows(tmp_path)] == [SIGMA * CLIP / 2]
    assert result.privacy["sampling_rate"] == 1.0 and "simulated_deployment" not in result.privacy
    assert result.epsilon == compute_epsilon(
        sampling_rate=1.0, noise_multiplier=SIGMA, rounds=1, delta=DELTA
    )


def test_disclosure_says_the_epsilon_is_not_this_runs_clients(tmp_path):
    cfg = FLConfig(output_folder=str(tmp_path), noise_multiplier=SIGMA, clip=CLIP,
                   sampling_rate=0.5, delta=DELTA, noise_cohort_size=M,
                   accounting_population=N)  # fmt: skip
    out = privacy_disclosure(cfg)
    assert out["guarantee"].startswith("the client-level (epsilon, delta)-DP of a SIMULATED")
    assert "not of this run's clients" in out["guarantee"]
    assert out["epsilon_covers_everything"] is False
    assert any("SIMULATED deployment" in c for c in out["caveats"])
    assert out["simulated_deployment"]["sampling_rate"] == pytest.approx(0.01)
    text = format_disclosure(out).splitlines()
    assert text[0] == (
        "SIMULATED DEPLOYMENT: the epsilon above is that of 1000 clients a round out of 100000 "
        "(q = 0.01), not of this run's clients (q = 0.5)."
    )
    plain = privacy_disclosure(FLConfig(output_folder=str(tmp_path), noise_multiplier=SIGMA,
                                        clip=CLIP))  # fmt: skip
    assert "simulated_deployment" not in plain and "SIMULATED" not in format_disclosure(plain)
