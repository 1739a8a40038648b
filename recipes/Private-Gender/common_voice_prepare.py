"""Data preparation for the Private-Gender recipe: Common Voice layout -> D_priv, D_aux, test.

Reads a Common Voice language folder (``train.tsv``, ``dev.tsv``, ``test.tsv``,
``validated.tsv``, ``clips/``) and writes three CSV manifests, ``priv.csv`` (the private set
D_priv the DP teacher trains on), ``aux.csv`` (the public auxiliary set D_aux the teacher is
queried on once and the student trains on) and ``test.csv``, with the columns
``ID,duration,wav,spk_id,label,gender_raw,age,accent,sentence`` (``wav`` starts with
``$data_root``).

Gender values -> classes. The mapping is explicit and logged (our choice; the paper names no
dataset). Older releases offer ``male``, ``female``, ``other``; the 2024 and later releases
("sex or gender") offer ``male_masculine``, ``female_feminine``, ``non-binary``,
``transgender``, ``intersex`` and ``do_not_wish_to_say``. :data:`DEFAULT_GENDER_MAP` sends
masculine values to ``male``, feminine ones to ``female`` and the others to ``other``; empty
and ``do_not_wish_to_say`` rows are *unlabeled*: excluded and counted. A value in neither list
stops the preparation with the file, line and value named. Values are compared after
``strip().lower()``.

Splits: ``priv_split``, ``aux_split`` and ``test_split`` name a TSV (``train``, ``dev``,
``test``, ``validated``) or ``validated_rest``: the rows of ``validated.tsv`` that are in none
of ``train.tsv``, ``dev.tsv``, ``test.tsv`` (and, with speaker-level disjointness, whose speaker
is in none of the other two chosen sets). The three sets must be disjoint by recording (the
clip file name; the paper's safeguard) and, with ``disjoint_by="speaker"``, by ``client_id``
too: an overlap is refused with the files (or speakers) named. Audio may be MP3 (the real
releases) or any format libsndfile reads (WAV, FLAC): every clip is opened once with
``soundfile.info`` (in a thread pool) to get its duration: a missing or corrupt clip is left
out with one log line naming it, counted under ``excluded[set]["unreadable_audio"]`` and
listed with libsndfile's error in the report's ``unreadable_audio``.

Example
-------
>>> import os, tempfile
>>> from speechbrain_fl.data.common_voice_synth import generate_common_voice_corpus
>>> root = tempfile.mkdtemp()
>>> _ = generate_common_voice_corpus(os.path.join(root, "cv"), speakers={"train": 6, "dev": 3,
...     "test": 3}, clips_per_speaker=1, unlabeled_share=0.0, progress=False)
>>> report = prepare_common_voice(os.path.join(root, "cv"), os.path.join(root, "manifests"))
>>> sorted(report["counts"]), report["counts"]["priv"]
(['aux', 'priv', 'test'], {'male': 3, 'female': 2, 'other': 1})
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np

from speechbrain_fl.data.audio_check import PRIVACY_NOTE, read_headers
from speechbrain_fl.recipe.prepare import prepared_with, save_prepare_options
from speechbrain_fl.utils.atomic import atomic_folder

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_GENDER_MAP", "UNLABELED_VALUES", "prepare_common_voice", "read_tsv"]

#: Release gender value -> class (our mapping; see the module docstring).
DEFAULT_GENDER_MAP = {
    "male": "male",
    "female": "female",
    "other": "other",
    "male_masculine": "male",
    "female_feminine": "female",
    "non-binary": "other",
    "transgender": "other",
    "intersex": "other",
}
#: Values meaning "no label": such rows are excluded and counted.
UNLABELED_VALUES = ("", "do_not_wish_to_say")
SET_NAMES = ("priv", "aux", "test")
TSV_SPLITS = ("train", "dev", "test", "validated")
MANIFEST_COLUMNS = (
    "ID",
    "duration",
    "wav",
    "spk_id",
    "label",
    "gender_raw",
    "age",
    "accent",
    "sentence",
)
OPTIONS_FILE = "prepare_options.json"


def read_tsv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a Common Voice TSV as dicts (``line`` holds the 1-based line number).

    Raises ``OSError`` naming the file when it is missing and ``ValueError`` when a required
    column (``client_id``, ``path``, ``sentence``, ``gender``) is absent.
    """
    path = Path(path)
    if not path.is_file():
        raise OSError(f"Common Voice file {path} not found (expected the release layout)")
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = [
            c
            for c in ("client_id", "path", "sentence", "gender")
            if c not in (reader.fieldnames or [])
        ]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; header {reader.fieldnames}")
        rows = []
        for i, row in enumerate(reader, start=2):
            row = {k: (v or "") for k, v in row.items() if k is not None}
            row["line"] = str(i)
            rows.append(row)
    return rows


def _label(row, *, source, gender_map, unlabeled_values):
    value = row["gender"].strip().lower()
    if value in unlabeled_values:
        return None
    if value not in gender_map:
        raise ValueError(
            f"{source}, line {row['line']}: unknown gender value {row['gender']!r} (clip "
            f"{row['path']}); known: {sorted(gender_map)}, unlabeled: {list(unlabeled_values)}. "
            "Add it to gender_map or unlabeled_values."
        )
    return gender_map[value]


def _rows_of(name, tsv, *, chosen, disjoint_by):
    if name in TSV_SPLITS:
        return tsv[name], f"{name}.tsv"
    if name != "validated_rest":
        raise ValueError(
            f"unknown split {name!r}; expected one of {TSV_SPLITS + ('validated_rest',)}"
        )
    in_splits = {r["path"] for s in ("train", "dev", "test") for r in tsv[s]}
    speakers = {r["client_id"] for other in chosen for r in other}
    rows = [r for r in tsv["validated"] if r["path"] not in in_splits]
    if disjoint_by == "speaker":
        rows = [r for r in rows if r["client_id"] not in speakers]
    return rows, "validated.tsv (rows in no split)"


def _check_disjoint(sets: dict[str, list[dict]], disjoint_by: str) -> None:
    keys = [("path", "recording")] + (
        [("client_id", "speaker")] if disjoint_by == "speaker" else []
    )
    for key, what in keys:
        for i, a in enumerate(SET_NAMES):
            for b in SET_NAMES[i + 1 :]:
                common = sorted({r[key] for r in sets[a]} & {r[key] for r in sets[b]})
                if common:
                    raise ValueError(
                        f"D_{a} and D_{b} share {len(common)} {what}(s), e.g. {common[:5]}: the "
                        f"sets must be disjoint by {what} (disjoint_by={disjoint_by!r})"
                    )


def _skip(save_folder: Path, options: dict) -> bool:
    """The kit's prepare-options record (:func:`speechbrain_fl.recipe.prepared_with`)."""
    files = [f"{s}.csv" for s in SET_NAMES]
    return prepared_with(save_folder, options, files, name=OPTIONS_FILE)


def _options(data_folder: Path, *, splits, classes, gender_map, unlabeled_values, disjoint_by,
             max_aux, seed) -> dict:  # fmt: skip
    """The preparation's options, normalised (gender values lower-cased) and checked; the
    manifests are rebuilt whenever they differ from the stamp's."""
    gender_map = {k.strip().lower(): v for k, v in (gender_map or DEFAULT_GENDER_MAP).items()}
    if disjoint_by not in ("recording", "speaker"):
        raise ValueError(f"disjoint_by must be 'recording' or 'speaker', got {disjoint_by!r}")
    bad = sorted(set(gender_map.values()) - {"male", "female", "other"})
    if bad:
        raise ValueError(f"gender_map maps to unknown class(es) {bad}")
    return {
        "data_folder": str(data_folder.resolve()),
        "splits": list(splits),
        "classes": list(classes),
        "gender_map": gender_map,
        "unlabeled_values": [v.strip().lower() for v in unlabeled_values],
        "disjoint_by": disjoint_by,
        "max_aux": max_aux,
        "seed": int(seed),
    }


def prepare_common_voice(
    data_folder: str | os.PathLike,
    save_folder: str | os.PathLike,
    *,
    priv_split: str = "train",
    aux_split: str = "dev",
    test_split: str = "test",
    classes: tuple[str, ...] | list[str] = ("male", "female", "other"),
    gender_map: dict[str, str] | None = None,
    unlabeled_values: tuple[str, ...] | list[str] = UNLABELED_VALUES,
    disjoint_by: str = "recording",
    max_aux: int | None = None,
    seed: int = 1234,
    skip_prep: bool = False,
) -> dict:
    """Write ``priv.csv``, ``aux.csv`` and ``test.csv`` from a Common Voice folder.

    Arguments
    ---------
    data_folder : str or PathLike
        Common Voice language folder (``train.tsv`` ... ``clips/``).
    save_folder : str or PathLike
        Output folder of the manifests (written whole or not at all).
    priv_split, aux_split, test_split : str
        TSV providing D_priv, D_aux and test (see the module docstring).
    classes : sequence of str
        Class set, e.g. ``("male", "female")`` for the binary variant (rows of other classes
        are excluded and counted).
    gender_map : dict, optional
        Release value -> class (default :data:`DEFAULT_GENDER_MAP`).
    unlabeled_values : sequence of str
        Values excluded as unlabeled.
    disjoint_by : str
        ``"recording"`` or ``"speaker"``.
    max_aux : int, optional
        Keep a random subset of this many D_aux clips (for the |D_aux| sweep; seeded by
        ``seed``, stratified by nothing: D_aux is public, its draw needs no privacy).
    seed : int
        Seed of the ``max_aux`` subsample.
    skip_prep : bool
        Do nothing (the manifests are expected to exist).

    Returns
    -------
    dict
        ``{"counts": {set: {class: n}}, "excluded": {set: {"unlabeled": n, "other_class": n,
        "unreadable_audio": n}}, "gender_map", "sources", "speakers": {set: n}, "skipped":
        bool}``, and ``"unreadable_audio": {clip: error}`` when a clip could not be read.
    """
    save_folder = Path(save_folder)
    data_folder = Path(data_folder)
    options = _options(
        data_folder,
        splits=[priv_split, aux_split, test_split],
        classes=classes,
        gender_map=gender_map,
        unlabeled_values=unlabeled_values,
        disjoint_by=disjoint_by,
        max_aux=max_aux,
        seed=seed,
    )
    gender_map, unlabeled_values = options["gender_map"], tuple(options["unlabeled_values"])
    classes = tuple(options["classes"])
    if skip_prep or _skip(save_folder, options):
        logger.info("Manifests in %s are up to date: preparation skipped.", save_folder)
        stamp = save_folder / OPTIONS_FILE
        report = json.loads(stamp.read_text(encoding="utf-8"))["report"] if stamp.is_file() else {}
        return {**report, "skipped": True}
    if not (data_folder / "clips").is_dir():
        raise OSError(f"{data_folder} is not a Common Voice folder: no clips/ subfolder")
    logger.info(
        "Gender mapping (release value -> class): %s; unlabeled values: %s",
        gender_map,
        list(unlabeled_values),
    )
    sets, sources = _read_sets(
        data_folder, {"priv": priv_split, "aux": aux_split, "test": test_split}, disjoint_by
    )
    manifests, counts, excluded, speakers, unreadable = _build_sets(
        sets,
        sources,
        data_folder=data_folder,
        classes=classes,
        gender_map=gender_map,
        unlabeled_values=unlabeled_values,
        max_aux=max_aux,
        seed=seed,
    )
    _check_sets(manifests, counts, classes=classes, sources=sources)
    report = {
        "counts": counts,
        "excluded": excluded,
        "speakers": speakers,
        "gender_map": gender_map,
        "sources": sources,
        **(
            {"unreadable_audio": dict(sorted(unreadable.items())), "unreadable_note": PRIVACY_NOTE}
            if unreadable
            else {}
        ),
    }
    _write_manifests(save_folder, manifests, {"options": options, "report": report})
    return {**report, "skipped": False}


def _build_sets(
    sets, sources, *, data_folder, classes, gender_map, unlabeled_values, max_aux, seed
):
    """Label, subsample (D_aux to ``max_aux``), read-check and write the rows of each set.

    Returns ``(manifests, counts, excluded, speakers, unreadable)``: the manifest rows, the
    clips per class, the excluded counts per reason, the speakers per set, and libsndfile's
    error per clip that could not be read.
    """
    manifests, counts, excluded, speakers = {}, {}, {}, {}
    unreadable: dict[str, str] = {}  # clip -> libsndfile's error
    for name in SET_NAMES:
        kept, excl = _labelled(
            sets[name],
            source=data_folder / sources[name].split(" ")[0],
            classes=classes,
            gender_map=gender_map,
            unlabeled_values=unlabeled_values,
        )
        if name == "aux" and max_aux is not None and len(kept) > max_aux:
            rng = np.random.default_rng([int(seed), 77])
            pick = rng.choice(len(kept), max_aux, replace=False)
            kept = [kept[i] for i in sorted(pick)]
        kept, durations, bad = _readable(name, kept, data_folder=data_folder)
        excl.update({"unreadable_audio": len(bad)} if bad else {})
        unreadable.update(bad)
        counts[name] = {c: sum(1 for _, lab in kept if lab == c) for c in classes}
        excluded[name] = dict(excl)
        speakers[name] = len({r["client_id"] for r, _ in kept})
        logger.info(
            "D_%s from %s: %d labelled clips %s, %d speakers; excluded %s",
            name,
            sources[name],
            len(kept),
            counts[name],
            speakers[name],
            dict(excl),
        )
        manifests[name] = _manifest_rows(name, kept, data_folder=data_folder, durations=durations)
    return manifests, counts, excluded, speakers, unreadable


def _read_sets(data_folder: Path, splits: dict[str, str], disjoint_by: str):
    """The rows of D_priv, D_aux and test (``splits``: set -> split) and their sources, read
    from the TSVs they need and checked disjoint by ``disjoint_by``."""
    needed = {s for s in splits.values() if s in TSV_SPLITS}
    if "validated_rest" in splits.values():
        needed |= set(TSV_SPLITS)
    tsv = {s: read_tsv(data_folder / f"{s}.tsv") for s in sorted(needed)}
    sets, sources = {}, {}
    for name in ("priv", "test", "aux"):
        chosen = [sets[k] for k in sets]
        sets[name], sources[name] = _rows_of(
            splits[name], tsv, chosen=chosen, disjoint_by=disjoint_by
        )
    _check_disjoint(sets, disjoint_by)
    return sets, sources


def _labelled(rows, *, source, classes, gender_map, unlabeled_values):
    """``(row, class)`` of the rows whose gender maps to one of ``classes``, and the counts of
    the others (``unlabeled``, ``other_class``)."""
    kept, excl = [], Counter()
    for row in rows:
        label = _label(row, source=source, gender_map=gender_map, unlabeled_values=unlabeled_values)
        if label is None:
            excl["unlabeled"] += 1
        elif label not in classes:
            excl["other_class"] += 1
        else:
            kept.append((row, label))
    return kept, excl


def _readable(name, kept, *, data_folder: Path):
    """``kept`` without the clips whose header cannot be read (read in parallel and each
    left-out clip logged: :func:`speechbrain_fl.data.audio_check.read_headers`), the durations
    of the others and ``{clip: error}`` of the left-out ones."""
    clips = [str(data_folder / "clips" / r["path"]) for r, _ in kept]
    durations, bad = read_headers(clips, desc=f"D_{name} headers")
    kept = [k for k, clip in zip(kept, clips, strict=True) if clip not in bad]
    return kept, durations, bad


def _manifest_rows(name, kept, *, data_folder: Path, durations: dict) -> list[dict]:
    """The manifest rows of a set; ``durations``: clip path -> seconds (its header)."""
    out = []
    for row, label in kept:
        clip = data_folder / "clips" / row["path"]
        duration = durations[str(clip)]
        if not duration > 0:
            raise ValueError(f"clip {clip} (D_{name}) is empty")
        out.append(
            {
                "ID": Path(row["path"]).stem,
                "duration": f"{duration:.3f}",
                "wav": f"$data_root/clips/{row['path']}",
                "spk_id": row["client_id"],
                "label": label,
                "gender_raw": row["gender"],
                "age": row.get("age", ""),
                "accent": row.get("accents", row.get("accent", "")),
                "sentence": row["sentence"],
            }
        )
    return out


def _check_sets(manifests, counts, *, classes, sources) -> None:
    """``ValueError`` for an empty D_aux or test set, or a class with no clip in D_priv."""
    if not manifests["aux"]:
        raise ValueError(
            f"D_aux ({sources['aux']}) has no labelled clip of classes {classes}: "
            "the teacher cannot be queried and the student cannot be trained"
        )
    missing = [c for c in classes if counts["priv"][c] == 0]
    if missing:
        raise ValueError(
            f"class(es) {missing} have no clip in D_priv ({sources['priv']}): the "
            "teacher cannot learn them; change classes or the split"
        )
    if not manifests["test"]:
        raise ValueError(f"the test set ({sources['test']}) has no labelled clip")


def _write_manifests(save_folder: Path, manifests: dict, stamp: dict) -> None:
    """The three manifests and the options stamp, written whole or not at all."""
    with atomic_folder(save_folder) as tmp:
        for name in SET_NAMES:
            with open(tmp / f"{name}.csv", "w", encoding="utf-8", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=MANIFEST_COLUMNS)
                writer.writeheader()
                writer.writerows(manifests[name])
        save_prepare_options(tmp, stamp["options"], stamp["report"], name=OPTIONS_FILE)
