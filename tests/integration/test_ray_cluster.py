"""A Ray cluster on loopback: ``ray start --head`` plus one worker node, the task run with
``ray_address``, its clients on both nodes.

Each Ray node offers one CPU and each client asks for one (``client_resources``), so Flower's
actor pool holds two actors, one per node: the run trains on both. The clients record the Ray
node they ran on (a file per round and partition), so the test sees both node ids. The Ray
processes are this test's own (``ray start --block`` in a session of its own, stopped by its
process group): ``ray stop`` would stop every Ray process of the machine.
"""

from __future__ import annotations

import csv
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from speechbrain_fl.fl import run_simulation
from speechbrain_fl.fl.task import FLTask
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings

from .conftest import BIN, free_port, wait_for


def _ray_nodes(address: str) -> int:
    """Alive nodes of the cluster at ``address`` (a fresh driver process: ``ray.nodes()``)."""
    code = (
        f"import ray; ray.init(address={address!r}, logging_level='ERROR', "
        "include_dashboard=False); print(sum(n['Alive'] for n in ray.nodes()))"
    )
    proc = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def recording_client(context, *, settings, folder):
    """The toy client, noting the Ray node it was built on (``<folder>/<pid>_<ray node>``)."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "none"
    pid = int(context.node_config.get("partition-id", 0))
    Path(folder, f"{pid}_{node}").touch()
    return toy_client(context, settings)


@pytest.mark.slow
@pytest.mark.heavy
def test_ray_cluster_head_and_worker(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    procs, logs = [], []
    temp = tempfile.mkdtemp(prefix="sbfl_ray_")  # short: Ray's socket paths are <= 107 bytes
    common = ["--num-cpus", "1", "--num-gpus", "0", "--block", "--disable-usage-stats",
              "--node-ip-address", "127.0.0.1", "--temp-dir", temp,
              "--object-store-memory", str(200 * 2**20)]  # fmt: skip
    try:
        for name, args in (
            ("head", ["--head", "--port", str(port), "--include-dashboard", "false"]),
            ("worker", ["--address", address]),
        ):  # fmt: skip
            log = open(tmp_path / f"ray_{name}.log", "w")  # noqa: SIM115
            logs.append(log)
            procs.append(
                subprocess.Popen([str(BIN / "ray"), "start", *args, *common], stdout=log,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )  # fmt: skip
            if name == "head":
                time.sleep(5)  # the worker needs the head's GCS
        wait_for(lambda: _ray_nodes(address) >= 2, timeout=180, what="two Ray nodes",
                 log=tmp_path / "ray_worker.log")  # fmt: skip
        seen = tmp_path / "seen"
        seen.mkdir()
        settings = toy_settings(overrides={
            "num_partitions": 4, "number_of_rounds": 2, "output_folder": str(tmp_path / "out"),
        })  # fmt: skip
        task = FLTask(
            build_client=functools.partial(recording_client, settings=settings, folder=seen),
            build_server=functools.partial(toy_server, settings=settings),
            num_partitions=4,
        )
        result = run_simulation(task, ray_address=address,
                                client_resources={"num_cpus": 1, "num_gpus": 0.0})  # fmt: skip
        assert len(result.params) == 2  # the toy's weight and bias
        with open(tmp_path / "out" / "rounds.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert [r["round"] for r in rows] == ["0", "1", "2"]
        assert all(r["num_replied"] == "4" for r in rows[1:])
        nodes = {p.name.split("_", 1)[1] for p in seen.iterdir()}
        assert len(nodes) == 2, f"clients ran on {nodes}, not on both Ray nodes"
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        shutil.rmtree(temp, ignore_errors=True)
