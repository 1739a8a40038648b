"""Data of the Private-Gender recipe: corpus, manifests, features and privileged tokens.

* :func:`prepare_data`: the embedded corpus (when ``data_folder`` is null) and the manifests
  ``priv.csv``/``aux.csv``/``test.csv`` (:func:`common_voice_prepare.prepare_common_voice`).
* :func:`read_manifest` and :func:`load_set`: one manifest's rows, labels and features.
* :func:`load_features`: log-mel filterbanks (SpeechBrain ``Fbank``) of a manifest's clips,
  cached in ``cache_folder`` by the manifest's content; a clip that cannot be read is named.
* :func:`privileged_tokens`: the teacher's privileged input (transcript words and/or metadata
  fields as hashed tokens); fields derived from the label are refused.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from speechbrain_fl.models.gender_classifier import hash_tokens
from speechbrain_fl.utils.atomic import atomic_open

logger = logging.getLogger(__name__)

__all__ = [
    "FORBIDDEN_FIELDS",
    "PRIVILEGED_FIELDS",
    "cap_clips_per_speaker",
    "check_privileged_fields",
    "load_features",
    "load_set",
    "prepare_data",
    "privileged_tokens",
    "read_manifest",
]

#: Fields allowed as privileged input. The label (``label``, ``gender_raw``) and the speaker
#: id are never inputs.
PRIVILEGED_FIELDS = ("sentence", "age", "accent")
FORBIDDEN_FIELDS = ("label", "gender", "gender_raw", "spk_id", "client_id")


def prepare_data(hparams: dict) -> tuple[str, str, dict]:
    """Embedded corpus if needed, then ``priv.csv``/``aux.csv``/``test.csv``.

    Returns ``(data_folder, manifest_folder, report)``.
    """
    from common_voice_prepare import prepare_common_voice

    data_folder = hparams["data_folder"]
    if data_folder is None:
        from speechbrain_fl.data.common_voice_synth import generate_common_voice_corpus

        data_folder = os.path.join(hparams["cache_folder"], "cv_synth")
        logger.info("No data_folder given: embedded espeak-ng corpus in %s", data_folder)
        info = generate_common_voice_corpus(
            data_folder,
            speakers=dict(hparams["corpus_speakers"]),
            clips_per_speaker=hparams["corpus_clips_per_speaker"],
            class_shares=tuple(hparams["corpus_class_shares"]),
            release_style=hparams["corpus_release_style"],
            audio_format=hparams["corpus_audio_format"],
            seed=hparams["corpus_seed"],
        )
        logger.info(
            "Embedded corpus %s (%.1f s)",
            "cached" if info["cached"] else "generated",
            info["seconds"],
        )
    manifests = os.path.join(hparams["output_folder"], "teacher", "manifests")
    report = prepare_common_voice(
        data_folder,
        manifests,
        priv_split=hparams["priv_split"],
        aux_split=hparams["aux_split"],
        test_split=hparams["test_split"],
        classes=tuple(hparams["classes"]),
        gender_map=hparams["gender_map"],
        unlabeled_values=tuple(hparams["unlabeled_values"]),
        disjoint_by=hparams["disjoint_by"],
        max_aux=hparams["max_aux"],
        seed=hparams["seed"],
        skip_prep=hparams["skip_prep"],
    )
    return data_folder, manifests, report


def read_manifest(path: str | os.PathLike, data_folder: str) -> list[dict[str, str]]:
    """Rows of a manifest with ``$data_root`` replaced."""
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        row["wav"] = row["wav"].replace("$data_root", str(data_folder))
    return rows


def cap_clips_per_speaker(rows: list[dict], *, max_clips: int, seed: int) -> list[dict]:
    """At most ``max_clips`` rows per speaker (``spk_id``), a random subset, manifest order kept.

    The subset is drawn from ``seed`` before training (which clips a speaker keeps is not a
    function of the clips' content), so that one speaker is at most ``max_clips`` records of
    D_priv and the clip-level guarantee extends to speakers by group privacy
    (``gender_report.speaker_level``).

    Example
    -------
    >>> rows = [{"spk_id": s} for s in "aaab"]
    >>> [r["spk_id"] for r in cap_clips_per_speaker(rows, max_clips=1, seed=0)]
    ['a', 'b']
    """
    rng = np.random.default_rng([int(seed), 91])
    by_speaker: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_speaker.setdefault(row["spk_id"], []).append(i)
    keep = set()
    for indices in by_speaker.values():
        if len(indices) > max_clips:
            indices = rng.choice(indices, max_clips, replace=False).tolist()
        keep.update(indices)
    return [row for i, row in enumerate(rows) if i in keep]


def load_set(
    name: str, manifests, data_folder, hparams: dict, classes, *, max_clips_per_speaker=None
) -> dict:
    """One set (``priv``, ``aux`` or ``test``): rows, ids, speakers, labels and features.

    ``max_clips_per_speaker`` (D_priv): :func:`cap_clips_per_speaker` before the features;
    the result then holds ``"capped_clips"``, the number of rows dropped.
    """
    rows = read_manifest(os.path.join(manifests, f"{name}.csv"), data_folder)
    capped = None
    if max_clips_per_speaker is not None:
        before = len(rows)
        rows = cap_clips_per_speaker(rows, max_clips=max_clips_per_speaker, seed=hparams["seed"])
        capped = before - len(rows)
    feats = load_features(
        rows,
        n_mels=hparams["n_mels"],
        max_frames=hparams["max_frames"],
        cache_folder=hparams["cache_folder"],
        desc=f"D_{name} features",
    )
    index = {c: i for i, c in enumerate(classes)}
    return {
        "rows": rows,
        "ids": [r["ID"] for r in rows],
        "speakers": [r["spk_id"] for r in rows],
        "labels": torch.tensor([index[r["label"]] for r in rows], dtype=torch.long),
        **feats,
        **({} if capped is None else {"capped_clips": capped}),
    }


def _fbank(n_mels: int):
    from speechbrain.lobes.features import Fbank

    return Fbank(n_mels=n_mels, sample_rate=16000)


def _read_clip(row) -> torch.Tensor:
    """Mono 16 kHz waveform of a manifest row; ``ValueError`` naming the clip if unreadable."""
    try:
        wav, sr = sf.read(row["wav"], dtype="float32", always_2d=True)
    except Exception as err:
        raise ValueError(f"clip {row['wav']} (record {row['ID']}) cannot be read: {err}") from err
    wav = torch.from_numpy(wav.mean(axis=1))
    if sr != 16000:
        import torchaudio

        wav = torchaudio.functional.resample(wav, sr, 16000)
    if wav.numel() < 400 or not torch.isfinite(wav).all():
        raise ValueError(f"clip {row['wav']} (record {row['ID']}) is empty or not finite")
    return wav


def load_features(
    rows, *, n_mels: int, max_frames: int, cache_folder: str, desc: str = "features"
) -> dict:
    """Log-mel features of ``rows``: ``{"feats" (N, T, n_mels), "lengths" (N,)}``, cached.

    Clips longer than ``max_frames`` frames (10 ms hop) keep their first ``max_frames``.
    """
    key = hashlib.sha256(
        json.dumps(
            [[r["ID"], r["wav"], r["duration"]] for r in rows] + [n_mels, max_frames]
        ).encode()
    ).hexdigest()[:16]
    cache = Path(cache_folder) / "features" / f"{key}.pt"
    if cache.is_file():
        return torch.load(cache)
    fbank = _fbank(n_mels)
    feats = torch.zeros(len(rows), max_frames, n_mels)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    chunk = 32  # clips per Fbank call (zero padding leaves the valid frames unchanged)
    with torch.inference_mode():
        for start in tqdm(range(0, len(rows), chunk), desc=desc, unit="batch", leave=False):
            wavs = [_read_clip(row) for row in rows[start : start + chunk]]
            longest = max(w.numel() for w in wavs)
            batch = torch.stack([F.pad(w, (0, longest - w.numel())) for w in wavs])
            mel = fbank(batch)
            for k, w in enumerate(wavs):
                n = min(1 + w.numel() // 160, mel.shape[1], max_frames)
                feats[start + k, :n] = mel[k, :n]
                lengths[start + k] = n
    out = {"feats": feats, "lengths": lengths}
    with atomic_open(cache, "wb") as handle:
        torch.save(out, handle)
    return out


def check_privileged_fields(fields) -> list[str]:
    """The privileged fields, or ``ValueError`` for a field derived from the label or unknown."""
    fields = list(fields)
    bad = [f for f in fields if f in FORBIDDEN_FIELDS]
    if bad:
        raise ValueError(
            f"privileged_fields {bad}: the label, anything derived from it and the "
            f"speaker id are never inputs; allowed: {PRIVILEGED_FIELDS}"
        )
    unknown = [f for f in fields if f not in PRIVILEGED_FIELDS]
    if unknown:
        raise ValueError(f"unknown privileged_fields {unknown}; allowed: {PRIVILEGED_FIELDS}")
    return fields


def privileged_tokens(rows, *, fields, buckets: int, max_tokens: int) -> torch.Tensor:
    """Hashed tokens of the privileged fields (``w=<word>`` per transcript word, ``age=...``).

    Raises ``ValueError`` for a field derived from the label or not in the manifests.
    """
    fields = check_privileged_fields(fields)
    records = []
    for row in rows:
        tokens = []
        for field in fields:
            if field == "sentence":
                tokens += [f"w={w}" for w in row["sentence"].lower().split()]
            elif row[field]:
                tokens.append(f"{field}={row[field]}")
        records.append(tokens)
    return hash_tokens(records, buckets=buckets, max_tokens=max_tokens)
