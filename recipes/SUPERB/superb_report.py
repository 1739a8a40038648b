"""The SUPERB recipe's report: test metric per exit with CIs, memory by exit, results.json.

- :func:`evaluate_test`: per exit, accuracy (or WER for ASR) with a 95% bootstrap CI;
- :func:`score_asv`: per exit, EER and minDCF of cosine-scored pooled embeddings (ASV);
- :func:`memory_by_exit`: training memory per trained exit, by part, and its saving;
- :func:`results_table`: the end-of-run table (:func:`speechbrain_fl.recipe.render_table`);
- :func:`report_run`: evaluate the final model and write the run's outputs.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import os
import time

import numpy as np
import speechbrain as sb
import torch
from superb_data import TASKS

from speechbrain_fl.plots import write_exit_plots
from speechbrain_fl.recipe import print_summary, render_table, write_results, write_rows


def evaluate_test(brain, test, settings, hparams):
    """Per exit: the task metric with a 95% bootstrap CI (speaker- or utterance-level)."""
    from speechbrain_fl.metrics.classification import bootstrap_classification

    spec = TASKS[hparams["task"]]
    brain.evaluate(
        test,
        progressbar=True,
        test_loader_kwargs=dict(hparams["eval_dataloader_options"]),
    )
    out, rows = {}, []
    if spec["head"] == "ctc":
        from speechbrain_fl.metrics import bootstrap_details, utterance_errors_from_stats

        with open(settings.test_csv, newline="", encoding="utf-8") as handle:
            speakers = {r["ID"]: r["spk_id"] for r in csv.DictReader(handle)}
        for e in brain.eval_exits:
            details = utterance_errors_from_stats(brain.wer[e], speaker_of=speakers)
            wer = bootstrap_details(
                details, num_resamples=hparams["bootstrap_resamples"], seed=hparams["seed"]
            )
            out[str(e)] = {"WER": wer.wer, "ci95": [wer.ci_low, wer.ci_high]}
        return out, rows
    ids, speakers, labels = zip(*brain.records, strict=True)
    units = speakers if spec["bootstrap_unit"] == "speaker" else ids
    for e in brain.eval_exits:
        stats = bootstrap_classification(
            speakers=list(units),
            labels=list(labels),
            predictions=brain.predictions[e],
            num_resamples=hparams["bootstrap_resamples"],
            seed=hparams["seed"],
        )
        out[str(e)] = {"accuracy": stats["accuracy"]["value"], "ci95": stats["accuracy"]["ci"]}
    for i, (uid, spk, label) in enumerate(brain.records):
        row = {"ID": uid, "spk_id": spk, "label": settings.labels[label]}
        row.update(
            {f"pred_{e}": settings.labels[brain.predictions[e][i]] for e in brain.eval_exits}
        )
        rows.append(row)
    return out, rows


def memory_by_exit(settings, hparams):
    """Training memory (MiB) of a client at each trained exit, for this task's batch shape.

    The batch is ``batch_size`` clips of the 95th-percentile duration of the training
    manifests (:func:`~speechbrain_fl.models.exit_memory.manifest_seconds`), with the run's
    LayerDrop and SpecAugment settings. Returns ``{"parts", "rss", "seconds", "batch_size",
    "method"}``: ``parts`` per exit ``{total, weights, gradients, optimizer, activations}``
    and ``method`` from :func:`~speechbrain_fl.models.exit_memory.training_memory` (counted
    from the tensors on CPU, ``max_memory_allocated`` on CUDA); ``rss`` per exit the peak of
    :func:`~speechbrain_fl.models.exit_memory.peak_training_memory` (CPU: the peak RSS of a
    fresh process, interpreter and imports included; what ``client_memory_budgets_mb`` is
    compared with).
    """
    if not hparams["measure_memory"]:
        return {"parts": {}, "rss": {}, "seconds": None, "batch_size": None, "method": None}
    from speechbrain_fl.models.exit_memory import (
        manifest_seconds,
        peak_training_memory,
        training_memory,
    )

    options = settings.model
    seconds = manifest_seconds(settings.clients, quantile=0.95)
    shape = {
        "batch_size": hparams["batch_size"],
        "seconds": seconds,
        "head": options["head"],
        "num_outputs": options["num_outputs"],
        "freeze_feature_encoder": options["freeze_feature_encoder"],
        "device": settings.device,
        "config_overrides": options.get("config_overrides"),
    }
    out = {"parts": {}, "rss": {}, "seconds": seconds, "batch_size": shape["batch_size"]}
    for e in settings.eval_exits:
        parts = training_memory(options["source"], depth=e, **shape)
        out["method"] = parts.pop("method")
        out["parts"][str(e)] = {k: round(v, 3) for k, v in parts.items()}
        rss = peak_training_memory(options["source"], depth=e, **shape)
        out["rss"][str(e)] = round(rss["peak_mb"], 1)
    return out


def memory_saved(parts):
    """Per exit, the training memory it saves against the deepest exit (%).

    ``100 (1 - total_e / total_deep)``.

    Example
    -------
    >>> memory_saved({"3": {"total": 60.0}, "6": {"total": 80.0}})
    {'3': 25.0, '6': 0.0}
    """
    if not parts:
        return {}
    deep = parts[max(parts, key=int)]["total"]
    return {e: round(100 * (1 - p["total"] / deep), 2) for e, p in parts.items()}


def memory_method(method):
    """The sentence results.json states the memory figures' method with."""
    if method is None:
        return None
    how = {
        "tensors": "counted from the tensors of one training step: total = weights used "
        "to the exit + gradients + AdamW moments of what trains + the activations "
        "autograd saves for backward (each storage once)",
        "cuda_max_memory_allocated": "total = torch.cuda.max_memory_allocated over one "
        "training step (whole model on the device); the parts counted from its tensors",
    }[method]
    return f"{method}: {how}; MiB; rss: peak RSS of a fresh process running the step"


def results_table(results):
    """The end-of-run results table (text): the metric, its CI and memory per exit."""
    metric = "WER" if results["task"] == "asr" else "accuracy"
    asv = "asv" in results
    header = ["exit", metric, "95% CI", "train MB", "saved %", "RSS MB"] + (
        ["EER", "minDCF"] if asv else []
    )
    rows = []
    for e, entry in results["test"].items():
        lo, hi = entry["ci95"]
        row = [
            e,
            f"{entry[metric]:.4f}",
            f"[{lo:.4f}, {hi:.4f}]",
            memory_cell(results["memory_mb"].get(e, {}).get("total")),
            memory_cell(results.get("memory_saved_pct", {}).get(e)),
            memory_cell(results.get("memory_rss_mb", {}).get(e)),
        ]
        if asv:
            row += [f"{results['asv'][e]['EER']:.4f}", f"{results['asv'][e]['minDCF']:.4f}"]
        rows.append(row)
    title = (
        f"SUPERB {results['task']} | scenario {results['scenario']} | aggregation "
        f"{results['aggregation']} ({results['weighting']}) | model {results['checkpoint']}"
    )
    table = render_table(header, rows, style="text")
    if not any(results["memory_mb"].get(e) is not None for e in results["test"]):
        table += "\nmemory: not measured (measure_memory: False, or no probe succeeded)"
    return title + "\n" + table


def memory_cell(value):
    """A memory cell of the results table: MiB to one decimal, ``-`` when not measured.

    Example
    -------
    >>> memory_cell(123.456), memory_cell(None)
    ('123.5', '-')
    """
    return "-" if value is None else f"{float(value):.1f}"


def _embeddings(model, paths, exits, device):
    """Stat-pooled (mean, std) hidden states at each exit for each wav path."""
    from speechbrain_fl.models.exit_heads import StatPoolHead

    out = {e: {} for e in exits}
    model.eval()
    with torch.no_grad():
        for path in paths:
            wav = sb.dataio.dataio.read_audio(path).unsqueeze(0).to(device)
            _, mask, captured = model.hidden(wav, None, depth=max(exits), capture=exits)
            for e in exits:
                out[e][path] = StatPoolHead.pool(captured[e], mask)[0]
    return out


def score_asv(brain, settings, hparams):
    """EER and minDCF (p_target 0.01) of cosine-scored pooled embeddings, per exit, with CIs.

    The embedding of an utterance at exit e is the stat-pooled hidden state after layer e of the
    federated SID model (the input of exit e's SID head). Trials come from ``trials.csv``;
    the CIs resample positive and negative trials with replacement (``asv_bootstrap_resamples``
    replicates; a trial-level bootstrap, ours).
    """
    from speechbrain.utils.metric_stats import EER, minDCF

    manifests = os.path.join(hparams["save_folder"], "manifests")
    with open(os.path.join(manifests, "trials.csv"), newline="", encoding="utf-8") as handle:
        trials = [
            (
                int(r["target"]),
                r["enrol"].replace("$data_root", settings.data_folder),
                r["test"].replace("$data_root", settings.data_folder),
            )
            for r in csv.DictReader(handle)
        ]
    paths = sorted({p for _, a, b in trials for p in (a, b)})
    device = settings.device
    embeddings = _embeddings(brain.modules.model, paths, brain.eval_exits, device)
    rng = np.random.default_rng(hparams["seed"])
    out = {}
    for e in brain.eval_exits:
        emb = embeddings[e]
        scores = np.array(
            [
                float(torch.nn.functional.cosine_similarity(emb[a], emb[b], dim=0))
                for _, a, b in trials
            ]
        )
        target = np.array([t for t, _, _ in trials], dtype=bool)
        pos, neg = torch.tensor(scores[target]), torch.tensor(scores[~target])
        eer, dcf = float(EER(pos, neg)[0]), float(minDCF(pos, neg)[0])
        eers, dcfs = [], []
        for _ in range(hparams["asv_bootstrap_resamples"]):
            p = pos[rng.integers(len(pos), size=len(pos))]
            n = neg[rng.integers(len(neg), size=len(neg))]
            eers.append(float(EER(p, n)[0]))
            dcfs.append(float(minDCF(p, n)[0]))
        out[str(e)] = {
            "EER": eer,
            "EER_ci95": [float(np.percentile(eers, 2.5)), float(np.percentile(eers, 97.5))],
            "minDCF": dcf,
            "minDCF_ci95": [float(np.percentile(dcfs, 2.5)), float(np.percentile(dcfs, 97.5))],
            "num_trials": len(trials),
        }
    return out


def report_run(settings, hparams, result, *, brain, test_set, timings, start):
    """Evaluate the final model at every trained exit and write the run's outputs.

    ``results.json`` (described in the README's outputs), ``test_predictions.csv``, the plots and, for
    ASV, the trial scores; prints the results table. ``result`` is the engine's
    :class:`~speechbrain_fl.fl.serverapp.task.ServerResult` or the centralized run's equivalent
    (``params`` and ``last_round``); ``brain`` the recipe's Brain (its per-process model) and
    ``test_set`` the test split's dataset. Returns the results mapping.
    """
    from speechbrain_fl.fl.params import load_trainable
    from speechbrain_fl.fl.settings.secagg import trust_model

    timings = dict(timings)
    load_trainable(brain.modules, result.params)
    t0 = time.time()
    test, rows = evaluate_test(brain, test_set, settings, hparams)
    extra = {}
    if hparams["task"] == "asv":
        extra["asv"] = score_asv(brain, settings, hparams)
    timings["evaluation"] = time.time() - t0
    if rows:
        write_rows(os.path.join(hparams["output_folder"], "test_predictions.csv"), rows)
    t0 = time.time()
    memory = memory_by_exit(settings, hparams)
    timings["memory"] = time.time() - t0
    timings["total"] = time.time() - start
    results = {
        "task": hparams["task"],
        "scenario": hparams["scenario"],
        "aggregation": hparams["aggregation"],
        "weighting": hparams["weighting"],
        "checkpoint": str(hparams["model"]),
        "checkpoint_source": settings.model["source"],
        "test": test,
        "memory_mb": memory["parts"],
        "memory_saved_pct": memory_saved(memory["parts"]),
        "memory_method": memory_method(memory["method"]),
        "memory_rss_mb": memory["rss"],
        "memory_input_seconds": memory["seconds"],
        "memory_batch_size": memory["batch_size"],
        **extra,
        # audio files left out of the manifests: which, and libsndfile's reason
        **(
            {"skipped": {k: settings.extra[k] for k in ("unreadable_audio",)}}
            if settings.extra.get("unreadable_audio")
            else {}
        ),  # fmt: skip
        # who saw the clients' updates (central, or the sum only under secure aggregation);
        # a centralized run has no clients
        **(
            {"privacy": {"trust_model": trust_model(result.config)}}
            if getattr(result, "config", None) is not None
            else {}
        ),  # fmt: skip
        "depths": settings.depths,
        "depth_decisions": settings.depth_decisions,
        "num_clients": settings.num_clients,
        "rounds": result.last_round,
        "seed": hparams["seed"],
        "freeze_feature_encoder": hparams["freeze_feature_encoder"],
        "embedded_corpus": hparams["data_folder"] is None,
        "bootstrap_unit": TASKS[hparams["task"]]["bootstrap_unit"],
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    write_results(hparams["output_folder"], results)
    plots = write_exit_plots(hparams["output_folder"])
    hparams["train_logger"].log_stats(
        stats_meta={"round": result.last_round, "scenario": hparams["scenario"]},
        test_stats={f"exit_{e}": next(iter(v.values())) for e, v in test.items()},
    )
    print_summary(
        results_table(results),
        output_folder=hparams["output_folder"],
        timings=results["timings_s"],
        plots=plots,
    )
    return results
