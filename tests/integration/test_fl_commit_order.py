"""Account first, then release: a kill around a round's commit.

Before: a private run killed after a round's noisy aggregate was made but before its state was
saved left that round's validation loss (a function of the noisy model) in train_log.txt and
its row in rounds.csv; the resumed run redrew the round, so one release was never accounted.
Now the state (accountant step, new model, pending outputs) is committed first and every row
and log line is written after it. The run is killed with ``os._exit`` in a subprocess right
before and right after the commit of round 2, then the same command resumes.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from speechbrain_fl.fl.serverapp.telemetry import train_log_rounds
from speechbrain_fl.privacy import compute_epsilon

SETTINGS = {
    "num_partitions": 3,
    "number_of_rounds": 4,
    "sampling_rate": 0.7,
    "noise_multiplier": 0.9,
    "clip": 0.5,
    "method": "pfl_dim",
    "seed": 2,
    "examples_per_client": 16,
}

SCRIPT = """
import json, os, sys
import speechbrain_fl.fl.serverapp.loop as server
from speechbrain_fl.fl import run_simulation
from speechbrain_fl.fl.toy import toy_task

folder, settings, kill = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
save = server.atomic_torch_save

def killing_save(obj, path):
    if obj["round"] == 2 and kill == "before":
        os._exit(9)  # the noisy aggregate of round 2 exists, nothing of it is committed
    save(obj, path)
    if obj["round"] == 2 and kill == "after":
        os._exit(9)  # round 2 committed, none of its outputs written yet

server.atomic_torch_save = killing_save
run_simulation(toy_task(overrides={"output_folder": folder, **settings}))
"""


def _run(script, folder, kill):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script), str(folder), json.dumps(SETTINGS), kill],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return proc


def _csv_rounds(folder):
    with open(folder / "rounds.csv", newline="") as handle:
        return [int(r["round"]) for r in csv.DictReader(handle)]


def _log_lines(folder):
    return [
        line
        for line in (folder / "train_log.txt").read_text().splitlines()
        if line.startswith("round: ")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["before", "after"])
def test_nothing_of_an_uncommitted_round_is_written_and_resume_is_whole(tmp_path, kill):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "run"
    killed = _run(script, folder, kill)
    assert killed.returncode == 9, killed.stderr[-2000:]
    state = torch.load(folder / "server_state.pt", weights_only=False)
    committed = 2 if kill == "after" else 1
    assert state["round"] == state["strategy"]["accountant"]["rounds"] == committed
    # nothing derived from round 2's noisy aggregate reached the disk before its commit
    assert _csv_rounds(folder) == [0, 1]
    assert sorted(train_log_rounds(folder / "train_log.txt")) == [0, 1]
    # a stale temporary of the killed run (as SIGKILL during a save leaves) is swept at start
    stale = folder / ".server_state.pt.k1ll3d00.tmp"
    stale.write_bytes(b"half a state")

    resumed = _run(script, folder, "none")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not stale.exists()
    final = torch.load(folder / "server_state.pt", weights_only=False)
    assert final["round"] == final["strategy"]["accountant"]["rounds"] == 4
    assert _csv_rounds(folder) == [0, 1, 2, 3, 4]  # each committed round once, none other
    lines = _log_lines(folder)
    assert [line.split()[1].rstrip(",") for line in lines] == ["0", "1", "2", "3", "4"]
    with open(folder / "rounds.csv", newline="") as handle:
        last = list(csv.DictReader(handle))[-1]
    eps = compute_epsilon(
        sampling_rate=SETTINGS["sampling_rate"],
        noise_multiplier=SETTINGS["noise_multiplier"],
        rounds=4,
        delta=1e-5,
        accountant="rdp",  # the running figure of rounds.csv (round_accountant)
        warn=False,
    )
    assert float(last["epsilon"]) == pytest.approx(eps, rel=1e-9)


SIGTERM_SCRIPT = """
import sys, time
from speechbrain_fl.utils.atomic import atomic_folder
with atomic_folder(sys.argv[1]) as tmp:
    (tmp / "part.wav").write_bytes(b"0" * 1000)
    print(tmp, flush=True)
    time.sleep(60)
"""


def test_sigterm_during_atomic_folder_removes_the_temporary(tmp_path):
    """The audit: a SIGTERM during corpus synthesis left a 535 MB ``.cv_synth.*.tmp`` folder."""
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path / "corpus")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    tmp = proc.stdout.readline().strip()
    assert tmp and os.path.isdir(tmp)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.1)
    assert not os.path.exists(tmp) and not (tmp_path / "corpus").exists()
    assert list(tmp_path.iterdir()) == []
