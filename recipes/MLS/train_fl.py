#!/usr/bin/env python3
"""Recipe: federated speech-LLM ASR on Multilingual LibriSpeech with component-aware DP.

A speech-LLM (Whisper-style encoder + connector + causal LLM with LoRA) is fine-tuned across
speaker-partitioned clients with Flower. The privacy method is the hparams file: FedAvg (no DP),
Flat, PFL-Uniform, PFL-Dim, PFL-Dim+EMA, PFL-Unif+EMA or alpha-split (Luque, Lopez, Sant:
"Component-Aware Differential Privacy for Federated Multilingual Speech-LLMs"). Each client clips
its own update delta to the round's per-group budgets; the server re-clips, averages, adds
N(0, (sigma C / n)^2) once and accounts the round with Opacus's RDP accountant.

Without ``data_folder`` the recipe generates a small multilingual corpus with espeak-ng in the
real MLS layout (8 languages), pretrains a tiny seed model on its public split, and runs the
federated stage on CPU.

The recipe is a task: :func:`mls_task` is the one factory both engines load. This script runs it
on the Simulation Engine (Ray) and adds what only a script does (round-0 and final test WER,
norm profiling, results.json, plots, the final checkpoint); ``flwr run`` loads the same factory
from this file (``task = "recipes/MLS/train_fl.py:mls_task"``, shipped in the Flower app
bundle by ``fab-include`` in pyproject.toml) on a simulation federation or the Deployment
Engine. It stays a script outside the package, as SpeechBrain recipes are; see
recipes/MLS/README.md for both commands.

To run this recipe (from the repository root or from recipes/MLS/):

    > python recipes/MLS/train_fl.py hparams/alpha_split.yaml
    > python recipes/MLS/train_fl.py hparams/flat.yaml --freeze_encoder True
    > python recipes/MLS/train_fl.py hparams/pfl_dim_ema.yaml --data_folder /data/mls \\
          --model whisper_tinyllama --device cuda --precision bf16
    > flwr run . local-simulation --run-config \\
          'task="recipes/MLS/train_fl.py:mls_task" hparams="recipes/MLS/hparams/flat.yaml"'

Outputs (``output_folder``): train_log.txt, hyperparams.yaml, results.json, rounds.csv,
group_norms.csv, test_utterances.csv, plots/*.png, final_model/ (transcribe with
recipes/MLS/transcribe.py), and the server state for resuming.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import speechbrain as sb
import torch

from speechbrain_fl.atomic import atomic_folder, atomic_open
from speechbrain_fl.data.mls_synth import generate_mls_corpus
from speechbrain_fl.data.partition import partition_manifest, read_manifest
from speechbrain_fl.fl.client import ClientTask
from speechbrain_fl.fl.config import FLConfig
from speechbrain_fl.fl.disclosure import format_disclosure, privacy_disclosure
from speechbrain_fl.fl.engine import run_simulation
from speechbrain_fl.fl.params import load_trainable
from speechbrain_fl.fl.profile import (
    format_profile,
    norm_profile,
    profile_config,
    write_profile,
)
from speechbrain_fl.fl.server import ServerTask
from speechbrain_fl.fl.task import FLTask, TaskSpec, import_factory
from speechbrain_fl.metrics import (
    paired_bootstrap_details,
    utterance_errors_from_stats,
    wer_report,
    write_utterance_details,
)
from speechbrain_fl.models.checkpoint import save_federated_model
from speechbrain_fl.models.presets import PRESETS, build_speech_llm
from speechbrain_fl.models.pretrain import pretrain_seed_model
from speechbrain_fl.plots import write_run_plots
from speechbrain_fl.privacy import layout_from_model
from speechbrain_fl.recipe import (
    federated_run_options,
    load_layered_hparams,
    prepare_once,
    resolve_hparams_path,
    split_overrides,
)
from speechbrain_fl.run_outputs import format_results_table

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))  # the recipe's own modules, SpeechBrain style
from mls_prepare import prepare_mls  # noqa: E402

logger = logging.getLogger("train_fl")  # one name whichever way the file was imported
TASK = f"{Path(__file__).resolve()}:mls_task"


# ##########################################################################################
# Brain
# ##########################################################################################
class SpeechLLMBrain(sb.Brain):
    """Trains the speech-LLM on transcript cross-entropy (+ optional CTC) and decodes for WER.

    The federated engine calls ``fit`` for a client's local epochs; the learning rate follows a
    cosine decay over the federated rounds (``fl_round`` / ``fl_num_rounds`` are set by the
    engine from the round's config before each local training).
    """

    def compute_forward(self, batch, stage):
        """Loss terms on the batch; greedy transcripts too outside training."""
        batch = batch.to(self.device)
        wavs, wav_lens = batch.sig
        model = self.modules.model
        languages = list(batch.language)
        out = model(wavs, wav_lens, list(batch.wrd), languages)
        hyps = None
        if stage != sb.Stage.TRAIN:
            hyps = model.transcribe(
                wavs,
                wav_lens,
                max_new_tokens=self.hparams.max_new_tokens,
                num_beams=self.hparams.num_beams,
                languages=languages,
            )
        return out, hyps

    def compute_objectives(self, predictions, batch, stage):
        """Transcript CE (+ ctc_weight * CTC); WER bookkeeping outside training."""
        out, hyps = predictions
        if hyps is not None:
            self.wer_metric.append(
                ids=batch.id,
                predict=[h.split() for h in hyps],
                target=[w.split() for w in batch.wrd],
            )
        return out.loss

    def init_optimizers(self):
        """AdamW over the trainable tensors (encoder at ``lr * encoder_lr_multiplier``)."""
        lr = self.round_lr()
        groups = self.modules.model.param_groups(lr, self.hparams.encoder_lr_multiplier)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=self.hparams.weight_decay)
        self.optimizers_dict = {"optimizer": self.optimizer}
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("optimizer", self.optimizer)

    def round_lr(self):
        """Cosine decay of the peak ``lr`` over the federated rounds, down to a floor.

        lr_t = lr * (m + (1 - m) * (1 + cos(pi (t - 1) / T)) / 2) for round t of T, with
        m = ``lr_min_ratio``. m = 0 is the paper's cosine decay (Sec. II-D); the floor m > 0 is
        ours (with few rounds a cosine to ~0 leaves the last rounds almost idle), m = 1 a
        constant lr.

        Example
        -------
        >>> from types import SimpleNamespace
        >>> brain = SpeechLLMBrain.__new__(SpeechLLMBrain)
        >>> brain.hparams = SimpleNamespace(lr=1.0, lr_min_ratio=0.5)
        >>> brain.fl_round, brain.fl_num_rounds = 1, 10
        >>> brain.round_lr()
        1.0
        >>> brain.fl_round = 6
        >>> round(brain.round_lr(), 3)
        0.75
        """
        rnd = getattr(self, "fl_round", 1)
        total = max(1, getattr(self, "fl_num_rounds", 1))
        floor = getattr(self.hparams, "lr_min_ratio", 0.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * (rnd - 1) / total))
        return self.hparams.lr * (floor + (1.0 - floor) * cosine)

    def on_stage_start(self, stage, epoch=None):
        """A fresh WER accumulator for each evaluation stage."""
        if stage != sb.Stage.TRAIN:
            self.wer_metric = sb.utils.metric_stats.ErrorRateStats()

    def on_stage_end(self, stage, stage_loss, epoch=None):
        """Store the stage statistics (read by the engine and by ``evaluate_test``)."""
        stats = {"loss": stage_loss}
        if stage != sb.Stage.TRAIN:
            stats["WER"] = self.wer_metric.summarize("error_rate") / 100.0
        self.last_stats = stats


# ##########################################################################################
# Data
# ##########################################################################################
def make_dataset(csv_path, data_folder):
    """A DynamicItemDataset yielding ``sig`` (16 kHz waveform), ``wrd`` and ``language``."""
    dataset = sb.dataio.dataset.DynamicItemDataset.from_csv(
        csv_path=csv_path, replacements={"data_root": data_folder}
    )

    @sb.utils.data_pipeline.takes("wav")
    @sb.utils.data_pipeline.provides("sig")
    def audio_pipeline(wav):
        return sb.dataio.dataio.read_audio(wav)

    sb.dataio.dataset.add_dynamic_item([dataset], audio_pipeline)
    sb.dataio.dataset.set_output_keys([dataset], ["id", "sig", "wrd", "language"])
    return dataset.filtered_sorted(sort_key="duration")


def prepare_data(hparams, *, progressbar=True):
    """Corpus (embedded if ``data_folder`` is null), manifests and the client partition."""
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
            public_utterances_per_speaker=hparams["corpus_public_utterances_per_speaker"],
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
    public = embedded or hparams["model"] == "tiny"
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
def model_options(hparams):
    """The keyword arguments of ``build_speech_llm`` from the hparams."""
    return {
        "freeze_encoder": hparams["freeze_encoder"],
        "lora_r": hparams["lora_r"],
        "lora_alpha": hparams["lora_alpha"],
        "connector": hparams["connector"],
        "downsample_k": hparams["downsample_k"],
        "ctc_weight": hparams["ctc_weight"],
        "gradient_checkpointing": hparams["gradient_checkpointing"],
        "prompt": hparams["prompt"],
        "train_llm_lora": hparams["train_llm_lora"],
    }


def seed_model_folder(hparams, manifests, data_folder, run_opts):
    """The starting checkpoint: the preset itself, or the tiny model pretrained centrally.

    The tiny preset is random; it is pretrained on the embedded corpus's ``public`` split
    (speakers disjoint from every client, dev and test) and saved with ``save_pretrained`` into
    the cache, keyed by the options that shape it, so a second run reuses it. Real presets start
    from their Hugging Face checkpoints and are not pretrained here. The run options that apply
    to a training loop (device, precision, max_grad_norm, grad_accumulation_factor,
    noprogressbar) apply here too; a command-line ``--max_grad_norm`` replaces
    ``pretrain_max_grad_norm`` as it replaces the clients' ``max_grad_norm``.
    """
    if hparams["model"] != "tiny":
        return hparams["model"], {}
    public_csv = os.path.join(manifests, "public.csv")
    if not os.path.isfile(public_csv):
        raise OSError(
            f"model: tiny needs a public split to pretrain on ({public_csv} is missing); use the "
            "embedded corpus (data_folder: null), set public_speaker_share to carve one from the "
            "training speakers of a real MLS folder, or use a real preset such as "
            "whisper_tinyllama"
        )
    max_grad_norm = run_opts.get("max_grad_norm", hparams["pretrain_max_grad_norm"])
    accumulation = int(run_opts.get("grad_accumulation_factor", 1))
    precision = run_opts.get("precision", "fp32")
    key = {
        "steps": hparams["pretrain_steps"],
        "ctc_steps": hparams["pretrain_ctc_steps"],
        "lr": hparams["pretrain_lr"],
        "batch_size": hparams["pretrain_batch_size"],
        "connector": hparams["connector"],
        "downsample_k": hparams["downsample_k"],
        "ctc_weight": hparams["ctc_weight"],
        "prompt": hparams["prompt"],
        "seed": hparams["seed"],
        "data": os.path.abspath(data_folder),
        # The public split's content: a corpus regenerated with other options in the same
        # folder must not reuse a seed model trained on the old one.
        "public_manifest": hashlib.sha256(Path(public_csv).read_bytes()).hexdigest(),
        "languages": list(hparams["languages"]),
    }
    # Run options that change the trained weights join the key only when not at their defaults
    # (so existing caches stay valid).
    for name, value, default in (
        ("max_grad_norm", max_grad_norm, 1.0),
        ("grad_accumulation_factor", accumulation, 1),
        ("precision", precision, "fp32"),
    ):
        if value != default:
            key[name] = value
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(hparams["cache_folder"]) / f"seed_tiny_{tag}"
    if (folder / "speech_llm.json").is_file():
        logger.info("Reusing the pretrained tiny seed model in %s", folder)
        return str(folder), {}
    logger.info("Pretraining the tiny seed model on the public split (%s steps)", key["steps"])
    start = time.time()
    model = build_speech_llm(
        "tiny",
        cache_dir=hparams["cache_folder"],
        freeze_encoder=False,
        lora_r=0,
        connector=hparams["connector"],
        downsample_k=hparams["downsample_k"],
        ctc_weight=hparams["ctc_weight"],
        prompt=hparams["prompt"],
        seed=hparams["seed"],
        device=run_opts.get("device") or "cpu",
    )
    dataset = make_dataset(public_csv, data_folder)
    loader = sb.dataio.dataloader.make_dataloader(
        dataset, batch_size=hparams["pretrain_batch_size"], shuffle=True
    )
    history = pretrain_seed_model(
        model,
        _Batches(loader),
        steps=hparams["pretrain_steps"],
        lr=hparams["pretrain_lr"],
        warmup_steps=min(30, hparams["pretrain_steps"] // 10),
        ctc_warmup_steps=hparams["pretrain_ctc_steps"] if hparams["ctc_weight"] > 0 else 0,
        max_grad_norm=max_grad_norm,
        grad_accumulation_factor=accumulation,
        precision=precision,
        progressbar=not run_opts.get("noprogressbar", False),
        log_every=50,
    )
    with atomic_folder(folder) as tmp:
        model.to("cpu").save_pretrained(tmp)
    seconds = time.time() - start
    tail = history["loss"][-20:]
    loss = sum(tail) / len(tail)
    hparams["train_logger"].log_stats(
        stats_meta={"stage": "seed pretraining", "steps": key["steps"]},
        train_stats={"loss": loss},
    )
    logger.info("Seed model saved to %s (%.1f s, final loss %.3f)", folder, seconds, loss)
    return str(folder), {"pretraining": seconds}


class _Batches:
    """Re-iterable ``(wavs, wav_lens, transcripts, languages)`` view of a SpeechBrain loader."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            wavs, lens = batch.sig
            yield wavs, lens, list(batch.wrd), list(batch.language)


_WORKER_MODELS: dict = {}


def build_brain(settings, *, checkpointer=None):
    """A SpeechLLMBrain around the seed model (one model per process, shared by its clients).

    A process (a Ray actor, a SuperNode) trains many clients one after another; the engine loads
    the global trainable tensors before each local training and restores them after, so one
    model per process is enough and avoids rebuilding it for every client.
    """
    key = json.dumps([settings["model"], settings["run_opts"].get("device")], sort_keys=True)
    if key not in _WORKER_MODELS:
        torch.manual_seed(settings["hparams"]["seed"])
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = build_speech_llm(
            settings["model"]["folder"],
            cache_dir=settings["model"]["cache_dir"],
            seed=settings["hparams"]["seed"],
            device=settings["run_opts"].get("device") or "cpu",
            **settings["model"]["options"],
        )
    return SpeechLLMBrain(
        modules={"model": _WORKER_MODELS[key]},
        hparams=settings["hparams"],
        run_opts=dict(settings["run_opts"]),
        checkpointer=checkpointer,
    )


def component_layout(brain):
    """Trainable groups labelled encoder / connector / llm by the model's name patterns."""
    patterns = brain.modules.model.component_patterns()
    components = {label: [f"model.{p}" for p in pats] for label, pats in patterns.items()}
    return layout_from_model(brain.modules, components=components)


# ##########################################################################################
# Federated task: the factory both engines load
# ##########################################################################################
BRAIN_KEYS = (
    "seed",
    "lr",
    "lr_min_ratio",
    "weight_decay",
    "encoder_lr_multiplier",
    "max_new_tokens",
    "num_beams",
    "max_grad_norm",
    "dataloader_options",
    "eval_dataloader_options",
)


def load_run(hparams_file, overrides=None, run_opts=None):
    """Hparams of a run (layered files, ``--debug`` shrinking, checks) and its run options."""
    run_opts = federated_run_options(run_opts or {})
    hparams, base_file, merged = load_layered_hparams(
        hparams_file, overrides, recipe_dir=RECIPE_DIR
    )
    check_hparams(hparams)
    if run_opts.get("debug"):  # 2 rounds, 2 local epochs of 2 batches (SpeechBrain's debug)
        hparams["number_of_rounds"] = min(2, hparams["number_of_rounds"])
        hparams["pretrain_steps"] = min(4, hparams["pretrain_steps"])
        hparams["pretrain_ctc_steps"] = min(2, hparams["pretrain_ctc_steps"])
        hparams["profile_rounds"] = min(1, hparams["profile_rounds"])
        # the EMA methods must leave their warm-up within the 2 debug rounds
        hparams["ema_warmup_rounds"] = min(1, hparams["ema_warmup_rounds"])
        hparams["bootstrap_resamples"] = min(200, hparams["bootstrap_resamples"])
    return hparams, run_opts, base_file, merged


def prepare_run(hparams, run_opts):
    """Data, partition and seed model of a run, as the picklable ``settings`` of its builders.

    Prepared once per run (:func:`speechbrain_fl.recipe.prepare_once`): a later process with
    the same preparation keys (a Ray actor, a SuperNode) reads the result instead.
    """

    def prepare():
        data_folder, manifests, prep_report, partition, timings = prepare_data(
            hparams, progressbar=not run_opts.get("noprogressbar", False)
        )
        seed_folder, pretrain_info = seed_model_folder(hparams, manifests, data_folder, run_opts)
        clients = [partition["clients"][n]["manifest"] for n in sorted(partition["clients"])]
        settings = {
            "hparams": {k: hparams[k] for k in BRAIN_KEYS},
            "run_opts": run_opts,
            "data_folder": data_folder,
            "clients": [os.path.join(hparams["save_folder"], "partition", c) for c in clients],
            "valid_csv": os.path.join(manifests, "dev.csv"),
            "test_csv": os.path.join(manifests, "test.csv"),
            "cpus_per_client": hparams["num_cpus_per_client"],
            "model": {
                "folder": seed_folder,
                "cache_dir": hparams["cache_folder"],
                "options": model_options(hparams),
            },
        }
        info = {"timings": {**timings, **pretrain_info}}
        info.update({k: prep_report.get(k, {}) for k in ("skipped", "num_skipped")})
        info["languages"] = prep_report.get("languages")
        info["missing_languages"] = prep_report.get("missing_languages", [])
        return {"settings": settings, "info": info}

    key = {**{k: hparams[k] for k in PREPARATION_KEYS}, "run_opts": run_opts}
    prepared = prepare_once(hparams["save_folder"], key, prepare)
    return prepared["settings"], prepared["info"]


PREPARATION_KEYS = (
    "data_folder", "cache_folder", "save_folder", "skip_prep", "languages", "max_utts_per_split",
    "corpus_speakers_per_language", "corpus_utterances_per_speaker",
    "corpus_public_speakers_per_language", "corpus_public_utterances_per_speaker",
    "corpus_eval_utterances_per_speaker", "partition", "num_clients", "seed", "model",
    "pretrain_steps", "pretrain_ctc_steps", "pretrain_lr", "pretrain_batch_size",
    "pretrain_max_grad_norm", "connector",
    "downsample_k", "ctc_weight", "prompt", "max_grad_norm", "freeze_encoder", "lora_r",
    "lora_alpha", "gradient_checkpointing", "train_llm_lora", "corpus_client_rate",
    "corpus_client_novel_share", *BRAIN_KEYS,
)  # fmt: skip


def build_client(context, *, settings):
    """ClientApp builder: this partition's Brain and training set."""
    partition_id = int(context.node_config["partition-id"])
    client = settings["clients"][partition_id]
    # One intra-op thread per CPU the engine gave this client: Ray runs several clients side by
    # side, and torch's default (all cores each) oversubscribes the machine (2.5x slower here).
    torch.set_num_threads(max(1, int(settings["cpus_per_client"])))
    brain = build_brain(settings)
    return ClientTask(
        brain=brain,
        train_set=make_dataset(client, settings["data_folder"]),
        train_loader_kwargs=dict(settings["hparams"]["dataloader_options"]),
        layout=component_layout(brain),
    )


def build_server(context, *, settings, fl_config):
    """ServerApp builder: the global model, DP configuration and dev-set WER evaluation."""
    brain = build_brain(settings)
    valid_set = make_dataset(settings["valid_csv"], settings["data_folder"])

    def evaluate(brain_):
        loss = brain_.evaluate(
            valid_set,
            progressbar=False,
            test_loader_kwargs=dict(settings["hparams"]["eval_dataloader_options"]),
        )
        return {"valid_loss": float(loss), "WER": float(brain_.last_stats["WER"])}

    return ServerTask(
        brain=brain,
        config=fl_config,
        layout=component_layout(brain),
        evaluate=evaluate,
        min_available_nodes=len(settings["clients"]) if fl_config.sampling_rate >= 1 else 1,
        num_partitions=len(settings["clients"]),
    )


def mls_task(hparams_path=None, overrides=None):
    """The MLS recipe as an :class:`~speechbrain_fl.fl.task.FLTask` (both engines load this).

    Arguments
    ---------
    hparams_path : str, optional
        A method file (``hparams/flat.yaml`` or ``recipes/MLS/hparams/flat.yaml``, resolved
        against the repository root, the working directory, then this folder); default
        ``hparams/fedavg.yaml``.
    overrides : dict, optional
        Hparams overrides and SpeechBrain run options in one mapping (as ``flwr run
        --run-config`` sends them; hyphens read as underscores), plus ``stage: profile`` for
        the norm-profiling rounds (:mod:`speechbrain_fl.fl.profile`).

    Returns
    -------
    FLTask
        ``info`` holds the prepared ``settings`` and the preparation report.
    """
    values, run_opts = split_overrides(overrides)
    stage = values.pop("stage", "train")
    path = hparams_path or "hparams/fedavg.yaml"
    if (RECIPE_DIR.parents[1] / path).is_file():  # relative to the app (repository) root
        path = str(RECIPE_DIR.parents[1] / path)
    hparams, run_opts, _, _ = load_run(path, values, run_opts)
    if stage == "train" and hparams["alpha"] == "auto":
        raise ValueError(
            "alpha: auto is resolved by the norm profiling of train_fl.py; with flwr run give "
            "alpha a number (train_fl.py --profile_rounds 1 prints one)"
        )
    settings, info = prepare_run(hparams, run_opts)
    if stage == "train":
        config = FLConfig.from_hparams(hparams)
        on_result = functools.partial(
            save_final_model,
            settings=settings,
            folder=os.path.join(hparams["output_folder"], "final_model"),
            info={"method": hparams["method"], "model": str(hparams["model"])},
        )
    elif stage == "profile":  # no noise, no effective clip: the method's keys do not apply
        config = profile_config(
            FLConfig.from_hparams({**hparams, "method": "fedavg", "noise_multiplier": 0.0}),
            rounds=hparams["profile_rounds"],
            output_folder=os.path.join(hparams["output_folder"], "profile"),
        )
        on_result = None
    else:
        raise ValueError(f"stage: {stage!r} must be 'train' or 'profile'")
    return FLTask(
        build_client=functools.partial(build_client, settings=settings),
        build_server=functools.partial(build_server, settings=settings, fl_config=config),
        num_partitions=len(settings["clients"]),
        on_result=on_result,
        info={"settings": settings, "hparams": hparams, "run_opts": run_opts, **info},
    )


def save_final_model(result, *, settings, folder, info):
    """Write the final global model as a loadable checkpoint (read by transcribe.py).

    The embedded tiny seed model lives in the cache; it is copied in, so the folder stands
    alone. A real preset is recorded by name and loaded from the hub (or its cache).
    """
    brain = build_brain(settings)
    load_trainable(brain.modules, result.params)
    path = save_federated_model(
        brain.modules.model,
        folder,
        base=settings["model"]["folder"],
        options=settings["model"]["options"],
        copy_base=Path(settings["model"]["folder"]).name.startswith("seed_tiny_"),
        info={**info, "rounds": result.last_round, "epsilon": result.epsilon},
    )
    logger.info("Final model saved to %s", path)
    return path


def run_federated(spec, hparams):
    """Run the spec's rounds on Flower's Simulation Engine (Ray) and return the ServerResult."""
    if hparams["engine"] != "simulation":
        raise ValueError(
            f"engine: {hparams['engine']!r}: train_fl.py drives the Simulation Engine; for the "
            "Deployment Engine start a SuperLink and SuperNodes and use `flwr run` (README)"
        )
    return run_simulation(
        spec,
        client_resources={
            "num_cpus": hparams["num_cpus_per_client"],
            "num_gpus": hparams["num_gpus_per_client"],
        },
        ray_address=hparams["ray_address"],
    )


# ##########################################################################################
# Test evaluation and results
# ##########################################################################################
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
    signal, profiling, telemetry) comes from :func:`speechbrain_fl.fl.disclosure.privacy_disclosure`.
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
    report = dict(result.privacy)
    report["accountant"] = f"opacus-{report['accountant']}"
    return {**report, **disclosure, "alpha": config.alpha}


PAPER_SIGMA = 0.1  # the alpha-split paper's noise multiplier (Sec. II-D)


def noise_vs_update(reports, layout, *, noise_multiplier, clip, expected_cohort_size):
    """The per-round noise norm against the mean client update norm (and the component ratio).

    The Gaussian noise added once per round to the mean update has standard deviation
    ``sigma C / n`` per coordinate, so its norm is about ``sigma C / n * sqrt(d)`` over the
    ``d`` trainable values; the mean client update norm is the clients' pre-clip joint norm
    averaged over the rounds. When the noise norm is several times the update norm, every DP
    method drowns alike; of the order of 1 or below, the clipping policy decides. A run without
    noise (FedAvg) reports the noise its cohort would get at the paper's sigma = 0.1 (C = 1),
    marked in ``sigma_source``. ``norm_profile`` is :func:`speechbrain_fl.fl.profile.norm_profile`
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


def check_hparams(hparams):
    """Fail fast, before any heavy work, on values the run cannot use."""
    model = hparams["model"]
    if model not in PRESETS and not (Path(str(model)) / "speech_llm.json").is_file():
        raise ValueError(
            f"model: {model!r} is neither a preset {sorted(PRESETS)} nor a folder with "
            "speech_llm.json"
        )
    if not 0.0 <= float(hparams.get("lr_min_ratio", 0.0)) <= 1.0:
        raise ValueError(f"lr_min_ratio: {hparams['lr_min_ratio']!r} must be in [0, 1]")
    workers = hparams.get("corpus_workers")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(f"corpus_workers: {workers!r} must be a positive integer or null")
    kappa = hparams["alpha_kappa"]
    if isinstance(kappa, bool) or not isinstance(kappa, int | float) or not 0 < kappa < math.inf:
        raise ValueError(f"alpha_kappa: {kappa!r} must be a positive number")
    if hparams["alpha"] == "auto" and hparams["profile_rounds"] < 1:
        raise ValueError("alpha: auto needs profile_rounds >= 1 to measure the norms")
    # method, clip, noise and alpha: the engine config's own checks (alpha: auto is resolved
    # by the profiling, so any valid alpha stands in for it here)
    FLConfig.from_hparams({**hparams, **({"alpha": 0.5} if hparams["alpha"] == "auto" else {})})


def main(argv):
    """Prepare data and the seed model, run the federated rounds, evaluate, report."""
    start_all = time.time()
    hparams_file, sb_run_opts, overrides = sb.parse_arguments(argv)
    hparams, run_opts, base_file, merged = load_run(hparams_file, overrides, sb_run_opts)
    sb.create_experiment_directory(
        experiment_directory=hparams["output_folder"],
        hyperparams_to_save=str(base_file),
        overrides=merged,
        **({"log_config": run_opts["log_config"]} if "log_config" in run_opts else {}),
    )
    settings, info = prepare_run(hparams, run_opts)
    timings = dict(info["timings"])
    if hparams.get("prepare_only", False):
        logger.info(
            "prepare_only: corpus, manifests and seed model ready (%s); no federated run",
            ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        )
        return
    spec_overrides = {**merged, **run_opts}
    num_clients = len(settings["clients"])
    logger.info(
        "%d clients, expected cohort %.1f", num_clients, hparams["sampling_rate"] * num_clients
    )

    test_rows = read_manifest(settings["test_csv"])
    test_set = make_dataset(settings["test_csv"], settings["data_folder"])
    brain = build_brain(settings)
    start = time.time()
    test_round0, details_round0 = evaluate_test(brain, test_set, test_rows, hparams)
    timings["evaluation"] = time.time() - start
    logger.info("Round-0 (seed model) test WER %.4f", test_round0["WER"])
    hparams["train_logger"].log_stats(
        stats_meta={"round": 0, "stage": "test"}, test_stats={"WER": test_round0["WER"]}
    )

    profile = None
    alpha_from_profile = hparams["alpha"] == "auto"
    if hparams["profile_rounds"] > 0:
        start = time.time()
        spec = TaskSpec(TASK, _hparams_path(hparams_file), {**spec_overrides, "stage": "profile"})
        result = run_federated(spec, hparams)
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
            hparams["alpha"] = spec_overrides["alpha"] = profile["alpha"]
            logger.info("alpha: auto -> %.4f (from the norm profile)", hparams["alpha"])

    start = time.time()
    config = FLConfig.from_hparams(hparams)
    result = run_federated(TaskSpec(TASK, _hparams_path(hparams_file), spec_overrides), hparams)
    timings["federated"] = time.time() - start

    load_trainable(brain.modules, result.params)  # the task's on_result saved final_model/
    final_model = os.path.join(hparams["output_folder"], "final_model")
    start = time.time()
    test_report, details = evaluate_test(brain, test_set, test_rows, hparams)
    timings["evaluation"] += time.time() - start
    write_utterance_details(os.path.join(hparams["output_folder"], "test_utterances.csv"), details)
    write_utterance_details(
        os.path.join(hparams["output_folder"], "test_utterances_round0.csv"), details_round0
    )
    change = federated_change(details, details_round0, hparams)
    logger.info(
        "Test WER change over the federated stage: %+.4f [%+.4f, %+.4f] (paired speaker "
        "bootstrap, %s)",
        change["difference"],
        *change["ci95"],
        "significant" if change["significant"] else "not significant",
    )

    ratio = noise_vs_update(
        result.reports,
        component_layout(brain),
        noise_multiplier=config.noise_multiplier,
        clip=hparams["clip"],
        expected_cohort_size=hparams["sampling_rate"] * num_clients,
    )
    _log_noise_ratio(ratio)
    timings["total"] = time.time() - start_all
    results = {
        "method": hparams["method"],
        "model": str(hparams["model"]),
        "freeze_encoder": hparams["freeze_encoder"],
        "num_clients": num_clients,
        "test": test_report,
        "test_round0": {"WER": test_round0["WER"], "WER_ci95": test_round0["WER_ci95"]},
        "test_change_from_round0": change,
        "privacy": privacy_section(hparams, config, result, alpha_from_profile=alpha_from_profile),
        "data": {
            "data_folder": settings["data_folder"],
            "embedded_corpus": hparams["data_folder"] is None,
            "skipped": info["skipped"],
            "num_skipped": info["num_skipped"],
            "languages": info.get("languages"),
            "missing_languages": info.get("missing_languages", []),
        },
        "profile": profile,
        "noise_vs_update": ratio,
        "stopped_early": result.stopped_early,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    with atomic_open(os.path.join(hparams["output_folder"], "results.json")) as handle:
        json.dump(results, handle, indent=2, default=float)
    plots = write_run_plots(
        hparams["output_folder"],
        noise_multiplier=config.noise_multiplier,
        clip=hparams["clip"] or 1.0,
        alpha=hparams["alpha"] if hparams["method"] == "alpha_split" else None,
        expected_cohort_size=hparams["sampling_rate"] * num_clients,
    )
    hparams["train_logger"].log_stats(
        stats_meta={"round": result.last_round, "method": hparams["method"]},
        test_stats={"WER": test_report["WER"], "round0_WER": test_round0["WER"]},
    )
    print("\n" + format_results_table(results, style="text"))
    print(format_disclosure(results["privacy"]))
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(
        f"Results: {os.path.join(hparams['output_folder'], 'results.json')}; "
        f"{len(plots)} plots in {os.path.join(hparams['output_folder'], 'plots')}; "
        f"model: {final_model} (python recipes/MLS/transcribe.py {final_model} <wav>)"
    )
    return results


def _log_noise_ratio(ratio):
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


def _hparams_path(hparams_file):
    return str(resolve_hparams_path(hparams_file, recipe_dir=RECIPE_DIR))


if __name__ == "__main__":
    # Run main() inside the module the engine loads for TASK (not as __main__), so the server
    # builder and this script share one copy of the module and its per-process model.
    import_factory(f"{TASK.rsplit(':', 1)[0]}:main")(sys.argv[1:])
