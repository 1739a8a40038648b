"""The MLS recipe's seed model: the tiny speech-LLM pretrained centrally on the public split.

Trained by :func:`speechbrain_fl.models.pretrain.pretrain_seed_model` and kept in the cache by
:func:`speechbrain_fl.recipe.cached_seed_model` (key, build, save); the key is the recipe's.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging
import os

import speechbrain as sb

from speechbrain_fl.models.presets import build_speech_llm
from speechbrain_fl.models.pretrain import pretrain_seed_model
from speechbrain_fl.recipe import cached_seed_model, file_digest

logger = logging.getLogger("train_fl")  # the recipe's log name

__all__ = ["seed_model_folder"]


def seed_model_folder(hparams, manifests, data_folder, run_opts, *, make_dataset):
    """The starting checkpoint: the preset itself, or the tiny model pretrained centrally.

    The tiny preset is random; it is pretrained on the embedded corpus's ``public`` split
    (speakers disjoint from every client, dev and test) with
    :func:`speechbrain_fl.models.pretrain.pretrain_seed_model` and kept in the cache by
    :func:`speechbrain_fl.recipe.cached_seed_model`, keyed by the options that shape it, so a
    second run reuses it. Real presets start from their Hugging Face checkpoints and are not
    pretrained here. The run options that apply to a training loop (device, precision,
    max_grad_norm, grad_accumulation_factor, noprogressbar) apply here too; a command-line
    ``--max_grad_norm`` replaces ``pretrain_max_grad_norm`` as it replaces the clients'
    ``max_grad_norm``. ``make_dataset(csv, data_folder)`` is the recipe's data pipeline.
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
        "public_manifest": file_digest(public_csv),
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

    def build(folder):
        logger.info("Pretraining the tiny seed model on the public split (%s steps)", key["steps"])
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
        loader = sb.dataio.dataloader.make_dataloader(
            make_dataset(public_csv, data_folder),
            batch_size=hparams["pretrain_batch_size"],
            shuffle=True,
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
        model.to("cpu").save_pretrained(folder)
        tail = history["loss"][-20:]
        hparams["train_logger"].log_stats(
            stats_meta={"stage": "seed pretraining", "steps": key["steps"]},
            train_stats={"loss": sum(tail) / len(tail)},
        )
        logger.info("Seed model pretrained (final loss %.3f)", sum(tail) / len(tail))

    return cached_seed_model(
        cache_folder=hparams["cache_folder"],
        prefix="seed_tiny",
        key=key,
        build=build,
        marker="speech_llm.json",
    )


class _Batches:
    """Re-iterable ``(wavs, wav_lens, transcripts, languages)`` view of a SpeechBrain loader."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            wavs, lens = batch.sig
            yield wavs, lens, list(batch.wrd), list(batch.language)
