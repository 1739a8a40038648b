"""Data preparation for VoxCeleb1 identification (SID) and verification (ASV) lists.

Parses the layout of the VoxCeleb1 dev+test wav archives and the official lists::

    <data_folder>/wav/id1xxxx/<video>/<nnnnn>.wav
    <data_folder>/iden_split.txt        (<1|2|3> id1xxxx/<video>/<nnnnn>.wav; train/dev/test)
    <data_folder>/veri_test.txt         (<1|0> <enrol wav> <test wav>; needed for ASV only)

and writes ``<save_folder>/{train,valid,test}.csv`` (``ID,duration,wav,start,stop,spk_id,
label``; the label is the speaker) from ``iden_split.txt``. With ``exclude_verification_speakers``
(the ASV task) the speakers of the trial list are left out of every SID split, so the
verification speakers are unseen, and ``trials.csv`` lists the trials; otherwise the overlap
between SID training speakers and trial speakers is reported in the returned dict.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import logging
import os

from prepare_common import (
    corpus_stamp,
    readable_rows,
    rel,
    require,
    save_options,
    skip,
    write_manifest,
)

from speechbrain_fl.utils.atomic import atomic_open

logger = logging.getLogger(__name__)

HEADER = ["ID", "duration", "wav", "start", "stop", "spk_id", "label"]
_WHERE = (
    "Get VoxCeleb1 (dev and test wav archives, iden_split.txt and veri_test.txt) from "
    "https://www.robots.ox.ac.uk/~vgg/data/voxceleb/vox1.html and unpack the wav/ folder and "
    "the two lists into data_folder, or leave data_folder unset for the embedded corpus."
)
_SPLITS = {"1": "train", "2": "valid", "3": "test"}


def read_trials(path: str) -> list[tuple[int, str, str]]:
    """``(target, enrol, test)`` triples of a VoxCeleb trial list."""
    trials = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 3 or fields[0] not in ("0", "1"):
                raise ValueError(f"{path}:{number}: expected '<0|1> <wav> <wav>', got {line!r}")
            trials.append((int(fields[0]), fields[1], fields[2]))
    return trials


def prepare_voxceleb1(
    data_folder: str,
    save_folder: str,
    *,
    exclude_verification_speakers: bool = False,
    skip_prep: bool = False,
) -> dict:
    """Write the SID manifests (and ``trials.csv`` for ASV).

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.data.superb_synth_speakers import generate_voxceleb1
    >>> root = tempfile.mkdtemp()
    >>> _ = generate_voxceleb1(root + "/vox", iden_speakers=2, veri_speakers=2,
    ...     videos_per_speaker=2, utterances_per_video=2, trials_per_speaker=1, progress=False)
    >>> r = prepare_voxceleb1(root + "/vox", root + "/save", exclude_verification_speakers=True)
    >>> r["counts"], r["labels"]
    ({'train': 4, 'valid': 2, 'test': 2}, ['id10001', 'id10002'])
    """
    options = {
        "data_folder": os.path.abspath(data_folder),
        "exclude_verification_speakers": bool(exclude_verification_speakers),
        "corpus": corpus_stamp(data_folder) if os.path.isdir(data_folder) else None,
    }
    files = ["train.csv", "valid.csv", "test.csv", "labels.txt"]
    if exclude_verification_speakers:
        files.append("trials.csv")
    if skip_prep:
        return {"skipped": True}
    if skip(save_folder, options, files):
        with open(os.path.join(save_folder, "labels.txt"), encoding="utf-8") as handle:
            return {"labels": handle.read().split(), "skipped": True}
    needed = ["wav", "iden_split.txt"]
    if exclude_verification_speakers:
        needed.append("veri_test.txt")
    require(data_folder, needed, corpus="VoxCeleb1", where=_WHERE)
    veri_speakers = set()
    trials = []
    if os.path.isfile(os.path.join(data_folder, "veri_test.txt")):
        trials = read_trials(os.path.join(data_folder, "veri_test.txt"))
        veri_speakers = {p.split("/")[0] for _, a, b in trials for p in (a, b)}
    rows = {"train": [], "valid": [], "test": []}
    missing = 0
    with open(os.path.join(data_folder, "iden_split.txt"), encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2 or fields[0] not in _SPLITS:
                raise ValueError(f"iden_split.txt:{number}: expected '<1|2|3> <wav>', got {line!r}")
            speaker = fields[1].split("/")[0]
            if exclude_verification_speakers and speaker in veri_speakers:
                continue
            path = os.path.join(data_folder, "wav", fields[1])
            if not os.path.isfile(path):
                missing += 1
                logger.warning("VoxCeleb1: %s listed in iden_split.txt is missing; skipped", path)
                continue
            rows[_SPLITS[fields[0]]].append(
                {
                    "ID": fields[1][:-4].replace("/", "_"),
                    "_path": path,  # duration from its header: readable_rows
                    "wav": rel(path, data_folder),
                    "start": 0,
                    "stop": -1,
                    "spk_id": speaker,
                    "label": speaker,
                }
            )
    rows = readable_rows(rows, data_folder, save_folder=save_folder, corpus="VoxCeleb1")
    labels = sorted({r["label"] for r in rows["train"]})
    os.makedirs(save_folder, exist_ok=True)
    for split, split_rows in rows.items():
        if not split_rows:
            raise OSError(f"VoxCeleb1: no utterances in the {split} split of iden_split.txt")
        unseen = {r["label"] for r in split_rows} - set(labels)
        if unseen:
            raise ValueError(f"VoxCeleb1: {split} has speakers {sorted(unseen)[:5]} not in train")
        write_manifest(os.path.join(save_folder, f"{split}.csv"), split_rows, HEADER)
    with open(os.path.join(save_folder, "labels.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(labels) + "\n")
    if exclude_verification_speakers:
        with atomic_open(os.path.join(save_folder, "trials.csv"), newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["target", "enrol", "test"])
            for target, a, b in trials:
                writer.writerow([target, f"$data_root/wav/{a}", f"$data_root/wav/{b}"])
    report = {
        "labels": labels,
        "counts": {s: len(r) for s, r in rows.items()},
        "missing": missing,
        "verification_speakers_in_sid_training": sorted(veri_speakers & set(labels)),
    }
    save_options(save_folder, options, report)
    return {**report, "skipped": False}
