#!/usr/bin/env python3
"""Recipe: federated early-exit fine-tuning of wav2vec 2.0 on SUPERB tasks.

A multi-exit wav2vec 2.0 (exits after Transformer layers 3, 6, 9, 12; stat-pooling + linear
heads, a CTC head for ASR) is fine-tuned across depth-heterogeneous clients with Flower: each
client trains up to its own exit L_max (layers past it are neither computed nor updated) and
the server aggregates every parameter over the clients that trained it, weighted by n_i * L_i
(layer-wise partial aggregation; ``speechbrain_fl/fl/aggregate/layerwise.py``). From "Adaptive Federated
Fine-Tuning of Self-Supervised Speech Representations" (the early-exit paper).

Tasks (``task``): kws12 (Speech Commands v0.01), kws35 (v0.02), sid (VoxCeleb1), asv (the SID
model scored on VoxCeleb1 trials), er (IEMOCAP, 4 classes), asr (LibriSpeech). Scenarios
(``scenario``): centralized (one run per exit, no federation), homogeneous (every client at one
exit) and heterogeneous (half the clients at exit 3, half at the task's best exit).

Without ``data_folder`` the recipe generates the task's corpus with espeak-ng in the real
layout and runs on CPU with the tiny model. The default task file, ``hparams/kws35.yaml``,
starts it from the phone seed shipped in ``seed/`` (``pretrain_objective: phones``); the
other task files start from random weights (``pretrain_objective: none``; ``bag_of_words``,
``ctc`` and ``phones`` pretrain it: README, *Embedded corpora*). Federated scenarios run the
task factory ``superb_task.py:superb_task`` (the one ``flwr run`` loads) on the Simulation
Engine.

To run this recipe (from the repository root or from recipes/SUPERB/):

    > python recipes/SUPERB/train_fl.py hparams/kws35.yaml
    > python recipes/SUPERB/train_fl.py hparams/kws35.yaml --scenario homogeneous --exit 3
    > python recipes/SUPERB/train_fl.py hparams/kws35.yaml --aggregation fedavg_full
    > python recipes/SUPERB/train_fl.py hparams/kws.yaml --weighting samples
    > python recipes/SUPERB/train_fl.py hparams/er.yaml --data_folder /data/IEMOCAP \\
          --model wav2vec2-base-100h --device cuda

Outputs (``output_folder``): train_log.txt, hyperparams.yaml, results.json, rounds.csv,
test_predictions.csv, plots/*.png and the server state for resuming.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import speechbrain as sb
import torch

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))
# Processes started from here (Ray workers, memory probes) find the recipe's modules too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(RECIPE_DIR), os.environ.get("PYTHONPATH", "")) if p
)

from speechbrain_fl.fl.task import import_factory  # noqa: E402

logger = logging.getLogger(__name__)

# The task module as the engine loads it (by its file path), so this script, the ServerApp
# and the Ray actors share one copy of it and of its per-process model.
TASK = f"{RECIPE_DIR / 'superb_task.py'}:superb_task"
superb = sys.modules[import_factory(TASK).__module__]


def main(run):
    """Prepare, pretrain the seed model, run the scenario, evaluate every trained exit, report.

    ``run`` comes from :meth:`speechbrain_fl.recipe.FederatedRecipe.run_script` (the parsed,
    checked hparams; the output folder locked). Federated scenarios run the task factory
    :func:`superb_task.superb_task` through its :class:`~speechbrain_fl.fl.task.TaskSpec` on
    the Simulation Engine (the same factory ``flwr run`` loads); its ``on_result`` writes the
    outputs. The centralized scenario trains here.
    """
    start = time.time()
    sb.create_experiment_directory(**run.experiment)
    hparams = run.hparams
    settings = superb.prepare_settings(hparams, run.run_opts)
    # One intra-op thread by default (num_threads): on a shared, oversubscribed CPU, OpenMP's
    # spin-waiting made a 2-thread training step 20x slower than a 1-thread one here.
    torch.set_num_threads(max(1, int(hparams["num_threads"])))
    logger.info(
        "%s: %d clients, depths %s, exits evaluated %s",
        hparams["scenario"],
        settings.num_clients,
        settings.depths,
        settings.eval_exits,
    )
    if hparams["scenario"] != "centralized":
        return superb.run_federated(superb.RECIPE.spec(run), hparams)
    t0 = time.time()
    result = superb.run_centralized(settings, hparams)
    timings = dict(settings.timings, training=time.time() - t0)
    return superb.report(settings, hparams, result, timings=timings, start=start)


if __name__ == "__main__":
    superb.RECIPE.run_script(sys.argv[1:], main)
