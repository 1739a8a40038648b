#!/usr/bin/env python3
"""Recipe: federated early-exit fine-tuning of wav2vec 2.0 on SUPERB tasks.

A multi-exit wav2vec 2.0 (exits after Transformer layers 3, 6, 9, 12; stat-pooling + linear
heads, a CTC head for ASR) is fine-tuned across depth-heterogeneous clients with Flower: each
client trains up to its own exit L_max (layers past it are neither computed nor updated) and
the server aggregates every parameter over the clients that trained it, weighted by n_i * L_i
(layer-wise partial aggregation; ``speechbrain_fl/fl/layerwise.py``). From "Adaptive Federated
Fine-Tuning of Self-Supervised Speech Representations" (the early-exit paper).

Tasks (``task``): kws12 (Speech Commands v0.01), kws35 (v0.02), sid (VoxCeleb1), asv (the SID
model scored on VoxCeleb1 trials), er (IEMOCAP, 4 classes), asr (LibriSpeech). Scenarios
(``scenario``): centralized (one run per exit, no federation), homogeneous (every client at one
exit) and heterogeneous (half the clients at exit 3, half at the task's best exit).

Without ``data_folder`` the recipe generates the task's corpus with espeak-ng in the real
layout, pretrains the tiny seed model with CTC on a generated LibriSpeech-style ``public``
split (the analogue of the paper's LibriSpeech-100h initialisation) and runs on CPU.

To run this recipe (from the repository root or from recipes/SUPERB/):

    > python recipes/SUPERB/train_fl.py hparams/kws.yaml
    > python recipes/SUPERB/train_fl.py hparams/kws.yaml --scenario homogeneous --exit 3
    > python recipes/SUPERB/train_fl.py hparams/kws.yaml --aggregation fedavg_full
    > python recipes/SUPERB/train_fl.py hparams/kws.yaml --weighting samples
    > python recipes/SUPERB/train_fl.py hparams/er.yaml --data_folder /data/IEMOCAP \\
          --model wav2vec2-base-100h --device cuda

Outputs (``output_folder``): train_log.txt, hyperparams.yaml, results.json, rounds.csv,
test_predictions.csv, plots/*.png and the server state for resuming.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
import time
from pathlib import Path

import speechbrain as sb
import torch

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))
# Ray's workers import the task module by name: give them this folder too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(RECIPE_DIR), os.environ.get("PYTHONPATH", "")) if p
)

from superb_task import (  # noqa: E402
    TASKS,
    build_brain,
    evaluate_test,
    format_table,
    load_hparams,
    make_settings,
    memory_by_exit,
    run_centralized,
    run_federated,
    write_plots,
)

from speechbrain_fl.atomic import atomic_open  # noqa: E402

logger = logging.getLogger(__name__)


def main(argv):
    """Prepare, pretrain the seed model, run the scenario, evaluate every trained exit, report."""
    start_all = time.time()
    hparams_file, run_opts, overrides = sb.parse_arguments(argv)
    hparams, base_file, merged = load_hparams(hparams_file, overrides, run_opts)
    sb.create_experiment_directory(
        experiment_directory=hparams["output_folder"],
        hyperparams_to_save=str(base_file),
        overrides=merged,
    )
    # One intra-op thread by default (num_threads): on a shared, oversubscribed CPU, OpenMP's
    # spin-waiting made a 2-thread training step 20x slower than a 1-thread one here.
    torch.set_num_threads(max(1, int(hparams["num_threads"])))
    settings = make_settings(hparams, run_opts)
    timings = dict(settings["timings"])
    logger.info(
        "%s: %d clients, depths %s, exits evaluated %s",
        hparams["scenario"],
        len(settings["clients"]),
        settings["depths"],
        settings["eval_exits"],
    )
    start = time.time()
    if hparams["scenario"] == "centralized":
        result = run_centralized(settings, hparams)
    else:
        result = run_federated(settings, hparams)
    timings["training"] = time.time() - start

    from speechbrain_fl.fl.params import load_trainable

    brain = build_brain(settings)
    load_trainable(brain.modules, result.params)
    start = time.time()
    test, rows = evaluate_test(brain, settings, hparams)
    extra = {}
    if hparams["task"] == "asv":
        from superb_data import score_asv

        extra["asv"] = score_asv(brain, settings, hparams)
    timings["evaluation"] = time.time() - start
    if rows:
        with atomic_open(
            os.path.join(hparams["output_folder"], "test_predictions.csv"), newline=""
        ) as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    start = time.time()
    memory, memory_step = memory_by_exit(settings, hparams)
    timings["memory"] = time.time() - start
    timings["total"] = time.time() - start_all
    results = {
        "task": hparams["task"],
        "scenario": hparams["scenario"],
        "aggregation": hparams["aggregation"],
        "weighting": hparams["weighting"],
        "checkpoint": str(hparams["model"]),
        "checkpoint_source": settings["model"]["source"],
        "test": test,
        "memory_mb": memory,
        "memory_step_mb": {k: round(v, 1) for k, v in memory_step.items()},
        **extra,
        "depths": settings["depths"],
        "depth_decisions": settings.get("depth_decisions"),
        "num_clients": len(settings["clients"]),
        "rounds": result.last_round,
        "freeze_feature_encoder": hparams["freeze_feature_encoder"],
        "embedded_corpus": hparams["data_folder"] is None,
        "bootstrap_unit": TASKS[hparams["task"]]["bootstrap_unit"],
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    with atomic_open(os.path.join(hparams["output_folder"], "results.json")) as handle:
        json.dump(results, handle, indent=2, default=float)
    plots = write_plots(hparams["output_folder"])
    hparams["train_logger"].log_stats(
        stats_meta={"round": result.last_round, "scenario": hparams["scenario"]},
        test_stats={f"exit_{e}": next(iter(v.values())) for e, v in test.items()},
    )
    print("\n" + format_table(results))
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(
        f"Results: {os.path.join(hparams['output_folder'], 'results.json')}; "
        f"{len(plots)} plot(s) in {os.path.join(hparams['output_folder'], 'plots')}"
    )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
