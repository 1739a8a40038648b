"""Under Ray (backend="ray"), a worker process runs the recipe factory once and builds each client
once (the local backend: tests/integration/test_fl_local_backend.py).

Flower pickles the ClientApp with every message; the per-process caches of
``speechbrain_fl.fl.task.load_task`` and ``speechbrain_fl.fl.clientapp.train`` must survive that. A
factory script records every call and every client build with its process id.
"""

from __future__ import annotations

import collections
import json
import os

import pytest

from speechbrain_fl.fl import TaskSpec, run_simulation

FACTORY = """
import functools, json, os
from speechbrain_fl.fl.toy import toy_client, toy_task

def _record(path, **event):
    with open(path, "a") as handle:
        handle.write(json.dumps({"pid": os.getpid(), **event}) + "\\n")

def _client(context, *, inner, path):
    _record(path, kind="client", partition=int(context.node_config["partition-id"]))
    return inner(context)

def counting_task(hparams, overrides):
    overrides = dict(overrides)
    path = overrides.pop("events")
    _record(path, kind="factory")
    task = toy_task(hparams, overrides)
    task.build_client = functools.partial(_client, inner=task.build_client, path=path)
    return task
"""


@pytest.mark.slow
def test_factory_once_per_process_and_client_once_per_partition(tmp_path):
    script = tmp_path / "counting.py"
    script.write_text(FACTORY)
    events = tmp_path / "events.jsonl"
    rounds, partitions = 3, 4
    spec = TaskSpec(f"{script}:counting_task", None, {
        "events": str(events), "output_folder": str(tmp_path / "out"),
        "num_partitions": partitions, "number_of_rounds": rounds, "sampling_rate": 1.0,
        "eval_every": 0,
    })  # fmt: skip
    result = run_simulation(
        spec, backend="ray", client_resources={"num_cpus": 1}, ray_init_args={"num_cpus": 2}
    )
    assert result.last_round == rounds
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    factory = collections.Counter(e["pid"] for e in seen if e["kind"] == "factory")
    clients = collections.Counter((e["pid"], e["partition"]) for e in seen if e["kind"] == "client")
    assert max(factory.values()) == 1, factory  # once per process (driver and each actor)
    assert max(clients.values()) == 1, clients  # each partition built once per actor
    workers = {pid for pid, _ in clients} - {os.getpid()}
    assert len(workers) >= 1 and sum(clients.values()) <= len(workers) * partitions
    assert sum(clients.values()) < rounds * partitions  # fewer builds than messages
