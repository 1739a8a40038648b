"""The MLS and SUPERB defaults under SecAgg+ on the Deployment Engine, with nothing shared.

The federation of :mod:`.test_deployment_tls_auth` (a SuperLink with TLS and SuperNode
authentication, two registered SuperNodes each with its own data folder, ``flwr run``) runs the
MLS alpha-split method and the SUPERB keyword-spotting task with ``secure_aggregation:
secaggplus``: every round's train stage goes through Flower's SecAgg+ workflow, the server
unmasks only the sum of both nodes' updates (sampling rate 1, two clients: two a round, the
protocol's minimum), and the epsilon is the accountant's for the same ``(q, sigma, T)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from speechbrain_fl.fl import run_deployment
from speechbrain_fl.privacy.accounting import compute_epsilon

from .conftest import REPO, wait_for
from .test_deployment_tls_auth import (  # noqa: F401 (the fixture)
    MLS_TINY,
    SUPERB_TINY,
    _mls_owner_folders,
    _rows,
    _superb_owner_folders,
    federation,
)

SUMMED = re.compile(r"round (\d+): securely summed (\d+) of (\d+) updates")


def _run_secure(tmp_path: Path, fed, folders: list[Path], run_config: dict) -> Path:
    """Start the SuperLink and the owners' SuperNodes, ``flwr run`` to completion; the output."""
    from speechbrain_fl.fl.engines.run import _run_status

    fed.start_superlink()
    fed.register("node0"), fed.register("node1")
    for pid, folder in enumerate(folders):
        fed.start_supernode(f"node{pid}", f'partition-id={pid} data-folder="{folder}"')
    proc = run_deployment("secure", app_dir=REPO, env=fed.env, timeout=1500, run_config=run_config)
    (tmp_path / "flwr_run.log").write_text(proc.stdout)
    status = _run_status(proc.stdout, "secure", fed.env)
    tail = (tmp_path / "superlink.log").read_text()[-3000:]
    assert status == "finished:completed", (status, tail)
    return Path(run_config["overrides"]["output_folder"])


def _assert_two_summed_a_round(tmp_path: Path, out: Path, rounds: int) -> list[dict[str, str]]:
    """rounds.csv and the ServerApp's log: every round securely summed both nodes' updates."""
    rows = _rows(out / "rounds.csv")
    assert [r["round"] for r in rows] == [str(r) for r in range(rounds + 1)]
    assert all(r["cohort_size"] == "2" and r["num_replied"] == "2" for r in rows[1:])
    assert all(r["num_failed"] == "0" for r in rows[1:])
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    summed = {int(r): (int(m), int(n)) for r, m, n in SUMMED.findall(logs)}
    assert summed == {r: (2, 2) for r in range(1, rounds + 1)}, summed
    return rows


@pytest.mark.slow
@pytest.mark.heavy
def test_mls_alpha_split_secaggplus_tls_auth(tmp_path, federation):  # noqa: F811
    folders = _mls_owner_folders(tmp_path)
    out = tmp_path / "server" / "out"
    overrides = {**MLS_TINY, "output_folder": str(out), "debug": True,
                 "cache_folder": str(tmp_path / "server" / "cache"),
                 "secure_aggregation": "secaggplus", "audit_canaries": 0}  # fmt: skip
    run_config = {"task": "recipes/MLS/train_fl.py:mls_task",
                  "hparams": "hparams/alpha_split.yaml", "num-server-rounds": 2,
                  "overrides": overrides}  # fmt: skip
    _run_secure(tmp_path, federation, folders, run_config)
    model = out / "final_model" / "federated_model.json"
    wait_for(model.is_file, timeout=120, what="the final model", log=tmp_path / "flwr_run.log")
    rows = _assert_two_summed_a_round(tmp_path, out, rounds=2)
    # flwr run of MLS writes no results.json: the ServerApp's settings line names the trust model
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "secure_aggregation='secaggplus' " in logs
    assert "trust_model='secure_aggregation'" in logs
    # the mechanism is unchanged by the blind server: (q, sigma, T) = (1, 0.1, 2), delta 1e-5
    # (alpha_split.yaml, base.yaml); rounds.csv has the running RDP figure, the model the PLD one
    mechanism = {"sampling_rate": 1.0, "noise_multiplier": 0.1, "rounds": 2, "delta": 1e-5}
    rdp = compute_epsilon(**mechanism, accountant="rdp", warn=False)
    assert float(rows[2]["epsilon"]) == pytest.approx(rdp, rel=1e-9)
    assert json.loads(model.read_text())["info"]["epsilon"] == pytest.approx(
        compute_epsilon(**mechanism, accountant="pld", warn=False), rel=1e-9
    )


@pytest.mark.slow
@pytest.mark.heavy
def test_superb_kws_secaggplus_tls_auth(tmp_path, federation):  # noqa: F811
    folders = _superb_owner_folders(tmp_path)
    out = tmp_path / "server" / "out"
    overrides = {**SUPERB_TINY, "output_folder": str(out),
                 "cache_folder": str(tmp_path / "server" / "cache"),
                 "secure_aggregation": "secaggplus", "secagg_clipping_range": 8.0}  # fmt: skip
    run_config = {"task": "recipes/SUPERB/superb_task.py:superb_task",
                  "hparams": "hparams/kws.yaml", "overrides": overrides}  # fmt: skip
    _run_secure(tmp_path, federation, folders, run_config)
    wait_for((out / "results.json").is_file, timeout=60, what="results.json",
             log=tmp_path / "flwr_run.log")  # fmt: skip
    _assert_two_summed_a_round(tmp_path, out, rounds=2)
    results = json.loads((out / "results.json").read_text())
    assert results["privacy"]["trust_model"]["name"] == "secure_aggregation"
    assert results["privacy"]["trust_model"]["protocol"] == "secaggplus"
    assert sorted(results["depths"]) == [3, 6] and set(results["test"]) == {"3", "6"}
