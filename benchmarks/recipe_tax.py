"""A federated recipe's tax: its federated stage against the same client updates in a plain loop.

For one recipe task (an :class:`~speechbrain_fl.fl.task.FLTask` factory, as ``flwr run`` and
``train_fl.py`` load it), in one process:

- ``engine``: :func:`speechbrain_fl.fl.run_simulation` with ``backend="local"`` for
  ``--rounds`` rounds, evaluation off (``eval_every: 0``): the ServerApp, the ClientApp and
  their Messages, the strategy, the reply checks, clipping and noise as the recipe configures
  them, the state file. Timers (``perf_counter`` wrappers, no profiler) split each client update
  into SpeechBrain's local training (``fl.clientapp.train._local_fit``: the recipe's Brain), the rest of
  the ClientApp call (ours + Flower) and the LocalGrid delivery, and the server's share.
- ``plain``: the same clients (``build_client`` of the same factory: the same Brains, data,
  loaders and batch sizes) trained by ``Brain.fit`` for the same local epochs in one Python
  loop, FedAvg (mean of the deltas) with no Flower, no engine, no checks, no clipping or noise,
  no state file: what the same client updates cost by themselves, on the engine's cohorts (the
  partitions each round of the preceding engine run trained, so both time the same clients).

Both are read per client update (a round's time over the updates it made) so the Poisson
cohorts need not be equal; "steady" is the median of rounds 3.. (the first two build the
clients and warm caches). The tax is engine / plain; the recipe's target is <= 1.3x.

Presets (``--recipe``): ``mls`` (``recipes/MLS/train_fl.py:mls_task``, the default
``hparams/fedavg.yaml``: the tiny speech-LLM on the embedded corpus) and ``kws``
(``recipes/SUPERB/superb_task.py:superb_task`` with ``hparams/kws.yaml``); ``toy``
(``speechbrain_fl.fl.toy:toy_task``) for tests. ``--task``/``--hparams``/``--overrides``
name any other factory.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/recipe_tax.py --recipe kws
[--rounds 5] [--overrides '{...}']``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECIPES = {
    "toy": ("speechbrain_fl.fl.toy:toy_task", None, {"num_partitions": 8}),
    "mls": ("recipes/MLS/train_fl.py:mls_task", "hparams/fedavg.yaml", {}),
    "kws": ("recipes/SUPERB/superb_task.py:superb_task", "hparams/kws.yaml", {}),
}


@contextlib.contextmanager
def _timed(owner, name: str, totals: dict, key: str) -> Iterator[None]:
    """Add the wall time of every ``owner.name`` call to ``totals[key]`` while inside."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
            totals[key + " calls"] = totals.get(key + " calls", 0) + 1

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run_engine(spec, rounds: int) -> dict:
    """The recipe's federated stage on the local backend, with per-round timers."""
    from speechbrain_fl.fl import run_simulation
    from speechbrain_fl.fl.clientapp import train as client_module
    from speechbrain_fl.fl.engines import local_grid
    from speechbrain_fl.fl.serverapp import strategy as strategy_module

    per_round: list[dict] = []
    totals: dict = {}
    configure = strategy_module.DPFedAvg.configure_train

    def configure_train(self, server_round, *args, **kwargs):
        if per_round:
            per_round[-1].update(totals)
        totals.clear()
        messages = list(configure(self, server_round, *args, **kwargs))
        per_round.append({"round": server_round, "updates": len(messages), "cohort": []})
        return messages

    real_train_round = client_module.train_round

    def train_round(task, content, *, partition_id=0):
        if per_round:  # which partitions the engine trained, for the plain loop's cohorts
            per_round[-1]["cohort"].append(int(partition_id))
        return real_train_round(task, content, partition_id=partition_id)

    client_module.train_round = train_round
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, client_module, "train_round", real_train_round)
        stack.enter_context(_timed(client_module, "_local_fit", totals, "training"))
        stack.enter_context(_timed(client_module, "train_round", totals, "client handler"))
        stack.enter_context(_timed(local_grid.LocalGrid, "_deliver", totals, "delivery"))
        strategy_module.DPFedAvg.configure_train = configure_train
        try:
            result = run_simulation(spec, backend="local")
        finally:
            strategy_module.DPFedAvg.configure_train = configure
    if per_round:
        per_round[-1].update(totals)
    for row, seconds in zip(per_round, result.round_seconds, strict=False):
        row["seconds"] = seconds
    return {"rounds": per_round[: len(result.round_seconds)], "epsilon": result.epsilon}


def run_plain(task, cohorts: list[list[int]], local_epochs: int) -> dict:
    """The same clients' updates in a plain loop: Brain.fit, FedAvg, nothing else.

    ``cohorts`` lists the partitions of each round (the engine's, so both train the same
    clients: a recipe's clients differ in data size and, for the layer-wise rules, in depth).
    """
    import torch
    from flwr.app import Context, RecordDict

    from speechbrain_fl.fl.params import load_trainable, trainable_parameters

    def context(node_config):
        return Context(
            run_id=0, node_id=0, node_config=node_config, state=RecordDict(), run_config={}
        )

    k = task.num_partitions
    server = task.build_server(context({}))
    glob = {n: p.detach().clone() for n, p in trainable_parameters(server.brain.modules).items()}
    clients: dict[int, object] = {}
    rounds = len(cohorts)
    rows = []
    for server_round, cohort in enumerate(cohorts, start=1):
        start = time.perf_counter()
        total = {n: torch.zeros_like(v) for n, v in glob.items()}
        for pid in cohort:
            if pid not in clients:
                c = task.build_client(context({"partition-id": pid, "num-partitions": k}))
                loader = c.brain.make_dataloader(
                    c.train_set, stage=__import__("speechbrain").Stage.TRAIN,
                    **dict(c.train_loader_kwargs),
                )  # fmt: skip
                clients[pid] = (c, loader, c.brain.train_sampler)
            c, loader, c.brain.train_sampler = clients[pid]
            params = trainable_parameters(c.brain.modules)
            load_trainable(c.brain.modules, glob)
            c.brain.fl_round, c.brain.fl_num_rounds = server_round, rounds
            c.brain.fit(range(1, local_epochs + 1), loader, progressbar=False)
            with torch.no_grad():
                for n, s in total.items():
                    s += params[n].detach().to(s.device, s.dtype) - glob[n]
        if cohort:
            glob = {n: g + total[n] / len(cohort) for n, g in glob.items()}
        rows.append(
            {"round": server_round, "updates": len(cohort), "seconds": time.perf_counter() - start}
        )
    return {"rounds": rows}


def _steady(rows: list[dict], key: str = "seconds") -> float:
    """Median over rounds 3.. (or all when fewer) of ``key`` per client update."""
    use = [r for r in rows if r["updates"]][2:] or [r for r in rows if r["updates"]]
    return statistics.median(r[key] / r["updates"] for r in use) if use else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=list(RECIPES), default="toy")
    parser.add_argument("--task", default=None, help="module:factory (instead of --recipe)")
    parser.add_argument("--hparams", default=None)
    parser.add_argument("--overrides", default="{}", help="JSON mapping, the factory's overrides")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--repeats", type=int, default=3, help="engine and plain runs, alternating (medians)"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from speechbrain_fl.fl import TaskSpec
    from speechbrain_fl.fl.settings.config import FLConfig
    from speechbrain_fl.fl.task import load_task

    task_path, hparams, overrides = RECIPES[args.recipe]
    task_path = args.task or task_path
    hparams = args.hparams or hparams
    overrides = {**overrides, **json.loads(args.overrides)}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        overrides = {
            "output_folder": overrides.get("output_folder", out),
            **overrides,
            "number_of_rounds": args.rounds,
            "eval_every": 0,
        }
        spec = TaskSpec(task=task_path, hparams=hparams, overrides=overrides)
        start = time.perf_counter()
        task = load_task(spec)
        t_load = time.perf_counter() - start
        server = task.build_server(
            __import__("flwr.app", fromlist=["Context"]).Context(
                run_id=0, node_id=0, node_config={}, state=__import__(
                    "flwr.app", fromlist=["RecordDict"]).RecordDict(), run_config={},
            )
        )  # fmt: skip
        config: FLConfig = server.config
        del server
        engines, plains = [], []
        for rep in range(args.repeats):  # alternating, so load changes hit both alike
            fresh = {**overrides, "output_folder": os.path.join(out, f"engine{rep}")}
            # a fresh output folder: the engine would resume a finished run from its state file
            engines.append(run_engine(TaskSpec(task_path, hparams, fresh), args.rounds))
            cohorts = [r["cohort"] for r in engines[-1]["rounds"]]
            plains.append(run_plain(task, cohorts, config.local_epochs))
            print(
                f"  repeat {rep}: engine {1e3 * _steady(engines[-1]['rounds']):.1f} ms, plain "
                f"{1e3 * _steady(plains[-1]['rounds']):.1f} ms per client update "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )

    def med(runs, key="seconds"):
        return statistics.median(_steady(r["rounds"], key) for r in runs)

    e_step, p_step = med(engines), med(plains)
    ratios = sorted(
        _steady(e["rounds"]) / _steady(p["rounds"]) for e, p in zip(engines, plains, strict=True)
    )
    training, handler, delivery = (
        med(engines, k) for k in ("training", "client handler", "delivery")
    )
    parts = {
        "local training (the recipe's Brain, SpeechBrain)": training,
        "rest of the ClientApp call (ours + Flower)": handler - training,
        "LocalGrid delivery (message copy, RNG states)": delivery - handler,
        "server (reply checks, aggregation, clip/noise, state file, accounting)": e_step - delivery,
    }
    engine, plain = engines, plains
    privacy = f"DP {config.method}" if config.private else "no DP"
    print(
        f"\n{task_path} ({hparams or 'defaults'}), {privacy} (sigma {config.noise_multiplier:g}), "
        f"aggregation {config.aggregation_rule_name}, K={task.num_partitions}, "
        f"q={config.sampling_rate:g}, E={config.local_epochs}, {args.rounds} rounds, medians of "
        f"{args.repeats} alternating repeats; task load {t_load:.1f} s; load average {load:.1f} "
        f"at the start, {os.getloadavg()[0]:.1f} at the end; {os.cpu_count()} CPUs"
    )
    print("| | ms per client update (steady) | vs plain |\n|---|---|---|")
    print(f"| plain loop (Brain.fit + FedAvg) | {1e3 * p_step:.1f} | 1.00x |")
    print(
        f"| federated stage (engine, local backend) | {1e3 * e_step:.1f} | "
        f"{e_step / p_step:.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)}) |"
    )
    for label, value in parts.items():
        print(f"| . {label} | {1e3 * value:.1f} | |")
    out = {
        "task": task_path,
        "hparams": hparams,
        "method": config.method if config.private else "no DP",
        "aggregation": config.aggregation_rule_name,
        "engine": engine,
        "plain": plain,
        "steady_ms": {"engine": 1e3 * e_step, "plain": 1e3 * p_step},
        "tax": e_step / p_step,
        "pair_ratios": ratios,
        "parts_ms": {k: 1e3 * v for k, v in parts.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
