"""The MLS recipe through ``flwr run``: a simulation federation and a Deployment Engine.

The same factory (``recipes/MLS/train_fl.py:mls_task``) that ``train_fl.py`` runs on the
Simulation Engine is named in the run config; the ServerApp prepares the (tiny, embedded)
corpus and seed model, the ClientApps read what it prepared, two ``--debug`` rounds run, and the
ServerApp writes the final model, which ``transcribe.py`` then loads and runs, and, as the
script does, the test WER against round 0, results.json and the plots.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from speechbrain_fl.fl import run_deployment

from .conftest import REPO, server_round, wait_for

TINY_CORPUS = {
    "languages": ["english", "german"],
    "corpus_speakers_per_language": 2,
    "corpus_utterances_per_speaker": 4,
    "corpus_public_speakers_per_language": 1,
    "corpus_public_utterances_per_speaker": 8,
    "corpus_eval_utterances_per_speaker": 2,
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mls_flwr_cache")


def _run_mls(tmp_path, cache, env, **kwargs):
    out = tmp_path / "out"
    overrides = {**TINY_CORPUS, "output_folder": str(out), "cache_folder": str(cache),
                 "num_clients": 2, "sampling_rate": 1.0, "debug": True}  # fmt: skip
    run_config = {
        "task": "recipes/MLS/train_fl.py:mls_task",
        "hparams": "hparams/flat.yaml",
        "overrides": overrides,
    }
    try:
        run_deployment(
            "loopback", app_dir=REPO, env=env, timeout=900, run_config=run_config, **kwargs
        )
    except subprocess.CalledProcessError as err:
        msg = f"flwr run failed:\n{err.output[-3000:]}\n{err.stderr[-3000:]}"
        raise AssertionError(msg) from err
    log = tmp_path / "superlink.log"
    wait_for(lambda: server_round(out) >= 2, timeout=120, what="round 2", log=log)
    wait_for(lambda: (out / "final_model" / "federated_model.json").is_file(), timeout=120,
             what="the final model", log=log)  # fmt: skip
    # the ServerApp holds the test split and writes what train_fl.py writes
    wait_for(lambda: (out / "results.json").is_file(), timeout=300, what="results.json",
             log=log)  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert 0 <= results["test"]["WER"] and len(results["test"]["WER_ci95"]) == 2
    assert "ci95" in results["test_change_from_round0"]
    for name in ("test_utterances.csv", "test_utterances_round0.csv",
                 "plots/metrics_by_round.png"):  # fmt: skip
        assert (out / name).is_file(), name
    with open(out / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" for r in rows[1:])
    assert float(rows[2]["epsilon"]) > 0 and float(rows[0]["WER"]) >= 0
    return out


def _transcribe(out, cache):
    spec = importlib.util.spec_from_file_location(
        "mls_transcribe", REPO / "recipes/MLS/transcribe.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wav = next(Path(cache).glob("mls_synth/mls_german/test/audio/*/*/*.flac"))
    texts = module.main([str(out / "final_model"), str(wav), "--language", "german",
                         "--max_new_tokens", "8"])  # fmt: skip
    assert len(texts) == 1 and isinstance(texts[0], str)


@pytest.mark.slow
def test_mls_flwr_run_simulation_federation(tmp_path, cache, flower):
    env = flower(simulation=True)
    out = _run_mls(tmp_path, cache, env, federation_config={"num-supernodes": 2})
    _transcribe(out, cache)


@pytest.mark.slow
def test_mls_flwr_run_deployment_two_supernodes(tmp_path, cache, flower):
    env = flower(supernodes=2)
    out = _run_mls(tmp_path, cache, env)
    _transcribe(out, cache)
