#!/usr/bin/env python3
"""Recipe: federated speech-LLM ASR on Multilingual LibriSpeech with component-aware DP.

A speech-LLM (Whisper-style encoder + connector + causal LLM with LoRA) is fine-tuned across
speaker-partitioned clients with Flower (Simulation Engine, Ray backend). The privacy method is
the hparams file: FedAvg (no DP), Flat, PFL-Uniform, PFL-Dim, PFL-Dim+EMA, PFL-Unif+EMA or
alpha-split (Luque, Lopez, Sant: "Component-Aware Differential Privacy for Federated Multilingual
Speech-LLMs"). Each client clips its own update delta to the round's per-group budgets; the
server re-clips, averages, adds N(0, (sigma C / n)^2) once and accounts the round with Opacus's
RDP accountant.

Without ``data_folder`` the recipe generates a small multilingual corpus with espeak-ng in the
real MLS layout (8 languages), pretrains a tiny seed model on its public split, and runs the
federated stage on CPU.

To run this recipe (from the repository root or from recipes/MLS/):

    > python recipes/MLS/train_fl.py hparams/alpha_split.yaml
    > python recipes/MLS/train_fl.py hparams/flat.yaml --freeze_encoder True
    > python recipes/MLS/train_fl.py hparams/pfl_dim_ema.yaml --data_folder /data/mls \\
          --model whisper_tinyllama --device cuda --precision bf16

Outputs (``output_folder``): train_log.txt, hyperparams.yaml, results.json, rounds.csv,
group_norms.csv, test_utterances.csv, plots/*.png, and the server state for resuming.

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

import numpy as np
import speechbrain as sb
import torch

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))

from mls_prepare import prepare_mls  # noqa: E402

from speechbrain_fl.atomic import atomic_folder, atomic_open  # noqa: E402
from speechbrain_fl.recipe import load_layered_hparams  # noqa: E402

logger = logging.getLogger(__name__)


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
        """Cosine decay of the peak ``lr`` over the federated rounds (paper Sec. II-D)."""
        rnd = getattr(self, "fl_round", 1)
        total = max(1, getattr(self, "fl_num_rounds", 1))
        return self.hparams.lr * 0.5 * (1.0 + math.cos(math.pi * (rnd - 1) / total))

    def on_stage_start(self, stage, epoch=None):
        """A fresh WER accumulator for each evaluation stage."""
        if stage != sb.Stage.TRAIN:
            self.wer_metric = sb.utils.metric_stats.ErrorRateStats()

    def on_stage_end(self, stage, stage_loss, epoch=None):
        """Store the stage statistics (read by the engine and by ``evaluate_wer``)."""
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


def prepare_data(hparams):
    """Corpus (embedded if ``data_folder`` is null), manifests and the client partition."""
    from speechbrain_fl.data.partition import partition_manifest

    timings = {}
    data_folder = hparams["data_folder"]
    embedded = data_folder is None
    if embedded:
        from speechbrain_fl.data.mls_synth import generate_mls_corpus

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
            seed=hparams["seed"],
        )
        logger.info(
            "Embedded corpus %s (%.1f s)",
            "reused from cache" if report["cached"] else "generated",
            report["seconds"],
        )
        timings["corpus"] = time.time() - start
    start = time.time()
    splits = ("train", "dev", "test", "public") if embedded else ("train", "dev", "test")
    manifests = os.path.join(hparams["save_folder"], "manifests")
    report = prepare_mls(
        data_folder,
        manifests,
        languages=hparams["languages"],
        splits=splits,
        skip_prep=hparams["skip_prep"],
        max_utts_per_split=hparams["max_utts_per_split"],
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
    }


def seed_model_folder(hparams, manifests, data_folder):
    """The starting checkpoint: the preset itself, or the tiny model pretrained centrally.

    The tiny preset is random; it is pretrained on the embedded corpus's ``public`` split
    (speakers disjoint from every client, dev and test) and saved with ``save_pretrained`` into
    the cache, keyed by the options that shape it, so a second run reuses it. Real presets start
    from their Hugging Face checkpoints and are not pretrained here.
    """
    from speechbrain_fl.models.presets import build_speech_llm
    from speechbrain_fl.models.pretrain import pretrain_seed_model

    if hparams["model"] != "tiny":
        return hparams["model"], {}
    public_csv = os.path.join(manifests, "public.csv")
    if not os.path.isfile(public_csv):
        raise OSError(
            f"model: tiny needs a public split to pretrain on ({public_csv} is missing); use the "
            "embedded corpus (data_folder: null) or a real preset such as whisper_tinyllama"
        )
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
    )
    dataset = make_dataset(public_csv, data_folder)
    loader = sb.dataio.dataloader.make_dataloader(
        dataset, batch_size=hparams["pretrain_batch_size"], shuffle=True
    )
    batches = _Batches(loader)
    history = pretrain_seed_model(
        model,
        batches,
        steps=hparams["pretrain_steps"],
        lr=hparams["pretrain_lr"],
        warmup_steps=min(30, hparams["pretrain_steps"] // 10),
        ctc_warmup_steps=hparams["pretrain_ctc_steps"] if hparams["ctc_weight"] > 0 else 0,
        log_every=50,
    )
    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp)
    seconds = time.time() - start
    tail = history["loss"][-20:]
    logger.info(
        "Seed model saved to %s (%.1f s, final loss %.3f)", folder, seconds, sum(tail) / len(tail)
    )
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
    from speechbrain_fl.models.presets import build_speech_llm

    key = json.dumps(settings["model"], sort_keys=True)
    if key not in _WORKER_MODELS:
        torch.manual_seed(settings["hparams"]["seed"])
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = build_speech_llm(
            settings["model"]["folder"],
            cache_dir=settings["model"]["cache_dir"],
            seed=settings["hparams"]["seed"],
            device=settings["run_opts"].get("device", "cpu"),
            **settings["model"]["options"],
        )
    return SpeechLLMBrain(
        modules={"model": _WORKER_MODELS[key]},
        hparams=settings["hparams"],
        run_opts=dict(settings["run_opts"]),
        checkpointer=checkpointer,
    )


# ##########################################################################################
# Federated task (Flower ClientApp / ServerApp builders)
# ##########################################################################################
def build_client(context, *, settings):
    """ClientApp builder: this partition's Brain and training set."""
    from speechbrain_fl.fl.client import ClientTask

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
    from speechbrain_fl.fl.server import ServerTask

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
        num_partitions=len(settings["clients"]),
    )


def component_layout(brain):
    """Trainable groups labelled encoder / connector / llm by the model's name patterns."""
    from speechbrain_fl.privacy import layout_from_model

    patterns = brain.modules.model.component_patterns()
    components = {label: [f"model.{p}" for p in pats] for label, pats in patterns.items()}
    return layout_from_model(brain.modules, components=components)


def fl_config(hparams, *, output_folder=None, **changes):
    """The engine's FLConfig from the recipe's hparams (``changes`` override single fields)."""
    from speechbrain_fl.fl.config import FLConfig

    private = hparams["method"] != "fedavg"
    values = {
        "output_folder": output_folder or hparams["output_folder"],
        "num_rounds": hparams["number_of_rounds"],
        "sampling_rate": hparams["sampling_rate"],
        "min_clients": hparams["min_clients"],
        "local_epochs": hparams["local_epochs"],
        "noise_multiplier": hparams["noise_multiplier"] if private else 0.0,
        "clip": hparams["clip"] if private else None,
        "clip_method": hparams["method"] if private else "flat",
        "alpha": hparams["alpha"] if hparams["method"] == "alpha_split" else None,
        "ema_beta": hparams["ema_beta"],
        "ema_gamma": hparams["ema_gamma"],
        "ema_warmup_rounds": hparams["ema_warmup_rounds"],
        "ema_signal": hparams["ema_signal"],
        "delta": hparams["delta"],
        "max_epsilon": hparams["max_epsilon"],
        "aggregation": "uniform" if private else "weighted",
        "eval_every": hparams["eval_every"],
        "round_timeout": hparams["round_timeout"],
        "max_retries": hparams["max_retries"],
        "seed": hparams["seed"],
    }
    values.update(changes)
    return FLConfig(**values)


def run_federated(settings, config, hparams, num_clients):
    """Run the rounds on Flower's Simulation Engine (Ray) and return the ServerResult."""
    from speechbrain_fl.fl.engine import run_simulation
    from speechbrain_fl.fl.task import FLTask

    if hparams["engine"] != "simulation":
        raise ValueError(
            f"engine: {hparams['engine']!r}: train_fl.py drives the Simulation Engine; for the "
            "Deployment Engine start a SuperLink and SuperNodes and use `flwr run` (README)"
        )
    task = FLTask(
        build_client=functools.partial(build_client, settings=settings),
        build_server=functools.partial(build_server, settings=settings, fl_config=config),
        num_partitions=num_clients,
    )
    return run_simulation(
        task,
        num_supernodes=num_clients,
        client_resources={
            "num_cpus": hparams["num_cpus_per_client"],
            "num_gpus": hparams["num_gpus_per_client"],
        },
        ray_address=hparams["ray_address"],
    )


# ##########################################################################################
# Norm profiling (paper Sec. III-A, VI)
# ##########################################################################################
PROFILE_CAVEAT = (
    "Privacy caveat: these norms come from non-DP rounds on the training clients; they are "
    "outside the DP guarantee. For a privacy-compatible choice, profile on public or proxy data "
    "(the paper's Sec. IV-A3) or count the profiling rounds in the privacy budget."
)


def profile_norms(settings, hparams, num_clients):
    """Non-DP rounds measuring per-component update norms; recommends a method and alpha.

    The profiling rounds clip with a budget no update reaches (C = 1e6, sigma = 0), so the
    engine records the pre-clip norms without changing any update.
    """
    from speechbrain_fl.privacy import select_alpha
    from speechbrain_fl.run_outputs import read_table

    folder = os.path.join(hparams["output_folder"], "profile")
    config = fl_config(
        hparams,
        output_folder=folder,
        num_rounds=hparams["profile_rounds"],
        noise_multiplier=0.0,
        clip=1e6,
        clip_method="pfl_dim",
        alpha=None,
        aggregation="weighted",
        eval_every=0,
        max_epsilon=None,
    )
    run_federated(settings, config, hparams, num_clients)
    groups = read_table(
        os.path.join(folder, "group_norms.csv"), text_columns=("group", "component")
    )
    last = groups["round"] == groups["round"].max()
    per_matrix = {}
    for label in ("encoder", "llm", "connector"):
        sel = last & (groups["component"] == label)
        if sel.any():
            per_matrix[label] = float(groups["mean_norm"][sel].mean())
    rounds = read_table(os.path.join(folder, "rounds.csv"))
    component = {
        label: float(rounds[f"norm_{label}"][-1])
        for label in ("encoder", "llm", "connector")
        if f"norm_{label}" in rounds
    }
    profile = {"per_matrix_mean_norm": per_matrix, "component_norm": component}
    if per_matrix.get("encoder", 0.0) > 0:
        ratio = per_matrix.get("llm", 0.0) / per_matrix["encoder"]
        profile["llm_encoder_ratio"] = ratio
        # alpha for an alpha-split run: encoder pool budget ~ kappa x observed encoder norm
        profile["alpha"] = select_alpha(component, clip=hparams["clip"] or 1.0)
        # The paper's regimes (Sec. V-B, VI): a pool split pays off for a large LLM/encoder
        # per-matrix norm ratio (~12x); adaptive single-pool EMA suffices for mild ones (~1.7x).
        method = "alpha_split" if ratio >= 5.0 else "pfl_dim_ema"
        profile["recommendation"] = {"method": method, "alpha": profile["alpha"]}
    else:
        profile["alpha"] = None
        profile["recommendation"] = {"method": "pfl_dim_ema", "alpha": None}
        profile["note"] = "encoder frozen: no encoder norms; a pool split has nothing to protect"
    profile["caveat"] = PROFILE_CAVEAT
    with open(os.path.join(folder, "profile.json"), "w", encoding="utf-8") as handle:
        json.dump(profile, handle, indent=2)
    logger.info("Norm profile: %s", json.dumps(profile))
    print(f"\nNorm profile ({hparams['profile_rounds']} non-DP rounds):")
    for label, value in per_matrix.items():
        print(f"  mean per-matrix update norm, {label:9s}: {value:.4g}")
    if "llm_encoder_ratio" in profile:
        print(f"  LLM/encoder per-matrix norm ratio: {profile['llm_encoder_ratio']:.2f}x")
    rec = profile["recommendation"]
    print(f"  recommended method: {rec['method']}")
    if profile["alpha"] is not None:
        print(f"  alpha for alpha-split (encoder pool ~ 2x its norm): {profile['alpha']:.4f}")
    print(f"  {PROFILE_CAVEAT}\n")
    return profile


# ##########################################################################################
# Test evaluation and results
# ##########################################################################################
def evaluate_test(brain, test_set, test_rows, hparams):
    """WER on the test split with speaker-level bootstrap CIs, overall and per language."""
    from speechbrain_fl.metrics import utterance_errors_from_stats, wer_report

    brain.evaluate(
        test_set,
        progressbar=True,
        test_loader_kwargs=dict(hparams["eval_dataloader_options"]),
    )
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
    from speechbrain_fl.metrics import paired_bootstrap_details

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


def privacy_section(hparams, result, *, alpha_from_profile=False):
    """Epsilon (Opacus RDP), effective noise and epsilon per pool of the finished run.

    The joint epsilon comes from the engine's accountant. Per pool (encoder; LLM + connector),
    the effective noise multiplier is sigma * C / (pool budget) (DESIGN.md contract 2) and the
    pool epsilon is the one the same mechanism gives at that sigma. For the EMA methods the
    budgets move between rounds, so the *largest* budget a pool had in any round (its smallest
    sigma_eff) is reported, a conservative figure.
    """
    from speechbrain_fl.privacy import compute_epsilon
    from speechbrain_fl.run_outputs import read_table

    section = {
        "epsilon": result.epsilon,
        "delta": hparams["delta"],
        "accountant": "opacus-rdp",
        "noise_multiplier": hparams["noise_multiplier"],
        "clip": hparams["clip"],
        "alpha": hparams["alpha"],
        "sampling_rate": hparams["sampling_rate"],
        "rounds": result.last_round,
        "sigma_eff": {},
        "epsilon_per_component": {},
    }
    from speechbrain_fl.fl.disclosure import privacy_disclosure

    section.update(
        privacy_disclosure(
            fl_config(hparams),
            profile_rounds=hparams["profile_rounds"],
            alpha_from_profile=alpha_from_profile,
        )
    )
    if hparams["method"] == "fedavg":
        section.update(epsilon=None, delta=None, accountant=None, noise_multiplier=0.0, clip=None)
        return section
    rounds = read_table(os.path.join(hparams["output_folder"], "rounds.csv"))
    trained = rounds["round"] > 0
    sigma, clip = hparams["noise_multiplier"], hparams["clip"]
    if hparams["method"] == "flat":  # one pool: every component sees sigma
        for column in sorted(rounds):
            if column.startswith("norm_"):
                section["sigma_eff"][column[len("norm_") :]] = sigma
                section["epsilon_per_component"][column[len("norm_") :]] = result.epsilon
        return section
    budgets = {
        column[len("budget_") :]: np.nan_to_num(rounds[column][trained], nan=0.0)
        for column in rounds
        if column.startswith("budget_")
    }
    # Pools as in the paper: the encoder, and the LLM together with the connector (Sec. IV-A1);
    # any other label is reported on its own.
    pools = {"encoder": ["encoder"], "llm": ["llm", "connector"]}
    pools.update(
        {label: [label] for label in budgets if label not in ("encoder", "llm", "connector")}
    )
    for pool, labels in pools.items():
        present = [budgets[label] for label in labels if label in budgets]
        if not present:
            continue
        pool_budget = float(np.sqrt(sum(b**2 for b in present)).max())
        if pool_budget <= 0:
            continue
        sigma_eff = sigma * clip / pool_budget
        section["sigma_eff"][pool] = sigma_eff
        section["epsilon_per_component"][pool] = compute_epsilon(
            sampling_rate=hparams["sampling_rate"],
            noise_multiplier=sigma_eff,
            rounds=max(1, result.last_round),
            delta=hparams["delta"],
        )
    return section


def check_hparams(hparams):
    """Fail fast, before any heavy work, on values the run cannot use."""
    from speechbrain_fl.models.presets import PRESETS
    from speechbrain_fl.privacy import METHODS

    methods = ("fedavg", *METHODS)
    if hparams["method"] not in methods:
        raise ValueError(f"method: {hparams['method']!r} is not one of {list(methods)}")
    model = hparams["model"]
    if model not in PRESETS and not (Path(str(model)) / "speech_llm.json").is_file():
        raise ValueError(
            f"model: {model!r} is neither a preset {sorted(PRESETS)} nor a folder with "
            "speech_llm.json"
        )
    alpha = hparams["alpha"]
    if hparams["method"] == "alpha_split":
        if alpha == "auto":
            if hparams["profile_rounds"] < 1:
                raise ValueError("alpha: auto needs profile_rounds >= 1 to measure the norms")
        elif alpha is None or not 0.0 < float(alpha) < 1.0:
            raise ValueError(f"alpha: {alpha!r} must be in (0, 1) or 'auto' for alpha_split")
    if hparams["method"] != "fedavg" and (hparams["clip"] is None or hparams["clip"] <= 0):
        raise ValueError(f"clip: {hparams['clip']!r} must be > 0 for method {hparams['method']}")


BRAIN_KEYS = (
    "seed",
    "lr",
    "weight_decay",
    "encoder_lr_multiplier",
    "max_new_tokens",
    "num_beams",
    "dataloader_options",
    "eval_dataloader_options",
)


def main(argv):
    """Prepare data and the seed model, run the federated rounds, evaluate, report."""
    timings = {}
    start_all = time.time()
    hparams_file, run_opts, overrides = sb.parse_arguments(argv)
    hparams, base_file, merged = load_layered_hparams(
        hparams_file, overrides, recipe_dir=RECIPE_DIR
    )
    check_hparams(hparams)
    sb.create_experiment_directory(
        experiment_directory=hparams["output_folder"],
        hyperparams_to_save=str(base_file),
        overrides=merged,
    )
    debug = bool(run_opts.get("debug"))
    if debug:  # --debug: 2 rounds, 2 local epochs of 2 batches (SpeechBrain's debug mode)
        hparams["number_of_rounds"] = min(2, hparams["number_of_rounds"])
        hparams["pretrain_steps"] = min(4, hparams["pretrain_steps"])
        hparams["pretrain_ctc_steps"] = min(2, hparams["pretrain_ctc_steps"])
        hparams["profile_rounds"] = min(1, hparams["profile_rounds"])
        # the EMA methods must leave their warm-up within the 2 debug rounds
        hparams["ema_warmup_rounds"] = min(1, hparams["ema_warmup_rounds"])
        hparams["bootstrap_resamples"] = min(200, hparams["bootstrap_resamples"])

    data_folder, manifests, prep_report, partition, t = prepare_data(hparams)
    timings.update(t)
    start = time.time()
    seed_folder, pretrain_info = seed_model_folder(hparams, manifests, data_folder)
    timings.update({k: v for k, v in pretrain_info.items() if k == "pretraining"})
    clients = [partition["clients"][name]["manifest"] for name in sorted(partition["clients"])]
    clients = [
        c if os.path.isabs(c) else os.path.join(hparams["save_folder"], "partition", c)
        for c in clients
    ]
    settings = {
        "hparams": {k: hparams[k] for k in BRAIN_KEYS},
        "run_opts": {
            **{
                k: v
                for k, v in run_opts.items()
                if k in ("device", "precision", "debug", "debug_batches", "debug_epochs")
            },
            "max_grad_norm": hparams["max_grad_norm"],
        },
        "data_folder": data_folder,
        "clients": clients,
        "valid_csv": os.path.join(manifests, "dev.csv"),
        "cpus_per_client": hparams["num_cpus_per_client"],
        "model": {
            "folder": seed_folder,
            "cache_dir": hparams["cache_folder"],
            "options": model_options(hparams),
        },
    }
    num_clients = len(clients)
    logger.info(
        "%d clients, expected cohort %.1f", num_clients, hparams["sampling_rate"] * num_clients
    )

    from speechbrain_fl.data.partition import read_manifest
    from speechbrain_fl.metrics import write_utterance_details

    test_rows = read_manifest(os.path.join(manifests, "test.csv"))
    test_set = make_dataset(os.path.join(manifests, "test.csv"), data_folder)
    brain = build_brain(settings)
    start = time.time()
    test_round0, details_round0 = evaluate_test(brain, test_set, test_rows, hparams)
    timings["evaluation"] = time.time() - start
    logger.info("Round-0 (seed model) test WER %.4f", test_round0["WER"])

    profile = None
    alpha_from_profile = hparams["alpha"] == "auto"
    if hparams["profile_rounds"] > 0:
        start = time.time()
        profile = profile_norms(settings, hparams, num_clients)
        timings["profiling"] = time.time() - start
        if hparams["alpha"] == "auto":
            if profile["alpha"] is None:
                raise ValueError(
                    "alpha: auto needs encoder update norms, but the encoder is frozen; "
                    "set alpha explicitly or use --freeze_encoder False"
                )
            hparams["alpha"] = profile["alpha"]
            logger.info("alpha: auto -> %.4f (from the norm profile)", hparams["alpha"])

    start = time.time()
    result = run_federated(settings, fl_config(hparams), hparams, num_clients)
    timings["federated"] = time.time() - start

    from speechbrain_fl.fl.server import _load_into

    _load_into(brain, result.params)
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

    from speechbrain_fl.plots import write_run_plots
    from speechbrain_fl.run_outputs import format_results_table

    timings["total"] = time.time() - start_all
    results = {
        "method": hparams["method"],
        "model": str(hparams["model"]),
        "freeze_encoder": hparams["freeze_encoder"],
        "num_clients": num_clients,
        "test": test_report,
        "test_round0": {"WER": test_round0["WER"], "WER_ci95": test_round0["WER_ci95"]},
        "test_change_from_round0": change,
        "privacy": privacy_section(hparams, result, alpha_from_profile=alpha_from_profile),
        "data": {
            "data_folder": data_folder,
            "embedded_corpus": hparams["data_folder"] is None,
            "skipped": prep_report.get("skipped", {}),
            "num_skipped": prep_report.get("num_skipped", {}),
        },
        "profile": profile,
        "stopped_early": result.stopped_early,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    _write_json_atomic(os.path.join(hparams["output_folder"], "results.json"), results)
    plots = write_run_plots(
        hparams["output_folder"],
        noise_multiplier=hparams["noise_multiplier"],
        clip=hparams["clip"] or 1.0,
        alpha=hparams["alpha"] if hparams["method"] == "alpha_split" else None,
        expected_cohort_size=hparams["sampling_rate"] * num_clients,
    )
    hparams["train_logger"].log_stats(
        stats_meta={"round": result.last_round, "method": hparams["method"]},
        test_stats={"WER": test_report["WER"], "round0_WER": test_round0["WER"]},
    )
    print("\n" + format_results_table(results, style="text"))
    from speechbrain_fl.fl.disclosure import format_disclosure

    print(format_disclosure(results["privacy"]))
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(
        f"Results: {os.path.join(hparams['output_folder'], 'results.json')}; "
        f"{len(plots)} plots in {os.path.join(hparams['output_folder'], 'plots')}"
    )
    return results


def _write_json_atomic(path, content):
    with atomic_open(path) as handle:
        json.dump(content, handle, indent=2, default=float)


if __name__ == "__main__":
    main(sys.argv[1:])
