"""Resuming a run: the round, the accountant and the parameters continue from the saved state.

Bit-identity with an uninterrupted run holds only under the test-only fixed sampler and noise
seeds; a private run with OS randomness resumes with fresh randomness (server_state.pt holds no
seed), so its check is the resume point itself: round, accountant state, parameters, telemetry.
"""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from flwr.app import Context, RecordDict

from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_server, toy_settings
from speechbrain_fl.privacy import compute_epsilon

SETTINGS = {
    "num_partitions": 4,
    "number_of_rounds": 4,
    "sampling_rate": 0.75,
    "noise_multiplier": 0.8,
    "clip": 0.5,
    "method": "pfl_dim_ema",
    "ema_warmup_rounds": 1,
    "seed": 5,
    "examples_per_client": 600,
    "batch_size": 4,
}
FIXED = {"sampler_seed": 5, "noise_seed": 11}  # test-only seeds: the run is not private

SCRIPT = """
import json, sys
from speechbrain_fl.fl import run_simulation
from speechbrain_fl.fl.toy import toy_task
task = toy_task(overrides={"output_folder": sys.argv[1], **json.loads(sys.argv[2])})
run_simulation(task, client_resources={"num_cpus": 1}, ray_init_args={"num_cpus": 2})
"""


def _command(script, folder, settings=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    settings = {**SETTINGS, **FIXED} if settings is None else settings
    return subprocess.Popen(
        [sys.executable, str(script), str(folder), json.dumps(settings)],
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


def _resume_point(folder, settings, done):
    """Resume ``folder`` in this process and stop before the next round (max_epsilon below it):
    the round, epsilon and parameters a resumed run starts from."""
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    overrides = {
        **settings,
        "output_folder": str(folder),
        "max_epsilon": 1e-9,
        "number_of_rounds": done + 1,  # not a privacy setting: one more round to stop before
    }
    return run_server(None, toy_server(context, toy_settings(overrides=overrides)))


def _check_resume_point(folder, settings):
    state = torch.load(folder / "server_state.pt", weights_only=False)
    done = state["round"]
    rows_before = (folder / "rounds.csv").read_text()
    result = _resume_point(folder, settings, done)
    assert result.last_round == done and result.stopped_early
    assert state["strategy"]["accountant"]["rounds"] == done
    eps = compute_epsilon(
        sampling_rate=settings["sampling_rate"],
        noise_multiplier=settings["noise_multiplier"],
        rounds=done,
        delta=1e-5,
        warn=False,
    )
    assert math.isclose(result.epsilon, eps, rel_tol=1e-9)
    for name, value in state["params"].items():
        assert torch.equal(result.params[name], value), name
    # rows are written only after their round's commit: never ahead of the state, and a row a
    # kill left unwritten (between the commit and the write) is restored by the resume
    rows_after = (folder / "rounds.csv").read_text().splitlines()
    assert rows_after[: len(rows_before.splitlines())] == rows_before.splitlines()
    assert rows_after[-1].split(",")[0] == str(done)
    return state


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
    state = _check_resume_point(killed, {**SETTINGS, **FIXED})
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


@pytest.mark.slow
@pytest.mark.heavy
def test_os_seeded_resume_continues_from_the_saved_round(tmp_path):
    """OS randomness (a private run): no secret on disk, and the resumed run continues the round,
    the accountant and the parameters of the state (number_of_rounds is no privacy setting)."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    first = {**SETTINGS, "number_of_rounds": 2}
    _finish(_command(script, out, first))
    state = _check_resume_point(out, first)
    assert state["round"] == 2
    for key in ("sampler", "seed"):
        assert key not in state["strategy"] and key not in (state["strategy"]["noise"] or {})
    rows_2 = (out / "rounds.csv").read_text().splitlines()
    _finish(_command(script, out, SETTINGS))  # the same command, two more rounds
    final = torch.load(out / "server_state.pt", weights_only=False)
    assert final["round"] == 4 and final["strategy"]["accountant"]["rounds"] == 4
    rows_4 = (out / "rounds.csv").read_text().splitlines()
    assert rows_4[: len(rows_2)] == rows_2 and len(rows_4) == 1 + 5
    assert [r.split(",")[0] for r in rows_4[1:]] == ["0", "1", "2", "3", "4"]
    assert any(not torch.equal(final["params"][k], state["params"][k]) for k in state["params"])
