"""The local backend (speechbrain_fl/fl/engines/local_grid.py) runs the same apps as the Ray backend.

Same ServerApp, ClientApp and Messages, same seeds: the final tensors, the epsilon and every
rounds.csv / group_norms.csv row must be identical. The fixed ``seed``, ``noise_seed`` and
``sampler_seed`` below are for tests only (real private runs draw noise and cohorts from the OS).
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os

import pytest
import torch

from speechbrain_fl.fl import FLTask, TaskSpec, run_simulation
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings
from speechbrain_fl.privacy import compute_epsilon

from .test_fl_build_once import FACTORY

SETTINGS = {
    "num_partitions": 4,
    "number_of_rounds": 3,
    "seed": 0,
    "eval_every": 1,
}
DP = {"method": "flat", "clip": 0.5, "noise_multiplier": 0.8, "sampling_rate": 0.75,
      "noise_seed": 1, "sampler_seed": 2}  # fmt: skip


def _run(tmp_path, name, backend, extra):
    out = tmp_path / name
    spec = TaskSpec("speechbrain_fl.fl.toy:toy_task", None,
                    {**SETTINGS, **extra, "output_folder": str(out)})  # fmt: skip
    result = run_simulation(
        spec, backend=backend, client_resources={"num_cpus": 1}, ray_init_args={"num_cpus": 2}
    )
    files = {
        f: (out / f).read_text() for f in ("rounds.csv", "group_norms.csv") if (out / f).exists()
    }
    return result, files


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedavg", "flat"])
def test_local_backend_identical_to_ray(tmp_path, method):
    extra = DP if method == "flat" else {"method": "fedavg"}
    ray_result, ray_files = _run(tmp_path, "ray", "ray", extra)
    local_result, local_files = _run(tmp_path, "local", "local", extra)
    assert ray_result.last_round == local_result.last_round == SETTINGS["number_of_rounds"]
    assert set(ray_result.params) == set(local_result.params)
    for name, value in ray_result.params.items():
        assert torch.equal(value, local_result.params[name]), name  # bit for bit
    assert ray_result.epsilon == local_result.epsilon
    # the result carries the FLConfig the task was built with (a report reads it, not rebuilds it)
    for result in (ray_result, local_result):
        assert result.config.noise_multiplier == extra.get("noise_multiplier", 0.0)
        assert result.config.num_rounds == SETTINGS["number_of_rounds"]
    assert ray_files == local_files  # every rounds.csv and group_norms.csv row
    rows = ray_files["rounds.csv"].splitlines()
    assert len(rows) == 1 + 1 + SETTINGS["number_of_rounds"]  # header, round 0, rounds
    if method == "flat":
        expected = compute_epsilon(sampling_rate=0.75, noise_multiplier=0.8, rounds=3, delta=1e-5)
        assert math.isclose(local_result.epsilon, expected, rel_tol=1e-9)
        assert len(ray_files["group_norms.csv"].splitlines()) > 1
    else:
        assert local_result.epsilon is None


def failing_client(context, settings):
    """Partition 1's ClientApp raises (NaN targets make a non-finite loss)."""
    task = toy_client(context, settings)
    if int(context.node_config["partition-id"]) == 1:
        task.train_set.y = torch.full_like(task.train_set.y, float("nan"))
    return task


def test_local_backend_failed_client_is_a_failed_reply(tmp_path):
    settings = toy_settings(
        overrides={**SETTINGS, "number_of_rounds": 2, "output_folder": str(tmp_path)}
    )
    task = FLTask(
        build_client=functools.partial(failing_client, settings=settings),
        build_server=functools.partial(toy_server, settings=settings),
        num_partitions=4,
    )
    result = run_simulation(task, backend="local")
    assert result.last_round == 2
    assert all(torch.isfinite(v).all() for v in result.params.values())
    rows = (tmp_path / "rounds.csv").read_text().splitlines()
    header = rows[0].split(",")
    for row in rows[2:]:
        cells = dict(zip(header, row.split(","), strict=True))
        assert (cells["num_replied"], cells["num_failed"]) == ("3", "1")


def test_local_backend_builds_each_partition_once_in_this_process(tmp_path):
    script = tmp_path / "counting.py"
    script.write_text(FACTORY)
    events = tmp_path / "events.jsonl"
    rounds, partitions = 3, 6  # more partitions than the Ray path's per-worker cache holds
    spec = TaskSpec(f"{script}:counting_task", None, {
        "events": str(events), "output_folder": str(tmp_path / "out"),
        "num_partitions": partitions, "number_of_rounds": rounds, "sampling_rate": 1.0,
        "eval_every": 0, "backend": "local",
    })  # fmt: skip
    result = run_simulation(spec)  # the config's backend: local
    assert result.last_round == rounds
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    assert {e["pid"] for e in seen} == {os.getpid()}  # no other process
    assert sum(e["kind"] == "factory" for e in seen) == 1
    clients = collections.Counter(e["partition"] for e in seen if e["kind"] == "client")
    assert clients == {p: 1 for p in range(partitions)}  # built once, reused every round


def test_backend_key_is_checked():
    from speechbrain_fl.fl.settings.config import FLConfig

    assert FLConfig.from_hparams({"output_folder": "o"}).backend == "local"
    assert FLConfig.from_hparams({"output_folder": "o", "backend": "ray"}).backend == "ray"
    with pytest.raises(ValueError, match="backend='spark'"):
        FLConfig.from_hparams({"output_folder": "o", "backend": "spark"})
