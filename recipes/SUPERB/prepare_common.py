"""Helpers the SUPERB prepare scripts share: layout checks, manifests, re-preparation.

- :func:`require`: raise ``OSError`` naming every missing file or folder of a corpus layout and
  where to get the corpus;
- :func:`write_manifest`: a SpeechBrain CSV (``$data_root`` in paths), written atomically;
- :func:`skip` / :func:`save_options`: a saved-options file, so a changed option re-prepares;
- :func:`check_audio` / :func:`unreadable_audio`: every audio header read before a manifest is
  written (in a thread pool); a file that cannot be read is left out, logged and listed in
  ``unreadable_audio.json`` (relative path -> error), read back on reuse.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Sequence

from speechbrain_fl.data.audio_check import read_headers
from speechbrain_fl.recipe.prepare import prepared_with, save_prepare_options
from speechbrain_fl.utils.atomic import atomic_open

OPTIONS_FILE = "prepare_options.json"
UNREADABLE_FILE = "unreadable_audio.json"


def require(data_folder: str, paths: Iterable[str], *, corpus: str, where: str) -> None:
    """Raise ``OSError`` if any of ``paths`` (relative to ``data_folder``) is missing.

    Example
    -------
    >>> import tempfile
    >>> try:
    ...     require(tempfile.mkdtemp(), ["testing_list.txt"], corpus="X", where="get it at Y")
    ... except OSError as err:
    ...     print("testing_list.txt" in str(err) and "get it at Y" in str(err))
    True
    """
    if not os.path.isdir(data_folder):
        raise OSError(f"{corpus}: data_folder {data_folder!r} does not exist. {where}")
    missing = [p for p in paths if not os.path.exists(os.path.join(data_folder, p))]
    if missing:
        raise OSError(
            f"{corpus}: {data_folder!r} is not in the expected layout; missing {missing}. {where}"
        )


def rel(path: str, data_folder: str) -> str:
    """``$data_root/<path relative to data_folder>`` (forward slashes)."""
    return "$data_root/" + os.path.relpath(path, data_folder).replace(os.sep, "/")


def write_manifest(path: str, rows: Sequence[dict], header: Sequence[str]) -> None:
    """Write ``rows`` to a CSV with ``header`` (atomically)."""
    with atomic_open(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(header))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in header})


def skip(save_folder: str, options: dict, files: Iterable[str]) -> bool:
    """True if every file in ``files`` exists and the saved options equal ``options``.

    The kit's prepare-options record (:func:`speechbrain_fl.recipe.prepared_with`).
    """
    return prepared_with(save_folder, options, files, name=OPTIONS_FILE)


def save_options(save_folder: str, options: dict, report: dict) -> None:
    """Record the options (and a report) the manifests were made with; written last, atomically."""
    save_prepare_options(save_folder, options, report, name=OPTIONS_FILE)


def corpus_stamp(data_folder: str) -> str | None:
    """The embedded corpus's generation stamp (options), if ``data_folder`` has one."""
    path = os.path.join(data_folder, ".superb_synth.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.dumps(json.load(handle).get("options"), sort_keys=True)


def check_audio(
    paths: Sequence[str], data_folder: str, *, save_folder: str, corpus: str
) -> dict[str, float]:
    """The durations (s) of the readable ``paths``; the others are left out and listed.

    Every header is read (``soundfile.info``, :func:`speechbrain_fl.data.audio_check.
    read_headers`); a file libsndfile cannot open is logged once and written to
    ``<save_folder>/unreadable_audio.json`` as ``{path relative to data_folder: error}``
    (an empty mapping when every file is readable, so a reuse reads the current list).
    """
    durations, unreadable = read_headers(paths, desc=f"{corpus} headers")
    listed = {os.path.relpath(p, data_folder): why for p, why in sorted(unreadable.items())}
    os.makedirs(save_folder, exist_ok=True)
    with atomic_open(os.path.join(save_folder, UNREADABLE_FILE)) as handle:
        json.dump(listed, handle, indent=2)
    return durations


def unreadable_audio(save_folder: str) -> dict[str, str]:
    """``unreadable_audio.json`` of a preparation (``{}`` when absent)."""
    path = os.path.join(save_folder, UNREADABLE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def readable_rows(
    rows: dict[str, list[dict]], data_folder: str, *, save_folder: str, corpus: str
) -> dict[str, list[dict]]:
    """``rows`` (split -> manifest rows, each with its audio file under ``"_path"``) without
    the rows whose file is unreadable (:func:`check_audio`), each with its ``duration``
    (seconds, 4 decimals) and without ``"_path"``; the order is kept."""
    durations = check_audio(
        [r["_path"] for split_rows in rows.values() for r in split_rows],
        data_folder,
        save_folder=save_folder,
        corpus=corpus,
    )
    out = {}
    for split, split_rows in rows.items():
        out[split] = []
        for row in split_rows:
            path = row.pop("_path")
            if path in durations:
                out[split].append({**row, "duration": round(durations[path], 4)})
    return out
