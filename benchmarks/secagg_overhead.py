"""Per-round cost of ``secure_aggregation: secaggplus`` against the same run without it.

The workload: the toy regression task (:mod:`speechbrain_fl.fl.toy`) with ``num_features``
inputs (``num_features + 1`` trainable parameters), K clients of 32 examples, every client
sampled every round (q = 1), flat clipping C = 0.05 and noise multiplier 1, on the local
backend (one process). Each configuration runs the same rounds from the same seeds; the
benchmark prints the median wall time of the rounds after the first (the first builds the
clients), the CPU seconds of the whole run (this process: server and clients; robust to other
processes sharing the machine, unlike the wall times), and the bytes the ServerApp sent and
received per round: the payload of the messages' records (tensor bytes, config values, 8 bytes
per metric), without the transport's framing. ``noise_seed`` and ``sampler_seed`` are fixed:
a benchmark, not a private run.

Run: ``PYTHONPATH=$PWD python benchmarks/secagg_overhead.py --clients 8 --features 10000``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

from flwr.app import Context, RecordDict

from speechbrain_fl.fl.clientapp.train import make_client_app
from speechbrain_fl.fl.engines.local_grid import LocalGrid
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings


def payload_bytes(content: RecordDict) -> int:
    """The bytes of a message's records: arrays' data, config values, 8 per metric value."""
    total = 0
    for record in content.array_records.values():
        total += sum(len(a.data) for a in record.values())
    for record in content.config_records.values():
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            total += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in items)
    for record in content.metric_records.values():
        for value in record.values():
            total += 8 * (len(value) if isinstance(value, list) else 1)
    return total


class CountingGrid:
    """Counts the bytes the ServerApp sends and receives in training messages."""

    def __init__(self, grid) -> None:
        self._grid, self.sent, self.received = grid, 0, 0

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == "train"]
        self.sent += sum(payload_bytes(m.content) for m in train)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        if train:
            self.received += sum(payload_bytes(r.content) for r in replies if not r.has_error())
        return replies


def run(*, clients: int, features: int, rounds: int, secure: bool) -> dict[str, float]:
    """One run; its median steady round (s) and its training bytes per round."""
    with tempfile.TemporaryDirectory() as out:
        overrides = {
            "num_partitions": clients, "num_features": features, "number_of_rounds": rounds,
            "seed": 0, "eval_every": 0, "method": "flat", "clip": 0.05,
            "noise_multiplier": 1.0, "sampling_rate": 1.0, "noise_seed": 1, "sampler_seed": 2,
            "output_folder": out,
        }  # fmt: skip
        if secure:
            overrides["secure_aggregation"] = "secaggplus"
        settings = toy_settings(None, overrides)
        app = make_client_app(functools.partial(toy_client, settings=settings))
        grid = CountingGrid(LocalGrid(app, num_nodes=clients))
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
        start, cpu = time.perf_counter(), time.process_time()
        with grid.identity():
            result = run_server(grid, toy_server(context, settings))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "steady_round_s": statistics.median(result.round_seconds[1:]),
        "first_round_s": result.round_seconds[0],
        "run_s": wall,
        "run_cpu_s": cpu,
        "sent_per_round": grid.sent / rounds,
        "received_per_round": grid.received / rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--features", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = {}
    for secure in (False, True):
        rows[secure] = run(
            clients=args.clients, features=args.features, rounds=args.rounds, secure=secure
        )
    print(f"K={args.clients} clients, {args.features + 1} parameters, {args.rounds} rounds")
    print(
        f"{'':>10} {'steady round s':>15} {'run CPU s':>10} {'sent B/round':>14} "
        f"{'received B/round':>17}"
    )
    for secure, row in rows.items():
        print(
            f"{'secaggplus' if secure else 'central':>10} {row['steady_round_s']:>15.3f} "
            f"{row['run_cpu_s']:>10.2f} "
            f"{row['sent_per_round']:>14.0f} {row['received_per_round']:>17.0f}"
        )
    plain, secure = rows[False], rows[True]
    ratio = secure["steady_round_s"] / plain["steady_round_s"]
    print(
        f"ratio (secaggplus / central): time {ratio:.1f}x, CPU "
        f"{secure['run_cpu_s'] / plain['run_cpu_s']:.1f}x, sent "
        f"{secure['sent_per_round'] / plain['sent_per_round']:.2f}x, received "
        f"{secure['received_per_round'] / plain['received_per_round']:.2f}x"
    )


if __name__ == "__main__":
    main()
