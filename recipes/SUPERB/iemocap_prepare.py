"""Data preparation for IEMOCAP emotion recognition (4 classes, leave one session out).

Parses the layout of the IEMOCAP release::

    <data_folder>/Session<n>/sentences/wav/<dialog>/<utterance>.wav
    <data_folder>/Session<n>/dialog/EmoEvaluation/<dialog>.txt
        ([start - end]\\t<utterance>\\t<emotion>\\t[V, A, D] lines)

and writes ``<save_folder>/{train,valid,test}.csv`` (``ID,duration,wav,start,stop,spk_id,
label``) with SUPERB's four classes: neutral, happy (``exc`` merged into ``hap``), sad, angry;
other labels are dropped (counted in the report). The speaker is the session and the gender
letter of the utterance id (``Ses01F``...). ``test_session`` is the held-out fold (the YAML key
``test_session``); ``valid_fraction`` of the remaining utterances (at least one), drawn per speaker, is
the validation split (ours).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
from prepare_common import (
    corpus_stamp,
    readable_rows,
    rel,
    require,
    save_options,
    skip,
    write_manifest,
)

logger = logging.getLogger(__name__)

HEADER = ["ID", "duration", "wav", "start", "stop", "spk_id", "label"]
LABELS = ["neu", "hap", "sad", "ang"]
MERGE = {"exc": "hap"}
_LINE = re.compile(r"^\[[\d.]+ - [\d.]+\]\t(\S+)\t(\S+)\t")
_WHERE = (
    "Request IEMOCAP from https://sail.usc.edu/iemocap/ and unpack it into data_folder "
    "(giving data_folder/Session1 ... Session5), or leave data_folder unset for the embedded "
    "corpus."
)


def prepare_iemocap(
    data_folder: str,
    save_folder: str,
    *,
    test_session: int = 5,
    valid_fraction: float = 0.1,
    seed: int = 1234,
    skip_prep: bool = False,
) -> dict:
    """Write the manifests of one leave-one-session-out fold.

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.data.superb_synth_speakers import generate_iemocap
    >>> root = tempfile.mkdtemp()
    >>> _ = generate_iemocap(root + "/iemocap", sessions=2, utterances_per_emotion=2,
    ...     emotions=("neu", "exc", "fru"), progress=False)
    >>> r = prepare_iemocap(root + "/iemocap", root + "/save", test_session=2)
    >>> r["counts"]["test"], r["dropped"]
    (8, {'fru': 8})
    """
    options = {
        "data_folder": os.path.abspath(data_folder),
        "test_session": int(test_session),
        "valid_fraction": float(valid_fraction),
        "seed": int(seed),
        "corpus": corpus_stamp(data_folder) if os.path.isdir(data_folder) else None,
    }
    files = ("train.csv", "valid.csv", "test.csv", "labels.txt")
    if skip_prep:
        return {"skipped": True}
    if skip(save_folder, options, files):
        return {"labels": LABELS, "skipped": True}
    sessions = (
        sorted(d for d in os.listdir(data_folder) if re.fullmatch(r"Session\d", d))
        if os.path.isdir(data_folder)
        else []
    )
    require(
        data_folder,
        [f"Session{test_session}/dialog/EmoEvaluation", f"Session{test_session}/sentences/wav"],
        corpus="IEMOCAP",
        where=_WHERE,
    )
    rows = {"train": [], "valid": [], "test": []}
    dropped: dict[str, int] = {}
    for session in sessions:
        evaluation = os.path.join(data_folder, session, "dialog", "EmoEvaluation")
        require(data_folder, [f"{session}/dialog/EmoEvaluation"], corpus="IEMOCAP", where=_WHERE)
        for name in sorted(n for n in os.listdir(evaluation) if n.endswith(".txt")):
            dialog = name[:-4]
            with open(os.path.join(evaluation, name), encoding="utf-8") as handle:
                for line in handle:
                    match = _LINE.match(line)
                    if not match:
                        continue
                    utt, emotion = match.groups()
                    emotion = MERGE.get(emotion, emotion)
                    if emotion not in LABELS:
                        dropped[emotion] = dropped.get(emotion, 0) + 1
                        continue
                    path = os.path.join(
                        data_folder, session, "sentences", "wav", dialog, f"{utt}.wav"
                    )
                    if not os.path.isfile(path):
                        logger.warning("IEMOCAP: no audio %s for %s; skipped", path, utt)
                        continue
                    split = "test" if session == f"Session{test_session}" else "train"
                    rows[split].append(
                        {
                            "ID": utt,
                            "_path": path,  # duration from its header: readable_rows
                            "wav": rel(path, data_folder),
                            "start": 0,
                            "stop": -1,
                            "spk_id": utt[:5] + utt.split("_")[-1][0],
                            "label": emotion,
                        }
                    )
    rows = readable_rows(rows, data_folder, save_folder=save_folder, corpus="IEMOCAP")
    rng = np.random.default_rng(seed)
    keep = []
    for speaker in sorted({r["spk_id"] for r in rows["train"]}):
        own = [r for r in rows["train"] if r["spk_id"] == speaker]
        count = max(1, int(round(valid_fraction * len(own)))) if len(own) > 1 else 0
        chosen = set(rng.choice(len(own), count, replace=False).tolist())
        rows["valid"] += [r for i, r in enumerate(own) if i in chosen]
        keep += [r for i, r in enumerate(own) if i not in chosen]
    rows["train"] = keep
    os.makedirs(save_folder, exist_ok=True)
    for split, split_rows in rows.items():
        if not split_rows:
            raise OSError(
                f"IEMOCAP: no utterances in the {split} split (test_session={test_session})"
            )
        write_manifest(os.path.join(save_folder, f"{split}.csv"), split_rows, HEADER)
    with open(os.path.join(save_folder, "labels.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(LABELS) + "\n")
    report = {"labels": LABELS, "counts": {s: len(r) for s, r in rows.items()}, "dropped": dropped}
    save_options(save_folder, options, report)
    return {**report, "skipped": False}
