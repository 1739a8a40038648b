"""A run SIGKILLed after a round and rerun ends where an uninterrupted run of the same seed does."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

SCRIPT = """
import sys
from speechbrain_fl.fl import run_simulation
from speechbrain_fl.fl.toy import toy_task
task = toy_task(overrides={
    "output_folder": sys.argv[1], "num_partitions": 4, "number_of_rounds": 4, "sampling_rate": 0.75,
    "noise_multiplier": 0.8, "clip": 0.5, "method": "pfl_dim_ema", "ema_warmup_rounds": 1,
    "seed": 5, "noise_seed": 11, "examples_per_client": 600, "batch_size": 4})
run_simulation(task, client_resources={"num_cpus": 1}, ray_init_args={"num_cpus": 2})
"""


def _command(script, folder):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(script), str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # own process group: the kill reaches Ray's children too
    )


def _last_round(folder):
    path = folder / "rounds.csv"
    if not path.exists():
        return -1
    with open(path, newline="") as handle:
        rows = [r for r in csv.reader(handle)][1:]
    return int(rows[-1][0]) if rows else -1


def _finish(proc, timeout=240):
    try:
        assert proc.wait(timeout=timeout) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_and_rerun_matches_uninterrupted_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    ref_proc = _command(script, reference)  # runs alongside, uninterrupted
    proc = _command(script, killed)
    try:
        deadline = time.time() + 180
        while _last_round(killed) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    state = torch.load(killed / "server_state.pt", weights_only=False)
    assert 1 <= state["round"] < 4
    _finish(ref_proc)
    _finish(_command(script, killed))  # the same command resumes
    a = torch.load(killed / "server_state.pt", weights_only=False)
    b = torch.load(reference / "server_state.pt", weights_only=False)
    assert a["round"] == b["round"] == 4
    for name in b["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    assert a["strategy"]["accountant"] == b["strategy"]["accountant"]
    rounds_a = (killed / "rounds.csv").read_text().splitlines()
    rounds_b = (reference / "rounds.csv").read_text().splitlines()
    assert [r.split(",")[:5] for r in rounds_a] == [r.split(",")[:5] for r in rounds_b]
    assert len(rounds_a) == 1 + 5  # header, rounds 0..4, no duplicated rows
