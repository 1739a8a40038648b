"""Overhead of Flower's Simulation Engine over a plain in-process loop (issue 3, item 8).

Rounds of K=32 clients, each running the same local training (the toy SpeechBrain Brain,
``examples_per_client / batch_size`` SGD steps, DP clipping of the update), measured
(a) through :func:`speechbrain_fl.fl.run_simulation` (Ray backend, one ClientApp per CPU) and
(b) as the same ``train_round`` calls in a plain Python loop in this process, plus the same
server aggregation. Prints the wall times, the ratio and the overhead per client in ms, for the
first round (cold actors import torch/SpeechBrain and build their tasks), for the second
(warm actors, the steady state of a long run) and for the whole run including Ray start-up.

Run: ``OMP_NUM_THREADS=1 python benchmarks/fl_overhead.py [--clients 32] [--steps 4]``
"""

import argparse
import json
import tempfile
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from speechbrain_fl.fl import run_simulation, train_round, trainable_parameters
from speechbrain_fl.fl.toy import toy_client, toy_settings, toy_task


def plain_loop(settings: dict, clients: int) -> float:
    """Build each client's task and run its round in-process, like a client would."""
    start = time.perf_counter()
    model = toy_client(
        Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), settings
    ).brain
    glob = {k: v.detach().clone() for k, v in trainable_parameters(model.modules).items()}
    budgets = json.dumps(1.0)
    total = {k: torch.zeros_like(v) for k, v in glob.items()}
    for pid in range(clients):
        ctx = Context(
            run_id=0,
            node_id=pid,
            node_config={"partition-id": pid},
            state=RecordDict(),
            run_config={},
        )
        task = toy_client(ctx, settings)
        config = ConfigRecord(
            {
                "local-epochs": 1,
                "round-seed": 0,
                "clip-budgets": budgets,
                "clip-groups": json.dumps(list(glob)),
                "clip-components": json.dumps(["all"]),
            }
        )
        out = train_round(
            task, RecordDict({"arrays": ArrayRecord(glob), "config": config}), partition_id=pid
        )
        for k, v in out["arrays"].to_torch_state_dict().items():
            total[k] += v / clients
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=None, help="Ray CPUs (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        overrides = {
            "output_folder": out,
            "num_partitions": args.clients,
            "number_of_rounds": 2,
            "examples_per_client": 8 * args.steps,
            "batch_size": 8,
            "method": "flat",
            "noise_multiplier": 1.0,
            "clip": 1.0,
            "eval_every": 0,
        }
        settings = toy_settings(overrides=overrides)
        plain = plain_loop(settings, args.clients)
        start = time.perf_counter()
        init = {"num_cpus": args.cpus} if args.cpus else None
        result = run_simulation(
            toy_task(overrides=overrides), client_resources={"num_cpus": 1}, ray_init_args=init
        )
        total = time.perf_counter() - start
    first, second = result.round_seconds
    print(f"clients={args.clients} local steps={args.steps}")
    print(f"plain in-process loop           : {plain:8.3f} s")
    for name, sec in (("round 1 (cold actors)", first), ("round 2 (warm actors)", second)):
        print(
            f"simulation, {name:21s}: {sec:8.3f} s  ratio {sec / plain:5.2f}x  "
            f"overhead {1000 * (sec - plain) / args.clients:7.1f} ms/client"
        )
    print(
        f"simulation, whole 2-round run    : {total:8.3f} s (Ray start-up, round 0 eval included)"
    )


if __name__ == "__main__":
    main()
