"""Our quantile clipping against Flower's server-side adaptive clipping, on the toy task.

Runs, for each of ``--seeds`` repetitions, the toy task (``speechbrain_fl.fl.toy``: every client
every round, so both sides have the same n) with the same settings (initial clip, target
quantile gamma, learning rate eta_C, count noise sigma_b, noise multiplier z):

- ``ours``: this engine with ``method: flat`` and ``clip_quantile`` (:mod:`speechbrain_fl.fl.dp.adaptive`);
- ``flower``: Flower's own ``DifferentialPrivacyServerSideAdaptiveClipping`` wrapping its
  ``FedAvg``, run by Flower's ``Strategy.start`` over the same in-process Grid and the same
  toy clients (which return their unclipped model, as that strategy expects);
- ``flower_unclipped_bit``: the same Flower strategy with one change, its geometric update fed
  the unclipped fraction ``1 - clipped`` (the bit of Andrew et al. 2021, Algorithm 1), which
  Flower's strategy replaces by the clipped indicator ``norm > C``.

Per round it records each side's clip C_t and compares the distributions over the seeds (mean
and standard deviation of log C_t, a two-sample Kolmogorov-Smirnov test at each round). It also
computes the epsilon of the pair (update at Flower's sigma_Delta, count at 2 sigma_b) with
dp-accounting's RDP accountant of the composed event, against this package's accountant at z.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/adaptive_clip_vs_flower.py --seeds 20 --rounds 30 \\
        --out /tmp/adaptive_vs_flower.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg
from scipy import stats

from speechbrain_fl.fl.clientapp.train import make_client_app, train_round
from speechbrain_fl.fl.engines.local_grid import LocalGrid
from speechbrain_fl.fl.npy_codec import decode_record
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import _brain, toy_client, toy_server, toy_settings
from speechbrain_fl.privacy import compute_epsilon
from speechbrain_fl.privacy.adaptive_clipping import update_noise_multiplier


def _settings(args, seed: int, out: Path) -> dict:
    return toy_settings(None, {
        "num_partitions": args.clients, "number_of_rounds": args.rounds, "seed": seed,
        "eval_every": 0, "method": "flat", "clip": args.clip, "noise_multiplier": args.z,
        "clip_quantile": args.quantile, "clip_quantile_lr": args.lr,
        "clip_count_stddev": args.count_stddev, "sampling_rate": 1.0, "noise_seed": seed,
        "sampler_seed": seed, "output_folder": str(out / f"ours_{seed}"),
    })  # fmt: skip


def run_ours(args, seed: int, out: Path) -> list[float]:
    """C_t of each round (the clip the round used), then the final clip."""
    settings = _settings(args, seed, out)
    grid = LocalGrid(make_client_app(functools.partial(toy_client, settings=settings)),
                     num_nodes=args.clients)  # fmt: skip
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with grid.identity():
        result = run_server(grid, toy_server(context, settings))
    adaptive = result.privacy["adaptive_clipping"]
    return [r["clip"] for r in adaptive["rounds"]] + [adaptive["final_clips"]["all"]]


def _model_client(settings: dict) -> ClientApp:
    """The toy client replying with its trained model (global + unclipped update)."""
    app, tasks = ClientApp(), {}

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config.get("partition-id", 0))
        if pid not in tasks:
            tasks[pid] = toy_client(context, settings)
        reply = train_round(tasks[pid], msg.content, partition_id=pid)
        start = decode_record(msg.content["arrays"])
        delta = decode_record(reply["arrays"])
        model = ArrayRecord({k: (start[k] + delta[k]).float() for k in start})
        metrics = MetricRecord({"num-examples": int(reply["metrics"]["num-examples"])})
        return Message(content=RecordDict({"arrays": model, "metrics": metrics}), reply_to=msg)

    return app


class _Recording(DifferentialPrivacyServerSideAdaptiveClipping):
    """Flower's strategy, recording the clip each round's replies are clipped with."""

    unclipped_bit = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clips: list[float] = []

    def aggregate_train(self, server_round, replies):
        self.clips.append(self.clipping_norm)
        return super().aggregate_train(server_round, replies)

    def _geometric_update(self, clipped_fraction: float) -> None:
        fraction = 1.0 - clipped_fraction if self.unclipped_bit else clipped_fraction
        super()._geometric_update(fraction)


def run_flower(args, seed: int, out: Path, *, unclipped_bit: bool) -> list[float]:
    """Flower's C_t of each round, then its final clip."""
    np.random.seed(seed)  # Flower's count and model noise draw from NumPy's global generator
    settings = _settings(args, seed, out)
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=args.clients,
                   min_available_nodes=args.clients)  # fmt: skip
    strategy = _Recording(
        inner,
        noise_multiplier=args.z,
        num_sampled_clients=args.clients,
        initial_clipping_norm=args.clip,
        target_clipped_quantile=args.quantile,
        clip_norm_lr=args.lr,
        clipped_count_stddev=args.count_stddev,
    )
    strategy.unclipped_bit = unclipped_bit
    grid = LocalGrid(_model_client(settings), num_nodes=args.clients)
    start = _brain(settings).modules.state_dict()
    with grid.identity():
        strategy.start(grid, ArrayRecord(start), num_rounds=args.rounds)
    return strategy.clips + [strategy.clipping_norm]


def pair_epsilon(args) -> dict:
    """Epsilon of (update at Flower's sigma_Delta, count at 2 sigma_b), composed by dp-accounting,
    and ours at z (q = 1, the toy's every-client rounds)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    _, flower_sigma = compute_adaptive_noise_params(args.z, args.clients, args.count_stddev)
    pair = dp_event.PoissonSampledDpEvent(1.0, dp_event.ComposedDpEvent(
        [dp_event.GaussianDpEvent(flower_sigma), dp_event.GaussianDpEvent(2 * args.count_stddev)]
    ))  # fmt: skip
    rdp = RdpAccountant()
    rdp.compose(dp_event.SelfComposedDpEvent(pair, args.rounds))
    ours = compute_epsilon(sampling_rate=1.0, noise_multiplier=args.z, rounds=args.rounds,
                           delta=1e-5, accountant="rdp", warn=False)  # fmt: skip
    return {
        "flower_update_noise_multiplier": flower_sigma,
        "our_update_noise_multiplier": update_noise_multiplier(
            args.z, count_stddev=args.count_stddev
        ),
        "epsilon_pair_dp_accounting_rdp": rdp.get_epsilon(1e-5),
        "epsilon_ours_at_z_rdp": ours,
    }


def compare(runs: dict[str, list[list[float]]], base: str = "ours") -> dict:
    """Per round and side: mean and sd of log C_t; KS p-value of each side against ``base``."""
    table = {}
    for side, trajectories in runs.items():
        logs = np.log(np.asarray(trajectories))
        rows = []
        for t in range(logs.shape[1]):
            row = {"round": t + 1, "mean_log_clip": float(logs[:, t].mean()),
                   "sd_log_clip": float(logs[:, t].std(ddof=1)),
                   "median_clip": float(np.median(np.exp(logs[:, t])))}  # fmt: skip
            if side != base:
                other = np.log(np.asarray(runs[base]))[:, t]
                row["ks_pvalue_vs_ours"] = float(stats.ks_2samp(logs[:, t], other).pvalue)
            rows.append(row)
        table[side] = rows
    return table


SIDES = {
    "ours": "this engine (`clip_quantile`)",
    "flower": "Flower `DifferentialPrivacyServerSideAdaptiveClipping`",
    "flower_unclipped_bit": "Flower, fed the unclipped fraction",
}


def markdown_table(result: dict, *, rounds: tuple[int, ...] = (10, 40)) -> str:
    """The docs' table (docs/adaptive_clipping.md) from a results file of this script.

    Per side, the median clip over the seeds after each of ``rounds`` and, after the last, the
    mean (sd) of log C, the KS p-value against ours and the smallest over the rounds; then the
    update noise multipliers and the epsilons of the pair.
    """
    by_round, n = result["by_round"], result["settings"]["seeds"]
    head = ["side"] + [f"median C after {r} rounds" for r in rounds]
    head += [f"log C after {rounds[-1]}: mean (sd)", f"KS p vs ours ({n} seeds)",
             f"smallest KS p, rounds 1-{rounds[-1]}"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for side, label in SIDES.items():
        rows = by_round[side]
        last = rows[rounds[-1]]
        cells = [label] + [f"{rows[r]['median_clip']:.4f}" for r in rounds]
        cells.append(f"{last['mean_log_clip']:.3f} ({last['sd_log_clip']:.3f})")
        if side == "ours":
            cells += ["-", "-"]
        else:
            smallest = min(row["ks_pvalue_vs_ours"] for row in rows[1 : rounds[-1] + 1])
            cells += [f"{last['ks_pvalue_vs_ours']:.3g}", f"{smallest:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    p = result["privacy"]
    lines += [
        "",
        f"sigma_Delta: Flower {p['flower_update_noise_multiplier']:.6f}, ours "
        f"{p['our_update_noise_multiplier']:.6f}; epsilon (RDP, delta 1e-5, "
        f"{result['settings']['rounds']} rounds, q = 1) of the pair composed by dp-accounting "
        f"{p['epsilon_pair_dp_accounting_rdp']:.4f}, this package's accountant at z "
        f"{p['epsilon_ours_at_z_rdp']:.4f}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--clip", type=float, default=0.1)
    parser.add_argument("--quantile", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--count-stddev", type=float, default=1.0)
    parser.add_argument("--z", type=float, default=1.0)
    parser.add_argument("--work", default="/tmp/adaptive_vs_flower")
    parser.add_argument("--out", required=True, help="results file to write (or read: --table)")
    parser.add_argument("--table", action="store_true", help="print the docs' table of --out")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.out).read_text())))
        return
    logging.getLogger("flwr").setLevel(logging.WARNING)
    work = Path(args.work)
    runs = {"ours": [], "flower": [], "flower_unclipped_bit": []}
    for seed in range(args.seeds):
        runs["ours"].append(run_ours(args, seed, work))
        runs["flower"].append(run_flower(args, seed, work, unclipped_bit=False))
        runs["flower_unclipped_bit"].append(run_flower(args, seed, work, unclipped_bit=True))
        print(f"seed {seed}: final C ours {runs['ours'][-1][-1]:.4g}, flower "
              f"{runs['flower'][-1][-1]:.4g}, flower_unclipped_bit "
              f"{runs['flower_unclipped_bit'][-1][-1]:.4g}", flush=True)  # fmt: skip
    table = compare(runs)
    result = {"settings": vars(args), "privacy": pair_epsilon(args), "by_round": table,
              "trajectories": runs}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    last = args.rounds  # the clip after the last round (index rounds)
    for side, rows in table.items():
        row = rows[last]
        print(
            f"{side:22s} after {last} rounds: median C {row['median_clip']:.4g}, "
            f"mean log C {row['mean_log_clip']:.3f} (sd {row['sd_log_clip']:.3f})"
            + (f", KS p vs ours {row['ks_pvalue_vs_ours']:.3g}" if side != "ours" else "")
        )
    print(json.dumps(result["privacy"], indent=1))
    print(
        f"ratio of epsilons (pair / ours at z): "
        f"{result['privacy']['epsilon_pair_dp_accounting_rdp'] / result['privacy']['epsilon_ours_at_z_rdp']:.4f}"
    )  # noqa: E501


if __name__ == "__main__":
    main()
