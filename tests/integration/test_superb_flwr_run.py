"""The SUPERB recipe through ``flwr run``: a simulation federation and a Deployment Engine.

The factory ``train_fl.py`` runs on the Simulation Engine (``recipes/SUPERB/superb_task.py:
superb_task``) is named in the run config; the ServerApp prepares the (tiny, embedded) KWS corpus
and seed model once, the ClientApps read what it prepared and each trains to its own exit (one
client at exit 3, one at exit 6), the layer-wise rule aggregates their partial replies, and the
ServerApp's ``on_result`` evaluates both exits on the test split and writes ``results.json``.
"""

from __future__ import annotations

import csv
import json
import subprocess

import pytest

from speechbrain_fl.fl import run_deployment

from .conftest import REPO, wait_for

TINY = {
    "corpus_options": {"train_speakers": 4, "valid_speakers": 1, "test_speakers": 2,
                       "repeats": 1, "unknown_words_per_speaker": 2, "noise_seconds": 3},
    "public_corpus_options": {"splits": {"public": 2}, "utterances_per_speaker": 2},
    "num_clients": 2, "sampling_rate": 1.0, "pretrain_steps": 2, "debug": True,
}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("superb_flwr_cache")


def _run_superb(tmp_path, cache, env, **kwargs):
    out = tmp_path / "out"
    run_config = {
        "task": "recipes/SUPERB/superb_task.py:superb_task",
        "hparams": "hparams/kws.yaml",
        "overrides": {**TINY, "output_folder": str(out), "cache_folder": str(cache)},
    }
    try:
        proc = run_deployment(
            "loopback", app_dir=REPO, env=env, timeout=900, run_config=run_config, **kwargs
        )
    except subprocess.CalledProcessError as err:
        msg = f"flwr run failed:\n{err.output[-3000:]}\n{err.stderr[-3000:]}"
        raise AssertionError(msg) from err
    (tmp_path / "flwr_run.log").write_text(proc.stdout or "")
    wait_for(lambda: (out / "results.json").is_file(), timeout=30, what="results.json",
             log=tmp_path / "flwr_run.log")  # fmt: skip
    with open(out / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" for r in rows[1:])  # both partial replies aggregated
    assert {"acc_3", "acc_6"} <= set(rows[0])
    results = json.loads((out / "results.json").read_text())
    assert results["scenario"] == "heterogeneous" and results["aggregation"] == "layerwise"
    assert sorted(results["depths"]) == [3, 6] and results["rounds"] == 2
    assert set(results["test"]) == {"3", "6"}  # every trained exit reported
    for entry in results["test"].values():
        assert entry["ci95"][0] <= entry["accuracy"] <= entry["ci95"][1]
    return results


@pytest.mark.slow
@pytest.mark.heavy
def test_superb_flwr_run_simulation_federation(tmp_path, cache, flower):
    env = flower(simulation=True)
    _run_superb(tmp_path, cache, env, federation_config={"num-supernodes": 2})


@pytest.mark.slow
@pytest.mark.heavy
def test_superb_flwr_run_deployment_two_supernodes(tmp_path, cache, flower):
    env = flower(supernodes=2)
    _run_superb(tmp_path, cache, env)
