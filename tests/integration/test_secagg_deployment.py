"""SecAgg+ on the Deployment Engine: a SuperLink with TLS and SuperNode authentication, two
SuperNodes with their own data, on loopback (the processes of three machines).

Every SuperNode runs each message in a fresh ClientApp process; SecAgg+'s client state (keys,
shares) lives in the node's run state between the protocol's four messages of a round. The run
is private (flat clip, noise); ``seed`` and ``noise_seed`` are fixed for the test only.
"""

from __future__ import annotations

import pytest

from speechbrain_fl.fl import run_deployment
from speechbrain_fl.fl.toy import toy_settings, write_toy_manifest

from .conftest import REPO, server_round, wait_for
from .test_deployment_tls_auth import _rows, federation  # noqa: F401 (the fixture)


@pytest.mark.slow
@pytest.mark.heavy
def test_secaggplus_deployment_tls_auth(tmp_path, federation):  # noqa: F811
    fed = federation
    fed.start_superlink()
    bound = {fed.register("node0"): 0, fed.register("node1"): 1}
    settings = toy_settings(overrides={"num_partitions": 2})
    for node, pid in (("node0", 0), ("node1", 1)):
        data = tmp_path / f"{node}_data"
        data.mkdir()
        write_toy_manifest(data / "train.csv", settings, pid)
        fed.start_supernode(node, f'partition-id={pid} data-folder="{data}" device="cpu"')
    out = tmp_path / "server" / "out"
    overrides = {"num_partitions": 2, "output_folder": str(out), "seed": 0, "noise_seed": 0,
                 "node_partitions": bound, "secure_aggregation": "secaggplus"}  # fmt: skip
    run_config = {"num-server-rounds": 2, "method": "flat", "noise-multiplier": 0.5,
                  "clip": 1.0, "overrides": overrides}  # fmt: skip
    proc = run_deployment("secure", app_dir=REPO, env=fed.env, timeout=600, run_config=run_config)
    (tmp_path / "flwr_run.log").write_text(proc.stdout)
    wait_for(lambda: server_round(out) >= 2, timeout=120, what="round 2",
             log=tmp_path / "superlink.log")  # fmt: skip
    rows = _rows(out / "rounds.csv")
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" and r["num_failed"] == "0" for r in rows[1:])
    assert float(rows[2]["epsilon"]) > 0
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "securely summed 2 of 2 updates" in logs
