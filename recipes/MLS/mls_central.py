"""The MLS recipe's centralized scenario: the clients' pooled data, one model, the same budget.

``scenario: centralized`` trains the federated stage's model (the same seed, the same trainable
tensors, optimizer, learning rates and ``max_grad_norm``) on the union of every client's
training utterances, without clients, rounds of aggregation or noise. It is the ceiling a
federated run of the same budget is measured against (README, "The central ceiling").

The budget (ours: the issue's "same step budget" read as the federated run's expected number
of optimizer steps): a round of the federated run samples each client with probability q and
the sampled client makes E local epochs of ``ceil(n_i / B)`` batches, so the federated run
makes in expectation

    S = T * q * E * sum_i ceil(n_i / B)

optimizer steps over its T rounds (n_i: client i's utterances, B: ``batch_size``). The
centralized run makes S steps too (``central_steps`` gives another number), in T stages of
S / T steps: stage t runs at the federated round t's learning rate (``lr_schedule``) with a
fresh optimizer, as a client of round t does, each batch drawn from the pooled utterances by a
:class:`torch.utils.data.RandomSampler` (without replacement within each pass over the pool).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import logging
import math
import os
import time

import speechbrain as sb
import torch

from speechbrain_fl.metrics import write_utterance_details
from speechbrain_fl.recipe import print_summary, write_results

logger = logging.getLogger("train_fl")  # the recipe's log name

SCENARIOS = ("federated", "centralized")


def step_budget(sizes, *, batch_size, local_epochs, sampling_rate, rounds):
    """The federated run's expected optimizer steps, ``T * q * E * sum_i ceil(n_i / B)``.

    Example
    -------
    >>> step_budget([16, 17, 5], batch_size=16, local_epochs=10, sampling_rate=0.1, rounds=12)
    48
    """
    per_round = sampling_rate * local_epochs * sum(math.ceil(n / batch_size) for n in sizes)
    return max(1, round(rounds * per_round))


def stage_steps(total, stages):
    """``total`` steps split into ``stages`` near-equal stages (the first ones one longer).

    Example
    -------
    >>> stage_steps(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(int(total), int(stages))
    return [base + (1 if t < extra else 0) for t in range(stages)]


def write_pooled_manifest(client_manifests, path):
    """Every client's rows in one manifest (the clients' header); the number of rows."""
    rows, header = [], None
    for manifest in client_manifests:
        with open(manifest, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = header or reader.fieldnames
            rows.extend(reader)
    if not rows:
        raise ValueError(f"scenario: centralized: the client manifests hold no rows ({path})")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def train_centralized(brain, dataset, *, steps, hparams):
    """``steps`` optimizer steps of ``brain`` on ``dataset`` in ``number_of_rounds`` stages.

    Stage t sets the Brain's round to t (its ``lr_schedule``) and calls ``brain.fit`` for one
    pass over ``steps_t * B`` utterances drawn by a seeded RandomSampler; ``fit`` starts a
    fresh optimizer, as a client's local training does each round. Returns the stages' mean
    training losses.
    """
    rounds = hparams["number_of_rounds"]
    batch_size = hparams["batch_size"]
    seed = hparams["sampler_seed"] if hparams["sampler_seed"] is not None else hparams["seed"]
    generator = torch.Generator().manual_seed(int(seed))
    losses = []
    brain.fl_num_rounds = rounds
    for t, n in enumerate(stage_steps(steps, rounds), start=1):
        if n == 0:
            continue
        brain.fl_round = t
        sampler = torch.utils.data.RandomSampler(
            dataset, num_samples=n * batch_size, generator=generator
        )
        loader = sb.dataio.dataloader.make_dataloader(
            dataset, batch_size=batch_size, sampler=sampler
        )
        brain.fit(range(1, 2), loader, progressbar=False)
        losses.append(float(brain.last_stats["loss"]))  # on_stage_end's
        logger.info(
            "centralized stage %d/%d: %d steps at lr %.2e, train loss %.3f",
            t, rounds, n, brain.round_lr(), losses[-1],
        )  # fmt: skip
    return losses


def run_centralized(*, brain, settings, hparams, test_set, test_rows, round0, timings, start):
    """Train on the pooled client data, evaluate on the test split, write the outputs.

    ``round0`` is ``(report, details)`` of the seed model's test evaluation (the federated
    run's round 0). Writes ``test_utterances*.csv``, ``test_ce_utterances*.csv``
    (:func:`mls_report.utterance_ce`) and ``results.json`` with ``scenario: centralized``;
    returns the results mapping.
    """
    from mls_brain import make_dataset
    from mls_report import audio_reliance, evaluate_test, federated_change, utterance_ce

    out = hparams["output_folder"]
    pooled_csv = os.path.join(hparams["save_folder"], "manifests", "pooled_clients.csv")
    pooled = write_pooled_manifest(settings.clients, pooled_csv)
    budget = step_budget(
        settings.partition_sizes(), batch_size=hparams["batch_size"],
        local_epochs=hparams["local_epochs"], sampling_rate=hparams["sampling_rate"],
        rounds=hparams["number_of_rounds"],
    )  # fmt: skip
    steps = hparams["central_steps"] or budget
    logger.info(
        "centralized: %d steps of batch %d on %d pooled client utterances (the federated "
        "budget: %d)", steps, hparams["batch_size"], pooled, budget,
    )  # fmt: skip
    test_round0, details_round0 = round0
    ce_round0 = utterance_ce(brain, test_set, test_rows)
    t0 = time.time()
    losses = train_centralized(
        brain, make_dataset(pooled_csv, settings.data_folder), steps=steps, hparams=hparams
    )
    timings["centralized"] = time.time() - t0
    t0 = time.time()
    test_report, details = evaluate_test(brain, test_set, test_rows, hparams)
    ce_final = utterance_ce(brain, test_set, test_rows)
    reliance = {"round0": test_round0.pop("audio_reliance", None)}
    reliance["final"] = audio_reliance(brain, test_set, hparams)
    timings["evaluation"] += time.time() - t0
    for name, value in (
        ("test_utterances.csv", details), ("test_utterances_round0.csv", details_round0),
        ("test_ce_utterances.csv", ce_final), ("test_ce_utterances_round0.csv", ce_round0),
    ):  # fmt: skip
        write_utterance_details(os.path.join(out, name), value)
    change = federated_change(details, details_round0, hparams)
    timings["total"] = time.time() - start
    results = {
        "scenario": "centralized",
        "method": "centralized",
        "model": str(hparams["model"]),
        "freeze_encoder": hparams["freeze_encoder"],
        "num_clients": settings.num_clients,
        "test": test_report,
        "test_round0": {"WER": test_round0["WER"], "WER_ci95": test_round0["WER_ci95"]},
        "test_change_from_round0": change,
        "test_ce": {"final": ce_final.wer, "round0": ce_round0.wer},
        "centralized": {
            "steps": steps,
            "federated_budget": budget,
            "pooled_utterances": pooled,
            "batch_size": hparams["batch_size"],
            "stages": hparams["number_of_rounds"],
            "stage_train_loss": losses,
        },  # fmt: skip
        "audio_reliance": reliance,
        "data": {
            "data_folder": settings.data_folder,
            "embedded_corpus": hparams["data_folder"] is None,
        },  # fmt: skip
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    write_results(out, results)
    print_summary(
        f"Centralized ceiling: test WER {test_round0['WER']:.4f} (seed) -> "
        f"{test_report['WER']:.4f} {test_report['WER_ci95']}, change "
        f"{change['difference']:+.4f} {change['ci95']}; test CE {ce_round0.wer:.3f} -> "
        f"{ce_final.wer:.3f} ({steps} steps on {pooled} utterances)",
        output_folder=out,
        timings=results["timings_s"],
    )
    return results
