"""Deployment Engine on loopback: a SuperLink, two SuperNodes, ``flwr run .``, two rounds."""

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speechbrain_fl.fl import run_deployment

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(cmd, log, env):
    # own session and process group, so cleanup reaches the SuperExec/app children too
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        cwd=os.path.dirname(log.name),
    )


def _round(out):
    path = out / "server_state.pt"
    return torch.load(path, weights_only=False)["round"] if path.exists() else -1


@pytest.mark.slow
def test_two_supernodes_two_rounds(tmp_path):
    home = tmp_path / "flwr_home"
    home.mkdir()
    link_port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), OMP_NUM_THREADS="1")
    procs, logs = [], []
    try:
        log = open(tmp_path / "superlink.log", "w")
        logs.append(log)
        procs.append(
            _start(
                [
                    str(BIN / "flower-superlink"),
                    "--insecure",
                    "--port",
                    str(link_port),
                    "--database",
                    str(tmp_path / "state.db"),
                    "--disable-runtime-dependency-installation",
                ],
                log,
                env,
            )
        )
        time.sleep(3)
        for pid in range(2):
            log = open(tmp_path / f"supernode{pid}.log", "w")
            logs.append(log)
            procs.append(
                _start(
                    [
                        str(BIN / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link_port}",
                        "--port",
                        str(_free_port()),
                        "--node-config",
                        f"partition-id={pid} num-partitions=2",
                    ],
                    log,
                    env,
                )
            )
        out = tmp_path / "out"
        hparams = tmp_path / "toy.yaml"  # the recipe hparams file, passed via the run config
        hparams.write_text("method: flat\nnoise_multiplier: 0.5\nclip: 1.0\nseed: 0\nnoise_seed: 0\n")
        run_config = {"number-of-rounds": 2, "output-folder": str(out), "hparams": str(hparams)}
        try:
            run_deployment("loopback", app_dir=REPO, env=env, timeout=300, run_config=run_config)
        except subprocess.CalledProcessError as err:
            raise AssertionError(
                f"flwr run failed:\n{err.output[-3000:]}\n{err.stderr[-3000:]}"
            ) from err
        deadline = time.time() + 60  # the state is written before the ServerApp returns
        while _round(out) < 2:
            assert time.time() < deadline, (tmp_path / "superlink.log").read_text()[-3000:]
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    with open(out / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" for r in rows[1:])
    assert float(rows[2]["epsilon"]) > 0
