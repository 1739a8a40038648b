"""Simulation Engine (Ray) end to end: DP rounds, a failing client, max_epsilon, telemetry."""

import csv
import functools
import math

import pytest
import torch
from flwr.app import Context, RecordDict

from speechbrain_fl.fl import FLTask, run_simulation
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings
from speechbrain_fl.privacy import compute_epsilon

FAULTY = 3


def faulty_client(context, settings):
    """Partition 3 has NaN targets: its update is non-finite and its ClientApp raises."""
    task = toy_client(context, settings)
    if int(context.node_config["partition-id"]) == FAULTY:
        task.train_set.y = torch.full_like(task.train_set.y, float("nan"))
    return task


def test_dp_simulation_drops_faulty_client_and_stops_at_max_epsilon(tmp_path):
    sigma, q = 1.0, 1.0
    eps2 = compute_epsilon(sampling_rate=q, noise_multiplier=sigma, rounds=2, delta=1e-5)
    eps3 = compute_epsilon(sampling_rate=q, noise_multiplier=sigma, rounds=3, delta=1e-5)
    settings = toy_settings(
        overrides={
            "output_folder": str(tmp_path),
            "num_partitions": 4,
            "number_of_rounds": 4,
            "sampling_rate": q,
            "method": "flat",
            "noise_multiplier": sigma,
            "clip": 1.0,
            "min_clients": 2,
            "max_epsilon": (eps2 + eps3) / 2,
            "seed": 0,
            "noise_seed": 0,
            "eval_every": 2,
        }
    )
    task = FLTask(
        build_client=functools.partial(faulty_client, settings=settings),
        build_server=functools.partial(toy_server, settings=settings),
        num_partitions=4,
    )
    result = run_simulation(
        task, backend="ray", client_resources={"num_cpus": 1}, ray_init_args={"num_cpus": 2}
    )
    assert result.stopped_early and result.last_round == 2
    assert math.isclose(result.epsilon, eps2, rel_tol=1e-6)
    assert all(torch.isfinite(v).all() for v in result.params.values())
    with open(tmp_path / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["valid_loss"] and not rows[0]["cohort_size"]  # round-0 evaluation only
    assert rows[1]["valid_loss"] == "" and rows[2]["valid_loss"] != ""  # eval_every=2
    for row in rows[1:]:
        assert (row["cohort_size"], row["num_replied"], row["num_failed"]) == ("4", "3", "1")
        assert float(row["noise_std"]) == sigma * 1.0 / (q * 4)
        assert 0.0 <= float(row["clip_rate_all"]) <= 1.0 and float(row["budget_all"]) == 1.0
    assert float(rows[2]["valid_loss"]) < float(rows[0]["valid_loss"])
    groups = (tmp_path / "group_norms.csv").read_text().splitlines()
    assert groups[0] == "round,group,component,numel,mean_norm,budget,clip_rate"
    assert len(groups) == 1 + 2 * 2  # two rounds x two groups
    assert "round: 2" in (tmp_path / "train_log.txt").read_text()

    # The saved state belongs to this starting model: another one (here other initial weights)
    # must not resume it. The check runs before any round, so no grid is needed.
    other = toy_server(
        Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        {**settings, "data_seed": settings["data_seed"] + 1},
    )
    with pytest.raises(ValueError, match="other initial parameters"):
        run_server(None, other)
