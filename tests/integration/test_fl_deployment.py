"""Deployment Engine on loopback: a SuperLink, two SuperNodes, ``flwr run .``, two rounds."""

import csv
import subprocess

import pytest

from speechbrain_fl.fl import run_deployment

from .conftest import REPO, server_round, wait_for


@pytest.mark.slow
def test_two_supernodes_two_rounds(tmp_path, flower):
    env = flower(supernodes=2)
    out = tmp_path / "out"
    hparams = tmp_path / "toy.yaml"  # the recipe hparams file, passed via the run config
    hparams.write_text("method: flat\nnoise_multiplier: 0.5\nclip: 1.0\nseed: 0\nnoise_seed: 0\n")
    run_config = {
        "hparams": str(hparams),
        "overrides": {"number_of_rounds": 2, "num_partitions": 2, "output_folder": str(out)},
    }
    try:
        run_deployment("loopback", app_dir=REPO, env=env, timeout=300, run_config=run_config)
    except subprocess.CalledProcessError as err:
        raise AssertionError(
            f"flwr run failed:\n{err.output[-3000:]}\n{err.stderr[-3000:]}"
        ) from err
    # the state is written before the ServerApp returns
    wait_for(lambda: server_round(out) >= 2, timeout=60, what="round 2",
             log=tmp_path / "superlink.log")  # fmt: skip
    with open(out / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" for r in rows[1:])
    assert float(rows[2]["epsilon"]) > 0
