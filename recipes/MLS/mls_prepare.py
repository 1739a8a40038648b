"""Data preparation for Multilingual LibriSpeech (MLS, openslr.org/94).

Parses the layout the MLS archives unpack to, for any of the 8 languages::

    <data_folder>/mls_<language>[_opus]/metainfo.txt
    <data_folder>/mls_<language>[_opus]/<split>/transcripts.txt   (<spk>_<book>_<utt>\\t<text>)
    <data_folder>/mls_<language>[_opus]/<split>/segments.txt
    <data_folder>/mls_<language>[_opus]/<split>/audio/<spk>/<book>/<spk>_<book>_<utt>.flac|.opus

and writes SpeechBrain CSV manifests ``<save_folder>/<split>.csv`` with the columns
``ID,duration,wav,spk_id,language,wrd`` (``wav`` starts with ``$data_root``, to be replaced by
``DynamicItemDataset.from_csv(..., replacements={"data_root": data_folder})``), plus:

- ``train_statistics.md`` / ``.csv``: hours, clients (speakers) and hours per client for each
  language under the speaker partition: the alpha-split paper's Table VI;
- ``speaker_overlap.json``: training speakers who also appear in the test split: its
  Appendix B (8 of 316 clients, 2.8 % of the training samples on the real corpus);
- ``skipped.json``: unreadable audio files (skipped), transcripts without audio and audio
  without a transcript, each listed by path or ID.

The embedded corpus (``speechbrain_fl.data.mls_synth``) adds a non-MLS ``public`` split with
its own speakers; ask for it with ``splits=("train", "dev", "test", "public")``. A real MLS
folder has no ``public`` split: with ``public_speaker_share`` set, one is carved from the
training speakers instead (see :func:`carve_public_split`), and those speakers are no longer
clients (they leave ``train.csv``).

Languages: ``languages=None`` uses every ``mls_<language>`` folder found. A list names the
wanted ones; those absent from ``data_folder`` (a user who downloaded only some archives) are
logged and left out, and the run goes on with the languages present. Only a folder with none
of them is an error.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import sys

from speechbrain_fl.data.audio_check import PRIVACY_NOTE, read_headers
from speechbrain_fl.recipe.prepare import prepared_with, save_prepare_options
from speechbrain_fl.utils.atomic import atomic_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the recipe's own modules
from mls_report import write_speaker_overlap, write_train_statistics  # noqa: E402

logger = logging.getLogger(__name__)

MLS_LANGUAGES = ("english", "german", "dutch", "french", "spanish", "italian", "portuguese",
                 "polish")  # fmt: skip
AUDIO_EXTENSIONS = (".flac", ".opus")
OPTIONS_FILE = "mls_prepare.json"
SKIPPED_FILE = "skipped.json"
HEADER = ["ID", "duration", "wav", "spk_id", "language", "wrd"]
_GET_MLS = (
    "Download MLS from https://www.openslr.org/94 (e.g. mls_polish.tar.gz) and unpack it into "
    "data_folder, or leave data_folder unset to use the embedded synthetic corpus."
)


def prepare_mls(
    data_folder: str,
    save_folder: str,
    *,
    languages: list[str] | None = None,
    splits: tuple[str, ...] = ("train", "dev", "test"),
    skip_prep: bool = False,
    max_utts_per_split: int | None = None,
    public_speaker_share: float | None = None,
    seed: int = 1234,
    durations: str = "segments",
    progress: bool = True,
) -> dict:
    """Prepare CSV manifests, the Table VI statistics and the overlap report for MLS.

    Arguments
    ---------
    data_folder : str
        Folder holding the unpacked ``mls_<language>`` (or ``mls_<language>_opus``) folders.
    save_folder : str
        Where the CSV files and reports are written.
    languages : list of str or None
        MLS language names to use; None uses every language found in ``data_folder``.
    splits : tuple of str
        Splits to prepare (``train``, ``dev``, ``test``; ``public`` for the embedded corpus).
    skip_prep : bool
        If True, do nothing (SpeechBrain convention).
    max_utts_per_split : int or None
        Keep at most this many utterances per language and split (first IDs in sorted order).
    public_speaker_share : float or None
        For a language without a ``public`` split on disk (real MLS) and ``"public"`` in
        ``splits``: the share of its training speakers moved out of ``train`` into ``public``
        (:func:`carve_public_split`). None: such a language is an error naming this key.
    seed : int
        Seed of the speaker choice of :func:`carve_public_split`.
    durations : str
        ``segments``: each utterance's duration is ``end - start`` of its line in the split's
        ``segments.txt`` (``<id> <url> <start> <end>``); an utterance without a segment line
        takes its audio header's. ``audio``: from every header.
    progress : bool
        A progress bar over the header reads.

    Every audio header is read either way (``soundfile.info``, in a thread pool:
    :func:`speechbrain_fl.data.audio_check.read_headers`): a file libsndfile cannot open is
    left out, logged, and listed in ``skipped.json`` and the report's
    ``skipped.unreadable_audio`` (paths relative to ``data_folder``) with the error in
    ``skipped.unreadable_audio_reasons``. Cost: see that module's docstring.

    Returns
    -------
    dict
        ``{"csv": {split: path}, "counts": {split: {language: n}}, "skipped": {...},
        "num_skipped": {...}, "languages": [...], "missing_languages": [...],
        "public_from_train": {language: [speaker, ...]}, "statistics": path, "overlap": path}``
        (empty when ``skip_prep``).

    Example
    -------
    >>> import tempfile, os
    >>> from speechbrain_fl.data.mls_synth import generate_mls_corpus
    >>> root = tempfile.mkdtemp()
    >>> _ = generate_mls_corpus(os.path.join(root, "mls"), languages=["polish"],
    ...     speakers_per_language=2, utterances_per_speaker=2, dev_speakers=1, test_speakers=1,
    ...     eval_utterances_per_speaker=1, public_speakers_per_language=1,
    ...     public_utterances_per_speaker=1, progress=False)
    >>> report = prepare_mls(os.path.join(root, "mls"), os.path.join(root, "csv"))
    >>> sorted(report["csv"])
    ['dev', 'test', 'train']
    """
    if skip_prep:
        return {}
    if durations not in ("segments", "audio"):
        raise ValueError(f"durations: {durations!r} must be 'segments' or 'audio'")
    if public_speaker_share is not None and not 0.0 < public_speaker_share < 1.0:
        raise ValueError(f"public_speaker_share must be in (0, 1), got {public_speaker_share}")
    data_folder = os.path.abspath(data_folder)
    language_dirs, missing = _find_languages(data_folder, languages)
    carve = _check_splits(data_folder, language_dirs, splits, public_speaker_share)
    options = {  # what the manifests depend on: a change prepares them again
        "data_folder": data_folder, "languages": sorted(language_dirs), "splits": list(splits),
        "max_utts_per_split": max_utts_per_split,
        "public_speaker_share": public_speaker_share if carve else None,
        "seed": seed if carve else None,
        "transcripts": _transcripts_fingerprint(data_folder, language_dirs, splits),
        "durations": durations,
    }  # fmt: skip
    os.makedirs(save_folder, exist_ok=True)
    if skip(save_folder, options):
        logger.info("MLS preparation already done in %s, skipping.", save_folder)
        with open(os.path.join(save_folder, OPTIONS_FILE), encoding="utf-8") as handle:
            return json.load(handle)["report"]

    rows_by_split, skipped, reasons, carved = _prepare_languages(
        data_folder, language_dirs, splits, carve,
        max_utts=max_utts_per_split, durations=durations, share=public_speaker_share,
        seed=seed, progress=progress,
    )  # fmt: skip
    for split, rows in rows_by_split.items():
        _write_csv(os.path.join(save_folder, f"{split}.csv"), rows)
        logger.info("%s.csv: %d utterances", split, len(rows))

    report = _write_reports(
        save_folder, rows_by_split, skipped=skipped, reasons=reasons,
        languages=sorted(language_dirs), missing=missing, carved=carved,
    )  # fmt: skip
    save_prepare_options(save_folder, options, report, name=OPTIONS_FILE)
    return report


def _prepare_languages(data_folder, language_dirs, splits, carve, *, max_utts, durations, share,
                       seed, progress):  # fmt: skip
    """Rows of every split over the languages, public splits carved where ``carve`` says.

    Returns ``(rows_by_split, skipped, reasons, carved)``: the manifest rows per split, the
    left-out files per reason, libsndfile's error per unreadable file (relative path), and the
    training speakers moved into ``public`` per language.
    """
    reasons: dict[str, str] = {}
    skipped: dict[str, list] = {
        "unreadable_audio": [],
        "transcript_without_audio": [],
        "audio_without_transcript": [],
    }
    rows_by_split: dict[str, list[dict]] = {split: [] for split in splits}
    carved: dict[str, list[str]] = {}
    for language, lang_dir in sorted(language_dirs.items()):
        rows = {
            split: _prepare_split(
                data_folder,
                lang_dir,
                language,
                split,
                skipped,
                max_utts=max_utts,
                durations=durations,
                reasons=reasons,
                progress=progress,
            )  # fmt: skip
            for split in splits
            if not (split == "public" and language in carve)
        }
        if language in carve:
            carved[language] = _carve(rows, language, share=share, seed=seed)
        for split in splits:
            rows_by_split[split].extend(rows[split])
    return rows_by_split, skipped, reasons, carved


def _carve(rows: dict, language: str, *, share: float, seed: int) -> list[str]:
    """Move ``share`` of a language's training speakers (never a dev or test speaker) from
    ``rows["train"]`` into ``rows["public"]`` (:func:`carve_public_split`); their IDs."""
    held = {r["spk_id"] for split in ("dev", "test") for r in rows.get(split, [])}
    rows["train"], rows["public"], carved = carve_public_split(
        rows["train"], share=share, seed=seed, exclude=held
    )
    logger.info(
        "%s has no public split on disk: %d of its %d training speakers moved to "
        "public (public_speaker_share %.2f); they are not clients.",
        language,
        len(carved),
        len(carved) + len({r["spk_id"] for r in rows["train"]}),
        share,
    )
    return carved


def _write_reports(
    save_folder, rows_by_split, *, skipped, reasons, languages, missing, carved
) -> dict:
    """The preparation report, ``skipped.json``, and the Table VI statistics and speaker-overlap
    reports of the prepared splits; ``reasons``: unreadable file -> libsndfile's error."""
    report = {
        "csv": {s: os.path.join(save_folder, f"{s}.csv") for s in rows_by_split},
        "counts": {
            s: {lang: sum(r["language"] == lang for r in rows) for lang in languages}
            for s, rows in rows_by_split.items()
        },
        "skipped": {k: sorted(v) for k, v in skipped.items()}
        | (
            {"unreadable_audio_reasons": dict(sorted(reasons.items())), "privacy": PRIVACY_NOTE}
            if reasons
            else {}
        ),
        "num_skipped": {k: len(v) for k, v in skipped.items()},
        "languages": languages,
        "missing_languages": missing,
        "public_from_train": carved,
    }
    with open(os.path.join(save_folder, SKIPPED_FILE), "w", encoding="utf-8") as handle:
        json.dump(report["skipped"], handle, indent=2)
    if "train" in rows_by_split:
        report["statistics"] = write_train_statistics(rows_by_split["train"], save_folder)
        if "test" in rows_by_split:
            report["overlap"] = write_speaker_overlap(
                rows_by_split["train"], rows_by_split["test"], save_folder
            )
    return report


def skip(save_folder: str, options: dict) -> bool:
    """True if every CSV exists and the saved options equal ``options``.

    The kit's prepare-options record (:func:`speechbrain_fl.recipe.prepared_with`).
    """
    return prepared_with(save_folder, options, [f"{s}.csv" for s in options["splits"]],
                         name=OPTIONS_FILE)  # fmt: skip


def _transcripts_fingerprint(data_folder: str, language_dirs: dict, splits) -> dict:
    """Size and modification time of every ``transcripts.txt`` read (cheap ``os.stat`` calls).

    Part of the saved options, so manifests made from an older copy of the corpus (e.g. the
    embedded corpus regenerated with other options in the same folder) are not reused.
    """
    stamps = {}
    for lang_dir in sorted(language_dirs.values()):
        for split in splits:
            path = os.path.join(data_folder, lang_dir, split, "transcripts.txt")
            if os.path.isfile(path):
                st = os.stat(path)
                stamps[f"{lang_dir}/{split}"] = [st.st_size, st.st_mtime_ns]
    return stamps


def _find_languages(data_folder: str, languages) -> tuple[dict[str, str], list[str]]:
    """The ``mls_<language>`` folders present, and the requested languages that are absent."""
    if languages is not None:
        unknown = [lang for lang in languages if lang not in MLS_LANGUAGES]
        if unknown:
            raise ValueError(f"unknown MLS language(s) {unknown}; MLS has {list(MLS_LANGUAGES)}")
    if not os.path.isdir(data_folder):
        raise OSError(f"MLS data_folder {data_folder!r} does not exist. {_GET_MLS}")
    found, missing = {}, []
    for language in languages or MLS_LANGUAGES:
        for name in (f"mls_{language}", f"mls_{language}_opus"):
            if os.path.isdir(os.path.join(data_folder, name)):
                found[language] = name
                break
        else:
            missing.append(language)
    wanted = list(languages) if languages is not None else list(MLS_LANGUAGES)
    if not found:
        raise OSError(
            f"{data_folder!r} is not an MLS folder: none of "
            f"{[f'mls_{lang}' for lang in wanted]} (nor their _opus variants) is in it. {_GET_MLS}"
        )
    if missing:
        logger.warning(
            "MLS languages present in %s: %s; missing (left out): %s.",
            data_folder,
            ", ".join(sorted(found)),
            ", ".join(missing),
        )
    else:
        logger.info("MLS languages present in %s: %s.", data_folder, ", ".join(sorted(found)))
    return found, missing


def _check_splits(data_folder, language_dirs, splits, public_speaker_share) -> set[str]:
    """Raise for a missing split; return the languages whose public split is carved from train."""
    carve = set()
    for language, name in sorted(language_dirs.items()):
        for split in splits:
            transcripts = os.path.join(data_folder, name, split, "transcripts.txt")
            if os.path.isfile(transcripts):
                continue
            if split == "public":
                if public_speaker_share is not None:
                    carve.add(language)
                    continue
                raise OSError(
                    f"{transcripts} is missing: real MLS has no public split. Set "
                    "public_speaker_share (e.g. 0.1) to carve one from the training speakers."
                )
            raise OSError(f"MLS file missing: {transcripts}. {_GET_MLS}")
    if carve and "train" not in splits:
        raise ValueError("a public split carved from train needs 'train' in splits")
    return carve


def carve_public_split(
    rows: list[dict], *, share: float, seed: int, exclude: set[str] = frozenset()
) -> tuple[list[dict], list[dict], list[str]]:
    """Move a share of the training speakers of one language to a public split.

    Real MLS has no data for central (seed-model) pretraining. Our choice: ``ceil(share * n)``
    of the ``n`` training speakers not in ``exclude`` (the dev/test speakers, so the test stays
    unseen by the seed model) are chosen by ``sha256(f"{seed}:{speaker}")`` order (deterministic,
    independent of the row order and of the other languages), at least one speaker is left as
    a client, and every utterance of a chosen speaker moves.

    Returns
    -------
    (train_rows, public_rows, public_speakers)

    Example
    -------
    >>> rows = [{"spk_id": str(s), "ID": f"{s}_1_{u}"} for s in range(10) for u in range(2)]
    >>> train, public, speakers = carve_public_split(rows, share=0.2, seed=0)
    >>> len(speakers), len(public), len(train)
    (2, 4, 16)
    """
    speakers = sorted({r["spk_id"] for r in rows})
    candidates = [s for s in speakers if s not in exclude]
    ranked = sorted(candidates, key=lambda s: hashlib.sha256(f"{seed}:{s}".encode()).hexdigest())
    n = min(math.ceil(share * len(speakers)), len(candidates), len(speakers) - 1)
    chosen = sorted(ranked[: max(n, 0)])
    if not chosen:
        logger.warning(
            "No training speaker can move to the public split (%d speakers, %d in dev/test).",
            len(speakers),
            len(speakers) - len(candidates),
        )
    picked = set(chosen)
    train = [r for r in rows if r["spk_id"] not in picked]
    public = [r for r in rows if r["spk_id"] in picked]
    return train, public, chosen


def _read_transcripts(path: str) -> dict[str, str]:
    out = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            utt_id, sep, text = line.partition("\t")
            if not sep or utt_id.count("_") != 2:
                raise ValueError(
                    f"{path}:{number}: expected '<spk>_<book>_<utt>\\t<transcript>', got {line!r}"
                )
            out[utt_id] = text.strip()
    return out


def read_segment_durations(path: str) -> dict[str, float]:
    """Durations ``end - start`` (seconds) from an MLS ``segments.txt``; {} if it is absent.

    Each line is ``<spk>_<book>_<utt>\t<source url>\t<start>\t<end>``. A line that does not
    parse raises ``ValueError`` naming the file and line.

    Example
    -------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "segments.txt")
    >>> _ = open(path, "w").write("1_2_3\thttp://x\t10.5\t12.25\n")
    >>> read_segment_durations(path)
    {'1_2_3': 1.75}
    """
    if not os.path.isfile(path):
        return {}
    out = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            fields = line.rstrip("\n").split("\t")
            try:
                start, end = float(fields[-2]), float(fields[-1])
            except (IndexError, ValueError):
                raise ValueError(
                    f"{path}:{number}: expected '<id>\t<url>\t<start>\t<end>', got {line!r}"
                ) from None
            if len(fields) < 3 or end < start:
                raise ValueError(f"{path}:{number}: end {end} before start {start}")
            out[fields[0]] = end - start
    return out


def _prepare_split(
    data_folder,
    lang_dir,
    language,
    split,
    skipped,
    *,
    max_utts,
    durations="segments",
    reasons=None,
    progress=False,
):
    split_dir = os.path.join(data_folder, lang_dir, split)
    transcripts = _read_transcripts(os.path.join(split_dir, "transcripts.txt"))
    segments = (
        read_segment_durations(os.path.join(split_dir, "segments.txt"))
        if durations == "segments"
        else {}
    )
    audio = {}
    audio_root = os.path.join(split_dir, "audio")
    for folder, _, files in os.walk(audio_root):
        for name in files:
            stem, ext = os.path.splitext(name)
            if ext in AUDIO_EXTENSIONS:
                audio[stem] = os.path.join(folder, name)
    for utt_id in sorted(set(audio) - set(transcripts)):
        logger.warning("Audio without transcript (ignored): %s", audio[utt_id])
        skipped["audio_without_transcript"].append(os.path.relpath(audio[utt_id], data_folder))
    ids = sorted(transcripts)
    if max_utts is not None:
        ids = ids[:max_utts]
    for utt_id in ids:
        if utt_id not in audio:
            logger.warning("Transcript without audio (skipped): %s in %s", utt_id, split_dir)
            skipped["transcript_without_audio"].append(f"{lang_dir}/{split}/{utt_id}")
    ids = [u for u in ids if u in audio]
    # every header is read (in parallel): a file that is not audio is left out and listed
    # here, not found by the client that would load it in every round
    headers, unreadable = read_headers(
        [audio[u] for u in ids], progress=progress, desc=f"{lang_dir}/{split} headers"
    )
    reasons = {} if reasons is None else reasons
    for path, reason in sorted(unreadable.items()):
        skipped["unreadable_audio"].append(os.path.relpath(path, data_folder))
        reasons[os.path.relpath(path, data_folder)] = reason
    rows = []
    for utt_id in ids:
        path = audio[utt_id]
        if path in unreadable:
            continue
        duration = segments[utt_id] if utt_id in segments else headers[path]
        rows.append(
            {
                "ID": utt_id,
                "duration": f"{duration:.3f}",
                "wav": "$data_root/" + os.path.relpath(path, data_folder).replace(os.sep, "/"),
                "spk_id": utt_id.split("_")[0],
                "language": language,
                "wrd": transcripts[utt_id],
            }
        )
    return rows


def _write_csv(path: str, rows: list[dict]) -> None:
    with atomic_open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=HEADER)
        writer.writeheader()
        writer.writerows(rows)


def node_train_manifest(node, hparams) -> str:
    """A data-owning SuperNode's training manifest, prepared from its own MLS-layout folder.

    The recipe's ``node_manifest`` hook (:class:`speechbrain_fl.recipe.FederatedRecipe`): a
    SuperNode started with ``--node-config "data-folder=<folder>"`` trains on the utterances
    of that folder. ``data-manifest=<csv>`` or a ``<folder>/train.csv`` is used as it is (the
    engine's default); otherwise the folder must hold MLS's layout,
    ``mls_<language>/train/transcripts.txt`` with ``audio/<speaker>/<book>/<id>.flac`` (or
    ``.opus``) beside it, for some of the run's ``languages``, and :func:`prepare_mls` writes
    its ``train.csv`` under the node's ``work-dir`` (``sbfl_mls_node/``; durations from
    ``segments.txt`` where it has a line, else the audio header; reused while the folder's
    transcripts are unchanged). The manifest's ``$data_root`` is the node's ``data-folder``.

    Raises
    ------
    OSError
        When the folder is neither: it names the folder and what is missing.
    ValueError
        When the folder's train split has no usable utterance.
    """
    if node.manifest is not None or (
        node.data_folder and os.path.isfile(os.path.join(node.data_folder, "train.csv"))
    ):
        return node.train_manifest
    save_folder = os.path.join(node.work_dir, "sbfl_mls_node")
    report = prepare_mls(
        node.data_folder,
        save_folder,
        languages=hparams.get("languages"),
        splits=("train",),
        durations="segments",
    )
    count = sum(report["counts"]["train"].values())
    if count == 0:
        raise ValueError(
            f"node_config data-folder={node.data_folder!r}: no usable training utterance in "
            f"its MLS folders ({report['num_skipped']} skipped; see {save_folder}/skipped.json)"
        )
    logger.info("SuperNode data: %d training utterances of %s prepared from %s",
                count, ", ".join(report["languages"]), node.data_folder)  # fmt: skip
    return report["csv"]["train"]
