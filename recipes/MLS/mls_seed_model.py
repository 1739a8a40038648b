"""The MLS recipe's seed model: the tiny speech-LLM's encoder and LLM pretrained apart.

The paper starts from two separately pretrained checkpoints (Whisper, TinyLlama) and a connector
initialised from scratch. The tiny stand-in does the same on the public split: the encoder is
trained as a character CTC acoustic model
(:func:`speechbrain_fl.models.pretrain.pretrain_seed_model`, every step CTC-only; the CTC head is
then discarded), the LLM as a causal LM on the public transcripts
(:func:`speechbrain_fl.models.pretrain.pretrain_text_lm`), then, unless
``pretrain_speech_steps`` is 0, every weight on the public audio through a pretraining
connector. The folder holds no connector, so
:func:`speechbrain_fl.models.presets.build_speech_llm` draws a fresh one when it loads the seed,
as it does for the hub checkpoints. Kept in the cache by
:func:`speechbrain_fl.recipe.cached_seed_model` (key, build, save); the key is the recipe's.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import speechbrain as sb

from speechbrain_fl.data import mls_synth
from speechbrain_fl.models.presets import build_speech_llm
from speechbrain_fl.models.pretrain import pretrain_seed_model, pretrain_text_lm
from speechbrain_fl.models.tiny import tiny_config_tag
from speechbrain_fl.recipe import cached_seed_model, file_digest
from speechbrain_fl.recipe.shipped_seed import shipped_seed_folder
from speechbrain_fl.recipe.shipped_seed import shipped_seed_serves as serves

logger = logging.getLogger("train_fl")  # the recipe's log name

__all__ = ["SHIPPED_SEED", "seed_model_folder", "seed_settings", "shipped_seed_serves"]

#: The tiny seed model shipped with the recipe (seed.safetensors in float16, seed.json).
SHIPPED_SEED = Path(__file__).resolve().parent / "seed"
REBUILD = "python recipes/MLS/build_seed.py"
#: Run options that change the pretrained weights, at their defaults.
_RUN_DEFAULTS = {"max_grad_norm": 1.0, "grad_accumulation_factor": 1, "precision": "fp32"}


def _pretrain_options(hparams, run_opts):
    """The run options that apply to the pretraining loops (a command-line --max_grad_norm too)."""
    return {
        "max_grad_norm": run_opts.get("max_grad_norm", hparams["pretrain_max_grad_norm"]),
        "grad_accumulation_factor": int(run_opts.get("grad_accumulation_factor", 1)),
        "precision": run_opts.get("precision", "fp32"),
    }


def seed_settings(hparams, run_opts):
    """Everything that shapes the tiny seed's weights when it is pretrained on the embedded
    corpus: the architecture's tag, the prompt, k, the pretraining keys, the public split's
    corpus options and the run options of the loops. The shipped seed serves a run exactly
    when these equal the ones in ``seed/seed.json``."""
    return {
        "model": "tiny",
        "config_tag": tiny_config_tag(),
        "data": "embedded",
        "corpus_version": mls_synth._VERSION,
        "languages": list(hparams["languages"]),
        "corpus_public_speakers_per_language": hparams["corpus_public_speakers_per_language"],
        "corpus_public_utterances_per_speaker": hparams["corpus_public_utterances_per_speaker"],
        "seed": hparams["seed"],
        "prompt": hparams["prompt"],
        "downsample_k": hparams["downsample_k"],
        **{
            key: hparams[key]
            for key in ("pretrain_ctc_steps", "pretrain_lm_steps", "pretrain_speech_steps")
        },
        "pretrain_lr": hparams["pretrain_lr"],
        "pretrain_batch_size": hparams["pretrain_batch_size"],
        **_pretrain_options(hparams, run_opts),
    }


def shipped_seed_serves(hparams, run_opts):
    """Whether the run starts from the shipped seed: model tiny on the embedded corpus,
    ``shipped_seed: True`` and the settings of ``seed/seed.json`` (one log line when not)."""
    if hparams["model"] != "tiny" or hparams["data_folder"] is not None:
        return False
    return bool(hparams["shipped_seed"]) and serves(SHIPPED_SEED, seed_settings(hparams, run_opts))


def _shipped_folder(hparams, run_opts):
    """The shipped seed, checked by sha256 and materialised in the cache."""
    return shipped_seed_folder(
        SHIPPED_SEED,
        settings=seed_settings(hparams, run_opts),
        cache_folder=hparams["cache_folder"],
        prefix="seed_tiny_shipped",
        materialise=lambda tensors, folder: _materialise(tensors, folder, hparams),
        marker="speech_llm.json",
        rebuild_hint=f", or rebuild it ({REBUILD})",
    )


def _materialise(tensors, folder, hparams):
    """Write the shipped ``encoder.*`` / ``llm.*`` tensors as a tiny checkpoint folder."""
    model = build_speech_llm(
        "tiny", cache_dir=hparams["cache_folder"], freeze_encoder=False, lora_r=0,
        downsample_k=hparams["downsample_k"], prompt=hparams["prompt"], seed=hparams["seed"],
    )  # fmt: skip
    for part in ("encoder", "llm"):
        state = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(part + ".")}
        getattr(model, part).load_state_dict(state, strict=True)
    model.save_pretrained(folder)
    (folder / "extra.safetensors").unlink()  # no connector, no CTC head in the seed


def seed_tensors(folder):
    """The ``encoder.*`` and ``llm.*`` tensors of a seed checkpoint folder (what is shipped)."""
    model = build_speech_llm(str(folder), cache_dir=str(folder), freeze_encoder=False, lora_r=0)
    return {
        **{f"encoder.{k}": v for k, v in model.encoder.state_dict().items()},
        **{f"llm.{k}": v for k, v in model.llm.state_dict().items()},
    }


def seed_model_folder(hparams, manifests, data_folder, run_opts, *, make_dataset, shipped=False):
    """The starting checkpoint: the preset itself, or the tiny model's encoder and LLM pretrained.

    The tiny preset is random; its encoder and LLM are pretrained apart on the embedded
    corpus's ``public`` split (speakers disjoint from every client, dev and test speaker) by
    :func:`_pretrain_parts` and kept in the cache by
    :func:`speechbrain_fl.recipe.cached_seed_model`, keyed by the options that shape them, so
    a second run reuses them. Real presets start from their Hugging Face checkpoints and are
    not pretrained here. The run options that apply to a training loop (device, precision,
    max_grad_norm, grad_accumulation_factor, noprogressbar) apply to the encoder's stage; a
    command-line ``--max_grad_norm`` replaces ``pretrain_max_grad_norm`` as it replaces the
    clients' ``max_grad_norm``. ``make_dataset(csv, data_folder)`` is the recipe's data
    pipeline.
    """
    if hparams["model"] != "tiny":
        return hparams["model"], {}
    if shipped:
        return _shipped_folder(hparams, run_opts), {}
    public_csv = os.path.join(manifests, "public.csv")
    if not os.path.isfile(public_csv):
        raise OSError(
            f"model: tiny needs a public split to pretrain on ({public_csv} is missing); use the "
            "embedded corpus (data_folder: null), set public_speaker_share to carve one from the "
            "training speakers of a real MLS folder, or use a real preset such as "
            "whisper_tinyllama"
        )
    options = _pretrain_options(hparams, run_opts)
    key = {
        "init": "encoder_ctc+text_lm",
        "ctc_steps": hparams["pretrain_ctc_steps"],
        "lm_steps": hparams["pretrain_lm_steps"],
        "speech_steps": hparams["pretrain_speech_steps"],
        "lr": hparams["pretrain_lr"],
        "batch_size": hparams["pretrain_batch_size"],
        "downsample_k": hparams["downsample_k"],
        "prompt": hparams["prompt"],
        "seed": hparams["seed"],
        "data": os.path.abspath(data_folder),
        # The public split's content: a corpus regenerated with other options in the same
        # folder must not reuse a seed model trained on the old one.
        "public_manifest": file_digest(public_csv),
        "languages": list(hparams["languages"]),
    }
    # Run options that change the trained weights join the key only when not at their defaults.
    for name, default in _RUN_DEFAULTS.items():
        if options[name] != default:
            key[name] = options[name]

    def build(folder):
        _pretrain_parts(
            folder,
            hparams=hparams,
            public_csv=public_csv,
            dataset=make_dataset(public_csv, data_folder),
            options=options,
            run_opts=run_opts,
        )

    return cached_seed_model(
        cache_folder=hparams["cache_folder"],
        prefix="seed_tiny",
        key=key,
        build=build,
        marker="speech_llm.json",
    )


def _pretrain_parts(folder, *, hparams, public_csv, dataset, options, run_opts):
    """Pretrain the tiny encoder (CTC) and LLM (text, then speech) and save them without connector.

    1. Encoder: the encoder and a character CTC head on the public audio for
       ``pretrain_ctc_steps`` (past CTC's blank-only phase, where every frame predicts blank).
    2. LLM: the LLM alone on the public transcripts for ``pretrain_lm_steps``, each
       ``<bos> prompt transcript </s>`` (:func:`speechbrain_fl.models.pretrain.pretrain_text_lm`).
    3. Speech (``pretrain_speech_steps`` > 0): every weight on the public audio through a
       pretraining connector, transcript cross-entropy; the LLM learns to read audio tokens,
       which a 2-layer LM trained on text alone does not learn through LoRA in the federated
       stage's budget (recipes/MLS/README.md). 0 is the paper's initialisation.

    Neither the connector nor the CTC head is saved: :func:`build_speech_llm` draws a fresh
    connector when it loads the folder, as it does for the hub checkpoints.
    """
    logger.info(
        "Pretraining the tiny seed model on the public split: encoder CTC %s steps, LLM text %s "
        "steps, speech %s steps",
        hparams["pretrain_ctc_steps"],
        hparams["pretrain_lm_steps"],
        hparams["pretrain_speech_steps"],
    )
    model = build_speech_llm(
        "tiny",
        cache_dir=hparams["cache_folder"],
        freeze_encoder=False,
        lora_r=0,
        downsample_k=hparams["downsample_k"],
        ctc_weight=1.0,
        prompt=hparams["prompt"],
        seed=hparams["seed"],
        device=run_opts.get("device") or "cpu",
    )
    batches = _Batches(
        sb.dataio.dataloader.make_dataloader(
            dataset, batch_size=hparams["pretrain_batch_size"], shuffle=True
        )
    )
    stats = {"encoder_ctc": _audio_stage(model, batches, hparams, options, run_opts, ctc=True)}
    with open(public_csv, newline="", encoding="utf-8") as handle:
        texts = [(row["wrd"], row["language"]) for row in csv.DictReader(handle)]
    steps = hparams["pretrain_lm_steps"]
    text = pretrain_text_lm(
        model,
        texts,
        steps=steps,
        lr=hparams["pretrain_lr"],
        batch_size=hparams["pretrain_batch_size"],
        warmup_steps=min(30, steps // 10),
        max_grad_norm=options["max_grad_norm"],
        seed=hparams["seed"],
    )
    stats["llm_text_loss"] = _tail_mean(text["loss"])
    if hparams["pretrain_speech_steps"] > 0:
        model.ctc_weight = 0.0  # the speech stage's loss is the transcript CE alone
        stats["speech_loss"] = _audio_stage(model, batches, hparams, options, run_opts, ctc=False)
    model.to("cpu").save_pretrained(folder)
    (folder / "extra.safetensors").unlink()  # no connector, no CTC head in the seed
    (folder / "pretraining.json").write_text(json.dumps({"final_loss": stats}, indent=2))
    hparams["train_logger"].log_stats(
        stats_meta={
            "stage": "seed pretraining",
            **{k: hparams[f"pretrain_{k}_steps"] for k in ("ctc", "lm", "speech")},
        },
        train_stats=stats,
    )
    logger.info("Seed model pretrained (%s)", ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))


def _audio_stage(model, batches, hparams, options, run_opts, *, ctc):
    """One audio stage of the seed: CTC alone (``ctc``) or transcript CE; its final loss."""
    steps = hparams["pretrain_ctc_steps" if ctc else "pretrain_speech_steps"]
    history = pretrain_seed_model(
        model,
        batches,
        steps=steps,
        lr=hparams["pretrain_lr"],
        warmup_steps=min(30, steps // 10),
        ctc_warmup_steps=steps if ctc else 0,
        max_grad_norm=options["max_grad_norm"],
        grad_accumulation_factor=options["grad_accumulation_factor"],
        precision=options["precision"],
        progressbar=not run_opts.get("noprogressbar", False),
        log_every=50,
    )
    return _tail_mean(history["ctc" if ctc else "loss"])


def _tail_mean(values, count=20):
    """Mean of the last ``count`` values (a stage's final loss)."""
    tail = list(values)[-count:]
    return sum(tail) / len(tail)


class _Batches:
    """Re-iterable ``(wavs, wav_lens, transcripts, languages)`` view of a SpeechBrain loader."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            wavs, lens = batch.sig
            yield wavs, lens, list(batch.wrd), list(batch.language)
