"""SecAgg+ on the Deployment Engine: a SuperLink with TLS and SuperNode authentication, two
SuperNodes with their own data, on loopback (the processes of three machines).

Every SuperNode runs each message in a fresh ClientApp process; SecAgg+'s client state (keys,
shares) lives in the node's run state between the protocol's four messages of a round. The run
is private (flat clip, noise); ``seed`` and ``noise_seed`` are fixed for the test only.
"""

from __future__ import annotations

import pytest

from .test_deployment_tls_auth import (  # noqa: F401 (the fixture)
    _run_toy_flat_two_rounds,
    _start_toy_nodes,
    federation,
)


@pytest.mark.slow
@pytest.mark.heavy
def test_secaggplus_deployment_tls_auth(tmp_path, federation):  # noqa: F811
    out = tmp_path / "server" / "out"
    bound = _start_toy_nodes(federation, tmp_path)
    rows = _run_toy_flat_two_rounds(
        federation, tmp_path, out, bound, secure_aggregation="secaggplus"
    )
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" and r["num_failed"] == "0" for r in rows[1:])
    assert float(rows[2]["epsilon"]) > 0
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "securely summed 2 of 2 updates" in logs
