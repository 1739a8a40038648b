"""Flower processes on loopback for the ``flwr run`` tests: a SuperLink, SuperNodes, cleanup.

Every process gets free ports, its own session (so cleanup reaches the app processes it
spawns) and a log file in the test's folder; readiness is polled on the SuperLink's health
endpoint, never waited for with a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, *, timeout: float, what: str, log: Path | None = None) -> None:
    """Poll ``condition()`` every 0.5 s until true; fail naming ``what`` (and the log tail)."""
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.5)


def server_round(out: Path) -> int:
    """The last round saved in ``out/server_state.pt`` (-1 before the first save)."""
    path = out / "server_state.pt"
    try:
        return int(torch.load(path, weights_only=False)["round"]) if path.exists() else -1
    except (EOFError, RuntimeError):  # being replaced right now
        return -1


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture
def flower(tmp_path):
    """Start a SuperLink (``simulation=True`` for a simulation federation) and SuperNodes.

    Returns a function ``start(*, simulation=False, supernodes=0) -> env`` whose ``env`` has
    ``FLWR_HOME`` pointing at a config with one connection named ``loopback``.
    """
    procs: list[subprocess.Popen] = []
    logs = []

    def spawn(cmd, name, env):
        log = open(tmp_path / f"{name}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=tmp_path,
            )
        )

    def start(*, simulation: bool = False, supernodes: int = 0) -> dict[str, str]:
        home = tmp_path / "flwr_home"
        home.mkdir(exist_ok=True)
        port = free_port()
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        env = dict(os.environ, FLWR_HOME=str(home), OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        # the SuperLink and SuperNodes start Flower's other executables by name
        env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
        cmd = [str(BIN / "flower-superlink"), "--insecure", "--port", str(port),
               "--database", str(tmp_path / "state.db"),
               "--disable-runtime-dependency-installation"]  # fmt: skip
        if simulation:
            cmd += ["--simulation", "--isolation", "subprocess"]
        spawn(cmd, "superlink", env)
        link = procs[-1]
        wait_for(lambda: link.poll() is not None or _healthy(port), timeout=60,
                 what="the SuperLink", log=tmp_path / "superlink.log")  # fmt: skip
        if link.poll() is not None:
            raise AssertionError(
                "the SuperLink exited:\n" + (tmp_path / "superlink.log").read_text()[-3000:]
            )
        for pid in range(supernodes):
            spawn(
                [str(BIN / "flower-supernode"), "--insecure",
                 "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
                 "--node-config", f"partition-id={pid} num-partitions={supernodes}"],
                f"supernode{pid}",
                env,
            )  # fmt: skip
        return env

    yield start
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
