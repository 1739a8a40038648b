"""Data preparation for LibriSpeech (ASR task; and the tiny seed model's ``public`` split).

Parses the layout the openslr.org/12 archives unpack to::

    <data_folder>/LibriSpeech/<split>/<spk>/<chapter>/<spk>-<chapter>-<utt>.flac
    <data_folder>/LibriSpeech/<split>/<spk>/<chapter>/<spk>-<chapter>.trans.txt

and writes ``<save_folder>/<split>.csv`` (``ID,duration,wav,spk_id,wrd``; transcripts
lower-cased) for each split asked for (``train-clean-100``, ``dev-clean``, ``test-clean``; the
embedded corpus adds ``public``). A transcript line without audio is skipped with a log line;
an audio file whose header cannot be read is left out and listed in ``unreadable_audio.json``
(:func:`prepare_common.check_audio`).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging
import os

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

HEADER = ["ID", "duration", "wav", "spk_id", "wrd"]
SPLITS = ("train-clean-100", "dev-clean", "test-clean")
_WHERE = (
    "Download train-clean-100, dev-clean and test-clean from https://www.openslr.org/12 and "
    "unpack them into data_folder (giving data_folder/LibriSpeech/<split>), or leave "
    "data_folder unset to use the embedded synthetic corpus."
)


def prepare_librispeech(
    data_folder: str,
    save_folder: str,
    *,
    splits: tuple[str, ...] = SPLITS,
    skip_prep: bool = False,
) -> dict:
    """Write one manifest per split.

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.data.superb_synth import generate_librispeech
    >>> root = tempfile.mkdtemp()
    >>> _ = generate_librispeech(root + "/ls", splits={"dev-clean": 1},
    ...     utterances_per_speaker=2, progress=False)
    >>> prepare_librispeech(root + "/ls", root + "/save", splits=("dev-clean",))["counts"]
    {'dev-clean': 2}
    """
    options = {
        "data_folder": os.path.abspath(data_folder),
        "splits": list(splits),
        "corpus": corpus_stamp(data_folder) if os.path.isdir(data_folder) else None,
    }
    files = [f"{s}.csv" for s in splits]
    if skip_prep:
        return {"skipped": True}
    if skip(save_folder, options, files):
        logger.info("LibriSpeech manifests in %s are up to date", save_folder)
        return {"skipped": True}
    require(data_folder, [f"LibriSpeech/{s}" for s in splits], corpus="LibriSpeech", where=_WHERE)
    counts = {}
    os.makedirs(save_folder, exist_ok=True)
    listed = {split: _transcribed(data_folder, split) for split in splits}
    durations = check_audio(
        [path for entries in listed.values() for _, path, _ in entries],
        data_folder,
        save_folder=save_folder,
        corpus="LibriSpeech",
    )
    for split in splits:
        root = os.path.join(data_folder, "LibriSpeech", split)
        rows = [
            {
                "ID": uid,
                "duration": round(durations[path], 4),
                "wav": rel(path, data_folder),
                "spk_id": uid.split("-")[0],
                "wrd": text.lower(),
            }
            for uid, path, text in listed[split]
            if path in durations  # an unreadable file is left out (listed by check_audio)
        ]
        if not rows:
            raise OSError(f"LibriSpeech: no transcribed audio under {root}. {_WHERE}")
        write_manifest(os.path.join(save_folder, f"{split}.csv"), rows, HEADER)
        counts[split] = len(rows)
    save_options(save_folder, options, {"counts": counts})
    return {"counts": counts, "skipped": False}


def _transcribed(data_folder, split):
    """``[(utterance id, audio path, transcript)]`` of a split; a transcript line without
    its audio file is logged and left out."""
    entries = []
    root = os.path.join(data_folder, "LibriSpeech", split)
    for dirpath, _, names in sorted(os.walk(root)):
        for name in sorted(n for n in names if n.endswith(".trans.txt")):
            with open(os.path.join(dirpath, name), encoding="utf-8") as handle:
                for line in handle:
                    if not line.strip():
                        continue
                    uid, _, text = line.strip().partition(" ")
                    path = os.path.join(dirpath, f"{uid}.flac")
                    if not os.path.isfile(path):
                        logger.warning("LibriSpeech: %s has no audio %s; skipped", uid, path)
                        continue
                    entries.append((uid, path, text))
    return entries
