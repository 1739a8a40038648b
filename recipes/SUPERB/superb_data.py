"""The SUPERB tasks of the recipe: corpus, head, metric, partition; preparation; the seed model.

:data:`TASKS` fixes what each task is (our table; the paper names the tasks and corpora, the
rest is ours): the corpus and its prepare script, the head (``utterance`` or ``ctc``), the
client partition (speaker for KWS, ER, ASR; IID for SID, as the paper says) and the bootstrap
unit of the 95% CI (speakers where the test set has many; utterances for SID, whose classes are
the speakers, and ER, whose held-out session has two). :func:`prepare_task` generates the
embedded corpus when ``data_folder`` is null, writes the manifests, partitions the training
split into clients and prepares the public split the tiny seed model is pretrained on.
:func:`make_dataset` is the recipe's data pipeline (audio, labels or CTC characters).
:func:`seed_model_folder` gives the backbone a run starts from: a real preset, or the tiny model,
random or pretrained centrally on the public split (``pretrain_objective``), built once per
options by :func:`speechbrain_fl.recipe.cached_seed_model` and trained by
:func:`speechbrain_fl.models.pretrain.train_steps`.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import functools
import logging
import os

import numpy as np
import speechbrain as sb
import torch

from speechbrain_fl.data.audio_check import guarded_read
from speechbrain_fl.models.multi_exit_phone_seed import phone_seed_folder, phone_seed_settings
from speechbrain_fl.recipe import cache_tag, cached_seed_model, file_digest

logger = logging.getLogger(__name__)

CTC_ALPHABET = " 'abcdefghijklmnopqrstuvwxyz"  # id 0 is the CTC blank
#: The phone seed shipped with the recipe (seed.safetensors in float16, seed.json)
SHIPPED_SEED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seed")
REBUILD = ", or rebuild it (python recipes/SUPERB/studies/phone_seed.py --out OUT --ship recipes/SUPERB/seed)"

TASKS = {
    "kws12": {
        "corpus": "speech_commands",
        "version": 1,
        "head": "utterance",
        "partition": "speaker",
        "bootstrap_unit": "speaker",
        "seconds": 1.0,
    },
    "kws35": {
        "corpus": "speech_commands",
        "version": 2,
        "head": "utterance",
        "partition": "speaker",
        "bootstrap_unit": "speaker",
        "seconds": 1.0,
    },
    "sid": {
        "corpus": "voxceleb1",
        "head": "utterance",
        "partition": "iid",
        "bootstrap_unit": "utterance",
        "seconds": 3.0,
    },
    "asv": {
        "corpus": "voxceleb1",
        "head": "utterance",
        "partition": "iid",
        "bootstrap_unit": "utterance",
        "seconds": 3.0,
    },
    "er": {
        "corpus": "iemocap",
        "head": "utterance",
        "partition": "speaker",
        "bootstrap_unit": "utterance",
        "seconds": 3.0,
    },
    "asr": {
        "corpus": "librispeech",
        "head": "ctc",
        "partition": "speaker",
        "bootstrap_unit": "speaker",
        "seconds": 3.0,
    },
}


#: ``--debug``'s corpus sizes per task: a few generated clips, seconds to run
DEBUG_CORPUS_OPTIONS = {
    "asr": {
        "splits": {"train-clean-100": 4, "dev-clean": 1, "test-clean": 1},
        "utterances_per_speaker": 3,
    },
    "asv": {
        "iden_speakers": 4,
        "veri_speakers": 2,
        "videos_per_speaker": 2,
        "utterances_per_video": 3,
        "trials_per_speaker": 2,
    },
    "sid": {
        "iden_speakers": 4,
        "veri_speakers": 2,
        "videos_per_speaker": 2,
        "utterances_per_video": 3,
    },
    "er": {"sessions": 5, "utterances_per_emotion": 1},
    "kws12": {
        "train_speakers": 4,
        "valid_speakers": 1,
        "test_speakers": 2,
        "repeats": 1,
        "unknown_words_per_speaker": 2,
        "noise_seconds": 3,
    },
    "kws35": {
        "train_speakers": 2,
        "valid_speakers": 1,
        "test_speakers": 1,
        "repeats": 1,
        "noise_seconds": 3,
    },
}


def debug_corpus_options(hparams):
    """The task's ``--debug`` ``corpus_options`` (:data:`DEBUG_CORPUS_OPTIONS`; {} if none)."""
    return DEBUG_CORPUS_OPTIONS.get(hparams["task"], {})


def check_task(task):
    """Raise naming the known tasks if ``task`` is not one."""
    if task not in TASKS:
        raise ValueError(f"task: {task!r} must be one of {sorted(TASKS)}")
    return TASKS[task]


def _keyed_folder(hparams, name, options):
    """``<cache_folder>/<name>_<tag>``, the tag a digest of the seed and the generator's options.

    Corpora of other seeds or sizes get folders of their own, so runs that differ in them can
    share one ``cache_folder`` (side by side too) without one rebuilding the corpus another
    is reading.
    """
    tag = cache_tag({"seed": int(hparams["seed"]), **dict(options)})
    return os.path.join(hparams["cache_folder"], f"{name}_{tag}")


def _generate(hparams, spec):
    """Generate (cached) the embedded corpus of the task; return its folder."""
    from speechbrain_fl.data import superb_synth, superb_synth_speakers

    options = dict(hparams["corpus_options"] or {})
    name = spec["corpus"] if spec["corpus"] != "speech_commands" else f"sc_v{spec['version']}"
    folder = _keyed_folder(hparams, f"{name}_synth", options)
    if spec["corpus"] == "speech_commands":
        superb_synth.generate_speech_commands(
            folder, version=spec["version"], seed=hparams["seed"], **options
        )
    elif spec["corpus"] == "voxceleb1":
        superb_synth_speakers.generate_voxceleb1(folder, seed=hparams["seed"], **options)
    elif spec["corpus"] == "iemocap":
        superb_synth_speakers.generate_iemocap(folder, seed=hparams["seed"], **options)
    else:
        superb_synth.generate_librispeech(folder, seed=hparams["seed"], **options)
    return folder


def _manifests(hparams, spec, data_folder, save):
    """Run the task's prepare script; return (train, valid, test csv, labels)."""
    skip_prep = hparams["skip_prep"]
    if spec["corpus"] == "speech_commands":
        from speech_commands_prepare import prepare_speech_commands

        report = prepare_speech_commands(
            data_folder,
            save,
            task=hparams["task"],
            silence_fraction=hparams["silence_fraction"],
            seed=hparams["seed"],
            skip_prep=skip_prep,
        )
        names = ("train", "valid", "test")
    elif spec["corpus"] == "voxceleb1":
        from voxceleb_prepare import prepare_voxceleb1

        report = prepare_voxceleb1(
            data_folder,
            save,
            exclude_verification_speakers=hparams["task"] == "asv"
            or hparams["exclude_verification_speakers"],
            skip_prep=skip_prep,
        )
        names = ("train", "valid", "test")
    elif spec["corpus"] == "iemocap":
        from iemocap_prepare import prepare_iemocap

        report = prepare_iemocap(
            data_folder,
            save,
            test_session=hparams["test_session"],
            seed=hparams["seed"],
            skip_prep=skip_prep,
        )
        names = ("train", "valid", "test")
    else:
        from librispeech_prepare import prepare_librispeech

        report = prepare_librispeech(data_folder, save, skip_prep=skip_prep)
        names = ("train-clean-100", "dev-clean", "test-clean")
        report.setdefault("labels", None)
    labels = report.get("labels")
    if labels is None and spec["head"] != "ctc":
        with open(os.path.join(save, "labels.txt"), encoding="utf-8") as handle:
            labels = handle.read().split()
    return [os.path.join(save, f"{n}.csv") for n in names], labels, report


def prepare_task(hparams):
    """Corpus (embedded if ``data_folder`` is null), manifests, client partition, public split.

    Returns
    -------
    dict
        ``data_folder``, ``clients`` (one CSV per client, partition order), ``valid``, ``test``,
        ``labels`` (None for ASR), ``public`` (csv, data folder) and ``extra`` (prepare report).
    """
    from speechbrain_fl.data.partition import partition_manifest
    from speechbrain_fl.data.superb_synth import generate_librispeech

    spec = check_task(hparams["task"])
    data_folder = hparams["data_folder"]
    if data_folder is None:
        data_folder = _generate(hparams, spec)
        logger.info("No data_folder given: embedded %s corpus in %s", spec["corpus"], data_folder)
    save = os.path.join(hparams["save_folder"], "manifests")
    (train, valid, test), labels, report = _manifests(hparams, spec, data_folder, save)
    partition = partition_manifest(
        train,
        os.path.join(hparams["save_folder"], "partition"),
        method=spec["partition"],
        num_clients=hparams["num_clients"],
        seed=hparams["seed"],
    )
    clients = []
    for name in sorted(partition["clients"]):
        path = partition["clients"][name]["manifest"]
        if not os.path.isabs(path):
            path = os.path.join(hparams["save_folder"], "partition", path)
        clients.append(path)
    public = None
    if hparams["model"] == "tiny" and hparams["pretrain_objective"] in ("bag_of_words", "ctc"):
        from librispeech_prepare import prepare_librispeech

        public_options = dict(hparams["public_corpus_options"])
        public_folder = _keyed_folder(hparams, "public_librispeech_synth", public_options)
        generate_librispeech(public_folder, seed=hparams["seed"], **public_options)
        public_save = f"{public_folder}_manifests"
        prepare_librispeech(public_folder, public_save, splits=("public",))
        public = (os.path.join(public_save, "public.csv"), public_folder)
    return {
        "data_folder": data_folder,
        "clients": clients,
        "valid": valid,
        "test": test,
        "labels": labels,
        "public": public,
        "extra": {k: v for k, v in report.items() if k not in ("labels",)}
        | _unreadable(save, data_folder),
    }


def _unreadable(save, data_folder):
    """``{"unreadable_audio": {file: error}}`` of the preparation in ``save`` (files under
    ``data_folder``, left out of the manifests), or ``{}`` when every file was readable."""
    from prepare_common import unreadable_audio

    listed = unreadable_audio(save)
    if not listed:
        return {}
    return {"unreadable_audio": {os.path.join(data_folder, f): why for f, why in listed.items()}}


# ------------------------------------------------------------------------------ data pipeline
def decode_chars(ids):
    """CTC ids (blank-free) to text."""
    return "".join(CTC_ALPHABET[i - 1] for i in ids if 0 < i <= len(CTC_ALPHABET))


def encode_chars(text):
    """Text to CTC ids (characters outside the alphabet dropped)."""
    return [CTC_ALPHABET.index(c) + 1 for c in text.lower() if c in CTC_ALPHABET]


def _guarded(read, source):
    """``read(source)``, or an ``Unreadable`` marker naming the file when it raises."""
    path = source["file"] if isinstance(source, dict) else source
    return guarded_read(read, path, source)


def make_dataset(csv_path, data_folder, *, labels=None, ctc=False, skip_unreadable=False):
    """A DynamicItemDataset: ``sig`` (16 kHz), ``spk_id`` and ``label_id`` or ``tokens``.

    ``skip_unreadable``: a file that fails to decode yields an ``Unreadable`` marker (one log
    line) that the client's collate function drops (a client's training set), instead of
    raising (evaluation, where every utterance counts).
    """
    read = sb.dataio.dataio.read_audio
    if skip_unreadable:
        read = functools.partial(_guarded, read)
    dataset = sb.dataio.dataset.DynamicItemDataset.from_csv(
        csv_path=csv_path, replacements={"data_root": data_folder}
    )
    has_crop = "start" in dataset.data[next(iter(dataset.data))]

    if has_crop:

        @sb.utils.data_pipeline.takes("wav", "start", "stop")
        @sb.utils.data_pipeline.provides("sig")
        def audio(wav, start, stop):
            if int(stop) > 0:
                return read({"file": wav, "start": int(start), "stop": int(stop)})
            return read(wav)

    else:

        @sb.utils.data_pipeline.takes("wav")
        @sb.utils.data_pipeline.provides("sig")
        def audio(wav):
            return read(wav)

    keys = ["id", "sig", "spk_id"]
    items = [audio]
    if ctc:

        @sb.utils.data_pipeline.takes("wrd")
        @sb.utils.data_pipeline.provides("wrd", "tokens")
        def text(wrd):
            yield wrd
            yield torch.LongTensor(encode_chars(wrd))

        items.append(text)
        keys += ["wrd", "tokens"]
    else:
        index = {label: i for i, label in enumerate(labels)}

        @sb.utils.data_pipeline.takes("label")
        @sb.utils.data_pipeline.provides("label_id")
        def label(value):
            if value not in index:
                raise KeyError(f"{csv_path}: label {value!r} is not one of {labels}")
            return torch.LongTensor([index[value]])

        items.append(label)
        keys.append("label_id")
    for item in items:
        sb.dataio.dataset.add_dynamic_item([dataset], item)
    sb.dataio.dataset.set_output_keys([dataset], keys)
    return dataset


# ##########################################################################################
# The seed model: the tiny multi-exit wav2vec 2.0, pretrained on the public split (optional)
# ##########################################################################################
def seed_model_folder(hparams, public):
    """The backbone to start from: a real preset, or the tiny model pretrained centrally.

    The tiny preset is random; it is trained centrally on the generated ``public``
    LibriSpeech-style split (voices drawn apart from the task corpora), saved with
    ``save_pretrained`` into the cache (keyed by the options and the split's content) and loaded
    back by ``Wav2Vec2Model.from_pretrained``. ``pretrain_objective`` (ours):

    - ``none`` (default): the random tiny model, no pretraining (random initialisation
      everywhere);
    - ``bag_of_words``: predict which words of the sentence vocabulary occur
      (multi-label BCE) from the stat-pooled hidden state of each exit in ``pretrain_exits``
      (default every exit), losses summed, so those exits become content-aware (with 64
      public speakers x 16 sentences, 1000 steps and every exit it lifts KWS-35 by about
      0.12-0.13 at exits 3 and 6);
    - ``ctc``: character CTC after layer 12, the objective of the paper's initialisation
      (LibriSpeech-100h fine-tuning). Measured here: 200 CPU steps leave it in CTC's all-blank
      phase (loss 2.9), and KWS federated training from that seed stalled at ln 12, so it is
      not the default for the short embedded pretraining;
    - ``phones``: frame-level phone classification at layer 12 on its own generated speech
      (:mod:`speechbrain_fl.models.multi_exit_phone_seed`; ``phone_corpus``, the
      ``pretrain_*`` keys). The recipe ships this seed (``seed/``): a run whose settings equal
      the shipped ones (and ``shipped_seed: True``) starts from it, checked by SHA-256; other
      settings pretrain it here (one log line says so).

    ``pretrain_seed`` seeds the pretraining (null: the run's ``seed``).
    """
    from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone, tiny_config_tag

    if hparams["model"] != "tiny":
        return resolve_backbone(hparams["model"], cache_dir=hparams["cache_folder"]), {}
    objective = hparams["pretrain_objective"]
    if objective == "none":  # random initialisation (the default)
        return resolve_backbone("tiny", cache_dir=hparams["cache_folder"], seed=hparams["seed"]), {}
    if objective == "phones":
        return phone_seed_folder(
            phone_settings(hparams), cache_folder=hparams["cache_folder"],
            shipped=SHIPPED_SEED if hparams["shipped_seed"] else None, rebuild_hint=REBUILD,
        )  # fmt: skip
    if objective not in ("bag_of_words", "ctc"):
        raise ValueError(
            f"pretrain_objective: {objective!r} must be 'none', 'bag_of_words', 'ctc' or 'phones'"
        )
    csv_path, data_folder = public
    key = {
        "tiny": tiny_config_tag(),
        "objective": objective,
        "steps": hparams["pretrain_steps"],
        "lr": hparams["pretrain_lr"],
        "batch_size": hparams["pretrain_batch_size"],
        "exits": list(_loss_exits(hparams, objective)),
        "seed": pretrain_seed(hparams),
        "public": file_digest(csv_path),
    }

    logger.debug("seed model key %s -> tag %s", key, cache_tag(key))
    return cached_seed_model(
        cache_folder=hparams["cache_folder"],
        prefix="seed_wav2vec2_tiny",
        key=key,
        build=functools.partial(
            _pretrain_seed,
            hparams=hparams,
            objective=objective,
            csv_path=csv_path,
            data_folder=data_folder,
        ),
        marker="config.json",
    )


def pretrain_seed(hparams):
    """The seed of the seed model's pretraining: ``pretrain_seed``, or the run's when null."""
    return hparams["seed"] if hparams["pretrain_seed"] is None else int(hparams["pretrain_seed"])


def phone_settings(hparams):
    """The phone seed's settings for this run (compared with the shipped seed's)."""
    return phone_seed_settings(
        **hparams["phone_corpus"], steps=hparams["pretrain_steps"],
        batch_size=hparams["pretrain_batch_size"], lr=hparams["pretrain_lr"],
        seed=pretrain_seed(hparams),
    )  # fmt: skip


def _loss_exits(hparams, objective):
    """The exits the pretraining loss is read at: 12 for ``ctc``, ``pretrain_exits`` else."""
    return (12,) if objective == "ctc" else tuple(sorted(set(hparams["pretrain_exits"])))


def _pretrain_seed(folder, *, hparams, objective, csv_path, data_folder):
    """Pretrain the tiny model centrally with ``objective``; save its backbone to ``folder``.

    ``ctc``: loss = CTC of the characters at layer 12. ``bag_of_words``: loss =
    sum over the exits e in ``pretrain_exits`` of BCE(logits_e, y), y_w = 1 if vocabulary word
    w occurs in the sentence; AdamW with a one-cycle lr (peak ``pretrain_lr``, 10% warmup),
    gradients clipped to norm 5.
    """
    from transformers import Wav2Vec2Model

    from speechbrain_fl.models.multi_exit_wav2vec2 import MultiExitWav2Vec2, resolve_backbone
    from speechbrain_fl.models.pretrain import train_steps

    seed = pretrain_seed(hparams)
    source = resolve_backbone("tiny", cache_dir=hparams["cache_folder"], seed=seed)
    # The seed model's own seed (its key holds it): the heads' initialisation and the
    # loader's shuffling of this one-off step, whatever ran before in the process.
    torch.manual_seed(seed)
    with open(csv_path, newline="", encoding="utf-8") as handle:
        vocab = sorted({w for row in csv.DictReader(handle) for w in row["wrd"].split()})
    ctc = objective == "ctc"
    model = MultiExitWav2Vec2(
        Wav2Vec2Model.from_pretrained(source),
        num_outputs=len(CTC_ALPHABET) + 1 if ctc else len(vocab),
        exits=_loss_exits(hparams, objective),
        head="ctc" if ctc else "utterance",
    )
    index = {w: i for i, w in enumerate(vocab)}
    dataset = make_dataset(csv_path, data_folder, ctc=True).filtered_sorted(sort_key="duration")
    loader = sb.dataio.dataloader.make_dataloader(
        dataset, batch_size=hparams["pretrain_batch_size"], shuffle=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=hparams["pretrain_lr"])
    steps = hparams["pretrain_steps"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=hparams["pretrain_lr"], total_steps=steps, pct_start=0.1
    )

    def loss_fn(batch):
        wavs, lens = batch.sig
        if ctc:  # character CTC after layer 12
            tokens, token_lens = batch.tokens
            return torch.nn.functional.ctc_loss(
                model(wavs, lens, depth=12).transpose(0, 1),
                tokens,
                model.frame_lengths(wavs, lens),
                torch.round(token_lens * tokens.shape[1]).long(),
                blank=0,
                zero_infinity=True,
            )
        # bag of words: which vocabulary words occur, from every exit, losses summed
        target = torch.zeros(len(batch.wrd), len(vocab))
        for i, text in enumerate(batch.wrd):
            target[i, [index[w] for w in text.split()]] = 1.0
        outputs = model.forward_exits(wavs, lens, exits=model.exits)
        return sum(
            torch.nn.functional.binary_cross_entropy_with_logits(out, target)
            for out in outputs.values()
        )

    losses = train_steps(
        model,
        loader,
        loss_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        steps=steps,
        max_grad_norm=5.0,
        desc=f"seed model pretraining ({objective})",
    )
    model.backbone.save_pretrained(folder)
    logger.info(
        "Seed model pretrained (%s loss %.3f -> %.3f)",
        objective,
        float(np.mean(losses[:20])),
        float(np.mean(losses[-20:])),
    )
