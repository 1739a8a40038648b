#!/usr/bin/env python3
"""Recipe: federated speech-LLM ASR on Multilingual LibriSpeech with component-aware DP.

A speech-LLM (Whisper-style encoder + connector + causal LLM with LoRA) is fine-tuned across
speaker-partitioned clients with Flower. The privacy method is the hparams file: FedAvg (no DP),
Flat, PFL-Uniform, PFL-Dim, PFL-Dim+EMA, PFL-Unif+EMA or alpha-split (Luque, Lopez, Sant:
"Component-Aware Differential Privacy for Federated Multilingual Speech-LLMs"). Each client clips
its own update delta to the round's per-group budgets; the server re-clips, averages, adds
N(0, (sigma C / n)^2) once and accounts the round (PLD by default, Opacus's RDP beside it).

Without ``data_folder`` the recipe generates a small multilingual corpus with espeak-ng in the
real MLS layout (8 languages), pretrains a tiny seed model on its public split, and runs the
federated stage on CPU.

The recipe is a task: :func:`mls_task` is the one factory both engines load. This script runs it
on the Simulation Engine and adds the norm profiling; ``flwr run`` loads the same factory
(``task = "recipes/MLS/train_fl.py:mls_task"``, shipped in the Flower app bundle by
``fab-include`` in pyproject.toml), and its ServerApp writes the same outputs (round-0 and
final test WER, results.json, plots, the final checkpoint). See recipes/MLS/README.md.

To run this recipe (from the repository root or from recipes/MLS/):

    > python recipes/MLS/train_fl.py hparams/alpha_split.yaml
    > python recipes/MLS/train_fl.py hparams/flat.yaml --freeze_encoder True
    > python recipes/MLS/train_fl.py hparams/pfl_dim_ema.yaml --data_folder /data/mls \\
          --model whisper_tinyllama --device cuda --precision bf16
    > flwr run . speechbrain-fl --run-config \\
          'task="recipes/MLS/train_fl.py:mls_task" hparams="recipes/MLS/hparams/flat.yaml"'

Outputs (``output_folder``): train_log.txt, hyperparams.yaml, results.json, rounds.csv,
group_norms.csv, test_utterances.csv, plots/*.png, final_model/ (transcribe with
recipes/MLS/transcribe.py), and the server state for resuming.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

import speechbrain as sb
import torch

from speechbrain_fl.data.mls_synth import generate_mls_corpus
from speechbrain_fl.data.partition import partition_manifest, read_manifest
from speechbrain_fl.fl.clientapp.train import ClientTask
from speechbrain_fl.fl.dp.profile import format_profile, norm_profile, profile_config, write_profile
from speechbrain_fl.fl.params import load_trainable, trainable_state
from speechbrain_fl.fl.serverapp.task import ServerTask
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.task import import_factory
from speechbrain_fl.models.checkpoint import save_federated_model
from speechbrain_fl.privacy import layout_from_model
from speechbrain_fl.privacy.methods import method_name, with_settings
from speechbrain_fl.recipe import (
    FederatedRecipe,
    ModelCache,
    RunSettings,
)

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))  # the recipe's own modules, SpeechBrain style
from mls_brain import SpeechLLMBrain, make_dataset  # noqa: E402
from mls_central import run_centralized  # noqa: E402
from mls_prepare import node_train_manifest, prepare_mls  # noqa: E402
from mls_report import (  # noqa: E402, F401 (re-exported: the recipe's analysis API)
    PAPER_SIGMA,
    _log_noise_ratio,
    audio_reliance,
    evaluate_test,
    federated_change,
    log_noise_ratio,
    noise_vs_update,
    privacy_section,
    report_run,
)
from mls_seed_model import seed_model_folder, shipped_seed_serves  # noqa: E402
from mls_settings import (  # noqa: E402
    BRAIN_KEYS,
    BRAIN_OBJECTS,
    PREPARATION_KEYS,
    check_hparams,
    engine_hparams,
    model_options,
)

logger = logging.getLogger("train_fl")  # one name whichever way the file was imported
TASK = f"{Path(__file__).resolve()}:mls_task"


# ##########################################################################################
# Data
# ##########################################################################################
def dataio_prepare(hparams, *, progressbar=True, shipped=False):
    """Corpus (embedded if ``data_folder`` is null), manifests and the client partition.

    ``shipped``: the shipped seed serves the run, so the public split (the seed's pretraining
    data) is neither synthesised nor prepared; every other utterance is the same file.
    """
    timings = {}
    data_folder = hparams["data_folder"]
    embedded = data_folder is None
    if embedded:
        start = time.time()
        data_folder = os.path.join(hparams["cache_folder"], "mls_synth")
        logger.info("No data_folder given: using the embedded espeak-ng corpus in %s", data_folder)
        report = generate_mls_corpus(
            data_folder,
            languages=hparams["languages"],
            speakers_per_language=hparams["corpus_speakers_per_language"],
            utterances_per_speaker=hparams["corpus_utterances_per_speaker"],
            public_speakers_per_language=hparams["corpus_public_speakers_per_language"],
            public_utterances_per_speaker=0
            if shipped
            else hparams["corpus_public_utterances_per_speaker"],
            eval_utterances_per_speaker=hparams["corpus_eval_utterances_per_speaker"],
            client_rate=tuple(hparams["corpus_client_rate"]),
            client_novel_share=hparams["corpus_client_novel_share"],
            seed=hparams["seed"],
            progress=progressbar,
            num_workers=hparams.get("corpus_workers"),
        )
        logger.info(
            "Embedded corpus %s (%.1f s)",
            "reused from cache" if report["cached"] else "generated",
            report["seconds"],
        )
        timings["corpus"] = time.time() - start
    start = time.time()
    # the tiny seed model pretrains on a public split: the embedded corpus has one; on a real
    # MLS folder prepare_mls carves it from training speakers (public_speaker_share)
    public = (embedded or hparams["model"] == "tiny") and not shipped
    splits = ("train", "dev", "test") + (("public",) if public else ())
    manifests = os.path.join(hparams["save_folder"], "manifests")
    report = prepare_mls(
        data_folder,
        manifests,
        languages=hparams["languages"],
        splits=splits,
        skip_prep=hparams["skip_prep"],
        max_utts_per_split=hparams["max_utts_per_split"],
        public_speaker_share=None if embedded else hparams["public_speaker_share"],
        seed=hparams["seed"],
        # a real MLS folder: durations from segments.txt (no audio opened); the embedded
        # corpus's segments.txt rounds to 10 ms, and its few files are read instead
        durations="audio" if embedded else "segments",
    )
    partition = partition_manifest(
        os.path.join(manifests, "train.csv"),
        os.path.join(hparams["save_folder"], "partition"),
        method=hparams["partition"],
        num_clients=hparams["num_clients"],
        seed=hparams["seed"],
    )
    timings["preparation"] = time.time() - start
    return data_folder, manifests, report, partition, timings


# ##########################################################################################
# Model
# ##########################################################################################
_MODELS = ModelCache()  # one model per process, shared by the clients it trains


def build_brain(settings, hparams, *, checkpointer=None):
    """A SpeechLLMBrain around the seed model (one model per process, shared by its clients).

    A process (a Ray actor, a SuperNode) trains many clients one after another; the engine loads
    the global trainable tensors before each local training and restores them after, so one
    model per process is enough (:class:`speechbrain_fl.recipe.ModelCache`). The model comes
    from the hparams' ``speech_llm`` factory; the Brain's objects (``opt_class``,
    ``lr_schedule``, ``error_stats``) from the loaded ``hparams``, beside the prepared plain
    values of ``settings``.
    """
    model = _MODELS.get(
        [settings.model, settings.run_opts.get("device")],
        lambda: hparams["speech_llm"](
            settings.model["folder"],
            cache_dir=settings.model["cache_dir"],
            seed=settings.hparams["seed"],
            device=settings.device,
        ),
    )
    return SpeechLLMBrain(
        modules={"model": model},
        hparams={**settings.hparams, **{k: hparams[k] for k in BRAIN_OBJECTS}},
        run_opts=dict(settings.run_opts),
        checkpointer=checkpointer,
    )


def component_layout(brain):
    """Trainable groups labelled encoder / connector / llm by the model's name patterns."""
    patterns = brain.modules.model.component_patterns()
    components = {label: [f"model.{p}" for p in pats] for label, pats in patterns.items()}
    group_by = getattr(brain.hparams, "group_by", "parameter")  # the hparams' clip groups
    return layout_from_model(brain.modules, components=components, group_by=group_by)


# ##########################################################################################
# Federated task: the factory both engines load
# ##########################################################################################
def prepare_run(hparams, run_opts):
    """Data, partition and seed model of a run as :class:`~speechbrain_fl.recipe.RunSettings`.

    Prepared once per run (:meth:`speechbrain_fl.recipe.FederatedRecipe.prepare`): a later
    process with the same preparation keys (a Ray actor, a SuperNode) reads the result instead.
    Returns ``(settings, info)``.
    """

    def prepare():
        shipped = shipped_seed_serves(hparams, run_opts)
        data_folder, manifests, prep_report, partition, timings = dataio_prepare(
            hparams, progressbar=not run_opts.get("noprogressbar", False), shipped=shipped
        )
        seed_folder, pretrain_info = seed_model_folder(
            hparams, manifests, data_folder, run_opts, make_dataset=make_dataset, shipped=shipped
        )
        clients = [partition["clients"][n]["manifest"] for n in sorted(partition["clients"])]
        settings = RunSettings(
            hparams={k: hparams[k] for k in BRAIN_KEYS},
            run_opts=run_opts,
            data_folder=data_folder,
            clients=[os.path.join(hparams["save_folder"], "partition", c) for c in clients],
            valid_csv=os.path.join(manifests, "dev.csv"),
            test_csv=os.path.join(manifests, "test.csv"),
            cpus_per_client=hparams["num_cpus_per_client"],
            model={
                "folder": seed_folder,
                "cache_dir": hparams["cache_folder"],
                "options": model_options(hparams),
            },
            timings={**timings, **pretrain_info},
        )
        info = {k: prep_report.get(k, {}) for k in ("skipped", "num_skipped")}
        info["languages"] = prep_report.get("languages")
        info["missing_languages"] = prep_report.get("missing_languages", [])
        return {"settings": settings.to_dict(), "info": info}

    key = {k: hparams[k] for k in PREPARATION_KEYS}
    prepared = RECIPE.prepare(hparams, run_opts, key=key, make=prepare)
    return RunSettings.from_dict(prepared["settings"]), prepared["info"]


def build_client(context, *, settings, hparams):
    """ClientApp builder: this partition's Brain and training set."""
    partition_id = int(context.node_config["partition-id"])
    # One intra-op thread per CPU the engine gave this client: Ray runs several clients side by
    # side, and torch's default (all cores each) oversubscribes the machine (2.5x slower here).
    torch.set_num_threads(max(1, int(settings.cpus_per_client)))
    brain = build_brain(settings, hparams)
    return ClientTask(
        brain=brain,
        train_set=make_dataset(
            settings.clients[partition_id], settings.data_folder, skip_unreadable=True
        ),
        train_loader_kwargs=dict(settings.hparams["dataloader_options"]),
        layout=component_layout(brain),
    )


def build_server(context, *, settings, hparams, fl_config):
    """ServerApp builder: the global model, DP configuration and dev-set WER evaluation."""
    brain = build_brain(settings, hparams)
    valid_set = make_dataset(settings.valid_csv, settings.data_folder)

    def evaluate(brain_):
        loss = brain_.evaluate(
            valid_set,
            progressbar=False,
            test_loader_kwargs=dict(settings.hparams["eval_dataloader_options"]),
        )
        return {"valid_loss": float(loss), "WER": float(brain_.last_stats["WER"])}

    return ServerTask(
        brain=brain,
        config=fl_config,
        layout=component_layout(brain),
        evaluate=evaluate,
        min_available_nodes=settings.num_clients if fl_config.sampling_rate >= 1 else 1,
        num_partitions=settings.num_clients,
        partition_sizes=settings.partition_sizes(),
    )


def mls_task(hparams_path=None, overrides=None):
    """The MLS recipe as an :class:`~speechbrain_fl.fl.task.FLTask` (both engines load this).

    Arguments
    ---------
    hparams_path : str, optional
        A method file (``hparams/flat.yaml`` or ``recipes/MLS/hparams/flat.yaml``, resolved
        against the working directory, this folder, then the repository root); default
        ``hparams/fedavg.yaml``.
    overrides : dict, optional
        Hparams overrides and SpeechBrain run options in one mapping (as ``flwr run
        --run-config`` sends them; hyphens read as underscores), plus ``stage: profile`` for
        the norm-profiling rounds (:mod:`speechbrain_fl.fl.dp.profile`).

    Returns
    -------
    FLTask
        ``info`` holds the prepared ``settings`` and the preparation report.
    """
    hparams, run_opts, stage = RECIPE.load_for_task(hparams_path, overrides)
    if stage == "train" and hparams["alpha"] == "auto":
        raise ValueError(
            "alpha: auto is resolved by the norm profiling of train_fl.py; with flwr run give "
            "alpha a number (train_fl.py --profile_rounds 1 prints one)"
        )
    if hparams["scenario"] != "federated":
        raise ValueError(f"scenario: {hparams['scenario']!r}: flwr run trains federated only")
    if stage not in ("train", "profile"):
        raise ValueError(f"stage: {stage!r} must be 'train' or 'profile'")
    settings, info = prepare_run(hparams, run_opts)
    if stage == "train":
        config = FLConfig.from_hparams(engine_hparams(hparams))
        on_result = functools.partial(
            finish_run,
            settings=settings,
            hparams=hparams,
            info=info,
            start=time.time(),
        )
    else:  # profile: no noise, no effective clip: the method's keys do not apply
        config = profile_config(
            FLConfig.from_hparams(
                {
                    **hparams,
                    "method": "fedavg",
                    "noise_multiplier": 0.0,
                    "noise_cohort_size": None,
                    "accounting_population": None,
                }
            ),
            rounds=hparams["profile_rounds"],
            output_folder=os.path.join(hparams["output_folder"], "profile"),
        )
        on_result = None
    return RECIPE.task(
        settings,
        build_client=functools.partial(build_client, hparams=hparams),
        build_server=functools.partial(build_server, hparams=hparams),
        fl_config=config,
        on_result=on_result,
        info={"settings": settings, "hparams": hparams, "run_opts": run_opts, **info},
        train_logger=hparams["train_logger"],  # the round lines go through it
    )


def finish_run(result, *, settings, hparams, info, start):
    """The rounds ended (in the ServerApp): the final model; under ``flwr run`` the outputs too.

    The script's :func:`main` reports itself; for ``flwr run`` the ServerApp evaluates the
    round-0 and final parameters on the test split and :func:`mls_report.report_run` writes
    what the script writes (results.json, test_utterances*.csv, the plots)."""
    folder = os.path.join(hparams["output_folder"], "final_model")
    languages = list(info.get("languages") or hparams["languages"])
    facts = {"method": method_name(hparams["method"]), "model": str(hparams["model"])}
    save_final_model(
        result, settings=settings, hparams=hparams, folder=folder,
        info={**facts, "languages": languages},
    )  # fmt: skip
    if _SCRIPT_RUN["active"]:
        return None
    timings = {**settings.timings, "federated": time.time() - start}
    test_rows = read_manifest(settings.test_csv)
    test_set = make_dataset(settings.test_csv, settings.data_folder)
    brain = build_brain(settings, hparams)
    t0 = time.time()
    load_trainable(brain.modules, _initial_params(settings, hparams))
    test_round0, details_round0 = evaluate_test(brain, test_set, test_rows, hparams)
    test_round0["audio_reliance"] = audio_reliance(brain, test_set, hparams)
    timings["evaluation"] = time.time() - t0
    load_trainable(brain.modules, result.params)
    return report_run(
        brain=brain, layout=component_layout(brain), test_set=test_set, test_rows=test_rows,
        hparams=hparams, settings=settings, info=info, config=result.config, result=result,
        round0=(test_round0, details_round0), profile=None, alpha_from_profile=False,
        timings=timings, start=start,
    )  # fmt: skip


# True while the script's main runs: it evaluates round 0 and reports itself.
_SCRIPT_RUN = {"active": False}


def _initial_params(settings, hparams):
    """The round-0 trainable tensors: the seed model built again (its connector drawn from
    ``seed``, the one the rounds started from)."""
    model = hparams["speech_llm"](
        settings.model["folder"],
        cache_dir=settings.model["cache_dir"],
        seed=settings.hparams["seed"],
        device=settings.device,
    )
    return {f"model.{k}": v for k, v in trainable_state(model).items()}


def save_final_model(result, *, settings, hparams, folder, info):
    """Write the final global model as a checkpoint transcribe.py loads: the tiny seed copied
    in (the folder stands alone), a real preset recorded by name (loaded from the hub)."""
    brain = build_brain(settings, hparams)
    load_trainable(brain.modules, result.params)
    path = save_federated_model(
        brain.modules.model,
        folder,
        base=settings.model["folder"],
        options=settings.model["options"],
        copy_base=Path(settings.model["folder"]).name.startswith("seed_tiny"),
        info={**info, "rounds": result.last_round, "epsilon": result.epsilon},
    )
    logger.info("Final model saved to %s", path)
    return path


# ##########################################################################################
# The script
# ##########################################################################################
RECIPE = FederatedRecipe(
    recipe_dir=RECIPE_DIR,
    task_ref=TASK,
    default_hparams="hparams/fedavg.yaml",
    check=check_hparams,
    # a SuperNode with its own data: its MLS-layout folder prepared on the node
    node_manifest=node_train_manifest,
    # --debug: 2 rounds, 2 local epochs of 2 batches, the EMA warm-up within them; a 2-language
    # corpus in <cache_folder>_debug; outputs in <output_folder>_debug.
    debug_caps={
        # 2 languages of the embedded corpus; a real MLS folder keeps the languages asked for
        "languages": lambda hp: 2 if hp["data_folder"] is None else len(hp["languages"]),
        "corpus_speakers_per_language": 2,
        "corpus_utterances_per_speaker": 4,
        "corpus_public_speakers_per_language": 1,
        "corpus_public_utterances_per_speaker": 8,
        "corpus_eval_utterances_per_speaker": 2,
        "corpus_workers": 1,  # 70 utterances: spawning synthesis workers costs more
        "number_of_rounds": 2,
        "pretrain_ctc_steps": 2,
        "pretrain_lm_steps": 2,
        "pretrain_speech_steps": 2,
        "profile_rounds": 1,
        "ema_warmup_rounds": 1,
        "bootstrap_resamples": 200,
    },
    # 4 debug clients at the default q = 0.1 would leave most debug rounds without a client
    debug_values={"sampling_rate": lambda hp: max(hp["sampling_rate"], 0.5)},
)


def main(run):
    """Prepare data and the seed model, run the federated rounds, evaluate, report."""
    start_all = time.time()
    _SCRIPT_RUN["active"] = True
    sb.create_experiment_directory(**run.experiment)
    hparams, run_opts = run.hparams, run.run_opts
    settings, info = prepare_run(hparams, run_opts)
    timings = dict(settings.timings)
    if hparams.get("prepare_only", False):
        logger.info(
            "prepare_only: corpus, manifests and seed model ready (%s); no federated run",
            ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        )
        return
    logger.info(
        "%d clients, expected cohort %.1f",
        settings.num_clients,
        hparams["sampling_rate"] * settings.num_clients,
    )

    test_rows = read_manifest(settings.test_csv)
    test_set = make_dataset(settings.test_csv, settings.data_folder)
    brain = build_brain(settings, hparams)
    start = time.time()
    test_round0, details_round0 = evaluate_test(brain, test_set, test_rows, hparams)
    test_round0["audio_reliance"] = audio_reliance(brain, test_set, hparams)
    timings["evaluation"] = time.time() - start
    logger.info("Round-0 (seed model) test WER %.4f", test_round0["WER"])
    hparams["train_logger"].log_stats(
        stats_meta={"round": 0, "stage": "test"}, test_stats={"WER": test_round0["WER"]}
    )

    if hparams["scenario"] == "centralized":  # the pooled-data ceiling (mls_central.py)
        return run_centralized(
            brain=brain, settings=settings, hparams=hparams, test_set=test_set,
            test_rows=test_rows, round0=(test_round0, details_round0), timings=timings,
            start=start_all,
        )  # fmt: skip
    profile = None
    alpha_from_profile = hparams["alpha"] == "auto"
    if hparams["profile_rounds"] > 0:
        start = time.time()
        result = RECIPE.simulate(RECIPE.spec(run, stage="profile"), hparams)
        profile = norm_profile(
            result.reports[-1],
            component_layout(brain),
            clip=hparams["clip"] or 1.0,
            kappa=hparams["alpha_kappa"],
        )
        write_profile(profile, os.path.join(hparams["output_folder"], "profile"))
        print("\n" + format_profile(profile, rounds=hparams["profile_rounds"]) + "\n")
        timings["profiling"] = time.time() - start
        if hparams["alpha"] == "auto":
            if profile["alpha"] is None and "alpha_refused" in profile:
                raise ValueError(
                    f"alpha: auto: {profile['alpha_refused']} (alpha_kappa "
                    f"{hparams['alpha_kappa']}, clip {hparams['clip']}); rerun with --clip or "
                    "--alpha_kappa set so (see recipes/MLS/README.md, automatic alpha)"
                )
            if profile["alpha"] is None:
                raise ValueError(
                    "alpha: auto needs encoder update norms, but the encoder is frozen; "
                    "set alpha explicitly or use --freeze_encoder False"
                )
            hparams["alpha"] = run.overrides["alpha"] = profile["alpha"]
            # the YAML's method object took alpha: auto; it gets the profiled alpha too
            hparams["method"] = with_settings(hparams["method"], alpha=profile["alpha"])
            logger.info("alpha: auto -> %.4f (from the norm profile)", hparams["alpha"])

    start = time.time()
    result = RECIPE.simulate(RECIPE.spec(run), hparams)
    timings["federated"] = time.time() - start

    load_trainable(brain.modules, result.params)  # the task's on_result saved final_model/
    return report_run(
        brain=brain, layout=component_layout(brain), test_set=test_set, test_rows=test_rows,
        hparams=hparams, settings=settings, info=info, config=result.config, result=result,
        round0=(test_round0, details_round0), profile=profile,
        alpha_from_profile=alpha_from_profile, timings=timings, start=start_all,
    )  # fmt: skip


if __name__ == "__main__":
    # Run inside the module the engine loads for TASK (not as __main__), so the server builder
    # and this script share one copy of the module and its per-process model.
    module = import_factory(f"{TASK.rsplit(':', 1)[0]}:main").__module__
    sys.modules[module].RECIPE.run_script(sys.argv[1:], sys.modules[module].main)
