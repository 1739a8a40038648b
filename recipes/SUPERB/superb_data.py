"""The SUPERB tasks of the recipe: corpus, head, metric, partition; preparation; ASV scoring.

:data:`TASKS` fixes what each task is (our table; the paper names the tasks and corpora, the
rest is ours): the corpus and its prepare script, the head (``utterance`` or ``ctc``), the
client partition (speaker for KWS, ER, ASR; IID for SID, as the paper says) and the bootstrap
unit of the 95% CI (speakers where the test set has many; utterances for SID, whose classes are
the speakers, and ER, whose held-out session has two). :func:`prepare_task` generates the
embedded corpus when ``data_folder`` is null, writes the manifests, partitions the training
split into clients and prepares the public split the tiny seed model is pretrained on.
:func:`make_dataset` is the recipe's data pipeline (audio, labels or CTC characters).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import logging
import os

import numpy as np
import speechbrain as sb
import torch

logger = logging.getLogger(__name__)

CTC_ALPHABET = " 'abcdefghijklmnopqrstuvwxyz"  # id 0 is the CTC blank

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


def check_task(task):
    """Raise naming the known tasks if ``task`` is not one."""
    if task not in TASKS:
        raise ValueError(f"task: {task!r} must be one of {sorted(TASKS)}")
    return TASKS[task]


def _generate(hparams, spec):
    """Generate (cached) the embedded corpus of the task; return its folder."""
    from speechbrain_fl.data import superb_synth

    options = dict(hparams["corpus_options"] or {})
    name = spec["corpus"] if spec["corpus"] != "speech_commands" else f"sc_v{spec['version']}"
    folder = os.path.join(hparams["cache_folder"], f"{name}_synth")
    if spec["corpus"] == "speech_commands":
        superb_synth.generate_speech_commands(
            folder, version=spec["version"], seed=hparams["seed"], **options
        )
    elif spec["corpus"] == "voxceleb1":
        superb_synth.generate_voxceleb1(folder, seed=hparams["seed"], **options)
    elif spec["corpus"] == "iemocap":
        superb_synth.generate_iemocap(folder, seed=hparams["seed"], **options)
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
    if hparams["model"] == "tiny" and hparams["pretrain_objective"] != "none":
        from librispeech_prepare import prepare_librispeech

        public_folder = os.path.join(hparams["cache_folder"], "public_librispeech_synth")
        generate_librispeech(
            public_folder, seed=hparams["seed"], **dict(hparams["public_corpus_options"])
        )
        public_save = os.path.join(hparams["cache_folder"], "public_manifests")
        prepare_librispeech(public_folder, public_save, splits=("public",))
        public = (os.path.join(public_save, "public.csv"), public_folder)
    return {
        "data_folder": data_folder,
        "clients": clients,
        "valid": valid,
        "test": test,
        "labels": labels,
        "public": public,
        "extra": {k: v for k, v in report.items() if k not in ("labels",)},
    }


# ------------------------------------------------------------------------------ data pipeline
def decode_chars(ids):
    """CTC ids (blank-free) to text."""
    return "".join(CTC_ALPHABET[i - 1] for i in ids if 0 < i <= len(CTC_ALPHABET))


def encode_chars(text):
    """Text to CTC ids (characters outside the alphabet dropped)."""
    return [CTC_ALPHABET.index(c) + 1 for c in text.lower() if c in CTC_ALPHABET]


def make_dataset(csv_path, data_folder, *, labels=None, ctc=False):
    """A DynamicItemDataset: ``sig`` (16 kHz), ``spk_id`` and ``label_id`` or ``tokens``."""
    dataset = sb.dataio.dataset.DynamicItemDataset.from_csv(
        csv_path=csv_path, replacements={"data_root": data_folder}
    )
    has_crop = "start" in dataset.data[next(iter(dataset.data))]

    if has_crop:

        @sb.utils.data_pipeline.takes("wav", "start", "stop")
        @sb.utils.data_pipeline.provides("sig")
        def audio(wav, start, stop):
            if int(stop) > 0:
                return sb.dataio.dataio.read_audio(
                    {"file": wav, "start": int(start), "stop": int(stop)}
                )
            return sb.dataio.dataio.read_audio(wav)

    else:

        @sb.utils.data_pipeline.takes("wav")
        @sb.utils.data_pipeline.provides("sig")
        def audio(wav):
            return sb.dataio.dataio.read_audio(wav)

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


# ------------------------------------------------------------------------------ ASV
def _embeddings(model, paths, exits, device):
    """Stat-pooled (mean, std) hidden states at each exit for each wav path."""
    from speechbrain_fl.models.multi_exit_wav2vec2 import StatPoolHead

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
