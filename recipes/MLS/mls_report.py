"""The MLS recipe's analysis: test WER with CIs, the federated change, privacy, noise vs update.

What ``train_fl.py`` reports after the federated rounds, kept apart from the training script as
SpeechBrain recipes keep their analysis helpers:

- :func:`evaluate_test`: test WER with speaker-level bootstrap CIs, overall and per language;
- :func:`federated_change`: final minus round-0 WER, paired speaker bootstrap;
- :func:`privacy_section`: results.json's privacy section (engine report + disclosure);
- :func:`noise_vs_update`: the per-round noise norm against the mean client update norm;
- :func:`results_summary`: the ``results.json`` mapping of a run;
- :func:`report_run`: all of it after the federated rounds, then results.json, plots, printout.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import speechbrain as sb
import torch

from speechbrain_fl.fl.dp.disclosure import format_disclosure, privacy_disclosure
from speechbrain_fl.fl.dp.profile import norm_profile, pool_norms, pool_retention
from speechbrain_fl.metrics import (
    UtteranceErrors,
    paired_bootstrap_details,
    utterance_errors_from_stats,
    wer_report,
    write_utterance_details,
)
from speechbrain_fl.plots import write_run_plots
from speechbrain_fl.privacy.methods import method_name
from speechbrain_fl.recipe import print_summary, write_results
from speechbrain_fl.run_outputs import format_results_table

logger = logging.getLogger("train_fl")  # the recipe's log name


def evaluate_test(brain, test_set, test_rows, hparams):
    """WER on the test split with speaker-level bootstrap CIs, overall and per language."""
    brain.evaluate(test_set, test_loader_kwargs=dict(hparams["eval_dataloader_options"]))
    details = utterance_errors_from_stats(
        brain.wer_metric,
        speaker_of={r["ID"]: r["spk_id"] for r in test_rows},
        language_of={r["ID"]: r["language"] for r in test_rows},
    )
    report = wer_report(details, num_resamples=hparams["bootstrap_resamples"], seed=hparams["seed"])
    return report, details


def audio_reliance(brain, test_set, hparams):
    """Audio-reliance probe: transcript CE with the true audio against another utterance's.

    Teacher-forced cross-entropy (Eq. 2, token mean) of the test transcripts, once with their
    own audio and once with the audio of the next utterance in the batch (rolled by one). A
    decoder that reads the audio has ``swapped`` well above ``true``; one that has learned to
    continue the (templated) text from its history has the two close (exposure bias: the
    reason the LLM adapters of an earlier default stayed frozen). ``gap = swapped - true``.
    """
    model = brain.modules.model
    loader = sb.dataio.dataloader.make_dataloader(
        test_set, **dict(hparams["eval_dataloader_options"])
    )
    was_training = model.training
    model.eval()
    totals = {"true": 0.0, "swapped": 0.0}
    count = 0
    with torch.no_grad():
        for batch in loader:
            batch = batch.to(brain.device)
            wavs, lens = batch.sig
            if wavs.shape[0] < 2:
                continue
            words, languages = list(batch.wrd), list(batch.language)
            n = wavs.shape[0]
            totals["true"] += n * float(model(wavs, lens, words, languages).ce_loss)
            rolled = torch.roll(wavs, 1, dims=0), torch.roll(lens, 1, dims=0)
            totals["swapped"] += n * float(model(*rolled, words, languages).ce_loss)
            count += n
    model.train(was_training)
    if not count:
        return None
    out = {k: v / count for k, v in totals.items()}
    out["gap"] = out["swapped"] - out["true"]
    return out


def federated_change(details, details_round0, hparams):
    """Final minus round-0 test WER, with a paired speaker-level bootstrap 95% CI.

    Both evaluations score the same utterances, so the paired bootstrap (one speaker draw per
    replicate for both) tells whether the federated stage changed the WER beyond speaker
    sampling noise, which two overlapping marginal CIs cannot.
    """
    paired = paired_bootstrap_details(
        details,
        details_round0,
        names=("final", "round 0"),
        num_resamples=hparams["bootstrap_resamples"],
        seed=hparams["seed"],
    )
    return {
        "difference": paired.difference,
        "ci95": [paired.ci_low, paired.ci_high],
        "p_value": paired.p_value,
        "significant": paired.significant,
    }


def privacy_section(hparams, config, result, *, alpha_from_profile=False):
    """results.json's privacy section: the engine's privacy report plus the recipe's method.

    The engine computed it (:func:`speechbrain_fl.privacy.accounting.privacy_report`): joint
    epsilon from its accountant, and per pool (``encoder``; ``llm`` = LLM + connector) the
    effective noise multiplier and epsilon, conservative for budgets that move between rounds.
    A run without noise (``fedavg``, or a clipping method with ``noise_multiplier: 0``) reports
    no epsilon. What the epsilon covers and what it does not (test-only seeds, raw-norm EMA
    signal, profiling, telemetry) comes from :func:`speechbrain_fl.fl.dp.disclosure.privacy_disclosure`.
    """
    disclosure = privacy_disclosure(
        config, profile_rounds=hparams["profile_rounds"], alpha_from_profile=alpha_from_profile
    )
    if result.privacy is None:
        return {
            **disclosure,
            "epsilon": None,
            "delta": None,
            "accountant": None,
            "noise_multiplier": 0.0,
            "clip": config.clip,
            "alpha": config.alpha,
            "sampling_rate": config.sampling_rate,
            "rounds": result.last_round,
            "sigma_eff": {},
            "epsilon_per_component": {},
        }
    # The engine's report: accountant "pld" (dp-accounting) by default, epsilon_rdp beside it.
    report = dict(result.privacy)
    # alpha-split with a frozen encoder runs as the paper's alpha = 0 row (mls_settings.engine_hparams)
    return {**report, **disclosure, "alpha": config.alpha, "clip_method": config.method}


PAPER_SIGMA = 0.1  # the alpha-split paper's noise multiplier (Sec. II-D)


def noise_vs_update(reports, layout, *, noise_multiplier, clip, expected_cohort_size):
    """The per-round noise norm against the mean client update norm (and the component ratio).

    The Gaussian noise added once per round to the mean update has standard deviation
    ``sigma C / n`` per coordinate, so its norm is about ``sigma C / n * sqrt(d)`` over the
    ``d`` trainable values; the mean client update norm is the clients' pre-clip joint norm
    averaged over the rounds. When the noise norm is several times the update norm, every DP
    method drowns alike; of the order of 1 or below, the clipping policy decides. A run without
    noise (FedAvg) reports the noise its cohort would get at the paper's sigma = 0.1 (C = 1),
    marked in ``sigma_source``. ``norm_profile`` is :func:`speechbrain_fl.fl.dp.profile.norm_profile`
    of the last round (mean per-matrix norm per component, LLM/encoder ratio; the paper's
    diagnosis), from the clients' pre-clip norms: telemetry outside the DP guarantee. Its
    ``llm_encoder_ratio`` is over alpha-split's pools: (LLM + connector) against the encoder.
    """
    d = sum(int(g.numel) for g in layout)
    sigma = noise_multiplier if noise_multiplier else PAPER_SIGMA
    c = clip if clip else 1.0
    norms = [r.joint_norm_mean for r in reports if r.joint_norm_mean is not None]
    mean_norm = sum(norms) / len(norms) if norms else None
    noise_norm = sigma * c / expected_cohort_size * math.sqrt(d) if expected_cohort_size else None
    out = {
        "sigma": sigma,
        "sigma_source": "this run" if noise_multiplier else "paper (this run adds no noise)",
        "clip": c,
        "expected_cohort_size": expected_cohort_size,
        "trainable_values": d,
        "noise_norm": noise_norm,
        "mean_update_norm": mean_norm,
        "ratio": noise_norm / mean_norm if noise_norm and mean_norm else None,
        "norm_profile": None,
    }
    last = next((r for r in reversed(reports) if getattr(r, "group_norms", None)), None)
    if last is not None:
        profile = norm_profile(last, layout, clip=c)
        out["norm_profile"] = {
            k: profile.get(k) for k in ("per_matrix_mean_norm", "component_norm")
        }
        # alpha-split's pools: the encoder, and the LLM together with the connector (with the
        # LLM's adapters frozen, the connector alone): mean per-matrix update norm of each
        pools = {"encoder": [], "llm": []}
        for group in layout:
            norm = last.group_norms.get(group.name)
            if norm is not None:
                pools["encoder" if group.component == "encoder" else "llm"].append(norm)
        means = {k: sum(v) / len(v) for k, v in pools.items() if v}
        out["norm_profile"]["pool_per_matrix_mean_norm"] = means
        out["norm_profile"]["llm_encoder_ratio"] = (
            means["llm"] / means["encoder"] if means.get("encoder") and "llm" in means else None
        )
    return out


def pool_summary(reports, layout):
    """Per-run pool statistics: update-norm ratios and clipped-signal retention (Fig. 5).

    Over the rounds with client statistics: the mean pre-clip norm of each group, turned into
    alpha-split's two pools by :func:`speechbrain_fl.fl.dp.profile.pool_norms` (per-matrix and
    per-coordinate norms and the (LLM + connector)/encoder ratios), and the mean over rounds of
    each pool's retention, post-clip / pre-clip norm (:func:`~speechbrain_fl.fl.dp.profile.pool_retention`;
    1.0 = nothing clipped). Telemetry from the clients' raw norms: outside the DP guarantee.
    """
    rows = [r for r in reports if getattr(r, "group_norms", None)]
    if not rows:
        return None
    names = {name for r in rows for name in r.group_norms}
    mean_norms = {}
    for name in names:
        values = [r.group_norms[name] for r in rows if r.group_norms.get(name) is not None]
        if values:
            mean_norms[name] = sum(values) / len(values)
    out = {"rounds": len(rows), **pool_norms(mean_norms, layout)}
    per_round = [x for x in (pool_retention(r, layout) for r in rows) if x]
    out["retention"] = {
        pool: sum(x[pool] for x in per_round) / len(per_round)
        for pool in sorted({k for x in per_round for k in x})
    } if per_round else None  # fmt: skip
    out["retention_by_round"] = per_round
    out["note"] = (
        "pools: encoder, llm = LLM + connector; per_coordinate_norm = pool norm / sqrt(p); "
        "retention = post-clip / pre-clip pool norm, mean over rounds (exact for one joint "
        "clip, estimated from the mean group norms for per-group budgets); telemetry outside "
        "the DP guarantee"
    )
    return out


def log_pool_summary(pools):
    """One log line: per-matrix and per-coordinate ratios, and each pool's retention."""
    if not pools:
        return
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}x"  # noqa: E731
    retention = pools.get("retention") or {}
    logger.info(
        "Pools (encoder | LLM + connector): (LLM + connector)/encoder update-norm ratio per "
        "matrix %s, per coordinate %s; clipped-signal retention %s",
        fmt(pools["ratio_per_matrix"]),
        fmt(pools["ratio_per_coordinate"]),
        ", ".join(f"{k} {v:.3f}" for k, v in retention.items()) or "n/a",
    )


def log_noise_ratio(ratio):
    """One log line: noise norm / mean update norm, and the LLM/encoder per-matrix ratio."""
    if ratio["ratio"] is None:
        logger.info("Noise vs update norm: no client norms recorded")
        return
    profile = ratio["norm_profile"] or {}
    llm_enc = profile.get("llm_encoder_ratio")
    logger.info(
        "Noise norm per round %.3g (sigma %g, %s; n = %.1f, d = %d) vs mean client update norm "
        "%.3g: ratio %.2f; (LLM + connector)/encoder per-matrix update-norm ratio %s (paper: "
        "~12x Whisper + TinyLlama, 1.7x Voxtral)",
        ratio["noise_norm"], ratio["sigma"], ratio["sigma_source"], ratio["expected_cohort_size"],
        ratio["trainable_values"], ratio["mean_update_norm"], ratio["ratio"],
        f"{llm_enc:.2f}x" if llm_enc is not None else "n/a (encoder frozen)",
    )  # fmt: skip


_log_noise_ratio = log_noise_ratio  # the older name


def results_summary(
    *, hparams, settings, info, config, result, test, test_round0, change, ratio, profile,
    alpha_from_profile, timings, pools=None, reliance=None,
):  # fmt: skip
    """The ``results.json`` mapping of a run (its schema is in recipes/MLS/README.md)."""
    return {
        "method": method_name(hparams["method"]),
        "model": str(hparams["model"]),
        "freeze_encoder": hparams["freeze_encoder"],
        "num_clients": settings.num_clients,
        "test": test,
        "test_round0": {"WER": test_round0["WER"], "WER_ci95": test_round0["WER_ci95"]},
        "test_change_from_round0": change,
        "privacy": privacy_section(hparams, config, result, alpha_from_profile=alpha_from_profile),
        "data": {
            "data_folder": settings.data_folder,
            "embedded_corpus": hparams["data_folder"] is None,
            "skipped": info["skipped"],
            "num_skipped": info["num_skipped"],
            # utterances whose audio failed to decode in training (counts, no file names)
            "unreadable_in_training": result.unreadable_in_training,
            "languages": info.get("languages"),
            "missing_languages": info.get("missing_languages", []),
        },
        "profile": profile,
        "noise_vs_update": ratio,
        "pools": pools,
        "audio_reliance": reliance,
        "stopped_early": result.stopped_early,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }


def report_run(
    *, brain, layout, test_set, test_rows, hparams, settings, info, config, result, round0,
    profile, alpha_from_profile, timings, start,
):  # fmt: skip
    """After the federated rounds: test WER, the change from round 0, noise vs update, outputs.

    ``brain`` holds the final global model; ``round0`` is ``(report, details)`` of the seed
    model's test evaluation. Writes ``test_utterances*.csv``, ``results.json`` and the plots,
    logs and prints the results table. Returns the results mapping.
    """
    test_round0, details_round0 = round0
    reliance = {"round0": test_round0.pop("audio_reliance", None)}
    final_model = os.path.join(hparams["output_folder"], "final_model")
    t0 = time.time()
    test_report, details = evaluate_test(brain, test_set, test_rows, hparams)
    timings["evaluation"] += time.time() - t0
    write_utterance_details(os.path.join(hparams["output_folder"], "test_utterances.csv"), details)
    write_utterance_details(
        os.path.join(hparams["output_folder"], "test_utterances_round0.csv"), details_round0
    )
    change = federated_change(details, details_round0, hparams)
    reliance["final"] = audio_reliance(brain, test_set, hparams)
    for when, probe in reliance.items():
        if probe:
            logger.info(
                "Audio reliance (%s): test CE %.3f with the true audio, %.3f with another "
                "utterance's (gap %.3f)", when, probe["true"], probe["swapped"], probe["gap"],
            )  # fmt: skip
    logger.info(
        "Test WER change over the federated stage: %+.4f [%+.4f, %+.4f] (paired speaker "
        "bootstrap, %s)",
        change["difference"],
        *change["ci95"],
        "significant" if change["significant"] else "not significant",
    )
    # the cohort the noise is scaled to: M of a simulated deployment, else n = qK
    cohort = config.noise_cohort_size or hparams["sampling_rate"] * settings.num_clients
    ratio = noise_vs_update(
        result.reports,
        layout,
        noise_multiplier=config.noise_multiplier,
        clip=hparams["clip"],
        expected_cohort_size=cohort,
    )
    log_noise_ratio(ratio)
    pools = pool_summary(result.reports, layout)
    log_pool_summary(pools)
    timings["total"] = time.time() - start
    results = results_summary(
        hparams=hparams, settings=settings, info=info, config=config, result=result,
        test=test_report, test_round0=test_round0, change=change, ratio=ratio, profile=profile,
        alpha_from_profile=alpha_from_profile, timings=timings, pools=pools,
        reliance=reliance,
    )  # fmt: skip
    write_results(hparams["output_folder"], results)
    plots = write_run_plots(
        hparams["output_folder"],
        noise_multiplier=config.noise_multiplier,
        clip=hparams["clip"] or 1.0,
        alpha=hparams["alpha"] if method_name(hparams["method"]) == "alpha_split" else None,
        expected_cohort_size=cohort,
        round_accountant=config.round_accountant,
    )
    hparams["train_logger"].log_stats(
        stats_meta={"round": result.last_round, "method": method_name(hparams["method"])},
        test_stats={"WER": test_report["WER"], "round0_WER": test_round0["WER"]},
    )
    print_summary(
        format_results_table(results, style="text"),
        output_folder=hparams["output_folder"],
        timings=results["timings_s"],
        plots=plots,
        extra=[
            format_disclosure(results["privacy"]),
            f"Model: {final_model} (python recipes/MLS/transcribe.py {final_model} <wav> "
            f"--language <{'|'.join(info.get('languages') or hparams['languages'])}>)",
        ],
    )
    return results


def write_train_statistics(rows: list[dict], save_folder: str) -> str:
    """Write the per-language training hours / clients / hours per client table (Table VI).

    One client per speaker (the speaker partition). Rows are sorted by hours, descending, as in
    the paper, with a Total row; written as ``train_statistics.csv`` and ``.md``.

    Returns
    -------
    str
        Path of the markdown table.
    """
    per_lang: dict[str, dict] = {}
    for row in rows:
        entry = per_lang.setdefault(row["language"], {"seconds": 0.0, "speakers": set()})
        entry["seconds"] += float(row["duration"])
        entry["speakers"].add(row["spk_id"])
    table = []
    for language, entry in sorted(per_lang.items(), key=lambda kv: -kv[1]["seconds"]):
        hours, clients = entry["seconds"] / 3600, len(entry["speakers"])
        table.append((language, hours, clients, hours / clients))
    total_hours = sum(t[1] for t in table)
    total_clients = sum(t[2] for t in table)
    table.append(("total", total_hours, total_clients, total_hours / max(total_clients, 1)))
    with open(os.path.join(save_folder, "train_statistics.csv"), "w", encoding="utf-8") as f:
        f.write("language,training_hours,clients,avg_hours_per_client\n")
        for language, hours, clients, per in table:
            f.write(f"{language},{hours:.4f},{clients},{per:.4f}\n")
    md = os.path.join(save_folder, "train_statistics.md")
    with open(md, "w", encoding="utf-8") as f:
        f.write("| Language | Training Hours | Clients (K) | Avg. Hours/Client |\n")
        f.write("|---|---:|---:|---:|\n")
        for language, hours, clients, per in table:
            name = "**Total**" if language == "total" else language.capitalize()
            f.write(f"| {name} | {hours:.3f} | {clients} | {per:.3f} |\n")
    return md


def write_speaker_overlap(train_rows: list[dict], test_rows: list[dict], save_folder: str) -> str:
    """Write the train-client / test-speaker overlap report (alpha-split paper, Appendix B).

    For each language and in total: training clients (speakers), test speakers, the
    overlapping speaker IDs, the fraction of clients they are, and the fraction of training
    utterances and hours they hold. Written as ``speaker_overlap.json``.

    Returns
    -------
    str
        Path of the JSON report.
    """

    def stats(train, test):
        train_spk = {r["spk_id"] for r in train}
        test_spk = {r["spk_id"] for r in test}
        overlap = sorted(train_spk & test_spk)
        in_overlap = [r for r in train if r["spk_id"] in test_spk]
        seconds = sum(float(r["duration"]) for r in train)
        return {
            "train_clients": len(train_spk),
            "test_speakers": len(test_spk),
            "overlapping_speakers": overlap,
            "num_overlapping": len(overlap),
            "fraction_of_clients": len(overlap) / max(len(train_spk), 1),
            "fraction_of_train_utterances": len(in_overlap) / max(len(train), 1),
            "fraction_of_train_hours": sum(float(r["duration"]) for r in in_overlap)
            / max(seconds, 1e-9),
        }

    languages = sorted({r["language"] for r in train_rows} | {r["language"] for r in test_rows})
    report = {
        "per_language": {
            lang: stats(
                [r for r in train_rows if r["language"] == lang],
                [r for r in test_rows if r["language"] == lang],
            )
            for lang in languages
        },
        "total": stats(train_rows, test_rows),
    }
    path = os.path.join(save_folder, "speaker_overlap.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    total = report["total"]
    logger.info(
        "Speaker overlap: %d of %d training clients also in test (%.1f%% of training utterances).",
        total["num_overlapping"],
        total["train_clients"],
        100 * total["fraction_of_train_utterances"],
    )
    return path


def utterance_ce(brain, test_set, test_rows):
    """Each test utterance's transcript cross-entropy (true audio) as per-utterance counts.

    The teacher-forced CE of utterance u (Eq. 2, the mean over its n_u target tokens, CE_u)
    is stored as ``num_edits`` = n_u * CE_u and ``num_ref_tokens`` = n_u, so the corpus figure
    sum_u n_u CE_u / sum_u n_u is the test set's token-mean CE and the WER tools give its CIs
    (the speaker-level bootstrap, the paired comparison, the pooling over seeds). Each
    utterance is a batch of its own: the model returns a batch's token mean.

    Returns
    -------
    speechbrain_fl.metrics.UtteranceErrors
    """
    model = brain.modules.model
    info = {r["ID"]: (r["spk_id"], r.get("language", "")) for r in test_rows}
    loader = sb.dataio.dataloader.make_dataloader(test_set, batch_size=1, shuffle=False)
    was_training = model.training
    model.eval()
    rows = []
    with torch.no_grad():
        for batch in loader:
            batch = batch.to(brain.device)
            wavs, lens = batch.sig
            out = model(wavs, lens, list(batch.wrd), list(batch.language))
            speaker, language = info[batch.id[0]]
            rows.append(
                {"ID": batch.id[0], "spk_id": speaker, "language": language,
                 "num_edits": float(out.ce_loss) * out.num_tokens,
                 "num_ref_tokens": out.num_tokens}
            )  # fmt: skip
    model.train(was_training)
    return UtteranceErrors.from_rows(rows)
