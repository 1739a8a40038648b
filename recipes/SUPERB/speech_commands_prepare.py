"""Data preparation for Speech Commands v0.01 (KWS-12) and v0.02 (KWS-35).

Parses the layout the archives unpack to::

    <data_folder>/<word>/<speaker-hash>_nohash_<k>.wav       (1 s, 16 kHz)
    <data_folder>/validation_list.txt                         (<word>/<file>.wav per line)
    <data_folder>/testing_list.txt
    <data_folder>/_background_noise_/*.wav

and writes ``<save_folder>/{train,valid,test}.csv`` with the columns
``ID,duration,wav,start,stop,spk_id,label``. Every clip not in the validation or testing list is
training data (Warden, 2018). Tasks:

- ``kws12`` (v0.01, SUPERB's KS): the 10 commands, ``_unknown_`` (every other word) and
  ``_silence_``: 1-s crops of the background-noise files, ``silence_fraction`` x the split's
  clip count (our choice; SUPERB draws them the same way). ``start``/``stop`` are the crop's
  samples (``stop = -1``: the whole file). Crops have no speaker: training crops are attached to
  the training speakers in turn (so the speaker partition spreads them over clients), evaluation
  crops get their own ``_silence_<k>`` id. The test split is ``testing_list.txt`` (SUPERB scores
  the separate v0.01 test archive instead).
- ``kws35`` (v0.02): the 35 words as classes, no silence or unknown class.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging
import os

import numpy as np
import soundfile as sf
from prepare_common import (
    check_audio,
    corpus_stamp,
    rel,
    require,
    save_options,
    skip,
    write_manifest,
)

logger = logging.getLogger(__name__)

COMMANDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
V2_EXTRA = ("backward", "forward", "follow", "learn", "visual")
HEADER = ["ID", "duration", "wav", "start", "stop", "spk_id", "label"]
TASKS = ("kws12", "kws35")
_WHERE = (
    "Download Speech Commands from http://download.tensorflow.org/data/speech_commands_v0.01.tar.gz"
    " (KWS-12) or .../speech_commands_v0.02.tar.gz (KWS-35) and unpack it into data_folder, or "
    "leave data_folder unset to use the embedded synthetic corpus."
)


def labels_for(task: str, words: list[str]) -> list[str]:
    """Class labels in a fixed order: KWS-12 commands + ``_silence_`` + ``_unknown_``, or the words."""
    if task == "kws12":
        return [*COMMANDS, "_silence_", "_unknown_"]
    return sorted(words)


def prepare_speech_commands(
    data_folder: str,
    save_folder: str,
    *,
    task: str = "kws12",
    silence_fraction: float = 0.1,
    seed: int = 1234,
    skip_prep: bool = False,
) -> dict:
    """Write the manifests of a Speech Commands tree.

    Arguments
    ---------
    data_folder : str
        The unpacked corpus.
    save_folder : str
        Where ``train.csv``, ``valid.csv``, ``test.csv`` and ``labels.txt`` go.
    task : str
        ``kws12`` or ``kws35``.
    silence_fraction : float
        ``_silence_`` crops per split, as a fraction of its clips (``kws12``).
    seed : int
        Seed of the crop offsets.
    skip_prep : bool
        Do nothing (the manifests exist already).

    Returns
    -------
    dict
        ``{"labels", "counts": {split: n}, "skipped": bool}``.

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.data.superb_synth import generate_speech_commands
    >>> root = tempfile.mkdtemp()
    >>> _ = generate_speech_commands(root + "/sc", train_speakers=2, valid_speakers=1,
    ...     test_speakers=1, repeats=1, unknown_words_per_speaker=1, noise_seconds=2,
    ...     progress=False)
    >>> report = prepare_speech_commands(root + "/sc", root + "/save")
    >>> report["counts"]["train"], len(report["labels"])
    (24, 12)
    """
    if task not in TASKS:
        raise ValueError(f"task: {task!r} must be one of {list(TASKS)}")
    options = {
        "data_folder": os.path.abspath(data_folder),
        "task": task,
        "silence_fraction": float(silence_fraction),
        "seed": int(seed),
        "corpus": corpus_stamp(data_folder) if os.path.isdir(data_folder) else None,
    }
    files = ("train.csv", "valid.csv", "test.csv", "labels.txt")
    if skip_prep:
        return {"skipped": True}
    if skip(save_folder, options, files):
        logger.info("Speech Commands manifests in %s are up to date", save_folder)
        with open(os.path.join(save_folder, "labels.txt"), encoding="utf-8") as handle:
            return {"labels": handle.read().split(), "skipped": True}
    needed = ["validation_list.txt", "testing_list.txt", "_background_noise_"]
    needed += list(COMMANDS) + (list(V2_EXTRA) if task == "kws35" else [])
    require(data_folder, needed, corpus=f"Speech Commands ({task})", where=_WHERE)
    lists = {}
    for split, name in (("valid", "validation_list.txt"), ("test", "testing_list.txt")):
        with open(os.path.join(data_folder, name), encoding="utf-8") as handle:
            lists[split] = {line.strip() for line in handle if line.strip()}
    words = sorted(
        d
        for d in os.listdir(data_folder)
        if os.path.isdir(os.path.join(data_folder, d)) and not d.startswith("_")
    )
    labels = labels_for(task, words)
    rows = {"train": [], "valid": [], "test": []}
    clips = []
    for word in words:
        if task == "kws35" and word not in labels:
            logger.info("skipping folder %s: not a KWS-35 word", word)
            continue
        names = sorted(os.listdir(os.path.join(data_folder, word)))
        clips += [(word, n) for n in names if n.endswith(".wav")]
    durations = check_audio(
        [os.path.join(data_folder, w, n) for w, n in clips],
        data_folder,
        save_folder=save_folder,
        corpus="Speech Commands",
    )
    for word, name in clips:
        label = word if word in labels else "_unknown_"
        relative = f"{word}/{name}"
        split = next((s for s in ("valid", "test") if relative in lists[s]), "train")
        path = os.path.join(data_folder, word, name)
        if path in durations:  # an unreadable clip is left out (listed by check_audio)
            rows[split].append(
                {
                    "ID": f"{word}_{name[:-4]}",
                    "duration": round(durations[path], 4),
                    "wav": rel(path, data_folder),
                    "start": 0,
                    "stop": -1,
                    "spk_id": name.split("_nohash_")[0],
                    "label": label,
                }
            )
    if task == "kws12":
        _add_silence(data_folder, rows, silence_fraction, seed)
    os.makedirs(save_folder, exist_ok=True)
    for split, split_rows in rows.items():
        if not split_rows:
            raise OSError(f"Speech Commands: no clips in the {split} split of {data_folder}")
        write_manifest(os.path.join(save_folder, f"{split}.csv"), split_rows, HEADER)
    with open(os.path.join(save_folder, "labels.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(labels) + "\n")
    report = {"labels": labels, "counts": {s: len(r) for s, r in rows.items()}}
    save_options(save_folder, options, report)
    return {**report, "skipped": False}


def _add_silence(data_folder, rows, fraction, seed):
    folder = os.path.join(data_folder, "_background_noise_")
    noises = sorted(n for n in os.listdir(folder) if n.endswith(".wav"))
    if not noises:
        raise OSError(f"Speech Commands: no .wav file in {folder} (needed for _silence_)")
    frames = {n: sf.info(os.path.join(folder, n)).frames for n in noises}
    rng = np.random.default_rng(seed)
    train_speakers = sorted({r["spk_id"] for r in rows["train"]})
    for split in ("train", "valid", "test"):
        for k in range(int(round(fraction * len(rows[split])))):
            noise = noises[k % len(noises)]
            start = int(rng.integers(0, max(1, frames[noise] - 16000)))
            speaker = (
                train_speakers[k % len(train_speakers)] if split == "train" else f"_silence_{k}"
            )
            rows[split].append(
                {
                    "ID": f"_silence_{split}_{k:05d}",
                    "duration": 1.0,
                    "wav": rel(os.path.join(folder, noise), data_folder),
                    "start": start,
                    "stop": start + 16000,
                    "spk_id": speaker,
                    "label": "_silence_",
                }
            )
