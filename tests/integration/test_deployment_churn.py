"""A deployment survives churn: SuperNodes that die in the middle of a round and come back, and
a ServerApp process killed mid-run and resumed from its state.

A SuperLink (TLS, SuperNode authentication) and SuperNodes on loopback run the toy task's
private ``flat`` method with every node sampled each round (q = 1), so that the accountant's
draws, the cohorts and epsilon of a run without churn are known in advance.

First test: 8 SuperNodes; a third of them (3) is killed (SIGKILL, with its ClientApp) once it
has received round 1's training message. Their replies never come: the round waits
``round_timeout``, counts them in ``num_failed`` and is released all the same (a private run
releases every Poisson draw). Each killed node is started again with its own key once the
SuperLink's record of its last heartbeat has expired: before that the SuperLink still holds the
node online and refuses to activate it again (HTTP 412, the SuperNode exits). A fresh key is no
way round: it is another node ID, which the run's ``node_partitions`` binding does not know, so
its replies would be refused. They are started after round 1's release, when the ServerApp has
seen them gone (the SuperLink no longer lists them): it sets them up again (a restarted
SuperNode has lost the setup held in its run state) and they train in round 2.

Second test: 2 SuperNodes; the ServerApp's process is killed (SIGKILL) after round 1's commit,
while round 2 runs, and the same ``flwr run`` is submitted again: it resumes from
``server_state.pt`` after round 1 and ends as an uninterrupted run would.

Both check that every round is released once (``rounds.csv``), that the accountant counted
``ROUNDS`` draws and that epsilon is the figure of ``ROUNDS`` rounds at the run's q and sigma.
Everything is on 127.0.0.1; every process started here (and what it started) is killed at the
end. ``ROUND_TIMEOUT`` covers 8 ClientApp processes started at once on a loaded 2-core machine
(one ClientApp process per message, each importing torch and SpeechBrain: ~12 s alone, a round of
8 took ~40 s at a load of 17).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from speechbrain_fl.fl import run_deployment
from speechbrain_fl.fl.engines.run import FlwrRunError
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.toy import FL_KEYS, toy_settings, write_toy_manifest
from speechbrain_fl.privacy.accounting.epsilon import compute_epsilon

from .conftest import BIN, REPO, server_round, wait_for
from .test_deployment_tls_auth import Federation, make_pki

ROUND_TIMEOUT = 75.0
SETTINGS = {
    "seed": 0,
    "noise_seed": 0,
    "sampler_seed": 0,
    "method": "flat",
    "noise_multiplier": 0.5,
    "clip": 1.0,
    "sampling_rate": 1.0,
    "examples_per_client": 16,
    "batch_size": 8,
    "round_timeout": ROUND_TIMEOUT,
}


class ChurnFederation(Federation):
    """:class:`Federation` with ``nodes`` registered SuperNodes that can be killed and restarted."""

    def __init__(self, root: Path, nodes: int):
        super().__init__(root)
        # a CA and keys for every node, in the folder the CLI config already points at
        self.pki = make_pki(root / "pki", tuple(f"node{i}" for i in range(nodes)))
        self.count = nodes
        self.nodes: dict[int, subprocess.Popen] = {}
        self.configs: dict[int, str] = {}
        self.ids: dict[int, int] = {}  # partition -> node id

    def register_all(self) -> None:
        """``flwr supernode register`` of every node's key, all at once (one CLI process each)."""
        cmd = [str(BIN / "flwr"), "supernode", "register"]
        procs = {
            pid: subprocess.Popen(
                [*cmd, str(self.pki / f"node{pid}.pub"), "secure", "--format", "json"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=self.env,
            )  # fmt: skip
            for pid in range(self.count)
        }
        for pid, proc in procs.items():
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            self.ids[pid] = int(json.loads(out[out.rindex("{") :])["node-id"])

    def start_all(self) -> dict[int, int]:
        """SuperLink, registrations and every SuperNode; ``{node id: partition}``."""
        self.start_superlink()
        self.register_all()
        settings = toy_settings(overrides={**SETTINGS, "num_partitions": self.count})
        for pid in range(self.count):
            data = self.root / f"node{pid}_data"
            data.mkdir()
            write_toy_manifest(data / "train.csv", settings, pid)
            self.configs[pid] = f'partition-id={pid} data-folder="{data}" device="cpu"'
            self.nodes[pid] = self.start_supernode(f"node{pid}", self.configs[pid])
        return {node: pid for pid, node in self.ids.items()}

    def log(self, pid: int) -> str:
        return (self.root / f"node{pid}.log").read_text(errors="replace")

    def kill(self, pid: int) -> None:
        """SIGKILL the node's process group (the SuperNode, its SuperExec and ClientApps)."""
        proc = self.nodes[pid]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def online_until(self, pid: int) -> float:
        """Until when the SuperLink holds the node online: its last heartbeat plus twice the
        heartbeat interval (the SuperLink's own record, read from its database)."""
        node = self.ids[pid] - 2**64 if self.ids[pid] >= 2**63 else self.ids[pid]  # sint64
        with sqlite3.connect(f"file:{self.root / 'server' / 'state.db'}?mode=ro", uri=True) as db:
            row = db.execute("SELECT online_until FROM node WHERE node_id = ?", (node,)).fetchone()
        assert row is not None, f"node{pid} ({self.ids[pid]}) is not in the SuperLink's database"
        return float(row[0] or 0.0)

    def restart(self, pid: int) -> None:
        """Start the node again with its key once the SuperLink no longer holds it online."""
        wait_for(lambda: time.time() > self.online_until(pid) + 1, timeout=120,
                 what=f"node{pid}'s heartbeat to expire")  # fmt: skip
        proc = self.start_supernode(f"node{pid}", self.configs[pid])
        wait_for(lambda: "SuperNode ID:" in self.log(pid) or proc.poll() is not None,
                 timeout=120, what=f"node{pid}'s activation")  # fmt: skip
        assert proc.poll() is None, self.log(pid)[-2000:]
        self.nodes[pid] = proc

    def close(self) -> None:
        """Stop every process started here, and what they started in sessions of their own
        (the SuperLink's executor and its ServerApp)."""
        started = []
        for proc in self.procs:
            try:
                started += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
        super().close()
        for child in started:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                continue


def _run_config(out: Path, bound: dict[int, int], rounds: int) -> dict:
    overrides = {**SETTINGS, "num_partitions": len(bound), "number_of_rounds": rounds,
                 "output_folder": str(out), "node_partitions": bound}  # fmt: skip
    return {"num-server-rounds": rounds, "overrides": overrides}


def _submit(fed, run_config: dict, box: list) -> threading.Thread:
    """``flwr run --stream`` of the toy task in a thread; its outcome (or error) goes to ``box``."""

    def submit():
        try:
            box.append(run_deployment("secure", app_dir=REPO, env=fed.env, timeout=600,
                                      run_config=run_config))  # fmt: skip
        except (FlwrRunError, OSError, subprocess.TimeoutExpired) as err:
            box.append(err)

    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    return thread


def _outcome(box: list) -> str:
    """What a submission ended with, for an assertion message: its error and output tail."""
    if not box:
        return "no outcome yet"
    err = box[0]
    return f"{err!r}\n{(getattr(err, 'output', None) or getattr(err, 'stdout', '') or '')[-3000:]}"


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _check_released_once(out: Path, rounds: int, nodes: int) -> list[dict[str, str]]:
    """Each round once, ``rounds`` accounted draws, epsilon and cohorts of a run without churn."""
    rows = _rows(out / "rounds.csv")
    assert [r["round"] for r in rows] == [str(r) for r in range(rounds + 1)]  # each round once
    state = torch.load(out / "server_state.pt", weights_only=False)
    assert state["round"] == rounds
    assert state["strategy"]["accountant"]["rounds"] == rounds  # one accounted draw a round
    config = FLConfig.from_hparams(
        {**{k: v for k, v in SETTINGS.items() if k in FL_KEYS}, "output_folder": str(out)}
    )
    expected = compute_epsilon(sampling_rate=1.0, noise_multiplier=0.5, rounds=rounds,
                               delta=config.delta, accountant="rdp", warn=False)  # fmt: skip
    assert float(rows[-1]["epsilon"]) == pytest.approx(expected, rel=1e-9)
    assert all(r["cohort_size"] == str(nodes) for r in rows[1:])  # q = 1: every node drawn
    return rows


@pytest.fixture
def churn(tmp_path, request):
    fed = ChurnFederation(tmp_path, request.param)
    yield fed
    fed.close()


VICTIMS = (0, 3, 6)  # a third of 8 nodes


@pytest.mark.slow
@pytest.mark.parametrize("churn", [8], indirect=True)
def test_a_third_of_the_nodes_die_mid_round_and_return(tmp_path, churn):
    started = time.time()
    bound = churn.start_all()
    out = tmp_path / "server" / "out"
    box: list = []
    thread = _submit(churn, _run_config(out, bound, rounds=2), box)
    # round 1 is under way once the victims have its training message: kill them then
    wait_for(lambda: all("Receiving: train message" in churn.log(p) for p in VICTIMS) or box,
             timeout=180, what="round 1's training messages",
             log=tmp_path / "superlink.log")  # fmt: skip
    assert not box, _outcome(box)
    killed = time.time()
    for pid in VICTIMS:
        churn.kill(pid)
    # back after round 1's release: the ServerApp has seen them gone and sets them up again
    wait_for(lambda: server_round(out) >= 1 or box, timeout=240, what="round 1",
             log=tmp_path / "superlink.log")  # fmt: skip
    for pid in VICTIMS:
        churn.restart(pid)
    restarted = time.time()
    thread.join(timeout=420)
    assert box and not isinstance(box[0], Exception), _outcome(box)
    rows = _check_released_once(out, rounds=2, nodes=8)
    # the dead nodes' replies are missing from round 1, which was released with 5 replies
    assert (rows[1]["num_replied"], rows[1]["num_failed"]) == ("5", "3")
    assert (rows[2]["num_replied"], rows[2]["num_failed"]) == ("8", "0")  # they train again
    print(f"setup+round 0: {killed - started:.0f} s, restart: {restarted - killed:.0f} s, "
          f"total: {time.time() - started:.0f} s")  # fmt: skip


def _serverapp(link_pid: int) -> psutil.Process | None:
    """The ServerApp process the SuperLink's executor started (``flwr-serverapp``), if any."""
    for child in psutil.Process(link_pid).children(recursive=True):
        try:
            if any("flwr-serverapp" in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def _gone(proc: psutil.Process) -> bool:
    """Whether ``proc`` (not a child of this process) has ended."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("churn", [2], indirect=True)
def test_the_serverapp_killed_mid_run_resumes(tmp_path, churn):
    bound = churn.start_all()
    out = tmp_path / "server" / "out"
    config = _run_config(out, bound, rounds=2)
    run_deployment("secure", app_dir=REPO, env=churn.env, timeout=120, run_config=config,
                   stream=False)  # fmt: skip
    wait_for(lambda: server_round(out) >= 1, timeout=240, what="round 1",
             log=tmp_path / "superlink.log")  # fmt: skip
    app = _serverapp(churn.procs[0].pid)
    assert app is not None, "no ServerApp process under the SuperLink"
    app.kill()
    wait_for(lambda: _gone(app), timeout=30, what="the ServerApp's end")
    done = server_round(out)
    assert done == 1  # round 2 was under way
    again: list = []
    _submit(churn, config, again).join(timeout=420)  # the same submission resumes
    assert again and not isinstance(again[0], Exception), _outcome(again)
    assert f"after round {done}" in again[0].stdout
    _check_released_once(out, rounds=2, nodes=2)
