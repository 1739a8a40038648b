"""What the MLS recipe's log-mel cache (``feature_cache_mb``) saves a client update.

One process, the MLS task of ``hparams/fedavg.yaml`` (the tiny speech-LLM on the embedded
corpus; its preparation reused from ``--cache_folder``), the recipe's own clients: for each of
``--clients`` partitions, one client update is ``Brain.fit`` for the recipe's local epochs from
the same starting tensors (loaded before each update, so every update does the same work).
Updates with the cache off and on alternate, client by client, ``--repeats`` times, after one
warm-up pass that fills the cache (what a client meets from its second local epoch or its
second round on). Printed: the median milliseconds per update off and on, the pairs' ratios,
the extractor's own share (its calls timed while off), and the cache's rows, bytes and hits.

The cache is exact (``tests/unit/test_speech_llm_feature_cache.py``), so both arms train the
same arithmetic; ``--check`` also asserts that one client's trained tensors are equal with and
without it.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/mls_feature_cache.py
--cache_folder <the MLS cache> [--clients 6] [--repeats 3] [--check]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _context(node_config):
    from flwr.app import Context, RecordDict

    return Context(run_id=0, node_id=0, node_config=node_config, state=RecordDict(), run_config={})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_folder", required=True, help="the MLS recipe's cache folder")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="also check equal trained tensors")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import speechbrain as sb
    import torch

    from speechbrain_fl.fl import TaskSpec
    from speechbrain_fl.fl.params import load_trainable, trainable_parameters
    from speechbrain_fl.fl.task import load_task

    with tempfile.TemporaryDirectory() as out:
        spec = TaskSpec(
            task="recipes/MLS/train_fl.py:mls_task",
            hparams="hparams/fedavg.yaml",
            overrides={"cache_folder": args.cache_folder, "output_folder": out},
        )
        task = load_task(spec)
        k = task.num_partitions
        clients = []
        for pid in range(min(args.clients, k)):
            c = task.build_client(_context({"partition-id": pid, "num-partitions": k}))
            loader = c.brain.make_dataloader(
                c.train_set, stage=sb.Stage.TRAIN, **dict(c.train_loader_kwargs)
            )
            clients.append((c, loader, c.brain.train_sampler))
        epochs = int(task.build_server(_context({})).config.local_epochs)
        model = clients[0][0].brain.modules.model
        cache = model.feature_cache
        if cache is None:
            print("feature_cache_mb is 0 in this configuration: nothing to compare")
            return 1
        start_params = {
            n: p.detach().clone()
            for n, p in trainable_parameters(clients[0][0].brain.modules).items()
        }
        extractor_seconds = [0.0]
        log_mel = model._log_mel

        def timed_log_mel(audio):
            t = time.perf_counter()
            try:
                return log_mel(audio)
            finally:
                extractor_seconds[0] += time.perf_counter() - t

        def update(client, cached: bool) -> float:
            c, loader, sampler = client
            model.feature_cache = cache if cached else None
            model._log_mel = timed_log_mel if not cached else log_mel
            load_trainable(c.brain.modules, start_params)
            c.brain.train_sampler = sampler
            torch.manual_seed(0)
            t = time.perf_counter()
            c.brain.fit(range(1, epochs + 1), loader, progressbar=False)
            return time.perf_counter() - t

        for client in clients:  # warm-up: fills the cache with every client's utterances
            update(client, True)
        off, on, ratios = [], [], []
        extractor_seconds[0] = 0.0
        for _ in range(args.repeats):
            for client in clients:
                a, b = update(client, False), update(client, True)
                off.append(a)
                on.append(b)
                ratios.append(b / a)
        if args.check:
            trained = []
            for cached in (False, True):
                update(clients[0], cached)
                params = trainable_parameters(clients[0][0].brain.modules)
                trained.append({n: p.detach().clone() for n, p in params.items()})
            same = all(torch.equal(trained[0][n], trained[1][n]) for n in trained[0])
            print(f"trained tensors equal with and without the cache: {same}")
            if not same:
                return 1
        model.feature_cache = cache
        model._log_mel = log_mel
    load = os.getloadavg()
    ratios.sort()
    print(
        f"\nMLS tiny default (hparams/fedavg.yaml), {len(clients)} clients x {args.repeats} "
        f"repeats, E = {epochs}; load average {load[0]:.1f}; {os.cpu_count()} CPUs"
    )
    print("| | ms per client update | vs off |\n|---|---|---|")
    med_off, med_on = statistics.median(off), statistics.median(on)
    print(f"| cache off (log-mel every time) | {1e3 * med_off:.1f} | 1.00x |")
    print(
        f"| cache on (warm) | {1e3 * med_on:.1f} | {med_on / med_off:.2f}x (pairs "
        f"{ratios[0]:.2f}-{ratios[-1]:.2f}, median {statistics.median(ratios):.2f}) |"
    )
    print(
        f"| . the extractor's own time while off | {1e3 * extractor_seconds[0] / len(off):.1f} "
        f"| {extractor_seconds[0] / sum(off):.0%} of an update |"
    )
    print(
        f"cache: {len(cache)} rows, {cache.bytes / 2**20:.1f} MB of {cache.max_bytes / 2**20:.0f} "
        f"MB, {cache.hits} hits / {cache.misses} misses"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
